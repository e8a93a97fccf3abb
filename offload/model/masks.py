"""Attention masks over (cache + new tokens): causal for sequences, ancestor masks for trees."""
from __future__ import annotations

import torch
from torch import Tensor


def causal_mask(cache_length: int, num_new: int, device: torch.device) -> Tensor:
    """[N, cache_length + N] bool: new token j sees the whole cache and new tokens 0..j."""
    new = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()
    past = torch.ones(num_new, cache_length, dtype=torch.bool, device=device)
    return torch.cat((past, new), dim=1)


def apply_sliding_window(mask: Tensor, key_positions: Tensor, query_positions: Tensor, window: int) -> Tensor:
    """mask [B, N, S]; forbids keys more than `window - 1` positions behind each query."""
    distance = query_positions[..., :, None] - key_positions[..., None, :]  # [B, N, S]
    return mask & (distance < window)
