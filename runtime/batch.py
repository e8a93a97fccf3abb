"""Resumable batch runs over JSONL.

Input lines: `{"id", "prompt"}` or OpenAI batch-file lines (`custom_id`, `url`, `body.messages`,
`body.max_tokens` or `max_completion_tokens`, `temperature`, `top_p`, `stop`, `presence_penalty`,
`frequency_penalty`, `seed`, vLLM's `repetition_penalty`; `n` > 1, `logprobs`, `tools` and a non-text
`response_format` get an error line, never a silent answer). Output: one OpenAI batch-output line per
input, flushed and fsynced as it completes; a rerun skips ids already in the output. A request for
an endpoint we do not serve (`url` other than /v1/chat/completions) gets an error line, as OpenAI's
and vLLM's batch runners write, so the output accounts for every request.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from offload.weights.disk_errors import append_text, writing
from spec import SamplingConfig

CHAT_URL = "/v1/chat/completions"


@dataclass(slots=True)
class BatchItem:
    id: str
    messages: list[dict[str, str]]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] | None = None   # stop strings (None: the command line's)
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    error: str | None = None        # set: answered with an error line, never generated
    error_code: str = "unsupported_url"


@dataclass(slots=True)
class BatchSummary:
    num_inputs: int = 0
    num_done_before: int = 0
    num_completed: int = 0
    num_failed: int = 0
    skipped_lines: list[str] = field(default_factory=list)   # "line N: why"

    @property
    def is_clean(self) -> bool:
        return not self.skipped_lines and not self.num_failed


def parse_line(text: str) -> BatchItem:
    """One input line -> BatchItem; raises ValueError naming what is wrong."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError("a line must be a JSON object")
    if "custom_id" in raw:
        url = raw.get("url", CHAT_URL)
        if url != CHAT_URL:
            return BatchItem(str(raw["custom_id"]), [], error=f"url {url!r} is not supported; this runner "
                                                                f"serves only {CHAT_URL}")
        body = raw.get("body")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            raise ValueError("an OpenAI batch line needs body.messages (a non-empty list)")
        for message in body["messages"]:
            if not isinstance(message, dict) or "role" not in message or not isinstance(message.get("content"), str):
                raise ValueError("each message needs a role and a string content")
        return _item(str(raw["custom_id"]), body["messages"], body)
    if "id" in raw and isinstance(raw.get("prompt"), str):
        return _item(str(raw["id"]), [{"role": "user", "content": raw["prompt"]}], raw)
    raise ValueError('expected {"id", "prompt"} or an OpenAI batch line with custom_id and body')


PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
# request fields this runner cannot honour, answered with an error line rather than silently dropped
UNSUPPORTED = {"n": lambda v: v not in (None, 1), "logprobs": bool, "top_logprobs": lambda v: v is not None,
               "tools": bool, "functions": bool, "response_format": lambda v: v not in (None, {"type": "text"})}


def _item(item_id: str, messages: list[dict[str, str]], raw: dict) -> BatchItem:
    """A request's settings (OpenAI's chat-completions fields; vLLM's repetition_penalty)."""
    for name, unsupported in UNSUPPORTED.items():
        if unsupported(raw.get(name)):
            return BatchItem(item_id, [], error=f"{name}={raw[name]!r} is not supported by this runner",
                             error_code="unsupported_parameter")
    max_tokens = _opt(raw, "max_completion_tokens", int)
    return BatchItem(item_id, messages, max_tokens if max_tokens is not None else _opt(raw, "max_tokens", int),
                     _opt(raw, "temperature", float), _opt(raw, "top_p", float), _stop(raw),
                     *[_opt(raw, name, float) for name in PENALTIES], _opt(raw, "seed", int))


def _stop(raw: dict) -> list[str] | None:
    """OpenAI's `stop`: a string or a list of strings."""
    value = raw.get("stop")
    if value is None:
        return None
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not strings or any(not isinstance(s, str) or not s for s in strings):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {value!r}")
    return strings


def _opt(raw: dict, key: str, kind: type):
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return kind(value)


def read_inputs(path: Path, summary: BatchSummary) -> list[BatchItem]:
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read batch input {path}: {err}") from None
    items, seen = [], set()
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            item = parse_line(text)
        except ValueError as err:
            summary.skipped_lines.append(f"line {number}: {err}")
            continue
        if item.id in seen:
            summary.skipped_lines.append(f"line {number}: duplicate id {item.id!r}")
            continue
        seen.add(item.id)
        if item.error:
            summary.skipped_lines.append(f"line {number}: {item.error}")
        items.append(item)
    summary.num_inputs = len(items)
    return items


