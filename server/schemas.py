"""Request bodies of /v1/chat/completions and /v1/completions, checked field by field: a wrong type, a value
out of range or a field this server does not support is a 400 naming the field (never silently ignored)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from spec import SamplingConfig
from .errors import ApiError, bad_field

MAX_STOP_STRINGS = 4            # OpenAI's limit
MAX_TEMPERATURE = 2.0           # OpenAI's range is [0, 2]
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty")          # the last three are llama.cpp's and vLLM's extensions
INTEGERS = ("top_k", "seed")
COMMON = {"model", "stream", "stream_options", "max_tokens", "stop", "n", "user", *NUMBERS, *INTEGERS}
FIELDS = {"chat": COMMON | {"messages", "max_completion_tokens"}, "completion": COMMON | {"prompt"}}


@dataclass(slots=True)
class Completion:
    """One checked request: what to answer (chat messages or a raw prompt) and how."""
    model: str
    messages: list[dict[str, str]] | None = None
    prompt: str | list[int] | None = None
    sampling: dict[str, float | int] = field(default_factory=dict)    # the fields the request gives
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def parse_json(body: bytes) -> dict:
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the body is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(value).__name__}")
    return value


def parse_request(kind: str, body: dict, max_tokens_limit: int) -> Completion:
    """kind: "chat" or "completion" -> the checked request (ApiError 400 naming the first bad field)."""
    for name in body:
        if name not in FIELDS[kind]:
            raise bad_field(name, "this field is not supported by this server (supported: "
                                  f"{', '.join(sorted(FIELDS[kind]))})")
    given = {name: value for name, value in body.items() if value is not None}
    request = Completion(_string(given, "model", required=True))
    if kind == "chat":
        request.messages = _messages(given.get("messages"))
    else:
        request.prompt = _prompt(given.get("prompt"))
    request.sampling = _sampling(given)
    request.max_tokens = _max_tokens(given, max_tokens_limit)
    request.stop = _stop(given.get("stop"))
    request.stream = _boolean(given, "stream")
    request.include_usage = _stream_options(given.get("stream_options"), request.stream)
    if given.get("n", 1) != 1 or isinstance(given.get("n"), bool):
        raise bad_field("n", f"only one choice per request is supported (n = 1), got {given['n']!r}")
    _string(given, "user")     # an end-user id (OpenAI's abuse monitoring): nothing here reads it
    return request


def _string(given: dict, name: str, required: bool = False) -> str | None:
    if name not in given:
        if required:
            raise bad_field(name, "this field is required")
        return None
    if not isinstance(given[name], str):
        raise bad_field(name, f"must be a string, got {_kind(given[name])}")
    return given[name]


def _boolean(given: dict, name: str) -> bool:
    value = given.get(name, False)
    if not isinstance(value, bool):
        raise bad_field(name, f"must be true or false, got {_kind(value)}")
    return value


def _integer(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_field(name, f"must be an integer, got {_kind(value)}")
    return value


def _sampling(given: dict) -> dict[str, float | int]:
    sampling = {}
    for name in NUMBERS + INTEGERS:
        if name not in given:
            continue
        value = given[name]
        if name in INTEGERS:
            value = _integer(value, name)
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_field(name, f"must be a number, got {_kind(value)}")
        try:
            SamplingConfig(**{name: value})
        except ValueError as err:
            raise bad_field(name, str(err)) from None
        sampling[name] = value
    if sampling.get("temperature", 0) > MAX_TEMPERATURE:
        raise bad_field("temperature", f"must lie in [0, {MAX_TEMPERATURE:g}], got {sampling['temperature']}")
    return sampling


def _max_tokens(given: dict, limit: int) -> int | None:
    name = "max_completion_tokens" if "max_completion_tokens" in given else "max_tokens"
    if name not in given:
        return None
    value = _integer(given[name], name)
    if not 1 <= value <= limit:
        raise bad_field(name, f"must lie in [1, {limit}] (this server's --max-new-tokens), got {value}")
    return value


def _stop(value) -> list[str]:
    strings = [value] if isinstance(value, str) else value if value is not None else []
    if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
        raise bad_field("stop", f"must be a non-empty string or a list of them, got {_kind(value)}")
    if len(strings) > MAX_STOP_STRINGS:
        raise bad_field("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
    return strings


def _stream_options(value, stream: bool) -> bool:
    if value is None:
        return False
    if not stream:
        raise bad_field("stream_options", "only allowed when stream is true")
    if not isinstance(value, dict) or set(value) - {"include_usage"}:
        raise bad_field("stream_options", f"takes only {{\"include_usage\": bool}}, got {json.dumps(value)[:80]}")
    return _boolean(value, "include_usage")


def _messages(value) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise bad_field("messages", "must be a non-empty list of messages" if value is not None else
                        "this field is required")
    return [_message(message, f"messages[{index}]") for index, message in enumerate(value)]


def _message(message, where: str) -> dict[str, str]:
    if not isinstance(message, dict):
        raise bad_field(where, f"must be an object with role and content, got {_kind(message)}")
    for key in message:
        if key not in ("role", "content"):
            raise bad_field(f"{where}.{key}", "this field is not supported by this server (role and content only)")
    role = message.get("role")
    if role not in ROLES:
        raise bad_field(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    return {"role": ROLES[role], "content": _content(message.get("content"), f"{where}.content")}


def _content(content, where: str) -> str:
    """A string, or a list of text parts (joined); images and audio are not supported."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_field(where, f"must be a string or a list of text parts, got {_kind(content)}")
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_field(f"{where}[{index}]", 'only text parts ({"type": "text", "text": ...}) are supported')
        texts.append(part["text"])
    return "".join(texts)


def _prompt(value) -> str | list[int]:
    """A string or a list of token ids; a list of one of them is that one (one prompt per request)."""
    if value is None:
        raise bad_field("prompt", "this field is required")
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) != 1:
            raise bad_field("prompt", f"one prompt per request is supported, got {len(value)}")
        value = value[0]
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 for t in value):
        return value
    raise bad_field("prompt", f"must be a non-empty string or a list of token ids, got {_kind(value)}")


def _kind(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
