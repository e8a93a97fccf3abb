"""A key/value cache with one slot per sequence, for packed passes over many sequences.

One store per layer, [KVH, num_slots x max_length, D]: slot s owns rows [s x max_length, (s + 1) x
max_length). Per slot the KVCache invariant holds: rows [0, length) are committed tokens in order (row i
has position i), then the pending ones. A packed pass concatenates the new tokens of several slots
([1, N] tokens, slot by slot in `begin`'s order); its keys are those slots' filled rows, gathered in the
same order ([1, KVH, S, D], S = the sum of each slot's committed + pending + new rows), and the caller's
block mask [N, S] lets each token see only its own slot. The forward reads this cache exactly as it reads
a KVCache (reserve, num_slots, key_positions, append), so one forward serves one sequence and many.

One attention over the packed pass costs N x S score entries, B times the sum of n_i x s_i its blocks
need when B similar sequences share it. `segments()` gives the blocks (query rows, key rows) of a pass
where attending block by block saves more than a kernel call costs; the layer then runs one attention
per sequence over its own keys alone.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from offload.model.config import ModelConfig
from offload.host_sync import send
from offload.model.kvcache import CacheFullError

# score entries (query x key) a pass must save per extra attention call before it attends block by block
SPLIT_MIN_SAVED = 1 << 17
_NONE = torch.empty(0, dtype=torch.long)      # no pending rows


class SlotCache:
    def __init__(self, config: ModelConfig, num_seq_slots: int, max_length: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        if num_seq_slots <= 0 or max_length <= 0:
            raise ValueError(f"slot cache needs positive slots and length, got {num_seq_slots}, {max_length}")
        shape = (config.num_layers, 1, config.num_kv_heads, num_seq_slots * max_length, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)      # [L, 1, KVH, slots x M, D]
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.num_seq_slots, self.max_length = num_seq_slots, max_length
        self.lengths = [0] * num_seq_slots                             # committed rows per slot
        self.pending: list[Tensor] = [_NONE] * num_seq_slots          # [n] positions of each slot's pending rows
        self._pass: list[tuple[int, int]] = []                         # (slot, new tokens) of the next pass
        self._write_rows: Tensor | None = None                         # [N] store rows of the pass's tokens
        self._read_rows: Tensor | None = None                          # [S] store rows the pass attends over
        self._segments: list[tuple[int, int, int, int]] | None = None   # per sequence: query rows, key rows
        self._blocks: list[tuple[int, int, int, int]] = []
        self._span: tuple[int, int, int] | None = None                 # a one-slot pass: first, first new, end row

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def num_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def num_filled(self, slot: int) -> int:
        """Committed plus pending rows of `slot`."""
        return self.lengths[slot] + self.pending[slot].numel()

    def begin(self, layout: Sequence[tuple[int, int]]) -> None:
        """The next pass's layout: (slot, number of new tokens) per sequence, in packed order."""
        slots = [slot for slot, _ in layout]
        if len(set(slots)) != len(slots) or any(not 0 <= s < self.num_seq_slots for s in slots):
            raise ValueError(f"a pass needs distinct slots in [0, {self.num_seq_slots}), got {slots}")
        self._pass = [(slot, int(count)) for slot, count in layout]

    # --- what DecoderModel.forward reads --------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        """Keys the current pass attends over (all its slots' filled rows, new tokens included)."""
        return sum(self.num_filled(slot) for slot, _ in self._pass)

    def reserve(self, num_new: int, positions: Tensor, keep_pending: bool = False) -> None:
        """positions [1, N] of the packed pass `begin` described; each slot's new rows follow its pending
        ones when `keep_pending`, else replace them."""
        if num_new != sum(count for _, count in self._pass):
            raise ValueError(f"pass of {num_new} tokens does not match the layout {self._pass}")
        flat = positions.reshape(-1)
        spans, offset, segments = [], 0, []
        for slot, count in self._pass:
            if not keep_pending:
                self.pending[slot] = _NONE
            start, end = self.num_filled(slot), self.num_filled(slot) + count
            if end > self.max_length:
                raise CacheFullError(f"KV cache slot holds {self.max_length} tokens; {end} needed")
            self.pending[slot] = torch.cat((self.pending[slot], flat[offset:offset + count]))
            first = slot * self.max_length
            spans.append((first, first + start, first + end))
            key_start = segments[-1][3] if segments else 0
            segments.append((offset, offset + count, key_start, key_start + end))
            offset += count
        self._blocks = segments
        self._segments = segments if _worth_splitting(segments) else None
        self._span = spans[0] if len(spans) == 1 else None    # one sequence reads and writes its rows in place
        if self._span is None:
            device = self.keys.device
            self._write_rows = send(torch.cat([torch.arange(write, end) for _, write, end in spans]), device)
            self._read_rows = send(torch.cat([torch.arange(first, end) for first, _, end in spans]), device)

    def segments(self) -> list[tuple[int, int, int, int]] | None:
        """Per sequence of the reserved pass, (first query, end query, first key, end key) in packed order
        when attending block by block pays; None: one attention over all keys under the block mask."""
        return self._segments

    def blocks(self) -> list[tuple[int, int, int, int]]:
        """Per sequence of the reserved pass, (first query, end query, first key, end key) in packed order."""
        return self._blocks

    def key_positions(self) -> Tensor:
        """[1, S] the position of every key the pass attends over."""
        rows = [torch.cat((torch.arange(self.lengths[slot]), self.pending[slot])) for slot, _ in self._pass]
        return send(torch.cat(rows)[None], self.keys.device)

    def append(self, layer: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """keys/values [1, KVH, N, D] of the reserved pass -> the pass's keys/values [1, KVH, S, D]."""
        if self._span is not None:
            first, write, end = self._span
            self.keys[layer, :, :, write:end] = keys
            self.values[layer, :, :, write:end] = values
            return self.keys[layer, :, :, first:end], self.values[layer, :, :, first:end]
        self.keys[layer, :, :, self._write_rows] = keys.to(self.keys.dtype)
        self.values[layer, :, :, self._write_rows] = values.to(self.values.dtype)
        return self.keys[layer].index_select(2, self._read_rows), self.values[layer].index_select(2, self._read_rows)

    # --- per-slot bookkeeping ---------------------------------------------------------------------------
    def commit(self, slot: int, kept_new_indices: Sequence[int] | Tensor | None = None) -> None:
        """Keeps the given pending rows of `slot` (indices into its pending rows), compacted in order."""
        length, num_pending = self.lengths[slot], self.pending[slot].numel()
        if kept_new_indices is None:
            self.lengths[slot] += num_pending
            self.pending[slot] = _NONE
            return
        # checked as host ints (a device tensor of indices is read once); the gather's index goes down unawaited
        kept = kept_new_indices.tolist() if isinstance(kept_new_indices, Tensor) else [int(i) for i in kept_new_indices]
        if len(set(kept)) != len(kept):
            raise IndexError(f"commit indices must be distinct, got {kept}")
        if kept and (min(kept) < 0 or max(kept) >= num_pending):
            raise IndexError(f"commit indices must lie in [0, {num_pending}), got {kept}")
        if kept != list(range(len(kept))):
            first = slot * self.max_length + length
            source = send(torch.tensor([first + i for i in kept]), self.keys.device)
            target = slice(first, first + len(kept))
            self.keys[:, :, :, target] = self.keys.index_select(3, source)
            self.values[:, :, :, target] = self.values.index_select(3, source)
        self.lengths[slot] += len(kept)
        self.pending[slot] = _NONE

    def truncate(self, slot: int, length: int) -> None:
        """Drops the slot's committed tokens past `length` (and anything pending); 0 frees the slot."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"truncate length must lie in [0, {self.lengths[slot]}], got {length}")
        self.lengths[slot] = length
        self.pending[slot] = _NONE


def _worth_splitting(segments: list[tuple[int, int, int, int]]) -> bool:
    if len(segments) < 2:
        return False
    num_queries, num_keys = segments[-1][1], segments[-1][3]
    needed = sum((q1 - q0) * (k1 - k0) for q0, q1, k0, k1 in segments)
    return num_queries * num_keys - needed > SPLIT_MIN_SAVED * (len(segments) - 1)


def block_mask(blocks: Sequence[Tensor]) -> Tensor:
    """Per-sequence masks [n_i, s_i] bool (in packed order) -> the packed pass's mask [sum n, sum s]: each
    token sees only keys of its own slot, as its own block allows."""
    return torch.block_diag(*blocks)
