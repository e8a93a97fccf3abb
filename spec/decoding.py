"""The decoding loop: every step is one target pass over a token tree. Without a draft (or at budget 1)
the tree is the last token alone, i.e. autoregressive decoding. The loop keeps both KV caches across
calls and reuses the longest common prefix (multi-turn chat).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from offload import DecoderModel, ForwardOutput, KVCache
from offload.host_sync import send
from .grow import MAX_CHILDREN, MAX_DEPTH, GrowthConfig
from .penalties import Penalties
from .sampling import PositionDraws, SamplingConfig, make_draws, sample_first
from .speculator import Speculator
from .stats import DecodeStats
from .tree import Tree
from .verify import AcceptancePolicy, ExactMatch, Verdict, accepted_path, matches_target, target_choices


@dataclass(slots=True)
class DecodeConfig:
    max_new_tokens: int = 256
    max_context: int = 4096
    max_pass_tokens: int = 512      # prefill chunk and largest tree: the engine's workspace
    max_width: int | None = None    # tree growth (see GrowthConfig)
    max_children: int = MAX_CHILDREN
    max_depth: int = MAX_DEPTH

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max-new-tokens must be positive, got {self.max_new_tokens}")
        if self.max_context <= 1:
            raise ValueError(f"context size must be > 1, got {self.max_context}")
        if self.max_pass_tokens <= 0:
            raise ValueError(f"max_pass_tokens must be positive, got {self.max_pass_tokens}")

    def growth(self, budget: int, remaining: int) -> GrowthConfig:
        """A step's tree with `remaining` tokens left to emit: no deeper than remaining - 1 (the target
        adds one token after the accepted path)."""
        return GrowthConfig(budget, self.max_width, self.max_children, min(self.max_depth, remaining - 1))


@dataclass(slots=True)
class DecodeResult:
    token_ids: list[int] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)


class BudgetPolicy(Protocol):
    """Chooses each step's tree size and learns from what the step accepted."""

    def choose(self) -> int: ...

    def observe(self, tree_size: int, path_ranks: list[int], draft_seconds: float,
                overhead_seconds: float, target_seconds: float | None = None) -> None: ...


@dataclass(slots=True)
class FixedBudget:
    budget: int

    def choose(self) -> int:
        return self.budget

    def observe(self, tree_size: int, path_ranks: list[int], draft_seconds: float,
                overhead_seconds: float, target_seconds: float | None = None) -> None:
        return None


TokenCallback = Callable[[list[int]], None]


class StopCondition(Protocol):
    """Ends an answer at the first token after which it holds (e.g. the text contains a stop string)."""

    def reached(self, answer_ids: list[int]) -> bool: ...


