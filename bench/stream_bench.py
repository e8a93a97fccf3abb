"""Streaming efficiency: pass time of our engine vs the raw bandwidth of the tier, on the same bytes.

efficiency = (bytes streamed / raw tier bandwidth) / pass seconds; 1.0 means the pass costs no more
than moving its bytes at the tier's raw rate, i.e. compute and overheads are fully hidden.
"""
from __future__ import annotations

import time

import torch

from offload import LoadOptions

from runtime.models import load_model
from offload.bandwidth import cold_read_gbps, copy_gbps


def run_stream_bench(target: str | None, gpu_mem: int, tier: str, pass_tokens: list[int], device: str = "auto",
                     dtype: str = "auto", repeats: int = 3, on_status=None) -> dict:
    if tier not in ("ram", "disk"):
        raise ValueError(f"tier must be ram or disk, got {tier!r}")
    max_tokens = max(pass_tokens)
    options = LoadOptions(target, device, dtype, gpu_mem=gpu_mem, ram=1 if tier == "disk" else None,
                          max_context=max_tokens + 1, max_pass_tokens=max_tokens, disk_cold=tier == "disk")
    loaded = load_model(options, on_status)
    try:
        if tier not in loaded.plan.tier_of:
            raise ValueError(f"--gpu-mem {gpu_mem / 2**20:.0f} MiB leaves no decoder layer on the {tier} tier "
                             f"(the plan keeps all {len(loaded.plan.tier_of)} on the device at {max_tokens} "
                             "tokens per pass): lower --gpu-mem")
        rows = [_measure(loaded, tier, n, repeats) for n in pass_tokens]
    finally:
        loaded.layers.close()
    return {"bench": "stream", "tier": tier, "device": str(loaded.model.device),
            "dtype": str(loaded.model.dtype).removeprefix("torch."),
            "layers": {t: loaded.plan.tier_of.count(t) for t in ("device", "ram", "disk")},
            "layer_bytes": loaded.layers.layout.num_bytes, "passes": rows}


def _measure(loaded, tier: str, num_tokens: int, repeats: int) -> dict:
    model, layers = loaded.model, loaded.layers
    tokens = torch.randint(0, loaded.config.vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(0))
    _one_pass(model, tokens)   # warm-up (and fills the ring for the first measured pass)
    best = None
    for _ in range(repeats):
        seconds = _one_pass(model, tokens)
        stats = layers.last_pass
        if best is None or seconds < best[0]:
            best = (seconds, stats)
    seconds, stats = best
    raw_gbps = _raw_bandwidth(loaded, tier)
    ideal = stats.bytes_streamed / (raw_gbps * 1e9)
    return {"tokens": num_tokens, "pass_seconds": round(seconds, 5), "bytes_streamed": stats.bytes_streamed,
            "wait_seconds": round(stats.wait_seconds, 5), "raw_gbps": round(raw_gbps, 3),
            "achieved_gbps": round(stats.bytes_streamed / seconds / 1e9, 3),
            "efficiency": round(ideal / seconds, 4)}


def _one_pass(model, tokens: torch.Tensor) -> float:
    cache = model.new_cache(tokens.shape[1] + 1)
    start = time.perf_counter()
    model.forward(tokens, cache, last_only=True)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter() - start


def _raw_bandwidth(loaded, tier: str) -> float:
    """The tier's raw rate measured on the same bytes a pass streams."""
    layers = loaded.layers
    streamed = [i for i, t in enumerate(layers.tier_of) if t == tier]
    if tier == "ram":
        sources = [layers.ram.buffers[i] for i in streamed]
        target = torch.empty(layers.layout.num_bytes, dtype=torch.uint8, device=loaded.model.device)
        return max(copy_gbps(sources, target) for _ in range(3))
    ranges = []
    for index in streamed:
        for path, entry in loaded.layers.disk.source.layer_entries(index).values():
            ranges.append((path, entry.start, entry.num_bytes))
    return cold_read_gbps(ranges)
