"""The distillation loss: KL from the target's (top-k sparse) next-token distribution to the draft's."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .generate import NO_TARGET


@dataclass(slots=True)
class LossOutput:
    loss: Tensor                # scalar: mean KL over counted positions
    num_counted: int            # positions in that mean (weighted, some top-k token in set)
    num_scored: int             # positions with a target next token (the weight)
    num_agree: int              # draft argmax == target top-1
    num_top1_in_set: int        # target top-1 inside the draft's vocabulary


def sparse_kl_loss(draft_logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, row_of: Tensor,
                   weight: Tensor) -> LossOutput:
    """draft_logits [B, N, K]; topk_ids [B, N, k] target ids (NO_TARGET: none); topk_logprobs [B, N, k];
    row_of [V] draft row per target id (-1 out of set); weight [B, N] bool: positions that count
    (never one whose topk_ids are NO_TARGET).

    The target distribution is its top-k restricted to the draft's vocabulary and renormalised:
    KL(p || q) = sum_i p_i (log p_i - log q_i). A position whose top-k has no in-set token is skipped.
    """
    draft_logprobs = draft_logits.float().log_softmax(-1)                           # [B, N, K]
    rows = torch.where(topk_ids == NO_TARGET, -1, row_of[topk_ids.clamp(min=0).long()])   # [B, N, k]
    in_set = rows >= 0
    target_logprobs = topk_logprobs.float().masked_fill(~in_set, float("-inf"))
    target_logprobs = target_logprobs - target_logprobs.logsumexp(-1, keepdim=True)  # renormalised
    counted = weight & in_set.any(-1)                                               # [B, N]
    target_logprobs = target_logprobs.masked_fill(~in_set, 0.0)
    target_probs = target_logprobs.exp().masked_fill(~in_set, 0.0)
    draft_at = draft_logprobs.gather(-1, rows.clamp(min=0))                         # [B, N, k]
    per_position = (target_probs * (target_logprobs - draft_at)).sum(-1)            # [B, N]
    num = int(counted.sum())
    loss = per_position.masked_fill(~counted, 0.0).sum() / max(num, 1)
    top1 = rows[..., 0]
    agree = (draft_logits.argmax(-1) == top1) & (top1 >= 0) & weight
    return LossOutput(loss, num, int(weight.sum()), int(agree.sum()), int(((top1 >= 0) & weight).sum()))
