"""Our engine's side of bench/shapes_bench.py, one child process per measurement (no engine sees another's
memory, mappings or threads): `python -m bench.shapes_ours --cfg JSON` prints one JSON line.

resident  every layer resident, the cfg's kernel (packed, ggml): greedy one-token steps after the prompt (prefill
          untimed, as bench/llama_cpp_runner.py times llama.cpp), a profile of those steps (the int4
          kernel's time per token against the rest), one timed 512-token prefill from an empty cache (one
          prompt chunk, as decoding passes it), then a pass's time by its rows after the prompt (PASS_ROWS: a
          tree pass's products, each row with a one-row pass's bits)
ram/disk  every layer streamed from host RAM, or from the file with the page cache dropped before each
          pass (disk-cold), with the cfg's kernel: one-token steps after a 16-token prompt"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch

from bench.cpu_kernel_bench import greedy_steps
from offload import LoadOptions
from offload.loader import streaming_device_budget
from runtime.models import load_model

INT4_KERNEL = "aten::_weight_int4pack_mm_for_cpu"
STREAM_PROMPT = 16
PASS_ROWS = (1, 4, 16, 64)


def _load(cfg: dict, tier: str, kernel: str):
    options = LoadOptions(cfg["path"], device="cpu", dtype="fp32", cpu_kernel=kernel,
                          max_context=cfg["max_context"], max_pass_tokens=len(cfg["prefill_ids"]),
                          ram=1 if tier == "disk" else None, disk_cold=tier == "disk")
    if tier != "resident":
        options.max_pass_tokens = STREAM_PROMPT
        options.gpu_mem = streaming_device_budget(options)           # every layer streams
    start = time.perf_counter()
    loaded = load_model(options)
    return loaded, time.perf_counter() - start


def _timed(run) -> tuple[float, object]:
    """-> (seconds, run's result)"""
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def _profile(run, num_steps: int, warmup) -> dict:
    """Where a one-token step goes, profiled: the step, the int4 kernel's self time and calls per token, and the
    largest other ops' self times."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True):
        warmup()                                  # the profiler's first events cost milliseconds each
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        seconds, _ = _timed(run)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    kernel = next((e for e in events if e.key == INT4_KERNEL), None)
    others = [e for e in events if e.key != INT4_KERNEL][:6]
    return {"step_ms": round(seconds * 1e3 / num_steps, 3),
            "kernel_ms_per_token": round(kernel.self_cpu_time_total / 1e3 / num_steps, 3) if kernel else 0.0,
            "kernel_calls_per_token": round(kernel.count / num_steps, 1) if kernel else 0,
            "kernel_products": _products(prof, num_steps),
            "other_ops_ms_per_token": {e.key: round(e.self_cpu_time_total / 1e3 / num_steps, 3) for e in others}}


def _products(prof, num_steps: int) -> dict:
    """Per product shape (N x K of the weight): calls per token, ms per call, and the weight's bytes per second
    (codes, scales and zeros: 5 bits a weight)."""
    rows = {}
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key != INT4_KERNEL or not event.count:
            continue
        num_out, half_width = event.input_shapes[1]                 # codes [N, K / 2]
        nbytes = num_out * half_width + num_out * half_width * 2 // 32 * 4
        ms = event.self_cpu_time_total / 1e3 / event.count
        rows[f"{num_out}x{2 * half_width}"] = {"calls_per_token": round(event.count / num_steps, 1),
                                               "ms_per_call": round(ms, 4), "gbps": round(nbytes / ms / 1e6, 2)}
    return rows


def resident(cfg: dict) -> dict:
    loaded, load_seconds = _load(cfg, "resident", cfg["kernel"])
    num_steps = cfg["new_tokens"] - 1
    run = greedy_steps(loaded.model, cfg["prompt_ids"], num_steps + 1)           # num_steps one-token passes
    warmup = greedy_steps(loaded.model, cfg["prompt_ids"], cfg["warmup_tokens"])
    warmup()
    seconds, token_ids = _timed(run)
    profiled = _profile(run, num_steps, warmup)
    cache = loaded.model.new_cache(len(cfg["prefill_ids"]) + 1)
    prefill, _ = _timed(lambda: loaded.model.forward(torch.tensor([cfg["prefill_ids"]]), cache, last_only=True,
                                                     prompt_chunks=[(0, len(cfg["prefill_ids"]))]))   # as decoding does
    tiers = loaded.plan.tier_of
    return {"load_seconds": round(load_seconds, 2), "layers": {t: tiers.count(t) for t in set(tiers)},
            "token_ids": token_ids, "seconds_per_token": round(seconds / num_steps, 5),
            "tokens_per_second": round(num_steps / seconds, 3), "profile": profiled,
            "prefill_tokens": len(cfg["prefill_ids"]), "prefill_seconds": round(prefill, 3),
            "prefill_tokens_per_second": round(len(cfg["prefill_ids"]) / prefill, 3),
            "pass_ms_by_rows": _pass_curve(loaded.model, cfg["prompt_ids"], cfg["prefill_ids"])}


def _pass_curve(model, prompt: list[int], ids: list[int], repeats: int = 3) -> dict[str, float]:
    """rows -> the median ms of one pass of that many rows after the prompt (no prompt chunks: every row is
    multiplied as a tree pass's are)."""
    curve = {}
    for rows in PASS_ROWS:
        times = []
        for _ in range(repeats):
            cache = model.new_cache(len(prompt) + rows + 1)
            model.forward(torch.tensor([prompt]), cache, last_only=True, prompt_chunks=[(0, len(prompt))])
            seconds, _ = _timed(lambda: model.forward(torch.tensor([ids[:rows]]), cache))
            times.append(seconds)
        curve[str(rows)] = round(sorted(times)[repeats // 2] * 1e3, 2)
    return curve


def streamed(cfg: dict, tier: str, kernel: str) -> dict:
    loaded, load_seconds = _load(cfg, tier, kernel)
    try:
        run = greedy_steps(loaded.model, cfg["prefill_ids"][:STREAM_PROMPT], cfg["stream_steps"] + 1)
        greedy_steps(loaded.model, cfg["prefill_ids"][:STREAM_PROMPT], 2)()                # warm-up: one pass
        before = loaded.layers.total.bytes_by_tier[tier]
        seconds, _ = _timed(run)
        streamed_bytes = loaded.layers.total.bytes_by_tier[tier] - before
        tiers = loaded.plan.tier_of
    finally:
        loaded.layers.close()
    return {"load_seconds": round(load_seconds, 2), "layers": {t: tiers.count(t) for t in set(tiers)},
            "steps": cfg["stream_steps"], "seconds_per_token": round(seconds / cfg["stream_steps"], 4),
            "tokens_per_second": round(cfg["stream_steps"] / seconds, 3),
            "bytes_per_token": streamed_bytes // cfg["stream_steps"]}


def measure(cfg: dict) -> dict:
    torch.set_num_threads(cfg["threads"])
    if cfg["tier"] == "resident":
        return resident(cfg)
    return streamed(cfg, cfg["tier"], cfg["kernel"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cfg", required=True, help="the measurement, as bench/shapes_bench.py writes it (JSON)")
    cfg = json.loads(parser.parse_args().cfg)
    try:
        result = measure(cfg)
    except Exception as err:     # the parent reports it; never a made-up figure
        result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
    result["threads"] = torch.get_num_threads()
    print(json.dumps(result), flush=True)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
