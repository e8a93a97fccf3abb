"""Tree growth: SpecExec-style batched best-first search on cumulative draft log-probability.

Each round expands the best open nodes in one draft forward (their ancestors' keys and values are
already pending in the draft's cache, so a round costs one pass over the new nodes only); each
expanded node proposes its top children; only the global top `budget` nodes survive. A child's
log-probability never exceeds its parent's, so the survivors form a tree, and the threshold to enter
only rises: growth stops when no open node could have a child that enters, or at the depth cap.

The tree's bookkeeping lives on the host whatever the draft's device: it is a few thousand small
integers, and on a GPU every read of a device tensor (a boolean index, an int(), a tolist()) waits for
all queued work. A round reads back only its children's top log-probabilities and their ids, and
sends the chosen nodes' tokens, positions and mask down.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from offload.host_sync import send
from .lookup import LOOKUP_LOGPROB, ContextLookup
from .tree import Tree

NOT_EXPANDED = -1
MAX_WIDTH, MAX_CHILDREN, MAX_DEPTH = 128, 32, 32
# A round expands no node this many times less likely than the best open one, priced or not: every expansion takes
# a draft cache row, and at growth temperature 0.1 such nodes filled 128-wide rounds and ran a budget-256 tree out
# of rows at depth 9 (9.7 tokens per pass against 31.5 at budget 64). Relative, not absolute: a good but unsure
# draft's argmax chain holds little probability and still matches a greedy target.
NEGLIGIBLE_RATIO = 1e-4
LOG_NEGLIGIBLE = math.log(NEGLIGIBLE_RATIO)
HOST = torch.device("cpu")


@dataclass(slots=True)
class GrowthConfig:
    budget: int                      # tree tokens, root included (1: the root alone, no draft work)
    max_width: int | None = None     # nodes expanded per draft forward (None: by budget)
    max_children: int = MAX_CHILDREN # children each expanded node proposes
    max_depth: int = MAX_DEPTH
    # Expected tokens a round must be able to add to be worth its draft forward's fixed cost, and a node to be worth
    # its row in it (0: grow to the budget). An expanded node's children hold at most the node's own path
    # probability, so it bounds what the node adds: a round expands the nodes whose probability pays for their
    # rows, if their sum pays for the round's fixed cost and those rows together.
    min_gain: float = 0.0
    min_node_gain: float = 0.0
    min_child_gain: float = 0.0      # a node's path probability must pay for its own row in the target's pass
    # The draft's log-probabilities score nodes at this temperature (verification never reads them, so any value
    # stays exact): below 1 for a draft that is the target's own layers and a greedy target, whose argmax chain it
    # follows far more often than its temperature-1 probabilities say (spec/self_speculator.py).
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"tree budget must be >= 1, got {self.budget}")
        if (self.max_width is not None and self.max_width < 1) or self.max_children < 1 or self.max_depth < 0:
            raise ValueError("tree width and children must be >= 1, depth >= 0")
        if not min(self.min_gain, self.min_node_gain, self.min_child_gain) >= 0:
            raise ValueError(f"minimum gains must be >= 0, got {self.min_gain}, {self.min_node_gain}, "
                             f"{self.min_child_gain}")
        if not self.temperature > 0:
            raise ValueError(f"a growth temperature must be > 0, got {self.temperature}")

    @classmethod
    def chain(cls, budget: int) -> "GrowthConfig":
        """A plain chain: one node expanded per round, one child each."""
        return cls(budget, max_width=1, max_children=1, max_depth=budget - 1)

    @property
    def width(self) -> int:
        # Wide rounds cost draft compute on nodes that may later drop out; narrow ones cost rounds, and
        # a round's fixed cost dominates a small draft's step (default pair, CPU, budget 8: widths 1 / 2
        # / 8 took 28.7 / 18.0 / 15.7 ms of draft time per step for the same 2.07 tokens per pass).
        return self.max_width or min(MAX_WIDTH, self.budget)


class _Pool:
    """The growing tree: parents precede children; `slots` is each node's draft cache slot once it
    has been expanded (the root's keys are committed, so it has none)."""

    def __init__(self, root_token: int) -> None:
        self.tokens = torch.tensor([root_token])
        self.parents = torch.tensor([-1])
        self.depths = torch.zeros(1, dtype=torch.long)
        self.logprobs = torch.zeros(1)
        self.slots = torch.full((1,), NOT_EXPANDED - 1)   # root: expanded, no slot

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def add_children(self, parents: Tensor, logq: Tensor, vocab_map: Tensor, num_children: int) -> None:
        """parents [W] node indices; logq [W, K] draft log-probabilities at each (any device; the
        top children are read to the host); vocab_map [K] on the host."""
        top = logq.topk(min(num_children, logq.shape[1]), dim=-1)                  # [W, C]
        # one copy to the host, not two: float64 holds both the float32 values and the ids exactly
        values, indices = torch.stack((top.values.double(), top.indices.double())).to(HOST)
        values, indices = values.float(), indices.long()
        self.tokens = torch.cat((self.tokens, vocab_map[indices].reshape(-1)))
        self.parents = torch.cat((self.parents, parents[:, None].expand_as(indices).reshape(-1)))
        self.depths = torch.cat((self.depths, (self.depths[parents] + 1)[:, None].expand_as(indices).reshape(-1)))
        self.logprobs = torch.cat((self.logprobs, (self.logprobs[parents][:, None] + values).reshape(-1)))
        self.slots = torch.cat((self.slots, self.slots.new_full((values.numel(),), NOT_EXPANDED)))

    def add_nodes(self, parents: list[int], tokens: list[int], logprob: float) -> None:
        """One child per listed parent, `logprob` below it."""
        if not parents:
            return
        index = torch.tensor(parents)
        self.tokens = torch.cat((self.tokens, torch.tensor(tokens)))
        self.parents = torch.cat((self.parents, index))
        self.depths = torch.cat((self.depths, self.depths[index] + 1))
        self.logprobs = torch.cat((self.logprobs, self.logprobs[index] + logprob))
        self.slots = torch.cat((self.slots, self.slots.new_full((len(parents),), NOT_EXPANDED)))

    def prune(self, budget: int, min_gain: float = 0.0) -> None:
        """Keeps the `budget` best nodes (the root is always best: log-probability 0) of path probability at least
        `min_gain`, minus any whose parent lost a tie at the threshold."""
        enough = self.logprobs >= math.log(min_gain) if min_gain > 0 else None
        if self.size <= budget and (enough is None or bool(enough[1:].all())):
            return
        best = torch.zeros(self.size, dtype=torch.bool)
        best[1 + self.logprobs[1:].topk(min(budget, self.size) - 1).indices] = True
        if enough is not None:
            best &= enough
        best[0] = True
        is_root, parents, keep = self.parents < 0, self.parents.clamp(min=0), best
        for _ in range(int(self.depths.max())):     # after k rounds, nodes at depth <= k are final
            keep = best & (keep[parents] | is_root)
        self.select(keep.nonzero().squeeze(1))

    def select(self, order: Tensor) -> None:
        """Keeps the nodes `order` (parents listed before children) in that order."""
        new_index = torch.full((self.size,), -1, dtype=torch.long)
        new_index[order] = torch.arange(order.numel())
        parents = self.parents[order]
        self.parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], parents)
        self.tokens, self.depths = self.tokens[order], self.depths[order]
        self.logprobs, self.slots = self.logprobs[order], self.slots[order]

    def open_nodes(self, budget: int, width: int, max_depth: int) -> Tensor:
        """Up to `width` best nodes not yet expanded whose children could still enter the tree."""
        candidates = (self.slots == NOT_EXPANDED) & (self.depths < max_depth)
        if self.size >= budget:
            candidates &= self.logprobs > self.logprobs.min()
        scores = torch.where(candidates, self.logprobs, float("-inf"))
        candidates &= scores >= scores.max() + LOG_NEGLIGIBLE
        count = min(width, int(candidates.sum()))
        return scores.topk(count).indices if count else scores.new_empty(0, dtype=torch.long)

    def best_first(self) -> tuple[Tree, Tensor]:
        """(the tree sorted by decreasing log-probability, each node's draft slot)."""
        by_depth = torch.argsort(self.depths, stable=True)
        order = by_depth[torch.argsort(-self.logprobs[by_depth], stable=True)]
        self.select(order)
        return Tree(self.tokens, self.parents, self.depths, self.logprobs), self.slots


