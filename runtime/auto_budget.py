"""`--budget auto`: the target's pass time by tree size, measured once per model, plan and machine (cached
on disk), feeds the chooser that sizes every tree for the most accepted tokens per second."""
from __future__ import annotations

import time

import torch

from offload import LoadedModel
from offload.weights.gguf_import import cache_root
from spec.budget import BudgetChooser, load_curve, probe_pass_times, save_curve


def auto_budget(target: LoadedModel, max_budget: int, on_status=None) -> BudgetChooser:
    key = curve_key(target, max_budget)
    folder = cache_root() / "pass_times"
    curve = load_curve(key, folder)
    if curve is None:
        if on_status:
            on_status("measuring the target's pass time by tree size (once for this model, plan and machine)")
        scratch = target.model.new_cache(max_budget)
        curve = probe_pass_times(lambda n: _pass_seconds(target, scratch, n), max_budget)
        save_curve(key, curve, folder)
    return BudgetChooser(curve, max_budget)


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
