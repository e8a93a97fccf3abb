"""Speculation with a self-draft (spec/self_draft.py): one cache. The draft attends to the target's committed keys
and values in the decoder's own slot cache (exact ones, from the verification passes), so it has no cache, no
prefill and no catch-up of its own: a step runs the root, then the tree's nodes, as pending rows past each slot's
committed ones, and the target's verification pass writes over them (its reserve replaces pending rows)."""
from __future__ import annotations

import time
from dataclasses import replace

import torch
from torch import Tensor

from offload.cache_sizes import draft_slot_tokens
from offload.model.masks import causal_mask
from offload.model.slots import SlotCache, block_mask
from .draft import Draft
from .grow import HOST, GrowthConfig
from .speculator import Proposal, Speculator
from .step_clock import StepClock
from .tree import Tree


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
        return super().propose(proposals)

    def _expand(self, rounds) -> None:
        if self.clock is None:
            return super()._expand(rounds)
        started = time.perf_counter()
        super()._expand(rounds)
        self.draft.model.synchronize()      # free: the next round reads these logits back at once
        self.clock.drafted(sum(chosen.numel() for _, _, chosen in rounds), time.perf_counter() - started)

    def _growth(self, growth: GrowthConfig) -> GrowthConfig:
        if self.clock is None:
            return growth
        return replace(growth, min_gain=self.clock.min_gain(), min_node_gain=self.clock.min_node_gain(),
                       min_child_gain=self.clock.min_child_gain())

    def observe_pass(self, num_tokens: int, seconds: float) -> None:
        if self.clock:
            self.clock.passed(num_tokens, seconds, time.perf_counter())

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
        started = time.perf_counter()
        logits = self.draft.logits(torch.tensor([[p.root for p in proposals]]), self.cache,
                                   torch.tensor([lengths]), block_mask([causal_mask(n, 1, HOST) for n in lengths]),
                                   keep_pending=False)                                       # [R, K]
        self.num_draft_forwards += 1
        if self.clock:
            self.draft.model.synchronize()
            self.clock.drafted(len(proposals), time.perf_counter() - started)
        return [self.draft.to_log_probs(logits[i:i + 1], p.penalties, torch.tensor([[p.root]]), p.growth.temperature)[-1]
                for i, p in enumerate(proposals)]
