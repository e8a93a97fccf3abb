"""Sampling penalties over what precedes each tree node: the repetition penalty (transformers' rule, over
the prompt and the answer) and OpenAI's presence and frequency penalties (over the answer, as vLLM applies
them). Each node's own context is the committed tokens plus its path from the root, so a tree verifies
exactly what one-token decoding with the same penalties would choose; the draft proposes under the same
penalties so that its trees follow.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .sampling import SamplingConfig, penalize_repetition

NO_TOKEN = -1        # path padding


def penalize_occurrences(logits: Tensor, seen: Tensor, presence: float, frequency: float) -> Tensor:
    """logits [N, C], seen [N, M] columns (repeats counted) -> logits - frequency x count - presence x [count > 0]."""
    rows = torch.arange(logits.shape[0], device=logits.device)[:, None].expand_as(seen)
    out = logits.index_put((rows, seen), torch.full(seen.shape, -frequency, device=logits.device), accumulate=True) \
        if frequency else logits.clone()
    if presence:
        ordered = seen.sort(dim=1).values
        first = torch.ones_like(ordered, dtype=torch.bool)
        first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
        out.index_put_((rows[first], ordered[first]), torch.tensor(-presence, device=logits.device), accumulate=True)
    return out


@dataclass(slots=True)
class Penalties:
    """A step's sampling penalties: what they cover before the tree's root; `apply` adds each node's path."""
    repetition: float
    presence: float
    frequency: float
    context: Tensor          # [M] distinct target ids before the tree's root, prompt included (repetition)
    answer: Tensor           # [A] the answer's target ids before the root, repeats kept (presence, frequency)
    logit_level: float = 0.0 # the target's log-sum-exp at the newest position (see Draft.log_probs)

    @classmethod
    def before(cls, sampling: SamplingConfig, committed_ids: list[int], answer_ids: list[int],
               logit_level: float = 0.0) -> "Penalties | None":
        """The penalties for nodes after `committed_ids` (whose last len(answer_ids) are this answer's), or
        None when the sampling has none."""
        if not sampling.has_penalties:
            return None
        return cls(sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty,
                   torch.tensor(sorted(set(committed_ids)), dtype=torch.long),
                   torch.tensor(answer_ids, dtype=torch.long), logit_level)

    def apply(self, logits: Tensor, paths: Tensor, column_of: Tensor | None = None) -> Tensor:
        """logits [N, C]; paths [N, D] target ids of each row's node and its ancestors up to the root
        (NO_TOKEN padding); column_of [V]: target id -> column, C where the row space has none (a draft's
        trimmed vocabulary). -> the penalized logits [N, C]."""
        num_rows, num_columns = logits.shape
        device = logits.device
        padded = torch.cat((logits, logits.new_zeros(num_rows, 1)), dim=1)    # column C: ids without one

        def columns(ids: Tensor) -> Tensor:
            ids = ids.to(device)
            mapped = column_of[ids.clamp(min=0)] if column_of is not None else ids.clamp(min=0)
            return torch.where(ids == NO_TOKEN, num_columns, mapped)

        path_columns = columns(paths)
        if self.repetition != 1.0:
            seen = torch.cat((columns(self.context)[None].expand(num_rows, -1), path_columns), dim=1)
            padded = penalize_repetition(padded, seen, self.repetition)
        if self.presence or self.frequency:
            seen = torch.cat((columns(self.answer)[None].expand(num_rows, -1), path_columns), dim=1)
            padded = penalize_occurrences(padded, seen, self.presence, self.frequency)
        return padded[:, :num_columns]
