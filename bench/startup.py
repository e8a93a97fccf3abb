"""Start-up time: a fresh process until its first generated token. First start: an empty cache (the GGUF
runs in place; config, tokenizer and the pass-time curve are written once). Later starts, as fresh
processes taken in turn: the GGUF in place (resident layers decoded at load) against its dequantized
import (`--gguf-import`, a memory-mapped fp32 cache made by one untimed start), the same page cache.

    .venv/bin/python bench/startup.py [--rounds 5]   -> one JSON line
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def time_first_token(cache: str, gguf_import: bool = False) -> float:
    env = {**os.environ, "SPECSTREAM_CACHE": cache}
    command = [sys.executable, str(ROOT / "cli.py"), "run", "What is 2+2?", "--max-new-tokens", "1", "--json"]
    start = time.perf_counter()
    subprocess.run(command + (["--gguf-import"] if gguf_import else []), check=True, capture_output=True, env=env)
    return time.perf_counter() - start


def later_starts(cache: str, rounds: int) -> dict[str, float]:
    """Median seconds of `rounds` later starts per path, taken in turn so both see the same machine."""
    time_first_token(cache, gguf_import=True)                     # makes the import's cache, untimed
    times: dict[str, list[float]] = {"gguf_in_place": [], "gguf_import": []}
    for _ in range(rounds):
        for name in times:
            times[name].append(time_first_token(cache, gguf_import=name == "gguf_import"))
    return {name: round(statistics.median(values), 3) for name, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    if rounds < 1:
        parser.error(f"--rounds must be >= 1, got {rounds}")
    with tempfile.TemporaryDirectory() as cache:
        first = time_first_token(cache)
        later = later_starts(cache, rounds)
    print(json.dumps({"bench": "startup", "first_start_seconds": round(first, 2),
                      "later_start_seconds_to_first_token": later,
                      "in_place_over_import": round(later["gguf_in_place"] / later["gguf_import"], 3),
                      "rounds": rounds, "goal_seconds": 5.0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
