"""A file of the target's greedy answers, so `bench draft` can compare several drafts on the same answers
without generating them again. Append-only JSON Lines: a run that stops keeps what it wrote.

Each record is keyed by the target (its folder or file, size and modification time), the answer
length limit and the prompt's token ids; a record made for another target or limit is never reused.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from offload.weights.disk_errors import append_text, writing
from textdata import read_jsonl


def target_fingerprint(path: Path) -> str:
    """The target's identity: resolved path plus size and mtime of its weight files."""
    path = Path(path).resolve()
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin", ".json"))
    stats = [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in files]
    return json.dumps([str(path), stats])


class AnswerCache:
    """Maps prompt token ids -> the target's greedy answer ids for one target and answer length."""

    def __init__(self, path: Path | None, target_path: Path, max_new_tokens: int):
        self.path = Path(path) if path is not None else None
        self.scope = f"{target_fingerprint(target_path)}|{max_new_tokens}"
        self.answers: dict[str, list[int]] = {}
        if self.path is not None and self.path.exists():
            for number, row in enumerate(read_jsonl(self.path), 1):
                if not isinstance(row.get("key"), str) or not isinstance(row.get("answer_ids"), list):
                    raise ValueError(f"{self.path} line {number}: not an answer-cache record")
                self.answers[row["key"]] = row["answer_ids"]

    def _key(self, prompt_ids: list[int]) -> str:
        return hashlib.sha256(f"{self.scope}|{prompt_ids}".encode()).hexdigest()

    def get(self, prompt_ids: list[int]) -> list[int] | None:
        return self.answers.get(self._key(prompt_ids))

    def put(self, prompt_ids: list[int], answer_ids: list[int]) -> None:
        key = self._key(prompt_ids)
        self.answers[key] = list(answer_ids)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with writing(self.path, f"{len(self.answers) - 1} answers in {self.path}",
                         f"rerun the same command with --answers-cache {self.path}: saved answers are reused"):
                append_text(self.path, json.dumps({"key": key, "answer_ids": list(answer_ids)}) + "\n")
