"""JSON Lines read line by line on "\n" only: answers may hold U+2028 or U+0085, which
str.splitlines() would treat as line breaks and cut a record in two."""
from __future__ import annotations

import json
from pathlib import Path


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8", newline="\n") as lines:
        return [json.loads(line) for line in lines if line.strip()]
