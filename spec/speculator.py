"""The draft side of speculation: one resident draft, a slot of its KV cache per sequence (one slot for a
single sequence).

Invariant per slot between steps: the draft's committed tokens are a prefix of that sequence's
target-committed tokens, nothing pending. A step catches every sequence up to its root in packed passes (usually
one or two tokens each: after verification the draft commits the accepted nodes it had expanded), then grows all
trees in lockstep: each growth round is one draft forward over every tree's chosen nodes (`Growth` decides a
tree's nodes the same whoever runs the forwards).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from offload.cache_sizes import draft_slot_tokens
from offload.model.masks import causal_mask
from offload.model.slots import SlotCache, block_mask
from .draft import Draft
from .grow import HOST, Growth, GrowthConfig, expansion_mask
from .lookup import ContextLookup
from .penalties import Penalties
from .requests import common_prefix
from .tree import Tree, path_tokens


@dataclass(slots=True)
class Proposal:
    """What one sequence asks of a step: a tree rooted at `root` after its committed ids."""
    slot: int
    committed_ids: list[int]
    root: int
    growth: GrowthConfig
    penalties: Penalties | None = None


class Speculator:
    shared_cache_rows = 0     # rows a speculator that drafts in the target's cache needs past each slot's context

    def __init__(self, draft: Draft, max_context: int, max_budget: int, max_pass_tokens: int = 512,
                 max_slots: int = 1) -> None:
        self.draft, self.max_pass_tokens = draft, max_pass_tokens
        model = draft.model
        self.cache = SlotCache(model.config, max_slots, draft_slot_tokens(max_context, max_budget), model.device,
                               model.dtype)
        self.cached_ids: list[list[int]] = [[] for _ in range(max_slots)]
        self.lookups = [self._new_lookup() for _ in range(max_slots)]
        self.vocab_map = draft.vocab_map.to(HOST)        # [K] target id of each draft row
        self.forward_seconds = 0.0                        # draft compute of the last propose
        self.num_draft_forwards = 0

    def _growth(self, growth: GrowthConfig) -> GrowthConfig:
        """How this step's trees grow (a speculator that prices its rounds sets their minimum gain)."""
        return growth

    def observe_pass(self, num_tokens: int, seconds: float) -> None:
        """A target pass over `num_tokens` took `seconds` (a speculator that prices its trees learns from it)."""

    def bind(self, target_cache: SlotCache) -> None:
        """The decoder's cache (a draft with a cache of its own ignores it)."""

    def _committed_rows(self, slot: int) -> int:
        """Rows of `slot` every tree node attends to: the committed sequence (the root's keys are among them)."""
        return self.cache.lengths[slot]

    def _new_lookup(self) -> ContextLookup | None:
        return ContextLookup(self.draft.vocab_map) if self.draft.is_trimmed else None

    def release(self, slot: int) -> None:
        """The slot's sequence left the batch: the next one starts from an empty slot."""
        self.cache.truncate(slot, 0)
        self.cached_ids[slot] = []
        self.lookups[slot] = self._new_lookup()

    def reset(self) -> None:
        for slot in range(self.cache.num_seq_slots):
            self.release(slot)

    def discard_pending(self, slot: int) -> None:
        """After an interrupted step: forget the tree; committed tokens stay valid (if the interrupt fell
        between a commit and its bookkeeping, the slot starts over: the next catch-up refills it)."""
        if len(self.cached_ids[slot]) != self.cache.lengths[slot]:
            self.release(slot)
        self.cache.truncate(slot, self.cache.lengths[slot])

    def propose(self, proposals: list[Proposal]) -> list[tuple[Tree, Tensor]]:
        """Each proposal's tree (root at position len(committed_ids)) and [N] draft slot rows per node."""
        start = time.perf_counter()
        root_logprobs = self._catch_up(proposals)
        growths = []
        for proposal, logprobs in zip(proposals, root_logprobs):
            lookup = self.lookups[proposal.slot]
            if lookup is not None:
                lookup.sync(proposal.committed_ids + [proposal.root])
            before_root = proposal.committed_ids[-1] if proposal.committed_ids else None
            growths.append(Growth(proposal.root, logprobs, proposal.growth, self.vocab_map, lookup,    # priced below
                                  before_root))
        while True:
            rounds = []
            for proposal, growth in zip(proposals, growths):
                growth.config = self._growth(proposal.growth)      # priced as measured so far
                room = self.cache.max_length - self.cache.num_filled(proposal.slot)
                chosen = growth.next_round(room)
                if chosen.numel():
                    rounds.append((proposal, growth, chosen))
            if not rounds:
                break
            self._expand(rounds)
        self.draft.model.synchronize()
        self.forward_seconds = time.perf_counter() - start
        return [growth.result() for growth in growths]

    def accept(self, slot: int, tree: Tree, draft_rows: Tensor, path: list[int]) -> None:
        """Commits the draft's keys of the accepted non-root nodes it expanded (a prefix of the path)."""
        accepted = path[1:]
        rows, tokens = torch.stack((draft_rows[accepted], tree.tokens[accepted])).tolist()   # one read
        expanded = [(row, token) for row, token in zip(rows, tokens) if row >= 0]
        self.cache.commit(slot, [row - self.cache.lengths[slot] for row, _ in expanded])
        self.cached_ids[slot].extend(token for _, token in expanded)

    def _expand(self, rounds: list[tuple[Proposal, Growth, Tensor]]) -> None:
        """One packed draft forward over every tree's chosen nodes."""
        device = self.draft.model.device
        layout, tokens, positions, blocks, firsts = [], [], [], [], []
        for proposal, growth, chosen in rounds:
            pool, slot = growth.pool, proposal.slot
            firsts.append(self.cache.num_filled(slot))
            layout.append((slot, chosen.numel()))
            tokens.append(pool.tokens[chosen])
            positions.append(len(proposal.committed_ids) + pool.depths[chosen])
            blocks.append(expansion_mask(pool, chosen, self._committed_rows(slot), firsts[-1], device))
        self.cache.begin(layout)
        logits = self.draft.logits(torch.cat(tokens)[None], self.cache, torch.cat(positions)[None],
                                   block_mask(blocks), keep_pending=True)                      # [N, K]
        self.num_draft_forwards += 1
        offset = 0
        for (proposal, growth, chosen), first in zip(rounds, firsts):
            rows = logits[offset:offset + chosen.numel()]
            offset += chosen.numel()
            paths = path_tokens(growth.pool.tokens, growth.pool.parents, chosen) if proposal.penalties else None
            growth.expanded(chosen, self.draft.to_log_probs(rows, proposal.penalties, paths,
                                                            proposal.growth.temperature), first)

    def _catch_up(self, proposals: list[Proposal]) -> list[Tensor]:
        """Brings each slot's committed draft cache to committed_ids + [root] in packed passes of at most
        max_pass_tokens -> per proposal [K] draft log-probabilities after its root, under its penalties."""
        rests = []
        for proposal in proposals:
            sequence = proposal.committed_ids + [proposal.root]
            cached = self.cached_ids[proposal.slot]
            common = min(common_prefix(cached, sequence), len(sequence) - 1)     # the root is fed again for its log-probs
            self.cache.truncate(proposal.slot, common)
            del cached[common:]
            rests.append(sequence[common:])
        results: list[Tensor | None] = [None] * len(proposals)
        while any(rests):
            self._catch_up_pass(proposals, rests, results)
        return results

    def _catch_up_pass(self, proposals: list[Proposal], rests: list[list[int]], results: list) -> None:
        room, chunks = self.max_pass_tokens, []
        for index, rest in enumerate(rests):
            if rest and room > 0:
                chunks.append((index, rest[:room]))
                room -= len(chunks[-1][1])
        layout, blocks, positions, rows, offset = [], [], [], [], 0
        for index, chunk in chunks:
            slot = proposals[index].slot
            length = self.cache.lengths[slot]
            layout.append((slot, len(chunk)))
            blocks.append(causal_mask(length, len(chunk), HOST))
            positions.append(torch.arange(length, length + len(chunk)))
            offset += len(chunk)
            rows.append(offset - 1)
        self.cache.begin(layout)
        tokens = torch.tensor([sum((chunk for _, chunk in chunks), [])])
        logits = self.draft.logits(tokens, self.cache, torch.cat(positions)[None], block_mask(blocks),
                                   rows=torch.tensor(rows))                                   # [R, K]
        for row, (index, chunk) in enumerate(chunks):
            proposal = proposals[index]
            self.cache.commit(proposal.slot)
            self.cached_ids[proposal.slot].extend(chunk)
            rests[index] = rests[index][len(chunk):]
            if not rests[index]:
                root_path = torch.tensor([[proposal.root]])
                results[index] = self.draft.to_log_probs(logits[row:row + 1], proposal.penalties, root_path,
                                                         proposal.growth.temperature)[-1]
