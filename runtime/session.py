"""A session: the target model loaded once, a decoder with its KV cache, and run reports."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from offload import LoadedModel, LoadOptions, StreamDecoder
from offload.loader import DEFAULT_CPU_KERNEL
from offload.devices import choose_device
from offload.planner import PlanError, with_batch
from offload.weights.resolve import DEFAULT_MODEL_NAME, is_default_model
from perf.probe import auto_budget, pass_time_curve, throughput_batch
from perf.tree_size import BudgetChooser, check_budget
from spec import DecodeConfig, Decoder, DecodeResult, FixedBudget, SamplingConfig, Speculator
from spec.draft import is_draft_folder, load_draft
from .models import load_model, weight_formats
from .speculation import (DraftFootprint, DraftUnavailable, choose_draft, draft_dtype_bytes,
                          estimated_draft_footprint, load_draft_for, max_budget_for)
from spec.self_draft import SELF_DRAFT, SubstituteConfig, load_self_draft
from spec.self_speculator import SelfSpeculator
from .self_drafting import SELF_DRAFT_MAX_DEPTH, auto_draft_choice, choose_substitutes, plan_self_draft
from .stop import HeldBackText, StopStrings


MIN_PASS_TOKENS = 512      # prefill chunk: the smallest workspace a session plans for
# `--batch-size auto`'s ceiling: on the CPU a packed pass attends over every slot's keys (see SlotCache)
AUTO_MAX_BATCH = {"cpu": 8, "cuda": 64}


class UserError(Exception):
    """A problem the user can fix; the CLI prints its message as one line."""


@dataclass(slots=True)
class RuntimeConfig:
    target: str | None = None       # None: the embedded default model
    draft: str | None = None
    no_draft: bool = False
    device: str = "auto"
    dtype: str = "auto"
    max_context: int = 4096
    allow_download: bool = False
    gpu_mem: int | None = None      # bytes; None: free device memory minus a margin
    ram: int | None = None          # bytes; None: available RAM minus a margin
    disk_cold: bool = False
    budget: int | None = None       # tree tokens per step; None: chosen automatically
    judge: str | None = None        # AutoJudge file or "default": lossy acceptance of unimportant mismatches
    judge_threshold: float | None = None
    gguf_import: bool = False       # a GGUF target is dequantized to a safetensors folder, not run in place
    batch_size: int | None = 1      # sequences decoded together (a KV cache slot each); None: auto, from the plan
    max_batch: int = 64             # the most auto picks (e.g. the number of requests to answer)
    cpu_kernel: str = DEFAULT_CPU_KERNEL    # a GGUF's matrices on the CPU: auto, packed (int4 kernel), ggml or dense (fp32)
    draft_bits: int | None = None   # --draft self: bits per substitute weight (None: the most that fit)

    def __post_init__(self) -> None:
        if self.draft and self.no_draft:
            raise ValueError("--draft and --no-draft exclude each other")
        if self.draft_bits is not None:
            SubstituteConfig(self.draft_bits)
            if self.draft != SELF_DRAFT:
                raise ValueError("--draft-bits sizes a self-draft's substitutes: give it with --draft self")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch size must be 'auto' or a positive integer, got {self.batch_size}")
        if self.max_context < 16:
            raise ValueError(f"context must be at least 16 tokens, got {self.max_context}")
        if self.budget is not None:
            check_budget(self.budget)
        if self.judge_threshold is not None:
            from judge.policy import check_threshold
            check_threshold(self.judge_threshold)
        if self.judge and self.no_draft:
            raise ValueError("--judge needs a draft to judge (drop --no-draft)")
        if self.judge:                  # a user's file is checked before any model loads
            from judge.policy import judge_path
            if not judge_path(self.judge).is_file():
                raise FileNotFoundError(f"judge file not found: {judge_path(self.judge)}")


def _is_draft_folder(target: str | None) -> bool:
    return bool(target) and is_draft_folder(Path(target).expanduser())


def _load_target(options: LoadOptions, on_status, on_progress) -> LoadedModel:
    """A draft folder runs on its own too (a quick look at its quality); anything else is a model."""
    if _is_draft_folder(options.model):
        return load_draft(options, on_status)
    return load_model(options, on_status, on_progress)


def load_options(config: RuntimeConfig, max_budget: int, draft: DraftFootprint) -> LoadOptions:
    """The target's load options for trees of up to max_budget tokens beside a draft of this footprint."""
    return LoadOptions(config.target, config.device, config.dtype, config.allow_download, gpu_mem=config.gpu_mem,
                       ram=config.ram, max_context=config.max_context,
                       max_pass_tokens=max(MIN_PASS_TOKENS, max_budget), disk_cold=config.disk_cold,
                       draft_bytes=draft.weight_bytes, formats=weight_formats(),
                       draft_kv_token_bytes=draft.kv_token_bytes, gguf_import=config.gguf_import,
                       cpu_kernel=config.cpu_kernel)


