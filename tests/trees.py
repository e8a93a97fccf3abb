"""Reference tree builders for tests: a hand-made Tree from parent lists, and the ancestor mask built
node by node (the library builds both vectorized from a grown tree; these are the slow, obvious versions)."""
from __future__ import annotations

import torch
from torch import Tensor

from spec.tree import Tree


def tree_from_parents(tokens: list[int], parents: list[int], logprobs: list[float] | None = None) -> Tree:
    """Depths follow from the parents (each parent precedes its children)."""
    depths = [0] * len(tokens)
    for node, parent in enumerate(parents):
        depths[node] = depths[parent] + 1 if parent >= 0 else 0
    return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths),
                torch.tensor(logprobs if logprobs is not None else [0.0] * len(tokens), dtype=torch.float32))


def tree_mask(parents: Tensor, cache_length: int) -> Tensor:
    """parents [N] (-1 for a root) -> [N, cache_length + N] bool: each node sees the cache, its ancestors
    and itself."""
    num_new = parents.shape[0]
    ancestors = torch.eye(num_new, dtype=torch.bool, device=parents.device)
    for node, parent in enumerate(parents.tolist()):
        if parent >= 0:
            ancestors[node] |= ancestors[parent]
    past = torch.ones(num_new, cache_length, dtype=torch.bool, device=parents.device)
    return torch.cat((past, ancestors), dim=1)
