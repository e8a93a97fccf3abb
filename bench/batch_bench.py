"""`bench batch`: batched decoding throughput by batch size, layers streamed from RAM and from a cold disk,
with and without speculation, in one run.

Per tier the target (and the draft) load once, planned for the largest batch, and serve every batch size;
per batch size the autoregressive and speculative rows run back to back, so slow drift of a shared machine
hits both. A row answers every prompt greedily through one Decoder with `batch_size` slots (continuous
batching: a finished sequence's slot takes the next prompt) and reports total new tokens per second and
each request's latency from its admission to its last token (queueing for a slot excluded).

RAM tier: every decoder layer streams from host memory. Disk tier: the device budget of `bench spec`'s
disk-cold mode (what never streams + the ring + DISK_COLD_RESIDENT_LAYERS layers), no RAM tier, the page
cache dropped before each pass.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from offload import LoadedModel, LoadOptions
from offload.devices import choose_device, choose_dtype
from offload.loader import largest_batch_for, streaming_device_budget
from offload.weights.resolve import resolve_model
from offload.weights.tokenizer import Tokenizer
from perf.probe import auto_budget
from runtime.models import load_model
from runtime.speculation import DraftFootprint, estimated_draft_footprint
from spec import BudgetPolicy, DecodeConfig, Decoder, DecodeRequest, FixedBudget, FixedTree, SamplingConfig, Speculator
from spec.draft import load_any_draft, require_draft
from bench.spec_bench import DISK_COLD_RESIDENT_LAYERS, MIN_PASS_TOKENS

TIERS = ("ram", "disk")


def check_tiers(tiers: list[str]) -> None:
    """--tiers names ram and/or disk, at least one."""
    if not tiers or any(t not in TIERS for t in tiers):
        raise ValueError(f"--tiers takes {','.join(TIERS)}; got {','.join(tiers) or 'nothing'}")


MODES = ("autoregressive", "speculative")
WARMUP_TOKENS = 2
Status = Callable[[str], None]


@dataclass(slots=True)
class BatchBenchConfig:
    target: str | None = None           # None: the embedded default model
    draft: str | None = None            # None: the target's shipped draft
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    tiers: list[str] = field(default_factory=lambda: list(TIERS))
    max_new_tokens: int = 32
    use_draft: bool = True              # False: autoregressive rows only
    budget: int | None = None           # tree tokens per sequence (FixedTree); None: BudgetChooser.split per pass
    max_budget: int = 64                # the chooser's largest tree
    device: str = "auto"
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) <= 0:
            raise ValueError(f"--batch-sizes needs positive sizes, e.g. 1,2,4; got {self.batch_sizes}")
        check_tiers(self.tiers)
        if self.max_new_tokens <= 0:
            raise ValueError(f"--max-new-tokens must be positive, got {self.max_new_tokens}")
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"--budget must be 'auto' or a positive tree size, got {self.budget}")

    @property
    def modes(self) -> tuple[str, ...]:
        return MODES if self.use_draft else MODES[:1]

    @property
    def draft_spec(self) -> str:
        return require_draft(self.target, self.draft, " or --no-draft")

    def max_pass_tokens(self) -> int:
        largest_tree = (self.budget or self.max_budget) if self.use_draft else 1
        return max(MIN_PASS_TOKENS, max(self.batch_sizes) * largest_tree)


class RecordingBudget:
    """A BudgetPolicy that forwards to `inner` and keeps each pass's (tokens, seconds)."""

    def __init__(self, inner: BudgetPolicy) -> None:
        self.inner, self.passes = inner, []

    def split(self, num_sequences: int, max_pass_tokens: int) -> int:
        return self.inner.split(num_sequences, max_pass_tokens)

    def observe(self, *args, **kwargs) -> None:
        self.inner.observe(*args, **kwargs)

    def observe_pass(self, num_tokens: int, seconds: float) -> None:
        self.passes.append((num_tokens, seconds))
        self.inner.observe_pass(num_tokens, seconds)


@dataclass(slots=True)
class TierRun:
    """One tier's loaded models, shared by every batch size and mode."""
    tier: str
    target: LoadedModel
    draft: object | None
    chooser: BudgetPolicy | None
    max_context: int
    max_pass_tokens: int
    largest_batch: int                  # the planner's, at this tier's device budget

    def close(self) -> None:
        self.target.layers.close()
        if self.draft is not None:
            self.draft.close()


def load_options(config: BatchBenchConfig, tier: str, max_context: int) -> LoadOptions:
    """Planned for the largest batch; ram: every decoder layer streams from RAM; disk: bench spec's
    disk-cold budget (DISK_COLD_RESIDENT_LAYERS layers resident), no RAM tier, cold page cache."""
    dtype_bytes = choose_dtype(config.dtype, choose_device(config.device)).itemsize
    draft = estimated_draft_footprint(config.draft_spec, dtype_bytes) if config.use_draft else DraftFootprint()
    options = LoadOptions(config.target, config.device, config.dtype, max_context=max_context,
                          max_pass_tokens=config.max_pass_tokens(), num_sequences=max(config.batch_sizes),
                          draft_bytes=draft.weight_bytes, draft_kv_token_bytes=draft.kv_token_bytes)
    resident = DISK_COLD_RESIDENT_LAYERS if tier == "disk" else 0
    options.gpu_mem = streaming_device_budget(options, resident)
    if tier == "disk":
        options.ram, options.disk_cold = 1, True
    return options


