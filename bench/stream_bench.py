"""Streaming efficiency: pass time of our engine vs the raw bandwidth of the tier, on the same bytes.

efficiency = (bytes streamed / raw tier bandwidth) / pass seconds; 1.0 means the pass costs no more
than moving its bytes at the tier's raw rate, i.e. compute and overheads are fully hidden. Each measured pass
is paired with a raw read of the same bytes just before it (a shared disk's rate drifts from second to
second): the row reports the median of the paired efficiencies, and the fastest pass.

A packed source (a GGUF run in place) also reports the time its layers spend in decoding (timed around
the ring's `decode`, on the compute thread), the decode rate in packed GB/s, and the link speed below
which streaming packed blocks pays: packed_bytes/link + decode < dense_bytes/link, i.e.
link < (dense_bytes - packed_bytes) / decode_seconds.
"""
from __future__ import annotations

import statistics
import threading
import time

import torch

from offload import LoadOptions
from offload.loader import streaming_device_budget

from runtime.models import load_model
from offload.bandwidth import cold_read_gbps, copy_gbps


def run_stream_bench(target: str | None, gpu_mem: int | None, tier: str, pass_tokens: list[int], device: str = "auto",
                     dtype: str = "auto", repeats: int = 3, on_status=None, direct_reads: bool = True,
                     ring_size: int | None = None, beside_compute: bool = False,
                     loaders: int | None = None) -> dict:
    if tier not in ("ram", "disk"):
        raise ValueError(f"tier must be ram or disk, got {tier!r}")
    max_tokens = max(pass_tokens)
    options = LoadOptions(target, device, dtype, gpu_mem=gpu_mem, ram=1 if tier == "disk" else None,
                          max_context=max_tokens + 1, max_pass_tokens=max_tokens, disk_cold=tier == "disk",
                          direct_reads=direct_reads)
    if ring_size is not None:
        options.ring_size = ring_size
    if loaders is not None:
        options.loaders = loaders
    if gpu_mem is None:   # the least that runs: every layer streams
        options.gpu_mem = gpu_mem = streaming_device_budget(options)
    loaded = load_model(options, on_status)
    try:
        if tier not in loaded.plan.tier_of:
            raise ValueError(f"--gpu-mem {gpu_mem / 2**20:.0f} MiB leaves no decoder layer on the {tier} tier "
                             f"(the plan keeps all {len(loaded.plan.tier_of)} on the device at {max_tokens} "
                             "tokens per pass): lower --gpu-mem")
        decode_clock = _time_decode(loaded)
        rows = [_measure(loaded, tier, n, repeats, decode_clock, beside_compute) for n in pass_tokens]
    finally:
        loaded.layers.close()
    result = {"bench": "stream", "tier": tier, "device": str(loaded.model.device),
              "disk_reads": ("direct" if loaded.layers.disk.is_direct else "buffered") if loaded.layers.disk else None,
              "dtype": str(loaded.model.dtype).removeprefix("torch."),
              "layers": {t: loaded.plan.tier_of.count(t) for t in ("device", "ram", "disk")},
              "layer_bytes": loaded.layers.layout.num_bytes, "ring_size": len(loaded.layers.slots),
              "loaders": loaded.layers.num_loaders, "passes": rows}
    if hasattr(loaded.source, "packed_bytes"):
        result.update(_packed_figures(loaded, rows))
    return result


def _time_decode(loaded) -> list[float]:
    """Wraps the ring's `decode` so that its seconds (device synchronized) add up in the returned list."""
    layers, model, clock = loaded.layers, loaded.model, [0.0]
    decode = layers.decode

    def timed(index: int, stored: dict) -> dict:
        start = time.perf_counter()
        decoded = decode(index, stored)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        clock[0] += time.perf_counter() - start
        return decoded

    layers.decode = timed
    return clock


