"""How long a start takes: load the model and answer the first forward over a short prompt, for a GGUF run in
place (its resident layers decoded at load) against its dequantized import (safetensors mapped at load, read
by the first forward), same process, same prompt, page cache warm; medians over rounds, in turn."""
from __future__ import annotations

import statistics
import time

import torch

from offload import LoadOptions
from runtime.models import load_model

PROMPT = "What is 2+2?"


def start_seconds(target: str | None, gguf_import: bool) -> dict:
    """One start: seconds to load, and to load plus the first forward (what a user waits for)."""
    began = time.perf_counter()
    loaded = load_model(LoadOptions(target, gguf_import=gguf_import))
    try:
        loaded_at = time.perf_counter()
        ids = loaded.tokenizer.encode_prompt(PROMPT)
        loaded.model.forward(torch.tensor([ids]), loaded.model.new_cache(len(ids) + 1), last_only=True)
        loaded.model.synchronize()
        answered_at = time.perf_counter()
    finally:
        loaded.layers.close()
    return {"load": loaded_at - began, "load_and_first_forward": answered_at - began}


def run_start_bench(target: str | None = None, rounds: int = 3) -> dict:
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    start_seconds(target, False)          # warms the page cache and both paths' lazy imports
    start_seconds(target, True)
    measured: dict[str, list[dict]] = {"gguf-in-place": [], "gguf-import": []}
    for _ in range(rounds):
        for name in measured:
            measured[name].append(start_seconds(target, name == "gguf-import"))
    rows = {name: {key: round(statistics.median(r[key] for r in runs), 4) for key in runs[0]}
            for name, runs in measured.items()}
    ratio = rows["gguf-in-place"]["load_and_first_forward"] / rows["gguf-import"]["load_and_first_forward"]
    return {"prompt": PROMPT, "rounds": rounds, "seconds": rows,
            "in_place_over_import_load_and_first_forward": round(ratio, 3)}
