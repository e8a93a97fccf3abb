"""The decoding loop. Autoregressive decoding is speculation with a tree of one node; the loop keeps
the target's KV cache across calls and reuses the longest common prefix (multi-turn chat)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from offload import DecoderModel, KVCache
from .sampling import SamplingConfig, make_generator, sample


@dataclass(slots=True)
class DecodeConfig:
    max_new_tokens: int = 256
    max_context: int = 4096
    max_pass_tokens: int = 512      # prefill runs in chunks of this size (the engine's workspace)

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max-new-tokens must be positive, got {self.max_new_tokens}")
        if self.max_context <= 1:
            raise ValueError(f"context size must be > 1, got {self.max_context}")
        if self.max_pass_tokens <= 0:
            raise ValueError(f"max_pass_tokens must be positive, got {self.max_pass_tokens}")


@dataclass(slots=True)
class DecodeStats:
    num_prompt_tokens: int = 0
    num_new_tokens: int = 0
    num_target_passes: int = 0
    num_reused_tokens: int = 0
    seconds: float = 0.0
    first_token_seconds: float | None = None
    stop_reason: str = ""

    @property
    def tokens_per_pass(self) -> float:
        return self.num_new_tokens / self.num_target_passes if self.num_target_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_new_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class DecodeResult:
    token_ids: list[int] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)


TokenCallback = Callable[[list[int]], None]


class Decoder:
    def __init__(self, target: DecoderModel, stop_ids: set[int], config: DecodeConfig) -> None:
        self.target, self.stop_ids, self.config = target, set(stop_ids), config
        self.cache: KVCache = target.new_cache(config.max_context)
        self.cached_ids: list[int] = []   # tokens whose keys/values are committed in the cache

    def reset(self) -> None:
        self.cache.truncate(0)
        self.cached_ids = []

    def generate(self, prompt_ids: list[int], sampling: SamplingConfig,
                 on_tokens: TokenCallback | None = None) -> DecodeResult:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.config.max_context:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context holds {self.config.max_context}")
        result, start = DecodeResult(), time.perf_counter()
        result.stats.num_prompt_tokens = len(prompt_ids)
        generator = make_generator(sampling, self.target.device)
        try:
            logits = self._prefill(prompt_ids, result.stats)
            self._loop(logits, sampling, generator, result, on_tokens, start)
        except KeyboardInterrupt:
            result.stats.stop_reason = "interrupted"
            raise
        finally:
            result.stats.seconds = time.perf_counter() - start
        return result

    def _prefill(self, prompt_ids: list[int], stats: DecodeStats) -> torch.Tensor:
        common = _common_prefix(self.cached_ids, prompt_ids)
        common = min(common, len(prompt_ids) - 1)   # at least one new token yields the next logits
        self.cache.truncate(common)
        self.cached_ids = self.cached_ids[:common]
        stats.num_reused_tokens = common
        rest, chunk = prompt_ids[common:], self.config.max_pass_tokens
        for start in range(0, len(rest), chunk):
            logits = self._step(rest[start:start + chunk], stats, last_only=True)
        return logits

    def _step(self, new_ids: list[int], stats: DecodeStats, last_only: bool = False) -> torch.Tensor:
        tokens = torch.tensor([new_ids], dtype=torch.long)
        output = self.target.forward(tokens, self.cache, last_only=last_only)
        self.cache.commit()
        self.cached_ids.extend(new_ids)
        stats.num_target_passes += 1
        return output.logits[0, -1]   # [V]

    def _loop(self, logits: torch.Tensor, sampling: SamplingConfig, generator, result: DecodeResult,
              on_tokens: TokenCallback | None, start: float) -> None:
        stats = result.stats
        while True:
            token = int(sample(logits, sampling, generator))
            result.token_ids.append(token)
            stats.num_new_tokens += 1
            if stats.first_token_seconds is None:
                stats.first_token_seconds = time.perf_counter() - start
            if on_tokens:
                on_tokens([token])
            if token in self.stop_ids:
                stats.stop_reason = "eos"
                return
            if stats.num_new_tokens >= self.config.max_new_tokens:
                stats.stop_reason = "length"
                return
            if self.cache.length + 1 >= self.config.max_context:
                stats.stop_reason = "context"
                return
            logits = self._step([token], stats)


def _common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count
