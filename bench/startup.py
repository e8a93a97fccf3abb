"""`bench startup`: a fresh process until its first generated token. First start: an empty cache (the GGUF
runs in place; config, tokenizer and the pass-time curve are written once). Later starts, as fresh
processes taken in turn: the GGUF in place (resident layers decoded at load) against its dequantized
import (`--gguf-import`, a memory-mapped fp32 cache made by one untimed start), the same page cache.
(bench/start_bench.py times the same two paths inside one process, for `bench quant-disk --gguf`.)"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HOME = Path(__file__).resolve().parents[1]      # holds cli.py: the checkout, or site-packages when installed
GOAL_SECONDS = 5.0


def time_first_token(cache: str, gguf_import: bool = False) -> float:
    env = {**os.environ, "SPECSTREAM_CACHE": cache}
    command = [sys.executable, "-m", "cli", "run", "What is 2+2?", "--max-new-tokens", "1", "--json"]
    start = time.perf_counter()
    subprocess.run(command + (["--gguf-import"] if gguf_import else []), check=True, capture_output=True, env=env,
                   cwd=HOME)
    return time.perf_counter() - start


def later_starts(cache: str, rounds: int) -> dict[str, float]:
    """Median seconds of `rounds` later starts per path, taken in turn so both see the same machine."""
    time_first_token(cache, gguf_import=True)                     # makes the import's cache, untimed
    times: dict[str, list[float]] = {"gguf_in_place": [], "gguf_import": []}
    for _ in range(rounds):
        for name in times:
            times[name].append(time_first_token(cache, gguf_import=name == "gguf_import"))
    return {name: round(statistics.median(values), 3) for name, values in times.items()}


def run_startup_bench(rounds: int, on_status: Callable[[str], None] = lambda message: None) -> dict:
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    with tempfile.TemporaryDirectory() as cache:
        on_status("first start, empty cache")
        first = time_first_token(cache)
        on_status(f"later starts: {rounds} round(s) of GGUF in place and its import")
        later = later_starts(cache, rounds)
    return {"bench": "startup", "first_start_seconds": round(first, 2),
            "later_start_seconds_to_first_token": later,
            "in_place_over_import": round(later["gguf_in_place"] / later["gguf_import"], 3),
            "rounds": rounds, "goal_seconds": GOAL_SECONDS}
