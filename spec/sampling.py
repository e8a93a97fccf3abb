"""Sampling: a pure map from logits to a token, configured by SamplingConfig.

A request's randomness is keyed by answer position (PositionDraws): the token at answer index p is drawn
by inverse CDF at a uniform u_p that is a pure function of (seed, p). Every tree node at depth d under a
root at index p - d - 1 draws with u_p, so what a sequence emits does not depend on its tree's size, on
how many nodes were drawn before, or on its batch neighbours. Exactness: u_p is independent of the tokens
before p (the trees and the draft never see it), so each emitted token is a target sample given its prefix.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(slots=True)
class SamplingConfig:
    temperature: float = 0.0   # 0 means greedy decoding
    top_p: float = 1.0
    top_k: int = 0             # 0 disables
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0   # > 1 discourages tokens already in the context (1: off)
    presence_penalty: float = 0.0     # OpenAI's, over the answer so far (0: off)
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min-p must lie in [0, 1), got {self.min_p}")
        if not 0 < self.repetition_penalty <= 10:
            raise ValueError(f"repetition penalty must lie in (0, 10], got {self.repetition_penalty}")
        for name in ("presence", "frequency"):
            if not -2 <= getattr(self, f"{name}_penalty") <= 2:
                raise ValueError(f"{name} penalty must lie in [-2, 2], got {getattr(self, f'{name}_penalty')}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def make_generator(config: SamplingConfig, device: torch.device) -> torch.Generator | None:
    if config.is_greedy:
        return None
    generator = torch.Generator(device=device)
    if config.seed is not None:
        generator.manual_seed(config.seed)
    else:
        generator.seed()
    return generator


_MASK64 = (1 << 64) - 1
_DRAW_BYTES = 64 << 20     # float64 CDF rows per step: bounds the workspace at large trees x vocabularies


def _mix64(value: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers whose outputs look independent."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


@dataclass(frozen=True, slots=True)
class PositionDraws:
    """The uniforms of one request: u_p in [0, 1) for answer index p, a pure function of (seed, p)."""
    seed: int

    def uniform(self, position: int) -> float:
        if position < 0:
            raise ValueError(f"answer positions start at 0, got {position}")
        return (_mix64(_mix64(self.seed & _MASK64) ^ position) >> 11) / float(1 << 53)

    def uniforms(self, first: int, count: int, device: torch.device) -> Tensor:
        """[count] float64: u_first, ..., u_{first + count - 1}."""
        return torch.tensor([self.uniform(first + i) for i in range(count)], dtype=torch.float64, device=device)


def make_draws(config: SamplingConfig) -> PositionDraws | None:
    """None when greedy; the request's seed, or 63 fresh bits from the OS when it has none."""
    if config.is_greedy:
        return None
    seed = config.seed if config.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    return PositionDraws(seed)


def sample_at(logits: Tensor, config: SamplingConfig, uniforms: Tensor | None) -> Tensor:
    """logits [N, V], uniforms [N] float64 (None when greedy) -> token ids [N]: row i's token is the first
    whose cumulative probability exceeds uniforms[i] of the row's total (a token of probability 0 never)."""
    if config.is_greedy:
        return logits.argmax(-1)
    if uniforms is None or uniforms.shape != logits.shape[:1]:
        raise ValueError(f"sampling {tuple(logits.shape)} logits needs one uniform per row")
    rows = max(1, _DRAW_BYTES // (8 * logits.shape[-1]))
    tokens = []
    for start in range(0, logits.shape[0], rows):
        cdf = probabilities(logits[start:start + rows], config).double().cumsum(-1)   # [n, V]
        targets = (uniforms[start:start + rows].to(cdf.device) * cdf[:, -1]).unsqueeze(-1)   # [n, 1]
        tokens.append(torch.searchsorted(cdf, targets, right=True).squeeze(-1))
    return torch.cat(tokens).clamp_(max=logits.shape[-1] - 1)


def sample_first(logits: Tensor, config: SamplingConfig, draws: PositionDraws | None) -> Tensor:
    """logits [V] after the prompt -> the answer's first token (answer index 0)."""
    uniforms = None if draws is None else draws.uniforms(0, 1, logits.device)
    return sample_at(logits[None], config, uniforms)[0]


def probabilities(logits: Tensor, config: SamplingConfig) -> Tensor:
    """logits [..., V] -> the distribution actually sampled from, [..., V] float32 (one-hot when greedy)."""
    logits = logits.float()
    if config.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / config.temperature
    if config.top_k:
        kth = logits.topk(min(config.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if config.min_p:
        probs = probs.masked_fill(probs < config.min_p * probs.amax(-1, keepdim=True), 0.0)
    if config.top_p < 1:
        probs = _top_p(probs, config.top_p)
    return probs / probs.sum(-1, keepdim=True)


def _top_p(probs: Tensor, top_p: float) -> Tensor:
    # Keep the smallest set of most likely tokens whose mass reaches top_p (the top token always).
    sorted_probs, order = probs.sort(-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def sample(logits: Tensor, config: SamplingConfig, generator: torch.Generator | None = None) -> Tensor:
    """logits [..., V] -> token ids [...]."""
    if config.is_greedy:
        return logits.argmax(-1)
    probs = probabilities(logits, config)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def penalize_repetition(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """logits [N, V], seen [N, M] token ids each row's context holds (repeats allowed) -> logits with
    each seen token's logit divided by `penalty` where positive, multiplied where negative (CTRL's rule,
    as transformers' RepetitionPenaltyLogitsProcessor applies it over the whole input). Each value is
    computed from the original logit and assigned, so a token seen twice is penalized once."""
    if penalty == 1.0:
        return logits
    values = logits.gather(1, seen)
    return logits.scatter(1, seen, torch.where(values > 0, values / penalty, values * penalty))
