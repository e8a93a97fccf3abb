"""`bench draft`: how often a draft agrees with its target on the target's own greedy answers, at
which rank the target's token sits among the draft's choices, and what a draft token costs.

Agreement is teacher-forced: the draft reads prompt + the target's greedy answer and, at every answer
position, its choices are compared with the target's greedy token there (the next answer token). With
`answers_by` (another model, e.g. the reference weights of a quantized target) both read that model's
answers instead and the target's greedy token is its argmax there: two targets are then compared on the
same text, so a difference in agreement is the targets' alone.
Cost is the wall time of a one-token step with a KV cache, batch 1, draft and target interleaved in
the same run; the ratio is what speculation pays per drafted token, in target steps.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from offload import LoadedModel
from offload.devices import dtype_name
from spec.distill.answer_cache import AnswerCache
from spec.tokenizer_match import check_tokenizers_match
from spec.vocab_map import out_of_set_rows
from spec.distill.generate import GenerationConfig, generate_batch

MAX_RANK = 8


@dataclass(slots=True)
class DraftBenchConfig:
    max_new_tokens: int = 256
    batch_size: int = 16            # target answers generated per batch
    num_cost_steps: int = 32        # timed one-token steps per repeat
    num_cost_repeats: int = 5
    max_chain: int = 16             # longest draft chain considered for the speed-up estimate

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "batch_size", "num_cost_steps", "num_cost_repeats", "max_chain"):
            if getattr(self, name) <= 0:
                raise ValueError(f"bench {name} must be positive, got {getattr(self, name)}")


def rank_counts(draft_logits: Tensor, target_ids: Tensor, row_of: Tensor) -> Tensor:
    """draft_logits [T, K] over draft rows; target_ids [T] target tokens -> [MAX_RANK] int64: how often the
    target's token is the draft's k-th choice (k = 1..MAX_RANK). Out-of-set tokens have no rank."""
    rows = row_of[target_ids]                                                       # [T]
    in_set = rows >= 0
    target_logit = draft_logits.gather(-1, rows.clamp(min=0)[:, None])              # [T, 1]
    ranks = (draft_logits > target_logit).sum(-1) + 1                               # [T]; ties favour the target
    ranks = ranks[in_set & (ranks <= MAX_RANK)]
    return torch.bincount(ranks - 1, minlength=MAX_RANK)[:MAX_RANK]


def expected_speedup(acceptance: float, cost_ratio: float, max_chain: int) -> tuple[float, int]:
    """Chain speculation with i.i.d. acceptance a and draft cost c (in target steps): tokens per cycle
    (1 - a^(g+1)) / (1 - a) over cost g*c + 1, maximised over chain length g. Returns (value, g)."""
    best = (1.0, 0)
    for chain in range(1, max_chain + 1):
        tokens = chain + 1 if acceptance >= 1 else (1 - acceptance ** (chain + 1)) / (1 - acceptance)
        best = max(best, (tokens / (chain * cost_ratio + 1), chain))
    return best


def _sequence_logits(loaded: LoadedModel, token_ids: list[int]) -> Tensor:
    """[T, K] a model's logits (a draft's trimmed ones) at every position of one sequence."""
    model = loaded.model
    cache = model.new_cache(len(token_ids))
    forward = getattr(model, "forward_trimmed", model.forward)
    return forward(torch.tensor([token_ids]), cache).logits[0].float().cpu()


def target_choices(target: LoadedModel, prompt_ids: list[int], answer_ids: list[int]) -> Tensor:
    """[A] the target's greedy token at every position of a given answer (teacher-forced)."""
    return _sequence_logits(target, prompt_ids + answer_ids)[len(prompt_ids) - 1:-1].argmax(-1)


def _step_seconds(model, prompt: list[int], num_steps: int) -> float:
    """Seconds per one-token step with a KV cache, after a prefill of `prompt`."""
    forward = getattr(model, "forward_trimmed", model.forward)
    cache = model.new_cache(len(prompt) + num_steps + 1)
    forward(torch.tensor([prompt]), cache, last_only=True)
    cache.commit()
    token = torch.tensor([[prompt[-1]]])
    start = time.perf_counter()
    for _ in range(num_steps):
        forward(token, cache, last_only=True)
        cache.commit()
    return (time.perf_counter() - start) / num_steps


def measure_costs(target: LoadedModel, draft: LoadedModel, prompt: list[int], config: DraftBenchConfig,
                  draft_at_target_dtype: LoadedModel | None = None) -> dict:
    """Median seconds per token of draft and target, measured alternately (one warm-up each). When the
    draft runs in another dtype than the target, `draft_at_target_dtype` (the same draft in the target's
    dtype) is timed in the same loop, so the report shows what the dtype alone buys."""
    models = {"target": target, "draft": draft}
    if draft_at_target_dtype is not None:
        models["draft_at_target_dtype"] = draft_at_target_dtype
    for loaded in models.values():
        _step_seconds(loaded.model, prompt, 2)
    times = {name: [] for name in models}
    for _ in range(config.num_cost_repeats):
        for name, loaded in models.items():
            times[name].append(_step_seconds(loaded.model, prompt, config.num_cost_steps))
    seconds = {name: statistics.median(values) for name, values in times.items()}
    report = {"target_seconds_per_token": seconds["target"], "draft_seconds_per_token": seconds["draft"],
              "cost_ratio": seconds["draft"] / seconds["target"],
              "target_dtype": dtype_name(target.model.dtype), "draft_dtype": dtype_name(draft.model.dtype)}
    if draft_at_target_dtype is not None:
        report["cost_ratio_at_target_dtype"] = seconds["draft_at_target_dtype"] / seconds["target"]
    return report