def completed_ids(path: Path) -> set[str]:
    """Ids already in the output. A torn last line (a crash mid-write) is cut off the file."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    keep = data if data.endswith(b"\n") or not data else data[: data.rfind(b"\n") + 1]
    if keep != data:
        with open(path, "r+b") as handle:
            handle.truncate(len(keep))
    done = set()
    for line in keep.decode().splitlines():
        if line.strip():
            done.add(json.loads(line)["custom_id"])
    return done


Generate = Callable[[BatchItem, SamplingConfig, int], tuple[str, dict]]
Job = tuple[BatchItem, SamplingConfig, int]
# generate_many(jobs, on_done): answers every job, many at once, calling on_done(item, (text, report)) or
# on_done(item, error message) as each ends (completion order)
GenerateMany = Callable[[list[Job], Callable[[BatchItem, "tuple[str, dict] | str"], None]], None]


def run_batch(in_path: Path, out_path: Path, generate: Generate | None, sampling: SamplingConfig,
              max_new_tokens: int, model_name: str,
              on_progress: Callable[[int, int], None] | None = None,
              generate_many: GenerateMany | None = None) -> BatchSummary:
    """`generate(item, sampling, max_tokens) -> (text, report)` where report carries token counts; or,
    given `generate_many`, requests run together and each line is written as its request ends."""
    summary = BatchSummary()
    items = read_inputs(in_path, summary)
    done = completed_ids(out_path)
    pending = [item for item in items if item.id not in done]
    summary.num_done_before = len(items) - len(pending)
    if on_progress:
        on_progress(0, len(pending))
    resume = f"rerun `specstream batch {in_path} -o {out_path}` with the same flags (answered ids are skipped)"
    answered = [0]

    def write(line: dict) -> None:
        saved = f"{summary.num_done_before + answered[0]} of {len(items)} answers in {out_path}"
        with writing(out_path, saved, resume):
            append_text(out_path, json.dumps(line, ensure_ascii=False) + "\n")
        answered[0] += 1
        if on_progress:
            on_progress(answered[0], len(pending))

    if generate_many is None:
        for item in pending:
            write(_answer(item, generate, sampling, max_new_tokens, model_name, summary))
        return summary
    for item in pending:
        if item.error:
            write(_error_line(item, item.error, item.error_code))
    jobs = [(item, _item_sampling(item, sampling), item.max_tokens or max_new_tokens)
            for item in pending if not item.error]
    generate_many(jobs, lambda item, outcome: write(_outcome_line(item, outcome, model_name, summary)))
    return summary


def _outcome_line(item: BatchItem, outcome: "tuple[str, dict] | str", model_name: str,
                  summary: BatchSummary) -> dict:
    if isinstance(outcome, str):
        summary.num_failed += 1
        return _error_line(item, outcome)
    summary.num_completed += 1
    return _success_line(item, *outcome, model_name)


def _answer(item: BatchItem, generate: Generate, sampling: SamplingConfig, max_new_tokens: int,
            model_name: str, summary: BatchSummary) -> dict:
    if item.error:
        return _error_line(item, item.error, item.error_code)
    try:
        text, report = generate(item, _item_sampling(item, sampling), item.max_tokens or max_new_tokens)
    except ValueError as err:
        summary.num_failed += 1
        return _error_line(item, str(err))
    summary.num_completed += 1
    return _success_line(item, text, report, model_name)


def _item_sampling(item: BatchItem, sampling: SamplingConfig) -> SamplingConfig:
    named = [(name, getattr(item, name)) for name in ("temperature", "top_p", *PENALTIES, "seed")]
    changes = {name: value for name, value in named if value is not None}
    return replace(sampling, **changes) if changes else sampling


def _success_line(item: BatchItem, text: str, report: dict, model_name: str) -> dict:
    finish = "length" if report.get("stop_reason") in ("length", "context") else "stop"
    usage = {"prompt_tokens": report["num_prompt_tokens"], "completion_tokens": report["num_new_tokens"],
             "total_tokens": report["num_prompt_tokens"] + report["num_new_tokens"]}
    body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model_name, "usage": usage,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}]}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item.id,
            "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body}, "error": None}


def _error_line(item: BatchItem, message: str, code: str = "invalid_request") -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item.id, "response": None,
            "error": {"code": code, "message": message}}
