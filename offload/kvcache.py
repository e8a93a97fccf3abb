"""A preallocated key/value cache with explicit append / commit / truncate.

Invariant: slots [0, length) hold committed tokens in sequence order; a forward pass appends its
N new tokens at [length, length + N) in every layer (pending) until `commit` keeps some of them.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .config import ModelConfig


class CacheFullError(RuntimeError):
    """More tokens than the cache was sized for."""


class KVCache:
    def __init__(self, config: ModelConfig, max_length: int, device: torch.device, dtype: torch.dtype,
                 batch_size: int = 1) -> None:
        if max_length <= 0 or batch_size <= 0:
            raise ValueError(f"cache max_length and batch_size must be positive, got {max_length}, {batch_size}")
        shape = (config.num_layers, batch_size, config.num_kv_heads, max_length, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)  # [L, B, KVH, S, D]
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.max_length = max_length
        self.length = 0
        self.num_pending = 0

    @property
    def num_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def append(self, layer: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """keys/values [B, KVH, N, D] -> all keys/values [B, KVH, length + N, D] for this layer."""
        num_new = keys.shape[2]
        end = self.length + num_new
        if end > self.max_length:
            raise CacheFullError(f"KV cache holds {self.max_length} tokens; {end} needed "
                                 f"(raise the context size)")
        self.keys[layer, :, :, self.length:end] = keys
        self.values[layer, :, :, self.length:end] = values
        self.num_pending = num_new
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def commit(self, kept_new_indices: Sequence[int] | Tensor | None = None) -> None:
        """Keeps the given pending slots (indices into the last pass's new tokens), compacted in order."""
        if kept_new_indices is None:
            self.length += self.num_pending
            self.num_pending = 0
            return
        kept = torch.as_tensor(kept_new_indices, dtype=torch.long).cpu()
        if kept.unique().numel() != kept.numel():
            raise IndexError(f"commit indices must be distinct, got {kept.tolist()}")
        if kept.numel() and (kept.min() < 0 or kept.max() >= self.num_pending):
            raise IndexError(f"commit indices must lie in [0, {self.num_pending}), got {kept.tolist()}")
        if not torch.equal(kept, torch.arange(kept.numel())):
            source = (kept + self.length).to(self.keys.device)
            target = slice(self.length, self.length + kept.numel())
            self.keys[:, :, :, target] = self.keys.index_select(3, source)
            self.values[:, :, :, target] = self.values.index_select(3, source)
        self.length += kept.numel()
        self.num_pending = 0

    def truncate(self, length: int) -> None:
        """Drops committed tokens past `length` (and anything pending)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate length must lie in [0, {self.length}], got {length}")
        self.length = length
        self.num_pending = 0
