"""Start-up time: a fresh process until its first generated token, first start (GGUF conversion into
an empty cache) and second start (memory-mapped cache).

    .venv/bin/python bench/startup.py    -> one JSON line
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def time_first_token(cache: str) -> float:
    env = {**os.environ, "SPECSTREAM_CACHE": cache}
    start = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "cli.py"), "run", "What is 2+2?", "--max-new-tokens", "1", "--json"],
                   check=True, capture_output=True, env=env)
    return time.perf_counter() - start


def main() -> int:
    with tempfile.TemporaryDirectory() as cache:
        first = time_first_token(cache)
        second = min(time_first_token(cache) for _ in range(3))
    print(json.dumps({"bench": "startup", "first_start_seconds": round(first, 2),
                      "second_start_seconds_to_first_token": round(second, 2), "goal_seconds": 5.0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
