"""OpenAI's response shapes: a whole completion, the chunks of a streamed one (server-sent events, ending with
`data: [DONE]`), and the usage chunk that stream_options.include_usage asks for."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from .worker import Finished

OBJECTS = {"chat": ("chat.completion", "chat.completion.chunk"), "completion": ("text_completion", "text_completion")}
DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(finished: Finished) -> dict:
    return {"prompt_tokens": finished.prompt_tokens, "completion_tokens": finished.completion_tokens,
            "total_tokens": finished.prompt_tokens + finished.completion_tokens}


@dataclass(slots=True)
class Shape:
    """One response's identity (id, creation time, model) and its kind: "chat" or "completion"."""
    kind: str
    model: str
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.id = self.id or f"{prefix}-{uuid.uuid4().hex[:24]}"

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def body(self, finished: Finished) -> dict:
        """The whole (non-streamed) completion."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": finished.text}}
        else:
            choice = {"index": 0, "text": finished.text}
        choice.update(logprobs=None, finish_reason=finished.finish_reason)
        return {**self._envelope(OBJECTS[self.kind][0], [choice]), "usage": usage(finished)}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, first: bool = False) -> str:
        """One streamed chunk: the first (a chat's role), a text delta, or the last (its finish reason)."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if first else {"content": text} if text is not None else {}
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(logprobs=None, finish_reason=finish_reason)
        payload = self._envelope(OBJECTS[self.kind][1], [choice])
        if self.include_usage:
            payload["usage"] = None
        return sse(payload)

    def ending(self, finished: Finished) -> str:
        """The last chunk, the usage chunk when asked for, and the end of the stream."""
        tail = self.chunk(finish_reason=finished.finish_reason)
        if self.include_usage:
            tail += sse({**self._envelope(OBJECTS[self.kind][1], []), "usage": usage(finished)})
        return tail + DONE