class Growth:
    """One tree's growth, round by round, whoever runs the draft forwards: `next_round` adds the last
    round's children and names the nodes to expand next (none: the tree is done); `expanded` records
    that forward's draft slots and log-probabilities."""

    def __init__(self, root_token: int, root_logprobs: Tensor, config: GrowthConfig, vocab_map: Tensor,
                 lookup: ContextLookup | None = None, before_root: int | None = None) -> None:
        self.pool, self.config, self.vocab_map = _Pool(root_token), config, vocab_map
        self.lookup, self.before_root = lookup, before_root
        self.is_done = config.budget == 1 or config.max_depth == 0
        self._chosen, self._logq = torch.zeros(1, dtype=torch.long), root_logprobs[None]

    def next_round(self, room: int) -> Tensor:
        """[W] nodes to expand in the next draft forward, at most `room` (the draft cache rows left: the best that
        fit); empty when growth stops (nothing could enter, the depth cap, no room, or not worth a round)."""
        if self.is_done:
            return self._chosen.new_empty(0)
        pool, config = self.pool, self.config
        pool.add_children(self._chosen, self._logq, self.vocab_map, min(config.max_children, config.budget - 1))
        self._add_lookups()
        pool.prune(config.budget, config.min_child_gain)
        width = min(config.width, max(room // 4, 1)) if room else 0   # three quarters of the rows left to deeper rounds
        chosen = pool.open_nodes(config.budget, width, config.max_depth)
        if chosen.numel() > max(room - config.max_depth, 0):
            # rows kept for the best node's line to reach the depth cap, one a level (read only once rows run low)
            levels_left = config.max_depth - int(pool.depths[chosen[0]])
            chosen = chosen[:max(room - levels_left, 1)]
        if config.min_node_gain:
            chosen = chosen[pool.logprobs[chosen] >= math.log(config.min_node_gain)]
        if chosen.numel() == 0 or (config.min_gain or config.min_node_gain) and \
                float(pool.logprobs[chosen].exp().sum()) < config.min_gain + config.min_node_gain * chosen.numel():
            self.is_done = True
            return chosen.new_empty(0)
        return chosen

    def expanded(self, chosen: Tensor, logq: Tensor, first_slot: int) -> None:
        """chosen [W] were expanded into draft cache rows first_slot.. ; logq [W, K] their children."""
        self.pool.slots[chosen] = first_slot + torch.arange(chosen.numel())
        self._chosen, self._logq = chosen, logq

    def result(self) -> tuple[Tree, Tensor]:
        """(the tree in best-first order, [N] draft slots), both on the host."""
        return self.pool.best_first()

    def _add_lookups(self) -> None:
        """The context lookup's out-of-vocabulary child of each node just expanded."""
        if self.lookup is None or self.before_root is None:
            return
        pool, chosen = self.pool, self._chosen
        parents = pool.parents[chosen]
        previous = torch.where(parents < 0, self.before_root, pool.tokens[parents.clamp(min=0)])
        nodes, last, previous = torch.stack((chosen, pool.tokens[chosen], previous)).tolist()   # one read
        found = [(node, token) for node, token in zip(nodes, self.lookup.children(previous, last)) if token is not None]
        pool.add_nodes([node for node, _ in found], [token for _, token in found], LOOKUP_LOGPROB)


def expansion_mask(pool: _Pool, chosen: Tensor, num_committed: int, num_filled: int,
                   device: torch.device) -> Tensor:
    """[W, num_filled + W] bool on `device` for expanding `chosen` when the draft's cache (or slot) holds
    num_committed committed rows and num_filled rows in all: the committed sequence, each chosen node's
    expanded ancestors, itself. Only the part over the tree's rows is built on the host and sent."""
    width, num_tree = chosen.numel(), num_filled - num_committed
    tree_part = torch.zeros(width, num_tree + width + 1, dtype=torch.bool)    # + a column for "no ancestor"
    rows = torch.arange(width)
    tree_part[rows, num_tree + rows] = True
    ancestor, no_ancestor = pool.parents[chosen], num_tree + width
    for _ in range(int(pool.depths[chosen].max()) - 1):   # a node at depth d has d - 1 ancestors below the root
        inner = ancestor > 0                  # node 0, the root, is in the committed part
        tree_part[rows, torch.where(inner, pool.slots[ancestor.clamp(min=0)] - num_committed, no_ancestor)] = True
        ancestor = torch.where(inner, pool.parents[ancestor.clamp(min=0)], ancestor)
    return torch.cat((torch.ones(width, num_committed, dtype=torch.bool, device=device),
                      send(tree_part[:, :-1], device)), dim=1)