def open_tier(config: BatchBenchConfig, tier: str, max_context: int, on_status: Status) -> TierRun:
    options = load_options(config, tier, max_context)
    largest = largest_batch_for(options)
    target = load_model(options)
    if tier not in target.plan.tier_of:
        target.layers.close()
        raise RuntimeError(f"the {tier} tier holds no decoder layer in this plan: nothing would stream from it")
    on_status(f"{tier}: {target.plan.tier_of.count(tier)} of {len(target.plan.tier_of)} layers stream from {tier}")
    draft, chooser = None, None
    if config.use_draft:
        draft = load_any_draft(config.draft_spec, target, LoadOptions(device=config.device, dtype=config.dtype,
                                                                      max_context=max_context), on_status)
        chooser = auto_budget(target, config.max_budget, on_status) if config.budget is None else None
    return TierRun(tier, target, draft, chooser, max_context, config.max_pass_tokens(), largest)


def run_batch_bench(config: BatchBenchConfig, prompts: list[list[dict[str, str]]],
                    on_status: Status = lambda message: None) -> dict:
    """Rows per tier, batch size and mode (see the module docstring)."""
    rows, tiers = [], {}
    for tier in config.tiers:
        run = None
        try:
            run = _open_with_prompts(config, tier, prompts, on_status)
            ids = [run.target.tokenizer.encode_chat(messages) for messages in prompts]
            tiers[tier] = {"layers": {t: run.target.plan.tier_of.count(t) for t in ("device", "ram", "disk")},
                           "device_budget_bytes": run.target.plan.request.device_budget,
                           "largest_batch": run.largest_batch}
            for mode in config.modes:            # warm-up: allocations, the draft's first pass
                _measure(run, config, mode, 1, ids[:1], WARMUP_TOKENS)
            for size in config.batch_sizes:
                for mode in config.modes:
                    rows.append(_row(run, config, mode, size, ids, on_status))
        finally:
            if run is not None:
                run.close()
    return {"bench": "batch", "prompts": len(prompts), "max_new_tokens": config.max_new_tokens,
            "batch_sizes": config.batch_sizes, "modes": list(config.modes),
            "budget": config.budget if config.budget is not None else "auto", "tiers": tiers, "rows": rows}


def _open_with_prompts(config: BatchBenchConfig, tier: str, prompts: list, on_status: Status) -> TierRun:
    """The context holds the longest prompt, its answer and a tree (a chat template adds few tokens)."""
    probe = Tokenizer(resolve_model(config.target))
    longest = max(len(probe.encode_chat(messages)) for messages in prompts)
    max_context = longest + config.max_new_tokens + (config.budget or config.max_budget) + 16
    return open_tier(config, tier, max_context, on_status)


def _row(run: TierRun, config: BatchBenchConfig, mode: str, size: int, ids: list[list[int]],
         on_status: Status) -> dict:
    if size > run.largest_batch:
        return {"tier": run.tier, "mode": mode, "batch_size": size,
                "refused": f"the planner fits at most {run.largest_batch} sequences at this device budget"}
    row = {"tier": run.tier, "mode": mode, "batch_size": size,
           **_measure(run, config, mode, size, ids, config.max_new_tokens)}
    on_status(f"{run.tier} {mode} batch {size}: {row['tokens_per_second']:.2f} tok/s, "
              f"latency p50 {row['latency_seconds']['p50']:.2f} s")
    return row


def _measure(run: TierRun, config: BatchBenchConfig, mode: str, size: int, ids: list[list[int]],
             max_new_tokens: int) -> dict:
    is_speculative = mode == "speculative"
    speculator = Speculator(run.draft, run.max_context, config.budget or config.max_budget, run.max_pass_tokens,
                            size) if is_speculative else None
    shared = (run.chooser or FixedTree(config.budget)) if is_speculative else FixedBudget(1)
    budget = RecordingBudget(shared)
    decoder = Decoder(run.target.model, run.target.stop_ids, DecodeConfig(max_context=run.max_context,
                      max_pass_tokens=run.max_pass_tokens, max_slots=size), speculator, budget)
    results: list = []

    def finish(request: DecodeRequest, result, error: str | None) -> None:
        if error is not None:
            raise RuntimeError(f"prompt {request.tag}: {error}")
        results.append(result)

    requests = [DecodeRequest(p, SamplingConfig(), max_new_tokens, tag=i) for i, p in enumerate(ids)]
    start = time.perf_counter()
    decoder.run(requests, finish)
    wall = time.perf_counter() - start
    return _figures(results, wall, budget.passes)


def _figures(results: list, wall: float, passes: list[tuple[int, float]]) -> dict:
    tokens = [len(r.token_ids) for r in results]
    latency = [r.stats.seconds for r in results]
    pass_seconds = sum(s for _, s in passes)
    return {"requests": len(results), "tokens": sum(tokens), "wall_seconds": round(wall, 3),
            "tokens_per_second": round(sum(tokens) / wall, 3),
            "latency_seconds": {"mean": round(statistics.fmean(latency), 3),
                                "p50": round(statistics.median(latency), 3), "max": round(max(latency), 3)},
            "passes": len(passes), "tokens_per_pass": round(sum(n for n, _ in passes) / max(len(passes), 1), 2),
            "new_tokens_per_pass": round(sum(tokens) / max(len(passes), 1), 3),
            "pass_seconds": round(pass_seconds / max(len(passes), 1), 5),
            "target_share": round(pass_seconds / wall, 3)}
