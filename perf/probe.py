"""Probing the target's pass time: `--budget auto` measures one pass per tree size once per model, plan and
machine (cached on disk) and feeds the curve to the chooser that sizes every tree for the best rate;
`--batch-size auto` reads the same curve: the batch past which more sequences add latency, not rate."""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from offload import LoadedModel
from offload.weights.gguf_import import cache_root

from .pass_curve import PassTimeCurve, load_curve, save_curve
from .tree_size import BudgetChooser, budget_grid

PROBE_VERSION = 2     # 2: disturbed points measured again; curves cached by version 1 are measured anew


# A pass over m x more tokens costs at most m x more (weights are read once, compute grows with tokens):
# a point above DISTURBED_FACTOR x that bound was measured while something else held the CPU or GPU.
DISTURBED_FACTOR = 1.5
DISTURBED_RETRIES = 3


def probe_pass_times(measure: Callable[[int], float], max_tokens: int, stop_factor: float = 12.0,
                     num_repeats: int = 3, repeat_under_seconds: float = 1.0) -> PassTimeCurve:
    """Measures one target pass at each of budget_grid(max_tokens) after a warm-up pass over 1 token.
    A size whose first pass took under `repeat_under_seconds` is measured `num_repeats` times (best
    kept); one that costs more than DISTURBED_FACTOR x proportionally more than the size before is
    measured again, up to DISTURBED_RETRIES times (best kept), and 1 token is measured once more at the
    end: the curve is cached for good, so a busy moment must not stay in it. Stops after the first size
    with t(n) > stop_factor * t(1): a tree yields far fewer than stop_factor tokens per pass, so no larger
    tree can pay for itself."""
    if stop_factor <= 1 or num_repeats < 1:
        raise ValueError(f"need stop_factor > 1 and num_repeats >= 1, got {stop_factor}, {num_repeats}")
    measure(1)
    points: list[tuple[float, float]] = []
    for n in budget_grid(max_tokens):
        best = _checked_seconds(n, measure(n))
        if best < repeat_under_seconds:
            best = min([best] + [_checked_seconds(n, measure(n)) for _ in range(num_repeats - 1)])
        if points:
            bound = DISTURBED_FACTOR * n / points[-1][0] * points[-1][1]
            for _ in range(DISTURBED_RETRIES):
                if best <= bound:
                    break
                best = min(best, _checked_seconds(n, measure(n)))
        points.append((n, best))
        if best > stop_factor * points[0][1]:
            break
    points[0] = (1, min(points[0][1], _checked_seconds(1, measure(1))))
    return PassTimeCurve(points)


def _checked_seconds(n: int, seconds: float) -> float:
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a pass over {n} tokens must take finite, non-negative seconds, got {seconds}")
    return seconds


def auto_budget(target: LoadedModel, max_budget: int, on_status=None) -> BudgetChooser:
    """`--budget auto`: a tree-size chooser on the target's pass-time curve up to `max_budget` tokens."""
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
        curve = probe_pass_times(lambda n: measure_pass_seconds(target, scratch, n), max_tokens)
        save_curve(key, curve, folder)
    return curve


def throughput_batch(curve: PassTimeCurve, largest: int, share: float = 0.98) -> int:
    """The smallest batch (1..largest) whose predicted throughput B / t(B), one new token per sequence per
    pass, is within `share` of the best over 1..largest: past it more sequences add latency and KV slots,
    not tokens per second. A flat pass time (streamed weights) takes the largest batch, one proportional
    to its tokens (compute-bound) one sequence. Judged against the best of all sizes, not step by step, so
    a noisy point of the measured curve moves the choice little."""
    if largest < 1 or not 0 < share <= 1:
        raise ValueError(f"need largest >= 1 and share in (0, 1], got {largest} and {share}")
    rates = [size / curve.seconds(size) for size in range(1, largest + 1)]
    return next(size for size, rate in enumerate(rates, start=1) if rate >= share * max(rates))


def curve_key(target: LoadedModel, max_budget: int) -> dict:
    """What the pass time depends on: the weights, where the plan put them, the device and dtype."""
    # a GGUF run in place: its file (the model folder holds only config and tokenizer)
    weights = sorted(target.source.file_paths() if target.source else target.path.glob("*.safetensors"))
    plan = target.plan
    return {"model": str(target.path.resolve()),
            "weights": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weights],
            "layers": {t: plan.tier_of.count(t) for t in ("device", "ram", "disk")}, "ring": plan.ring_size,
            "device": str(target.model.device), "dtype": str(target.model.dtype), "threads": torch.get_num_threads(),
            "disk_cold": target.layers.disk_cold, "max_budget": max_budget, "torch": torch.__version__,
            "probe": PROBE_VERSION}


@torch.inference_mode()
def measure_pass_seconds(target: LoadedModel, scratch, num_tokens: int) -> float:
    """One target pass over `num_tokens` tokens (a causal block: the same work as a tree of that size)."""
    tokens = torch.randint(0, target.config.vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(0))
    scratch.truncate(0)
    start = time.perf_counter()
    target.model.forward(tokens, scratch)
    target.model.synchronize()
    seconds = time.perf_counter() - start
    scratch.truncate(0)
    return seconds
