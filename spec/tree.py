"""A token tree for one speculative step: node 0 is the root (the last emitted token, not yet seen by the
target); every other node is a draft guess following its parent. Parents precede children.

Grown trees come in best-first order: nodes sorted by cumulative draft log-probability, so a node's
index is its rank and the first b nodes form the tree a budget of b would have grown.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from offload.host_sync import send


@dataclass(slots=True)
class Tree:
    tokens: Tensor       # [N] int64 target token ids
    parents: Tensor      # [N] int64 index of the parent, -1 for the root
    depths: Tensor       # [N] int64, the root at 0
    logprobs: Tensor     # [N] float32 cumulative draft log-probability of the path root -> node (root 0)

    max_depth: int = field(init=False, default=0)   # the deepest node's depth

    def __post_init__(self) -> None:
        size = self.tokens.shape[0]
        if size == 0 or any(t.shape != (size,) for t in (self.parents, self.depths, self.logprobs)):
            raise ValueError("a tree needs one token, parent, depth and log-probability per node, root first")
        later = self.parents[1:]
        preceding = ((later >= 0) & (later < torch.arange(1, size, device=later.device))).all()
        # one read of the tree's values (a device sync where they live on a GPU)
        root, ordered, self.max_depth = torch.stack((self.parents[0], preceding, self.depths.max())).tolist()
        if root != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        if not ordered:
            raise ValueError("every node but the root needs a parent that precedes it")

    @classmethod
    def root_only(cls, token: int, device: torch.device | None = None) -> "Tree":
        def one(value, dtype):
            return torch.tensor([value], dtype=dtype, device=device)
        return cls(one(token, torch.long), one(-1, torch.long), one(0, torch.long), one(0.0, torch.float32))

    def path_tokens(self) -> Tensor:
        """[N, max depth + 1]: each node's tokens from itself up to the root, padded with -1."""
        return path_tokens(self.tokens, self.parents, torch.arange(self.num_nodes, device=self.tokens.device))

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    def positions(self, root_position: int) -> Tensor:
        """[1, N] position ids: the root's position plus each node's depth."""
        return (root_position + self.depths)[None]

    def ancestor_mask(self) -> Tensor:
        """[N, N] bool: node i may attend to node j when j is i itself or one of its ancestors.
        Built by following parent pointers one level per round: O(N x depth), nothing kept between steps."""
        size = self.num_nodes
        rows = torch.arange(size, device=self.parents.device)
        mask = torch.zeros(size, size, dtype=torch.bool, device=self.parents.device)
        mask[rows, rows] = True
        current = self.parents
        for _ in range(self.max_depth):     # no data-dependent shapes: a row without an ancestor left ORs False
            has_parent = current >= 0
            mask[rows, current.clamp(min=0)] |= has_parent
            current = torch.where(has_parent, self.parents[current.clamp(min=0)], current)
        return mask

    def attention_mask(self, num_cached: int, device: torch.device | None = None) -> Tensor:
        """[N, num_cached + N] bool on `device` (default: the tree's) for the target pass: every node
        sees the whole cache, its ancestors and itself. Only the [N, N] part is built here and sent."""
        device = device or self.parents.device
        past = torch.ones(self.num_nodes, num_cached, dtype=torch.bool, device=device)
        return torch.cat((past, send(self.ancestor_mask(), device)), dim=1)

    def path_to(self, node: int) -> list[int]:
        """Node indices root -> node."""
        return root_path(self.parents.tolist(), node)


def root_path(parents: list[int], node: int) -> list[int]:
    """Node indices root -> node of the tree whose parent indices are `parents` (-1: the root)."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def path_tokens(tokens: Tensor, parents: Tensor, nodes: Tensor) -> Tensor:
    """tokens, parents [N] of a tree; nodes [W] -> [W, D]: each node's token, then its ancestors' up to the
    root, padded with -1 (what sampling penalties see along the path)."""
    columns, current = [tokens[nodes]], parents[nodes]
    while bool((current >= 0).any()):
        columns.append(torch.where(current >= 0, tokens[current.clamp(min=0)], -1))
        current = torch.where(current >= 0, parents[current.clamp(min=0)], current)
    return torch.stack(columns, dim=1)