class Decoder:
    def __init__(self, target: DecoderModel, stop_ids: set[int], config: DecodeConfig,
                 speculator: Speculator | None = None, budget: BudgetPolicy | None = None,
                 policy: AcceptancePolicy | None = None) -> None:
        self.target, self.stop_ids, self.config = target, set(stop_ids), config
        self.speculator, self.budget = speculator, budget or FixedBudget(1)
        self.policy = policy or ExactMatch()
        self.cache: KVCache = target.new_cache(config.max_context)
        self.cached_ids: list[int] = []   # tokens whose keys/values are committed in the cache
        self._logit_level = 0.0           # the target's last log-sum-exp (see Draft.log_probs)

    def reset(self) -> None:
        self.cache.truncate(0)
        self.cached_ids = []
        if self.speculator:
            self.speculator.reset()

    def generate(self, prompt_ids: list[int], sampling: SamplingConfig,
                 on_tokens: TokenCallback | None = None, stop: StopCondition | None = None) -> DecodeResult:
        """The answer to `prompt_ids`: it ends at a stop token, at `stop`, at max_new_tokens or at the end
        of the context, token by token in order, so exactly where one-token decoding would end it."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.config.max_context:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context holds {self.config.max_context}")
        result, start = DecodeResult(), time.perf_counter()
        result.stats.num_prompt_tokens = len(prompt_ids)
        result.stats.speculative = self.speculator is not None
        draws = make_draws(sampling)
        try:
            logits = self._prefill(prompt_ids, result.stats)
            self._loop(logits, sampling, draws, result, on_tokens, start, stop)
        except KeyboardInterrupt:
            result.stats.stop_reason = "interrupted"
            self._discard_pending()
            raise
        finally:
            result.stats.seconds = time.perf_counter() - start
        return result

    def _discard_pending(self) -> None:
        """Both caches keep only committed tokens; if the interrupt fell between a commit and its
        bookkeeping, the target's cache starts over (the next prompt is prefilled again)."""
        if len(self.cached_ids) != self.cache.length:
            self.cached_ids = []
            self.cache.truncate(0)
        self.cache.truncate(self.cache.length)
        if self.speculator:
            self.speculator.discard_pending()

    def _prefill(self, prompt_ids: list[int], stats: DecodeStats) -> torch.Tensor:
        common = _common_prefix(self.cached_ids, prompt_ids)
        common = min(common, len(prompt_ids) - 1)   # at least one new token yields the next logits
        self.cache.truncate(common)
        self.cached_ids = self.cached_ids[:common]
        stats.num_reused_tokens = common
        rest, chunk = prompt_ids[common:], self.config.max_pass_tokens
        for begin in range(0, len(rest), chunk):
            new_ids = rest[begin:begin + chunk]
            logits = self.target.forward(torch.tensor([new_ids]), self.cache, last_only=True).logits
            self.cache.commit()
            self.cached_ids.extend(new_ids)
            stats.num_target_passes += 1
        return logits[0, -1]   # [V]

    def _loop(self, logits: torch.Tensor, sampling: SamplingConfig, draws: PositionDraws | None, result: DecodeResult,
              on_tokens: TokenCallback | None, start: float, stop: StopCondition | None) -> None:
        stats = result.stats
        if sampling.repetition_penalty != 1.0:           # the target's level, for a penalized draft
            self._logit_level = float(logits.logsumexp(-1))
        penalties = Penalties.before(sampling, self.cached_ids, [])
        if penalties:
            logits = penalties.apply(logits[None], torch.empty(1, 0, dtype=torch.long))[0]
        emitted = [int(sample_first(logits, sampling, draws))]
        while True:
            count, stats.stop_reason = self._cut(emitted, result.token_ids, stop)
            result.token_ids.extend(emitted[:count])
            stats.num_new_tokens += count
            if stats.first_token_seconds is None:
                stats.first_token_seconds = time.perf_counter() - start
            if on_tokens:
                on_tokens(emitted[:count])
            if stats.stop_reason:
                return
            if self.cache.length + 1 >= self.config.max_context:
                stats.stop_reason = "context"
                return
            emitted = self._step(result.token_ids, sampling, draws, stats)

    def _cut(self, emitted: list[int], answer: list[int], stop: StopCondition | None) -> tuple[int, str]:
        """How many of a step's tokens to emit after `answer`, and why generation stops there ("" if it
        goes on)."""
        return cut_answer(emitted, answer, self.stop_ids, stop, self.config.max_new_tokens)

    def _step(self, answer: list[int], sampling: SamplingConfig, draws: PositionDraws | None,
              stats: DecodeStats) -> list[int]:
        """One target pass over a tree rooted at the answer's last token -> the tokens it yields (accepted
        path + the target's token after it). Commits the root and the accepted nodes in both caches."""
        began = time.perf_counter()
        root = answer[-1]
        penalties = Penalties.before(sampling, self.cached_ids, answer[:-1], self._logit_level)
        budget = self._fitting_budget()
        slots, draft_seconds = None, 0.0
        if budget > 1 and self.speculator:
            growth = self.config.growth(budget, self.config.max_new_tokens - stats.num_new_tokens)
            tree, slots = self.speculator.propose(self.cached_ids, root, growth, penalties)
            draft_seconds = self.speculator.forward_seconds
        else:
            tree = Tree.root_only(root)
        verified = time.perf_counter()
        output = self._verify_pass(tree)
        self.target.synchronize()     # the choices' read below would wait anyway; here it is timed as the pass
        target_seconds = time.perf_counter() - verified
        logits = output.logits[0]                                                      # [N, V]
        if penalties:
            logits = penalties.apply(logits, send(tree.path_tokens(), logits.device))
        choices = target_choices(logits, sampling, draws, tree, len(answer)).to(tree.tokens.device)
        hidden = output.hidden[0] if output.hidden is not None else None
        path = accepted_path(tree, self.policy.accept(tree, Verdict(choices, hidden)))
        if sampling.repetition_penalty != 1.0:       # the level at the newest position, for the next tree
            self._logit_level = float(output.logits[0, path[-1]].logsumexp(-1))
        path_tokens = torch.cat((tree.tokens[path], choices[path[-1:]])).tolist()   # one read: path + next token
        yielded = path_tokens[1:]
        if not self.policy.is_lossless:      # accepted tokens that are not the target's own choice
            stats.policy_accepted += int((~matches_target(tree, choices))[path[1:]].sum())
        self.cache.commit(path)
        self.cached_ids.extend(path_tokens[:-1])
        if slots is not None:
            self.speculator.accept(tree, slots, path)
        overhead = time.perf_counter() - began - draft_seconds - target_seconds
        stats.record_step(budget, tree.num_nodes, len(yielded), draft_seconds, target_seconds, overhead)
        self.budget.observe(tree.num_nodes, path[1:], draft_seconds, overhead, target_seconds)
        return yielded

    def _fitting_budget(self) -> int:
        """The policy's tree size, shrunk to what the context window and the engine's workspace hold
        (the committed path must leave the last slot free, as autoregressive decoding does)."""
        room = self.config.max_context - 1 - self.cache.length
        return max(1, min(self.budget.choose(), room, self.config.max_pass_tokens))

    def _verify_pass(self, tree: Tree) -> ForwardOutput:
        tokens = tree.tokens[None]
        if tree.num_nodes == 1:
            return self.target.forward(tokens, self.cache, return_hidden=self.policy.needs_hidden)
        length = self.cache.length
        return self.target.forward(tokens, self.cache, tree.positions(length),
                                   tree.attention_mask(length, self.target.device),
                                   return_hidden=self.policy.needs_hidden)


def cut_answer(emitted: list[int], answer: list[int], stop_ids: set[int], stop: StopCondition | None,
               max_new_tokens: int) -> tuple[int, str]:
    """How many of a step's `emitted` tokens follow `answer`, and why generation stops there ("" if it goes
    on): token by token in order, so exactly where one-token decoding would stop."""
    for index, token in enumerate(emitted, start=1):
        if token in stop_ids:
            return index, "eos"
        if stop is not None and stop.reached(answer + emitted[:index]):
            return index, "stop_string"
        if len(answer) + index >= max_new_tokens:
            return index, "length"
    return len(emitted), ""


def _common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count
