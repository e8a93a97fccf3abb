"""A draft's trimmed output vocabulary: K head rows, each standing for one target token id."""
from __future__ import annotations

import torch
from torch import Tensor


def out_of_set_rows(vocab_map: Tensor, vocab_size: int) -> Tensor:
    """vocab_map [K] target ids -> [V] int64: the draft row of each target id, -1 if out of set."""
    inverse = torch.full((vocab_size,), -1, dtype=torch.long)
    inverse[vocab_map.long()] = torch.arange(vocab_map.numel())
    return inverse


def expand_to_target_vocab(logits: Tensor, vocab_map: Tensor, vocab_size: int) -> Tensor:
    """logits [..., K] over the draft's rows -> [..., V] over target ids; out-of-set tokens get -inf
    (zero probability)."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, vocab_map.to(logits.device).long(), logits)
