"""Greedy speculation against autoregressive decoding on the device a pair is loaded on, per budget: tokens
per pass and per second (timed), and what a step makes the host wait for (counted in separate runs:
offload/host_sync.py). The one earlier GPU run lost to plain decoding at ~285 device syncs per step.
"""
from __future__ import annotations

import json
from dataclasses import replace

from offload import LoadedModel, LoadOptions, load_model
from offload.host_sync import count_steps
from spec import DecodeConfig, Decoder, DecodeResult, Draft, FixedBudget, SamplingConfig, Speculator
from spec.draft import default_draft_for, load_any_draft

WARMUP_TOKENS = 4
COUNTED_TOKENS = 16
MIN_PASS_TOKENS = 512


def speculation_syncs(target: LoadedModel, draft: Draft, prompt_ids: list[int], budgets: list[int],
                      max_new_tokens: int, max_context: int) -> dict:
    """One greedy answer of max_new_tokens to `prompt_ids` per row: autoregressive (no draft), then each
    budget (budget 1: the speculative loop without a tree)."""
    rows, reference, counted_tokens = [], None, min(COUNTED_TOKENS, max_new_tokens)
    for budget in ["autoregressive", *budgets]:
        decoder = _decoder(target, draft, budget, max_context)
        _answer(decoder, prompt_ids, WARMUP_TOKENS)
        result = _answer(decoder, prompt_ids, max_new_tokens)
        reference = reference or result.token_ids
        counts, steps = count_steps(lambda tokens: _answer(decoder, prompt_ids, tokens).stats.num_steps,
                                    counted_tokens, target.model.device)
        stats, per_step = result.stats, max(result.stats.num_steps, 1)
        rows.append({"budget": budget, "new_tokens": stats.num_new_tokens, "steps": stats.num_steps,
                     "tokens_per_pass": round(stats.tokens_per_pass, 3),
                     "tokens_per_second": round(stats.tokens_per_second, 2),
                     "ms_per_step": {part: round(1e3 * getattr(stats, f"{part}_seconds") / per_step, 3)
                                     for part in ("draft", "target", "overhead")},
                     "identical_to_autoregressive": result.token_ids == reference, **counts.report(steps)})
    return {"device": str(target.model.device), "dtype": str(target.model.dtype).removeprefix("torch."),
            "prompt_tokens": len(prompt_ids), "max_new_tokens": max_new_tokens, "counted_tokens": counted_tokens,
            "rows": rows}


def _decoder(target: LoadedModel, draft: Draft, budget: int | str, max_context: int) -> Decoder:
    size = 1 if budget == "autoregressive" else budget
    config = DecodeConfig(WARMUP_TOKENS, max_context, max(MIN_PASS_TOKENS, size))     # tokens: set per answer
    speculator = None if budget == "autoregressive" else Speculator(draft, max_context, max(size, 2), config.max_pass_tokens)
    return Decoder(target.model, set(), config, speculator, FixedBudget(size))


def _answer(decoder: Decoder, prompt_ids: list[int], max_new_tokens: int) -> DecodeResult:
    """A greedy answer from empty caches; stop tokens ignored, so every row decodes the same length."""
    decoder.config = replace(decoder.config, max_new_tokens=max_new_tokens)
    decoder.reset()
    return decoder.generate(prompt_ids, SamplingConfig())


def default_pair_syncs(device: str, budgets: list[int], max_new_tokens: int, max_context: int = 2048) -> dict:
    """speculation_syncs on the embedded default model and its shipped draft (fp32: greedy answers then
    equal target-only decoding's token for token) and the first chat prompt."""
    import textdata
    options = LoadOptions(device=device, dtype="fp32", max_context=max_context,
                          max_pass_tokens=max(MIN_PASS_TOKENS, *budgets))
    target = load_model(options)
    draft = load_any_draft(str(default_draft_for(None)), target, LoadOptions(device=device, dtype="fp32",
                                                                             max_context=max_context))
    prompt = json.loads(textdata.path(textdata.CHAT_PROMPTS).open().readline())["prompt"]
    try:
        ids = target.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return {"pair": "default", **speculation_syncs(target, draft, ids, budgets, max_new_tokens, max_context)}
    finally:
        target.layers.close()
        draft.close()