def _packed_figures(loaded, rows: list[dict]) -> dict:
    """Packed bytes per pass against the file's, decode rate and the link speed where packing stops paying."""
    source, layers = loaded.source, loaded.layers
    streamed = layers.streamed
    file_bytes = sum(entry.num_bytes for i in streamed for _, entry in source.layer_entries(i).values())
    dense_bytes = len(streamed) * source.dense_layer_bytes(loaded.model.dtype)
    for row in rows:
        row["decode_gbps"] = round(row["bytes_streamed"] / row["decode_seconds"] / 1e9, 3) if row["decode_seconds"] else None
        # packed pays while packed/link + decode < dense/link
        row["break_even_link_gbps"] = (round((dense_bytes - row["bytes_streamed"]) / row["decode_seconds"] / 1e9, 3)
                                       if row["decode_seconds"] else None)
    return {"source": source.describe(), "file_layer_bytes": file_bytes, "dense_layer_bytes": dense_bytes,
            "bytes_vs_file": round(rows[0]["bytes_streamed"] / file_bytes, 4),
            "break_even_note": "packed streaming pays while link GB/s < break_even_link_gbps "
                               "(dense bytes in the compute dtype minus packed bytes, over decode seconds)"}


def _measure(loaded, tier: str, num_tokens: int, repeats: int, decode_clock: list[float],
             beside_compute: bool = False) -> dict:
    model, layers = loaded.model, loaded.layers
    tokens = torch.randint(0, loaded.config.vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(0))
    _one_pass(model, tokens)   # warm-up (and fills the ring for the first measured pass)
    best, paired, beside = None, [], []
    for _ in range(repeats):
        if not layers.wait_filled():   # the loaders' read-ahead into the next pass done: the tier is timed alone
            raise RuntimeError("the prefetch ring did not fill within 60 s: the tier's raw rate cannot be timed alone")
        if beside_compute:
            beside.append(_beside_compute(loaded, lambda: _raw_bandwidth(loaded, tier)))
        raw_gbps = _raw_bandwidth(loaded, tier)
        _one_pass(model, tokens)   # the raw read left the ring idle: one pass to refill it as decoding would
        decode_clock[0] = 0.0
        seconds = _one_pass(model, tokens)
        stats = layers.last_pass
        paired.append((stats.bytes_streamed / (raw_gbps * 1e9) / seconds, raw_gbps))
        if best is None or seconds < best[0]:
            best = (seconds, stats, decode_clock[0])
    seconds, stats, decode_seconds = best
    efficiency, raw_gbps = sorted(paired)[len(paired) // 2]
    row = _row(num_tokens, seconds, stats, raw_gbps, efficiency, paired, decode_seconds)
    if beside:      # the tier's rate while the cores multiply as a pass does: what the loader competes with
        rate = statistics.median(beside)
        row.update(raw_gbps_beside_compute=round(rate, 3),
                   efficiency_vs_raw_beside_compute=round(stats.bytes_streamed / (rate * 1e9) / seconds, 4))
    return row


def _row(num_tokens, seconds, stats, raw_gbps, efficiency, paired, decode_seconds) -> dict:
    return {"tokens": num_tokens, "pass_seconds": round(seconds, 5), "bytes_streamed": stats.bytes_streamed,
            "wait_seconds": round(stats.wait_seconds, 5), "raw_gbps": round(raw_gbps, 3),
            "achieved_gbps": round(stats.bytes_streamed / seconds / 1e9, 3),
            "loader_gbps": round(stats.link_gbps, 3),    # the loader's own rate: bytes over its read/copy time
            "efficiency": round(efficiency, 4), "paired_efficiencies": [round(e, 4) for e, _ in paired],
            "decode_seconds": round(decode_seconds, 5), "decode_share": round(decode_seconds / seconds, 4)}


def _one_pass(model, tokens: torch.Tensor) -> float:
    cache = model.new_cache(tokens.shape[1] + 1)
    start = time.perf_counter()
    model.forward(tokens, cache, last_only=True)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter() - start


def _beside_compute(loaded, measure) -> float:
    """measure() while a second thread multiplies fp32 matrix-vector products over one layer's bytes, over and
    over, on the compute's thread count (a one-token pass's compute, without the ring)."""
    hidden = loaded.config.hidden_size
    weights = torch.randn(max(loaded.layers.layout.num_bytes // 4 // hidden, 1), hidden)     # [R, H] fp32
    vector, done = torch.randn(hidden, 1), threading.Event()

    def multiply() -> None:
        while not done.is_set():
            torch.mm(weights, vector)
    worker = threading.Thread(target=multiply, name="bench-compute", daemon=True)
    worker.start()
    try:
        return measure()
    finally:
        done.set()
        worker.join()


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
