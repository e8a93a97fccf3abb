"""Speculation with a self-draft (spec/self_draft.py): one cache. The draft attends to the target's committed keys
and values in the decoder's own slot cache (exact ones, from the verification passes), so it has no cache, no
prefill and no catch-up of its own: a step runs the root, then the tree's nodes, as pending rows past each slot's
committed ones, and the target's verification pass writes over them (its reserve replaces pending rows)."""
from __future__ import annotations

import time
from dataclasses import replace

import torch
from torch import Tensor

from offload.model.masks import causal_mask
from offload.model.slots import SlotCache, block_mask
from offload.planner import draft_slot_tokens
from .draft import Draft
from .grow import HOST, GrowthConfig
from .speculator import Proposal, Speculator
from .tree import Tree


class StepClock:
    """What a draft round costs against what a token is worth, from recent steps (exponential means): seconds per
    draft forward, and seconds per emitted token of a whole step (draft, target pass and the rest)."""
    SMOOTHING = 0.2

    def __init__(self) -> None:
        self.round_seconds: float | None = None
        self.token_seconds: float | None = None
        self._step_started: float | None = None
        self._tokens = 0

    def step_started(self, now: float) -> None:
        if self._step_started is not None and self._tokens:
            self.token_seconds = self._mean(self.token_seconds, (now - self._step_started) / self._tokens)
        self._step_started, self._tokens = now, 0

    def drafted(self, seconds: float, num_forwards: int) -> None:
        if num_forwards:
            self.round_seconds = self._mean(self.round_seconds, seconds / num_forwards)

    def emitted(self, num_tokens: int) -> None:
        self._tokens += num_tokens

    def min_gain(self) -> float:
        """Expected tokens a round must add to pay for itself (0 until both costs are measured)."""
        if self.round_seconds is None or not self.token_seconds:
            return 0.0
        return self.round_seconds / self.token_seconds

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.SMOOTHING * (new - old)


class SelfSpeculator(Speculator):
    def __init__(self, draft: Draft, max_budget: int, max_slots: int = 1, priced: bool = True) -> None:
        """priced: growth stops where another round costs more than it can earn (StepClock); off, trees grow to
        their budget (deterministic: what measurements of tokens per pass need)."""
        if not draft.is_self:
            raise ValueError("SelfSpeculator drafts with the target's own layers (load_self_draft)")
        self.draft, self.max_pass_tokens = draft, max_budget
        self.cache: SlotCache | None = None
        self.lookups = [None] * max_slots
        self.vocab_map = draft.vocab_map.to(HOST)
        self.forward_seconds, self.num_draft_forwards = 0.0, 0
        # the root, every node a tree of max_budget expands, slack for expanded nodes that later drop out
        self.shared_cache_rows = draft_slot_tokens(1, max_budget)
        self.clock = StepClock() if priced else None

    def propose(self, proposals: list[Proposal]) -> list[tuple[Tree, Tensor]]:
        if self.clock:
            self.clock.step_started(time.perf_counter())
        forwards = self.num_draft_forwards
        trees = super().propose(proposals)
        if self.clock:
            self.clock.drafted(self.forward_seconds, self.num_draft_forwards - forwards)
        return trees

    def _growth(self, growth: GrowthConfig) -> GrowthConfig:
        return replace(growth, min_gain=self.clock.min_gain()) if self.clock else growth

    def bind(self, target_cache: SlotCache) -> None:
        self.cache = target_cache

    def release(self, slot: int) -> None:
        """Nothing of the slot is the draft's own."""

    def reset(self) -> None:
        """As release."""

    def discard_pending(self, slot: int) -> None:
        """The decoder truncates its cache."""

    def accept(self, slot: int, tree: Tree, draft_rows: Tensor, path: list[int]) -> None:
        """The target's pass committed the accepted keys itself (exact ones); the step emitted the path's tokens."""
        if self.clock:
            self.clock.emitted(len(path))

    def _committed_rows(self, slot: int) -> int:
        return self.cache.lengths[slot] + 1          # the root's pending row, first after the committed ones

    def _catch_up(self, proposals: list[Proposal]) -> list[Tensor]:
        """One packed draft pass over every root -> per proposal [K] draft log-probabilities after its root."""
        for proposal in proposals:
            if len(proposal.committed_ids) != self.cache.lengths[proposal.slot]:
                raise RuntimeError(f"slot {proposal.slot} holds {self.cache.lengths[proposal.slot]} keys, "
                                   f"its sequence {len(proposal.committed_ids)}")
        lengths = [self.cache.lengths[p.slot] for p in proposals]
        self.cache.begin([(p.slot, 1) for p in proposals])
        logits = self.draft.logits(torch.tensor([[p.root for p in proposals]]), self.cache,
                                   torch.tensor([lengths]), block_mask([causal_mask(n, 1, HOST) for n in lengths]),
                                   keep_pending=False)                                       # [R, K]
        self.num_draft_forwards += 1
        return [self.draft.to_log_probs(logits[i:i + 1], p.penalties, torch.tensor([[p.root]]), p.growth.temperature)[-1]
                for i, p in enumerate(proposals)]
