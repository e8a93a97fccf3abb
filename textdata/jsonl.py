"""JSON Lines read line by line on "\n" only: answers may hold U+2028 or U+0085, which
str.splitlines() would treat as line breaks and cut a record in two."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def jsonl_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, line without its newline) for every non-blank line."""
    with open(path, encoding="utf-8", newline="\n") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                yield number, line.rstrip("\n")


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for _, line in jsonl_lines(path)]
