"""A preallocated key/value cache with explicit append / commit / truncate.

Invariant: slots [0, length) hold committed tokens in sequence order (slot i has position i);
slots [length, length + num_pending) are pending: the new tokens of the last pass, or of several passes
when each later one asked to keep them (a draft growing a tree over many passes), until `commit` keeps
some of them, in order, right after the committed ones.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from offload.host_sync import send
from offload.model.config import ModelConfig


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
        self._write_start = 0
        self._pending_positions: Tensor | None = None     # [B, num_pending] when a pass gave positions

    @property
    def num_slots(self) -> int:
        """Committed plus pending slots: the keys a new token may attend to."""
        return self.length + self.num_pending

    def reserve(self, num_new: int, positions: Tensor, keep_pending: bool = False) -> None:
        """Starts a pass of `num_new` tokens at `positions` [B, N]: their slots follow the pending ones
        when `keep_pending`, else they replace them."""
        if not keep_pending:
            self.num_pending, self._pending_positions = 0, None
        end = self.num_slots + num_new
        if end > self.max_length:
            raise CacheFullError(f"KV cache holds {self.max_length} tokens; {end} needed (raise the context size)")
        self._write_start = self.num_slots
        self.num_pending += num_new
        previous = self._pending_positions
        self._pending_positions = positions if previous is None else torch.cat((previous, positions), dim=1)

    def key_positions(self) -> Tensor:
        """[B, num_slots] the position of every filled slot (committed slot i has position i)."""
        pending = self._pending_positions
        committed = torch.arange(self.length, device=self.keys.device).expand(pending.shape[0], -1)
        return torch.cat((committed, pending.to(committed.device)), dim=1)

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def num_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def append(self, layer: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """keys/values [B, KVH, N, D] of the reserved pass -> all keys/values [B, KVH, num_slots, D]."""
        end = self._write_start + keys.shape[2]
        if end != self.num_slots:
            raise ValueError(f"append of {keys.shape[2]} tokens does not match the reserved pass")
        self.keys[layer, :, :, self._write_start:end] = keys
        self.values[layer, :, :, self._write_start:end] = values
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def commit(self, kept_new_indices: Sequence[int] | Tensor | None = None) -> None:
        """Keeps the given pending slots (indices into the pending slots), compacted in order."""
        if kept_new_indices is None:
            self.length += self.num_pending
            self.num_pending, self._pending_positions = 0, None
            return
        # Checked on the host as Python ints: one read of a tensor's values, none of a list's.
        kept = kept_new_indices.tolist() if isinstance(kept_new_indices, Tensor) else [int(i) for i in kept_new_indices]
        if len(set(kept)) != len(kept):
            raise IndexError(f"commit indices must be distinct, got {kept}")
        if kept and (min(kept) < 0 or max(kept) >= self.num_pending):
            raise IndexError(f"commit indices must lie in [0, {self.num_pending}), got {kept}")
        if kept != list(range(len(kept))):
            source = send(torch.tensor(kept) + self.length, self.keys.device)
            target = slice(self.length, self.length + len(kept))
            self.keys[:, :, :, target] = self.keys.index_select(3, source)
            self.values[:, :, :, target] = self.values.index_select(3, source)
        self.length += len(kept)
        self.num_pending, self._pending_positions = 0, None

    def truncate(self, length: int) -> None:
        """Drops committed tokens past `length` (and anything pending)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate length must lie in [0, {self.length}], got {length}")
        self.length = length
        self.num_pending, self._pending_positions = 0, None
