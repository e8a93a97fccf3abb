"""Batched generation with the target, keeping its top-k next-token log-probabilities at every position.

Prompts are left-padded into one batch: pad slots get position 0 and are hidden from every real
query by the mask; a pad query sees only earlier pads (a row of all-False would turn into NaN).
Finished rows keep a slot until the batch is compacted (when a quarter of it has finished).
The teacher signal comes from the same passes that generate the text, so it costs nothing extra,
and because everything goes through DecoderModel.forward, an offloaded target streams as usual.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from offload import DecoderModel, KVCache
from ..sampling import SamplingConfig, sample

NO_TARGET = -1   # top-k id marking a position with no next token (the last of a sequence)


@dataclass(slots=True)
class GenerationConfig:
    batch_size: int = 64
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    top_k: int = 32              # teacher log-probabilities kept per position
    temperature: float = 0.0     # 0: greedy answers
    prefill_chunk: int = 32      # positions per prefill pass (bounds the [B, chunk, V] logits)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_new_tokens", "max_prompt_tokens", "top_k", "prefill_chunk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"generation {name} must be positive, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"generation temperature must be >= 0, got {self.temperature}")


@dataclass(slots=True)
class GeneratedSequence:
    token_ids: list[int]        # prompt + answer
    num_prompt_tokens: int
    topk_ids: Tensor            # [T, k] int32: the target's top-k next tokens after each token
    topk_logprobs: Tensor       # [T, k] float16: their log-probabilities (full-vocabulary softmax)
    stop_reason: str            # "eos" | "length"

    @property
    def answer_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


def topk_logprobs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """logits [..., V] -> (ids [..., k] int32, log-probabilities [..., k] float16)."""
    values, ids = logits.float().topk(k, dim=-1)
    return ids.int(), (values - logits.float().logsumexp(-1, keepdim=True)).half()


def _prefill_mask(key_valid: Tensor, start: int, end: int) -> Tensor:
    """key_valid [B, W] -> [B, end - start, end]: causal, real queries see only real keys."""
    queries = torch.arange(start, end)
    causal = torch.arange(end)[None, :] <= queries[:, None]                       # [n, end]
    query_is_pad = ~key_valid[:, start:end]                                       # [B, n]
    return causal[None] & (key_valid[:, None, :end] | query_is_pad[:, :, None])


def _compact(model: DecoderModel, cache: KVCache, rows: Tensor) -> KVCache:
    """A cache holding only `rows` of `cache` (committed slots copied)."""
    smaller = model.new_cache(cache.max_length, len(rows))
    length = cache.length
    index = rows.to(cache.keys.device)
    smaller.keys[:, :, :, :length] = cache.keys[:, index, :, :length]
    smaller.values[:, :, :, :length] = cache.values[:, index, :, :length]
    smaller.length = length
    return smaller


class _BatchState:
    """Per original row: answer tokens so far and the top-k tables indexed by cache slot."""

    def __init__(self, prompt_ids: list[list[int]], config: GenerationConfig) -> None:
        self.lengths = torch.tensor([len(p) for p in prompt_ids])
        self.width = int(self.lengths.max())
        self.pads = self.width - self.lengths                                       # [B]
        num_slots = self.width + config.max_new_tokens
        batch = len(prompt_ids)
        self.topk_ids = torch.full((batch, num_slots, config.top_k), NO_TARGET, dtype=torch.int32)
        self.topk_logprobs = torch.zeros(batch, num_slots, config.top_k, dtype=torch.float16)
        self.answers: list[list[int]] = [[] for _ in prompt_ids]
        self.stop = [""] * batch
        slots = torch.arange(num_slots)
        self.key_valid = slots[None] >= self.pads[:, None]                          # [B, S]
        self.positions = (slots[None] - self.pads[:, None]).clamp(min=0)            # [B, S]


def generate_batch(model: DecoderModel, prompt_ids: list[list[int]], stop_ids: set[int],
                   config: GenerationConfig, generator: torch.Generator | None = None) -> list[GeneratedSequence]:
    """Answers every prompt (greedy or sampled per config) with one left-padded batch."""
    state = _BatchState(prompt_ids, config)
    tokens = torch.zeros(len(prompt_ids), state.width, dtype=torch.long)             # [B, W]
    for row, ids in enumerate(prompt_ids):
        tokens[row, state.pads[row]:] = torch.tensor(ids)
    cache = model.new_cache(state.width + config.max_new_tokens, len(prompt_ids))
    for start in range(0, state.width, config.prefill_chunk):
        end = min(start + config.prefill_chunk, state.width)
        mask = _prefill_mask(state.key_valid, start, end)
        logits = model.forward(tokens[:, start:end], cache, state.positions[:, start:end], mask).logits
        cache.commit()
        state.topk_ids[:, start:end], state.topk_logprobs[:, start:end] = topk_logprobs(logits, config.top_k)
    _decode(model, cache, logits[:, -1], state, stop_ids, config, generator)
    return [_sequence(state, row, ids) for row, ids in enumerate(prompt_ids)]


def _decode(model: DecoderModel, cache: KVCache, logits: Tensor, state: _BatchState, stop_ids: set[int],
            config: GenerationConfig, generator: torch.Generator | None) -> None:
    """logits [B, V]: the last prompt position of every row. Samples until every row stops."""
    sampling = SamplingConfig(temperature=config.temperature)
    rows = torch.arange(len(state.answers))          # cache row -> original row
    is_live = torch.ones(len(rows), dtype=torch.bool)
    while True:
        next_ids = sample(logits, sampling, generator)                               # [A]
        tokens = next_ids.tolist()               # one read of the device per step, not one per row
        for cache_row, row in enumerate(rows.tolist()):
            if not is_live[cache_row]:
                continue
            token = tokens[cache_row]
            state.answers[row].append(token)
            if token in stop_ids or len(state.answers[row]) >= config.max_new_tokens:
                state.stop[row] = "eos" if token in stop_ids else "length"
                is_live[cache_row] = False
        if not is_live.any():
            return
        if is_live.sum() <= 0.75 * len(rows):
            cache, rows, next_ids = _compact(model, cache, is_live.nonzero()[:, 0]), rows[is_live], next_ids[is_live]
            is_live = torch.ones(len(rows), dtype=torch.bool)
        slot = cache.length
        positions = state.positions[rows, slot:slot + 1]                              # [A, 1]
        mask = state.key_valid[rows, None, :slot + 1]                                 # [A, 1, slot + 1]
        logits = model.forward(next_ids[:, None], cache, positions, mask).logits[:, -1]
        cache.commit()
        ids, logprobs = topk_logprobs(logits, config.top_k)
        state.topk_ids[rows, slot], state.topk_logprobs[rows, slot] = ids, logprobs


def _sequence(state: _BatchState, row: int, prompt_ids: list[int]) -> GeneratedSequence:
    pad = int(state.pads[row])
    end = state.width + len(state.answers[row])
    ids = state.topk_ids[row, pad:end].clone()
    ids[-1] = NO_TARGET                       # nothing follows the last token
    return GeneratedSequence(list(prompt_ids) + state.answers[row], len(prompt_ids), ids,
                             state.topk_logprobs[row, pad:end].clone(), state.stop[row])


def length_sorted_batches(items: list, length_of: Callable[[object], int], batch_size: int,
                          window: int = 4) -> list[list]:
    """Batches of similar length (less padding): windows of `window` batches, sorted inside."""
    batches = []
    for start in range(0, len(items), batch_size * window):
        chunk = sorted(items[start:start + batch_size * window], key=length_of)
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    return batches
