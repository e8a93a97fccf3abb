"""Verification: the target's one pass over a tree gives its choice at every node; acceptance follows the
longest root path on which each child is what the target chose at its parent.

Exactness: the target samples once at each node (argmax when greedy) from its own distribution at that
node's context, with the uniform of the answer position the node's child would take (sampling.py's
PositionDraws); an accepted child equals that sample, and the step ends with the target's sample at the
last accepted node. So every emitted token is a target sample given exactly the tokens before it, and
the output distribution is the target's, whatever the draft proposed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from .sampling import PositionDraws, SamplingConfig, sample_at
from .tree import Tree, root_path


@dataclass(slots=True)
class Verdict:
    choices: Tensor          # [N] the target's token at each node
    hidden: Tensor | None    # [N, H] the target's final-norm hidden states, when the policy asked for them


class AcceptancePolicy(Protocol):
    """Decides which draft children may follow their parent; the judge is one (lossy) policy."""
    is_lossless: bool
    needs_hidden: bool

    def accept(self, tree: Tree, verdict: Verdict) -> Tensor:
        """-> [N] bool: node i may follow its parent (the root always may)."""
        ...


class ExactMatch:
    """Lossless: a child is accepted only when it is the target's own choice at its parent."""
    is_lossless = True
    needs_hidden = False

    def accept(self, tree: Tree, verdict: Verdict) -> Tensor:
        return matches_target(tree, verdict.choices)


def matches_target(tree: Tree, choices: Tensor) -> Tensor:
    """[N] bool: node i's token is the target's choice at its parent (root: True)."""
    ok = tree.tokens == choices[tree.parents.clamp(min=0)]
    ok[0] = True
    return ok


def target_choices(logits: Tensor, sampling: SamplingConfig, draws: PositionDraws | None, tree: Tree,
                   first_position: int) -> Tensor:
    """logits [N, V] -> [N]: the target's token after each node (argmax when greedy); the token after a node
    at depth d takes answer index first_position + d and is drawn with that index's uniform."""
    if sampling.is_greedy:
        return logits.argmax(-1)
    table = draws.uniforms(first_position, tree.max_depth + 1, logits.device)     # [max_depth + 1]
    return sample_at(logits, sampling, table[tree.depths.to(logits.device)])


def accepted_path(tree: Tree, ok: Tensor) -> list[int]:
    """Node indices root -> deepest node whose every step from the root is accepted (ties: the
    earlier node, i.e. the higher draft log-probability)."""
    if tree.num_nodes == 1:
        return [0]
    # reach = ok and the parent's reach; after k rounds every node at depth <= k holds its final value
    # (no data-dependent shapes, so nothing waits for the device where the tree lives there)
    is_root, parents = tree.parents < 0, tree.parents.clamp(min=0)
    reach = ok
    for _ in range(tree.max_depth):
        reach = ok & (reach[parents] | is_root)
    size = tree.num_nodes
    score = torch.where(reach, tree.depths * (size + 1) - torch.arange(size, device=reach.device), -1)
    best, *parents = torch.cat((score.argmax()[None], tree.parents)).tolist()     # one read
    return root_path(parents, best)
