"""`bench serve`'s clients: streamed chat requests over plain HTTP (the standard library: nothing the server does
not also serve to any client), each timed at every content chunk, and the figures of a set of them."""
from __future__ import annotations

import http.client
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field


@dataclass(slots=True)
class Timed:
    """One streamed answer: when it was sent, when each content chunk (one pass's tokens) arrived, its end."""
    sent: float
    chunks: list[float] = field(default_factory=list)
    text: str = ""
    tokens: int = 0
    ended: float = 0.0

    @property
    def first_token_seconds(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def chunk_gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]

    @property
    def seconds_per_token(self) -> float | None:
        """After the first token: (last chunk - first chunk) / the tokens that came after the first."""
        return (self.chunks[-1] - self.chunks[0]) / (self.tokens - 1) if self.tokens > 1 else None


def stream_chat(port: int, model: str, messages: list[dict[str, str]], max_tokens: int) -> Timed:
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    timed = Timed(time.perf_counter())
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"the server answered {response.status}: {response.read()[:300]!r}")
    pieces = []
    for line in response:
        data = line.removeprefix(b"data: ").strip()
        if not line.startswith(b"data: ") or data == b"[DONE]":
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"the stream ended with an error: {chunk['error']['message']}")
        timed.tokens = (chunk.get("usage") or {}).get("completion_tokens", timed.tokens)
        content = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
        if content:
            timed.chunks.append(time.perf_counter())
            pieces.append(content)
    timed.ended, timed.text = time.perf_counter(), "".join(pieces)
    connection.close()
    return timed


def together(port: int, model: str, prompts: list[list[dict[str, str]]], max_tokens: int) -> list[Timed]:
    """Every prompt from its own client, all at once."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda messages: stream_chat(port, model, messages, max_tokens), prompts))


def one_after_another(port: int, model: str, prompts: list[list[dict[str, str]]], max_tokens: int) -> list[Timed]:
    return [stream_chat(port, model, messages, max_tokens) for messages in prompts]


def figures(answers: list[Timed], wall: float) -> dict:
    """Total tokens per second over `wall`, time to first token and the gaps between chunks (p50 / p90)."""
    tokens = sum(a.tokens for a in answers)
    per_token = [s for a in answers if (s := a.seconds_per_token) is not None]
    return {"requests": len(answers), "tokens": tokens, "wall_seconds": round(wall, 3),
            "tokens_per_second": round(tokens / wall, 3),
            "first_token_seconds": percentiles([a.first_token_seconds for a in answers]),
            "chunk_gap_seconds": percentiles([gap for a in answers for gap in a.chunk_gaps]),
            "seconds_per_token": percentiles(per_token)}


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "max": None}
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered), 4), "p90": round(p90, 4), "max": round(ordered[-1], 4)}
