"""The draft side of speculation: a resident draft with its own KV cache, kept in step with the target.

Invariant between steps: the draft's committed tokens are a prefix of the target's committed tokens
(plus nothing pending). Before growing, the draft catches up on what it has not seen, up to and
including the root; after verification it commits the accepted nodes it had expanded, so the next
catch-up is usually one or two tokens.
"""
from __future__ import annotations

import time

import torch
from torch import Tensor

from .draft import Draft
from .grow import GrowthConfig, TreeGrower
from .lookup import ContextLookup
from .penalties import Penalties
from .tree import Tree


class Speculator:
    def __init__(self, draft: Draft, max_context: int, max_budget: int, max_pass_tokens: int = 512) -> None:
        self.draft, self.max_pass_tokens = draft, max_pass_tokens
        # Room for the committed sequence plus every node a tree of max_budget expands, with slack for
        # expanded nodes that later drop out (growth stops before overflowing it).
        self.cache = draft.model.new_cache(max_context + 2 * max_budget + 256)
        self.cached_ids: list[int] = []
        # Only a trimmed draft has tokens it cannot propose; a full-vocabulary draft needs no lookup.
        self.lookup = ContextLookup(draft.vocab_map) if draft.is_trimmed else None
        self.grower = TreeGrower(draft, self.cache, self.lookup)
        self.forward_seconds = 0.0        # draft compute of the last propose (catch-up + growth)

    def reset(self) -> None:
        self.cache.truncate(0)
        self.cached_ids = []

    def discard_pending(self) -> None:
        """After an interrupted step: forget the tree; committed tokens stay valid (if the interrupt
        fell between a commit and its bookkeeping, start over: the next catch-up refills the cache)."""
        if len(self.cached_ids) != self.cache.length:
            self.reset()
        self.cache.truncate(self.cache.length)

    def propose(self, committed_ids: list[int], root: int, config: GrowthConfig,
                penalties: Penalties | None = None) -> tuple[Tree, Tensor]:
        """A tree rooted at `root` (position len(committed_ids)) -> (tree, [N] draft slot per node). Under
        the target's sampling `penalties` the draft proposes as the penalized target would choose."""
        start = time.perf_counter()
        sequence = committed_ids + [root]
        root_logprobs = self._catch_up(sequence, penalties)
        if self.lookup is not None:
            self.lookup.sync(sequence)
        before_root = committed_ids[-1] if committed_ids else None
        tree, slots = self.grower.grow(root, root_logprobs, len(committed_ids), config, before_root, penalties)
        self.draft.model.synchronize()
        self.forward_seconds = time.perf_counter() - start
        return tree, slots

    def accept(self, tree: Tree, slots: Tensor, path: list[int]) -> None:
        """Commits the draft's keys of the accepted non-root nodes it expanded (a prefix of the path)."""
        accepted = path[1:]
        path_slots, path_tokens = torch.stack((slots[accepted], tree.tokens[accepted])).tolist()   # one read
        expanded = [(slot, token) for slot, token in zip(path_slots, path_tokens) if slot >= 0]
        self.cache.commit([slot - self.cache.length for slot, _ in expanded])
        self.cached_ids.extend(token for _, token in expanded)

    def _catch_up(self, sequence: list[int], penalties: Penalties | None = None) -> Tensor:
        """Brings the committed draft cache to `sequence` (its last token the root) -> [K] draft
        log-probabilities after it, under `penalties`."""
        root_path = torch.tensor([sequence[-1:]])                                      # [1, 1]
        common = 0
        for seen, wanted in zip(self.cached_ids, sequence):
            if seen != wanted:
                break
            common += 1
        common = min(common, len(sequence) - 1)      # the last token is fed again for its log-probs
        self.cache.truncate(common)
        del self.cached_ids[common:]
        rest = sequence[common:]
        for begin in range(0, len(rest), self.max_pass_tokens):
            chunk = rest[begin:begin + self.max_pass_tokens]
            logprobs = self.draft.log_probs(torch.tensor([chunk]), self.cache, last_only=True,
                                            penalties=penalties, paths=root_path)
            self.cache.commit()
            self.cached_ids.extend(chunk)
        return logprobs[-1]
