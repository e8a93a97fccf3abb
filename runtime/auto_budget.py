"""`--budget auto`: the target's pass time by tree size, measured once per model, plan and machine (cached
on disk), feeds the chooser that sizes every tree for the most accepted tokens per second. `--batch-size
auto` reads the same curve: the batch past which more sequences add latency rather than throughput."""
from __future__ import annotations

import time

import torch

from offload import LoadedModel
from offload.weights.gguf_import import cache_root
from spec.budget import BudgetChooser, PassTimeCurve, load_curve, probe_pass_times, save_curve


def auto_budget(target: LoadedModel, max_budget: int, on_status=None) -> BudgetChooser:
    return BudgetChooser(pass_time_curve(target, max_budget, on_status), max_budget)


def pass_time_curve(target: LoadedModel, max_tokens: int, on_status=None) -> PassTimeCurve:
    """The target's pass seconds by tokens per pass up to `max_tokens`: cached, else measured once."""
    key = curve_key(target, max_tokens)
    folder = cache_root() / "pass_times"
    curve = load_curve(key, folder)
    if curve is None:
        if on_status:
            on_status("measuring the target's pass time by tokens per pass (once for this model, plan and machine)")
        scratch = target.model.new_cache(max_tokens)
        curve = probe_pass_times(lambda n: _pass_seconds(target, scratch, n), max_tokens)
        save_curve(key, curve, folder)
    return curve


def throughput_batch(curve: PassTimeCurve, largest: int) -> int:
    """The batch (1..largest) that sequences keep joining while each adds at least half a sequence's
    throughput, one new token per sequence per pass: the b-th joins while (b - 1/2) / t(b) >= (b - 1) / t(b - 1),
    i.e. while a pass grows by at most (b - 1/2) / (b - 1) with it. A flat pass time (streamed weights)
    takes the largest batch; one proportional to its tokens (compute-bound) gains nothing from batching."""
    if largest < 1:
        raise ValueError(f"the largest batch must be >= 1, got {largest}")
    for size in range(2, largest + 1):
        if (size - 0.5) / curve.seconds(size) < (size - 1) / curve.seconds(size - 1):
            return size - 1
    return largest


def curve_key(target: LoadedModel, max_budget: int) -> dict:
    """What the pass time depends on: the weights, where the plan put them, the device and dtype."""
    # a GGUF run in place: its file (the model folder holds only config and tokenizer)
    weights = sorted(target.source.file_paths() if target.source else target.path.glob("*.safetensors"))
    plan = target.plan
    return {"model": str(target.path.resolve()),
            "weights": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weights],
            "layers": {t: plan.tier_of.count(t) for t in ("device", "ram", "disk")}, "ring": plan.ring_size,
            "device": str(target.model.device), "dtype": str(target.model.dtype), "threads": torch.get_num_threads(),
            "disk_cold": target.layers.disk_cold, "max_budget": max_budget, "torch": torch.__version__}


@torch.inference_mode()
def _pass_seconds(target: LoadedModel, scratch, num_tokens: int) -> float:
    """One target pass over `num_tokens` tokens (a causal block: the same work as a tree of that size)."""
    tokens = torch.randint(0, target.config.vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(0))
    scratch.truncate(0)
    start = time.perf_counter()
    target.model.forward(tokens, scratch)
    target.model.synchronize()
    seconds = time.perf_counter() - start
    scratch.truncate(0)
    return seconds
