"""Batched decoding: many sequences share every target pass, so one transfer of a streamed layer serves
them all.

Each pass packs, back to back into one [1, N] pass, every decoding sequence's tree (a root alone without a
draft) and chunks of joining prompts, within max_pass_tokens; the slot cache and a block mask keep each
token to its own sequence's keys. A sequence does exactly what Decoder does alone (the same position-keyed draws
from its own seed, same penalties, stop checks token by token), so its answer does not depend on its
neighbours. Finished sequences leave after the pass that ends them and waiting prompts take their slots
(continuous batching); a joining prompt's prefill rides along with the others' decoding.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from offload import DecoderModel
from offload.model.masks import causal_mask
from offload.model.slots import SlotCache, block_mask
from .batch_speculator import BatchSpeculator, Proposal
from .decoding import DecodeResult, StopCondition, TokenCallback, cut_answer
from .grow import HOST, MAX_CHILDREN, MAX_DEPTH, GrowthConfig
from .penalties import Penalties
from .sampling import PositionDraws, SamplingConfig, make_draws, sample_first
from .tree import Tree
from .verify import AcceptancePolicy, ExactMatch, Verdict, accepted_path, matches_target, target_choices


@dataclass(slots=True)
class BatchConfig:
    max_slots: int = 8              # sequences decoded together (KV cache slots)
    max_context: int = 4096         # per sequence
    max_pass_tokens: int = 512      # all sequences' tokens in one pass: the engine's workspace
    max_width: int | None = None    # tree growth (see GrowthConfig)
    max_children: int = MAX_CHILDREN
    max_depth: int = MAX_DEPTH

    def __post_init__(self) -> None:
        if self.max_slots <= 0:
            raise ValueError(f"batch size must be positive, got {self.max_slots}")
        if self.max_context <= 1:
            raise ValueError(f"context size must be > 1, got {self.max_context}")
        if self.max_pass_tokens < self.max_slots:
            raise ValueError(f"a pass of {self.max_pass_tokens} tokens cannot hold one token of each of "
                             f"{self.max_slots} sequences")

    def growth(self, budget: int, remaining: int) -> GrowthConfig:
        return GrowthConfig(budget, self.max_width, self.max_children, min(self.max_depth, remaining - 1))


@dataclass(slots=True)
class BatchRequest:
    prompt_ids: list[int]
    sampling: SamplingConfig
    max_new_tokens: int
    stop: StopCondition | None = None
    on_tokens: TokenCallback | None = None
    tag: object = None               # the caller's handle (a batch item, an index)


class SharedBudget(Protocol):
    """Sizes each tree when `num_sequences` trees share a pass, and learns from what steps accepted."""

    def split(self, num_sequences: int, max_pass_tokens: int) -> int: ...

    def observe(self, tree_size: int, path_ranks: list[int], draft_seconds: float,
                overhead_seconds: float, target_seconds: float | None = None) -> None: ...

    def observe_pass(self, num_tokens: int, seconds: float) -> None: ...


@dataclass(slots=True)
class FixedShare:
    """A fixed number of tree tokens per pass, split evenly between the sequences (--budget N)."""
    total: int

    def split(self, num_sequences: int, max_pass_tokens: int) -> int:
        return max(1, min(self.total, max_pass_tokens) // max(num_sequences, 1))

    def observe(self, *args, **kwargs) -> None:
        return None

    def observe_pass(self, num_tokens: int, seconds: float) -> None:
        return None


@dataclass(slots=True)
class FixedTree(FixedShare):
    """The same tree size for every sequence whatever the batch (trees, hence seeded samples, do not depend
    on the batch's composition), within the pass."""

    def split(self, num_sequences: int, max_pass_tokens: int) -> int:
        return max(1, min(self.total, max_pass_tokens // max(num_sequences, 1)))


FinishCallback = Callable[[BatchRequest, DecodeResult | None, str | None], None]


@dataclass(slots=True)
class _Sequence:
    request: BatchRequest
    slot: int
    draws: PositionDraws | None
    started: float
    result: DecodeResult = field(default_factory=DecodeResult)
    cached_ids: list[int] = field(default_factory=list)   # committed in the target's slot
    num_prefilled: int = 0
    logit_level: float = 0.0
    is_finished: bool = False

    @property
    def is_decoding(self) -> bool:
        return self.num_prefilled == len(self.request.prompt_ids)


@dataclass(slots=True)
class _Part:
    """One sequence's share of a pass: a tree to verify or a prompt chunk to prefill."""
    sequence: _Sequence
    tokens: Tensor          # [n]
    positions: Tensor       # [n]
    mask: Tensor            # [n, filled + n]
    tree: Tree | None = None
    draft_rows: Tensor | None = None
    penalties: Penalties | None = None
    budget: int = 1


class BatchDecoder:
    def __init__(self, target: DecoderModel, stop_ids: set[int], config: BatchConfig,
                 speculator: BatchSpeculator | None = None, budget: SharedBudget | None = None,
                 policy: AcceptancePolicy | None = None) -> None:
        self.target, self.stop_ids, self.config = target, set(stop_ids), config
        self.speculator, self.budget = speculator, budget or FixedShare(1)
        self.policy = policy or ExactMatch()
        self.cache = SlotCache(target.config, config.max_slots, config.max_context, target.device, target.dtype)
        self.num_passes = 0
        self.num_in_flight = 0

    def run(self, requests: Iterable[BatchRequest], on_finish: FinishCallback) -> None:
        """Answers every request; on_finish(request, result, None) as each ends (in completion order), or
        on_finish(request, None, message) for a request that cannot run (nothing generated)."""
        waiting, active = iter(requests), []
        free = list(range(self.config.max_slots))
        while True:
            self._admit(waiting, active, free, on_finish)
            if not active:
                return
            self._pass(active)
            for sequence in [s for s in active if s.is_finished]:
                active.remove(sequence)
                free.append(sequence.slot)
                self.cache.truncate(sequence.slot, 0)
                if self.speculator:
                    self.speculator.release(sequence.slot)
                sequence.result.stats.seconds = time.perf_counter() - sequence.started
                on_finish(sequence.request, sequence.result, None)
            self.num_in_flight = len(active)

    def _admit(self, waiting: Iterator[BatchRequest], active: list[_Sequence], free: list[int],
               on_finish: FinishCallback) -> None:
        while free:
            request = next(waiting, None)
            if request is None:
                return
            problem = self._problem(request)
            if problem:
                on_finish(request, None, problem)
                continue
            sequence = _Sequence(request, free.pop(0), make_draws(request.sampling),
                                 time.perf_counter())
            sequence.result.stats.num_prompt_tokens = len(request.prompt_ids)
            sequence.result.stats.speculative = self.speculator is not None
            active.append(sequence)
        self.num_in_flight = len(active)

    def _problem(self, request: BatchRequest) -> str | None:
        if not request.prompt_ids:
            return "the prompt is empty"
        if len(request.prompt_ids) >= self.config.max_context:
            return f"prompt has {len(request.prompt_ids)} tokens; the context holds {self.config.max_context}"
        if request.max_new_tokens <= 0:
            return f"max tokens must be positive, got {request.max_new_tokens}"
        return None

    def _pass(self, active: list[_Sequence]) -> None:
        began = time.perf_counter()
        decoding = [s for s in active if s.is_decoding]
        prefilling = [s for s in active if not s.is_decoding]
        parts, draft_seconds = self._trees(decoding, bool(prefilling))
        room = self.config.max_pass_tokens - sum(part.tokens.numel() for part in parts)
        for sequence in prefilling:
            if room <= 0:
                break
            parts.append(self._prompt_chunk(sequence, room))
            room -= parts[-1].tokens.numel()
        verified = time.perf_counter()
        logits, hidden = self._forward(parts)
        target_seconds = time.perf_counter() - verified
        self.budget.observe_pass(sum(part.tokens.numel() for part in parts), target_seconds)
        offset, num_trees = 0, max(len(decoding), 1)
        for part in parts:
            count = part.tokens.numel() if part.tree is not None else 1
            rows = slice(offset, offset + count)
            offset += count
            part.sequence.result.stats.num_target_passes += part.tree is None
            if part.tree is None:
                self._prefilled(part, logits[rows])
                continue
            overhead = (time.perf_counter() - began - draft_seconds - target_seconds) / num_trees
            self._verified(part, logits[rows], hidden[rows] if hidden is not None else None,
                           draft_seconds / num_trees, target_seconds, overhead)
        self.num_passes += 1

    def _trees(self, decoding: list[_Sequence], is_prefill_waiting: bool) -> tuple[list[_Part], float]:
        """Each decoding sequence's tree for this pass (the root alone at budget 1) -> (parts, draft seconds)."""
        if not decoding:
            return [], 0.0
        room = self.config.max_pass_tokens
        if is_prefill_waiting:         # leave a joining prompt half the pass, so it is never starved
            room = max(len(decoding), room // 2)
        share = self.budget.split(len(decoding), room) if self.speculator else 1
        parts, proposals = [], []
        for sequence in decoding:
            answer = sequence.result.token_ids
            sampling = sequence.request.sampling
            penalties = Penalties.before(sampling, sequence.cached_ids, answer[:-1], sequence.logit_level)
            length = self.cache.lengths[sequence.slot]
            budget = max(1, min(share, self.config.max_context - 1 - length))
            part = _Part(sequence, torch.empty(0), torch.empty(0), torch.empty(0), Tree.root_only(answer[-1]),
                         penalties=penalties, budget=budget)
            parts.append(part)
            if budget > 1 and self.speculator:
                remaining = sequence.request.max_new_tokens - sequence.result.stats.num_new_tokens
                proposals.append((part, Proposal(sequence.slot, sequence.cached_ids, answer[-1],
                                                 self.config.growth(budget, remaining), penalties)))
        draft_seconds = 0.0
        if proposals:
            grown = self.speculator.propose([proposal for _, proposal in proposals])
            for (part, _), (tree, rows) in zip(proposals, grown):
                part.tree, part.draft_rows = tree, rows
            draft_seconds = self.speculator.forward_seconds
        for part in parts:
            length = self.cache.lengths[part.sequence.slot]
            part.tokens, part.positions = part.tree.tokens, part.tree.positions(length)[0]
            part.mask = part.tree.attention_mask(length, HOST)
        return parts, draft_seconds

    def _prompt_chunk(self, sequence: _Sequence, room: int) -> _Part:
        prompt, start = sequence.request.prompt_ids, sequence.num_prefilled
        chunk = prompt[start:start + room]
        length = self.cache.lengths[sequence.slot]
        return _Part(sequence, torch.tensor(chunk), torch.arange(length, length + len(chunk)),
                     causal_mask(length, len(chunk), HOST))

    def _forward(self, parts: list[_Part]) -> tuple[Tensor, Tensor | None]:
        """One packed target pass -> logits [R, V] (every tree node, each prompt chunk's last token) and
        hidden states [R, H] when the policy asks for them."""
        rows, offset = [], 0
        for part in parts:
            count = part.tokens.numel()
            rows.extend(range(offset, offset + count) if part.tree is not None else [offset + count - 1])
            offset += count
        self.cache.begin([(part.sequence.slot, part.tokens.numel()) for part in parts])
        output = self.target.forward(torch.cat([p.tokens for p in parts])[None], self.cache,
                                     torch.cat([p.positions for p in parts])[None],
                                     block_mask([p.mask for p in parts]),
                                     return_hidden=self.policy.needs_hidden, rows=torch.tensor(rows))
        self.target.synchronize()
        return output.logits[0], output.hidden[0] if output.hidden is not None else None

    def _prefilled(self, part: _Part, logits: Tensor) -> None:
        """Commits a prompt chunk; after the prompt's last chunk, samples the answer's first token."""
        sequence = part.sequence
        self.cache.commit(sequence.slot)
        sequence.cached_ids.extend(part.tokens.tolist())
        sequence.num_prefilled += part.tokens.numel()
        if not sequence.is_decoding:
            return
        logits, sampling = logits[-1], sequence.request.sampling                            # [V]
        if sampling.repetition_penalty != 1.0:
            sequence.logit_level = float(logits.logsumexp(-1))
        penalties = Penalties.before(sampling, sequence.cached_ids, [])
        if penalties:
            logits = penalties.apply(logits[None], torch.empty(1, 0, dtype=torch.long))[0]
        self._emit(sequence, [int(sample_first(logits, sampling, sequence.draws))])

    def _verified(self, part: _Part, logits: Tensor, hidden: Tensor | None, draft_seconds: float,
                  target_seconds: float, overhead_seconds: float) -> None:
        """As Decoder._step after its pass: the sequence's own choices, path, commits and tokens."""
        sequence, tree = part.sequence, part.tree
        stats, sampling = sequence.result.stats, sequence.request.sampling
        penalized = part.penalties.apply(logits, tree.path_tokens().to(logits.device)) if part.penalties else logits
        choices = target_choices(penalized, sampling, sequence.draws, tree, len(sequence.result.token_ids))
        choices = choices.to(tree.tokens.device)
        path = accepted_path(tree, self.policy.accept(tree, Verdict(choices, hidden)))
        if sampling.repetition_penalty != 1.0:       # the level at the newest position, for the next tree
            sequence.logit_level = float(logits[path[-1]].logsumexp(-1))
        path_tokens = torch.cat((tree.tokens[path], choices[path[-1:]])).tolist()   # one read: path + next token
        yielded = path_tokens[1:]
        if not self.policy.is_lossless:
            stats.policy_accepted += int((~matches_target(tree, choices))[path[1:]].sum())
        self.cache.commit(sequence.slot, path)
        sequence.cached_ids.extend(path_tokens[:-1])
        if part.draft_rows is not None:
            self.speculator.accept(sequence.slot, tree, part.draft_rows, path)
        stats.record_step(part.budget, tree.num_nodes, len(yielded), draft_seconds, target_seconds, overhead_seconds)
        self.budget.observe(tree.num_nodes, path[1:], draft_seconds, overhead_seconds)
        self._emit(sequence, yielded)

    def _emit(self, sequence: _Sequence, emitted: list[int]) -> None:
        result, request = sequence.result, sequence.request
        count, result.stats.stop_reason = cut_answer(emitted, result.token_ids, self.stop_ids, request.stop,
                                                     request.max_new_tokens)
        result.token_ids.extend(emitted[:count])
        result.stats.num_new_tokens += count
        if result.stats.first_token_seconds is None:
            result.stats.first_token_seconds = time.perf_counter() - sequence.started
        if request.on_tokens:
            request.on_tokens(emitted[:count])
        if not result.stats.stop_reason and self.cache.lengths[sequence.slot] + 1 >= self.config.max_context:
            result.stats.stop_reason = "context"
        sequence.is_finished = bool(result.stats.stop_reason)