def target_answers(target: LoadedModel, encoded: list[list[int]], config: DraftBenchConfig, cache: AnswerCache,
                   on_progress: Callable[[dict], None] | None = None) -> list[list[int]]:
    """The target's greedy answer ids for each encoded prompt: from `cache` where present, else generated in
    batches (and added to the cache)."""
    missing = [ids for ids in encoded if cache.get(ids) is None]
    generation = GenerationConfig(batch_size=config.batch_size, max_new_tokens=config.max_new_tokens)
    for start in range(0, len(missing), config.batch_size):
        batch = missing[start:start + config.batch_size]
        for prompt_ids, seq in zip(batch, generate_batch(target.model, batch, target.stop_ids, generation)):
            cache.put(prompt_ids, seq.answer_ids)
        if on_progress:
            on_progress({"phase": "answers", "done": min(start + config.batch_size, len(missing)),
                         "total": len(missing)})
    return [cache.get(ids) for ids in encoded]


def load_pair(target_spec: str | None, draft_spec: str | None) -> tuple[LoadedModel, LoadedModel, LoadedModel | None]:
    """(target, draft, the draft again at the target's dtype when its own differs: see measure_costs).
    `draft_spec` None: the target's shipped draft."""
    from offload import LoadOptions
    from runtime.models import load_model
    from spec.draft import default_draft_for, load_draft
    draft_path = draft_spec or default_draft_for(target_spec)
    if draft_path is None:
        raise ValueError("this target has no shipped draft: give --draft DIR (see `distill`)")
    target = load_model(LoadOptions(target_spec))
    draft = load_draft(LoadOptions(str(draft_path)), embed=target.model.embed)
    same_dtype = None
    if draft.model.dtype != target.model.dtype:
        same_dtype = load_draft(LoadOptions(str(draft_path), dtype=dtype_name(target.model.dtype)),
                                embed=target.model.embed)
    return target, draft, same_dtype


def bench_draft(target: LoadedModel, draft: LoadedModel, prompts: list[list[dict[str, str]]],
                config: DraftBenchConfig, on_progress: Callable[[dict], None] | None = None,
                cache: AnswerCache | None = None, draft_at_target_dtype: LoadedModel | None = None,
                answers_by: LoadedModel | None = None) -> dict:
    """prompts: chat message lists. Returns the JSON report (see module docstring). `cache` keeps the
    answering model's answers between runs (default: none kept); `draft_at_target_dtype`: see
    measure_costs; `answers_by`: the model whose greedy answers are read (default: the target)."""
    check_tokenizers_match(target.path, draft.path)
    answerer = answers_by or target
    if answers_by is not None:
        check_tokenizers_match(target.path, answers_by.path)
    encoded = [target.tokenizer.encode_chat(m) for m in prompts]
    cache = cache or AnswerCache(None, answerer.path, config.max_new_tokens)
    answers = target_answers(answerer, encoded, config, cache, on_progress)
    vocab_map = getattr(draft.model, "vocab_map", torch.arange(draft.config.vocab_size))
    row_of = out_of_set_rows(vocab_map.cpu(), target.config.vocab_size)
    counts = torch.zeros(MAX_RANK, dtype=torch.long)
    num_positions = num_in_set = num_target_agrees = 0
    for prompt_ids, answer_ids in zip(encoded, answers):
        answer = torch.tensor(answer_ids, dtype=torch.long)
        labels = answer if answers_by is None else target_choices(target, prompt_ids, answer_ids)
        logits = _sequence_logits(draft, prompt_ids + answer_ids)[len(prompt_ids) - 1:-1]     # [A, K]
        counts += rank_counts(logits, labels, row_of)
        num_positions += answer.numel()
        num_in_set += int((row_of[labels] >= 0).sum())
        num_target_agrees += int((labels == answer).sum())
    report = _report(counts, num_positions, num_in_set, len(encoded))
    if answers_by is not None:
        report["answers_by"] = answers_by.path.name
        report["target_agrees_with_answers"] = num_target_agrees / max(num_positions, 1)
    report.update(measure_costs(target, draft, encoded[0], config, draft_at_target_dtype))
    report["estimated_speedup"], report["best_chain_length"] = expected_speedup(
        report["top1_agreement"], report["cost_ratio"], config.max_chain)
    return report


def _report(counts: Tensor, num_positions: int, num_in_set: int, num_prompts: int) -> dict:
    rates = (counts.double() / max(num_positions, 1)).tolist()
    return {"num_prompts": num_prompts, "num_answer_tokens": num_positions,
            "top1_agreement": rates[0],
            "rank_acceptance": {str(k + 1): rates[k] for k in range(MAX_RANK)},
            "topk_coverage": {str(k + 1): sum(rates[:k + 1]) for k in range(MAX_RANK)},
            "vocab_coverage": num_in_set / max(num_positions, 1)}