def planned_options(config: RuntimeConfig) -> LoadOptions:
    """What a session of `config` with an explicit draft (or none) first plans with: auto's largest tree (or the
    fixed budget), the named draft's footprint, a self-draft's substitutes at --draft-bits (else the most that fit)."""
    spec = choose_draft(config.target, config.draft, config.no_draft).spec
    max_budget = max_budget_for(config.budget, config.device) if spec else 1
    options = load_options(config, max_budget, estimated_draft_footprint(spec, draft_dtype_bytes(spec, config.device)))
    return choose_substitutes(options, config.draft_bits)[1] if spec == SELF_DRAFT else options


class Session:
    def __init__(self, config: RuntimeConfig, on_status=None, on_warning=None, on_progress=None) -> None:
        """on_status(text), on_warning(text): one-line messages; on_progress(done, total): a GGUF import."""
        self.config = config
        self.draft_choice = choose_draft(config.target, config.draft, config.no_draft)
        self.shipped_draft = self.draft_choice.spec if config.draft is None else None
        self.substitutes: SubstituteConfig | None = None      # a self-draft's, once the plan has room for them
        if config.draft is None and not config.no_draft and not _is_draft_folder(config.target):
            options = self._options(max_budget_for(config.budget, config.device), DraftFootprint())
            self.draft_choice = auto_draft_choice(options, self.shipped_draft, self.draft_choice, on_status)
        max_budget = max_budget_for(config.budget, config.device) if self.draft_choice.spec else 1
        self.target, max_budget = self._load_target(max_budget, on_status, on_progress)
        self.tokenizer = self.target.tokenizer
        self.model_name = DEFAULT_MODEL_NAME if is_default_model(config.target) else self.target.path.name
        self.draft = self._load_draft(on_status, on_warning, on_progress)
        self._streamed_before = 0
        self.policy = self._policy()
        budget = self._budget(max_budget, on_status)
        self.batch_size = self._fitted_batch_size(budget, on_status)
        if self.batch_size < self.target.plan.request.num_sequences:     # the plan counts what is allocated
            self.target.plan = with_batch(self.target.plan, self.batch_size)
        is_self = self.draft is not None and self.draft.is_self
        self_growth = {"max_depth": SELF_DRAFT_MAX_DEPTH,
                       "greedy_growth_temperature": self.draft.growth_temperature} if is_self else {}
        decode = DecodeConfig(max_context=config.max_context, max_pass_tokens=self.options.max_pass_tokens,
                              max_slots=self.batch_size, **self_growth)
        self.decoder = Decoder(self.target.model, self.target.stop_ids, decode, self._speculator(decode), budget,
                               self.policy)

    def _speculator(self, decode: DecodeConfig) -> Speculator | None:
        if self.draft is None:
            return None
        if self.draft.is_self:            # drafts in the decoder's own cache
            return SelfSpeculator(self.draft, decode.max_pass_tokens, self.batch_size)
        # the draft's cache is sized for the largest pass the plan sized its own for (draft_slot_tokens)
        return Speculator(self.draft, self.config.max_context, decode.max_pass_tokens, decode.max_pass_tokens,
                          self.batch_size)

    def _load_target(self, max_budget: int, on_status, on_progress) -> tuple[LoadedModel, int]:
        """The target planned for trees of max_budget tokens; under `--budget auto` a workspace that
        does not fit the device budget halves the largest tree instead of failing."""
        config = self.config
        while True:
            spec = self.draft_choice.spec
            self.options = self._options(max_budget, estimated_draft_footprint(spec, draft_dtype_bytes(spec, config.device)))
            self.options.num_sequences = self._batch_size(self.options)
            try:
                if spec == SELF_DRAFT:
                    planned = plan_self_draft(self.options, config.draft_bits, config.draft == SELF_DRAFT,
                                              self.shipped_draft, on_status)
                    self.draft_choice, self.substitutes, self.options = planned.choice, planned.substitutes, planned.options
                    if self.draft_choice.spec not in (SELF_DRAFT, None):
                        continue             # auto's self-draft did not fit: planned again with the shipped draft
                return _load_target(self.options, on_status, on_progress), max_budget
            except PlanError as err:
                if config.budget is not None or max_budget <= MIN_PASS_TOKENS:
                    raise UserError(str(err)) from None
                max_budget //= 2

    def _options(self, max_budget: int, draft: DraftFootprint) -> LoadOptions:
        return load_options(self.config, max_budget, draft)

    def _batch_size(self, options: LoadOptions) -> int:
        """The batch the plan sizes the KV cache for: the configured one, or auto's pick."""
        if self.config.batch_size is not None:
            return self.config.batch_size
        from offload.loader import largest_batch_for
        cap = min(self.config.max_batch, AUTO_MAX_BATCH[choose_device(self.config.device).type])
        return max(1, largest_batch_for(options, cap))

    def _fitted_batch_size(self, budget, on_status) -> int:
        """The batch the plan sized, or under auto the part of it that still adds throughput on the measured
        pass-time curve (the budget chooser's, else measured once up to the plan's batch)."""
        planned = self.options.num_sequences
        if self.config.batch_size is not None or planned == 1:
            return planned
        curve = budget.curve if isinstance(budget, BudgetChooser) else pass_time_curve(self.target, planned, on_status)
        return throughput_batch(curve, planned)

    @property
    def draft_name(self) -> str | None:
        """The draft's folder, or what a self-draft substitutes (None without a draft)."""
        if self.draft is None:
            return None
        if self.draft.is_self:
            return (f"self ({self.substitutes.bits}-bit substitutes of {self.draft.model.layers.num_substitutes} "
                    f"streamed layers)")
        return str(self.draft.path)

    def _load_draft(self, on_status, on_warning, on_progress):
        if not self.draft_choice.spec:
            return None
        if self.draft_choice.spec == SELF_DRAFT:
            return load_self_draft(self.target, self.substitutes, on_status)
        draft_options = LoadOptions(None, self.config.device, "auto", self.config.allow_download,
                                    gpu_mem=self.config.gpu_mem, max_context=self.config.max_context,
                                    max_pass_tokens=self.options.max_pass_tokens, formats=weight_formats(),
                                    gguf_import=self.config.gguf_import)
        try:
            return load_draft_for(self.draft_choice, self.target, draft_options, on_status, on_progress)
        except DraftUnavailable as err:
            if on_warning:
                on_warning(str(err))
            return None

    def _policy(self):
        """Lossless acceptance, or the judge's (lossy) when --judge is given."""
        if not self.config.judge:
            return None
        from judge.policy import JudgePolicy, default_threshold, load_judge_for
        judge = load_judge_for(self.config.judge, self.target.model.embed, self.target.config.hidden_size)
        threshold = self.config.judge_threshold
        return JudgePolicy(judge, default_threshold(judge) if threshold is None else threshold)

    @property
    def judge_cost(self) -> dict | None:
        """The judge file's held-out evaluation at the threshold in use (None without --judge)."""
        if self.policy is None:
            return None
        from judge.held_out import judge_cost
        return judge_cost(self.policy.judge.evaluation, self.policy.threshold)

    def _budget(self, max_budget: int, on_status):
        if self.draft is None:
            return FixedBudget(1)
        if self.config.budget is not None:
            return FixedBudget(self.config.budget)
        if self.draft.is_self:            # its trees price their own growth (spec/step_clock.py): the budget caps them
            return FixedBudget(max_budget)
        return auto_budget(self.target, max_budget, on_status)

    def encode(self, messages: list[dict[str, str]] | None = None, raw: str | None = None) -> list[int]:
        if raw is not None:
            return self.tokenizer.encode(raw)
        return self.tokenizer.encode_chat(messages or [])

    def generate(self, prompt_ids: list[int], sampling: SamplingConfig, max_new_tokens: int,
                 on_text=None, stop: list[str] | None = None) -> tuple[str, DecodeResult]:
        """-> (the answer's text, ending before its first stop string, if any; the decode result).
        on_text(delta) receives the text as it grows, never a stop string or the start of one."""
        stops = StopStrings(self.tokenizer, stop) if stop else None
        show = HeldBackText(stops.strings, on_text) if stops and on_text else None
        stream = StreamDecoder(self.tokenizer)

        def on_tokens(ids: list[int]) -> None:
            delta = stream.push(ids)
            if delta and on_text:
                (show.push if show else on_text)(delta)

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._streamed_before = self.target.layers.total.bytes_streamed
        self.decoder.config = replace(self.decoder.config, max_new_tokens=max_new_tokens)
        result = self.decoder.generate(prompt_ids, sampling, on_tokens, stops)
        text = self.tokenizer.decode(result.token_ids)
        if stops:
            text = stops.trim(text)
        if show:
            show.finish(text)
        return text, result

    def reset(self) -> None:
        self.decoder.reset()

    def close(self) -> None:
        """Stops and joins the target's and the draft's loader threads; `with Session(...)` calls it on
        success, on an error and on Ctrl-C (a daemon loader left inside a torch op at exit aborts the process)."""
        self.target.close()
        if self.draft:
            self.draft.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def peak_device_bytes(self) -> int:
        if self.target.model.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated())
        # On the CPU the engine accounts for its own device memory: weights, ring buffers, KV cache.
        speculator = self.decoder.speculator
        draft = self.draft.device_bytes if speculator else 0
        if speculator and not self.draft.is_self:        # a self-draft's cache is the decoder's
            draft += speculator.cache.num_bytes
        return self.target.device_bytes + self.decoder.cache.num_bytes + draft

    def engine_stats(self) -> dict:
        plan = self.target.plan
        return {"layers": {t: plan.tier_of.count(t) for t in ("device", "ram", "disk")},
                "ring_size": plan.ring_size, "layer_bytes": plan.request.layer_bytes, "last_pass": self.target.layers.last_pass.as_dict(),
                "total": self.target.layers.total.as_dict()}

    def report(self, text: str, result: DecodeResult) -> dict:
        stats = result.stats
        return {
            "text": text,
            "model": self.model_name,
            "num_prompt_tokens": stats.num_prompt_tokens,
            "num_new_tokens": stats.num_new_tokens,
            "num_target_passes": stats.num_target_passes,
            "tokens_per_pass": round(stats.tokens_per_pass, 3),
            "seconds": round(stats.seconds, 4),
            "first_token_seconds": round(stats.first_token_seconds or 0.0, 4),
            "tokens_per_second": round(stats.tokens_per_second, 3),
            "peak_device_bytes": self.peak_device_bytes(),
            "bytes_streamed": self.target.layers.total.bytes_streamed - self._streamed_before,
            "stop_reason": stats.stop_reason,
            "device": str(self.target.model.device),
            "dtype": str(self.target.model.dtype).removeprefix("torch."),
            "draft": self.draft_name,
            "speculative": stats.speculative,
            "lossy": self.policy is not None,
            "judge_accepted": stats.policy_accepted,
            **({"judge_threshold": self.policy.threshold, "judge": self.judge_cost} if self.policy else {}),
            **({"speculation": stats.speculation_report()} if stats.speculative else {}),
            "engine": self.engine_stats(),
        }
