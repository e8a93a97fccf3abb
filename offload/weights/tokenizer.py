"""Tokenizer and chat template, loaded from a checkpoint folder without importing transformers.

The chat template is rendered the way transformers' `apply_chat_template` renders it (sandboxed
jinja2, trim_blocks + lstrip_blocks, special tokens as variables) and the text is encoded without
adding special tokens; a test checks token-for-token agreement with transformers.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as FastTokenizer

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# What a model folder holds besides weights and config.json: copied whole into any folder derived from it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def copy_tokenizer_files(source: Path, destination: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copyfile(source / name, destination / name)


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{folder} has no tokenizer.json (a fast tokenizer is required)")
        self._fast = _fast_tokenizer(path)
        settings = _read_json(folder / "tokenizer_config.json")
        self.special_tokens = {k: _content(settings.get(k)) for k in SPECIAL_TOKEN_KEYS if settings.get(k)}
        self.chat_template = _chat_template(folder, settings)
        self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str) -> int | None:
        return self._fast.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._fast.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._fast.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use --raw to send the prompt as is")
        template = _environment().from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               tools=None, documents=None, **self.special_tokens)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))

    def encode_prompt(self, text: str) -> list[int]:
        """A user turn through the chat template, or the text as is for a model without one (benchmarks)."""
        if self.chat_template:
            return self.encode_chat([{"role": "user", "content": text}])
        return self.encode(text)

    def end_of_turn_ids(self) -> set[int]:
        """Ids that end an assistant turn: eos plus common end-of-turn markers the vocab has."""
        names = [self.special_tokens.get("eos_token"), "<|im_end|>", "<|eot_id|>", "<|end_of_text|>",
                 "<|endoftext|>", "</s>"]
        found = {self.token_id(n) for n in names if n}
        return {i for i in found if i is not None}


class StreamDecoder:
    """Turns a growing list of ids into text increments, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.ids, self.emitted = tokenizer, [], ""

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta


def _fast_tokenizer(path: Path) -> FastTokenizer:
    """One parsed tokenizer per distinct tokenizer.json content (a draft folder carries a copy of its
    target's). Shared read-only: no padding or truncation is ever set on it."""
    digest = _DIGESTS.get(_stat_key(path))
    if digest not in _PARSED:
        data = path.read_bytes()
        digest = _remember_digest(path, data)     # the bytes parsed name the entry, even if the file just changed
        if len(_PARSED) >= 4:
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[digest] = FastTokenizer.from_str(data.decode("utf-8"))
    return _PARSED[digest]


def file_digest(path: Path) -> bytes:
    """sha256 of a file's bytes, remembered while its size and modification time stay (a speculative start
    compares the target's and the draft's tokenizer files, then parses them)."""
    digest = _DIGESTS.get(_stat_key(path))
    return digest if digest is not None else _remember_digest(path, path.read_bytes())


def _stat_key(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


def _remember_digest(path: Path, data: bytes) -> bytes:
    if len(_DIGESTS) >= 16:
        _DIGESTS.pop(next(iter(_DIGESTS)))
    digest = _DIGESTS[_stat_key(path)] = hashlib.sha256(data).digest()
    return digest


_PARSED: dict[bytes, FastTokenizer] = {}     # sha256 of a tokenizer.json -> its parse, oldest first
_DIGESTS: dict[tuple[str, int, int], bytes] = {}   # (path, size, mtime_ns) -> sha256, oldest first


def _environment() -> ImmutableSandboxedEnvironment:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _chat_template(folder: Path, settings: dict) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _content(value) -> str:
    return value["content"] if isinstance(value, dict) else str(value)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}
