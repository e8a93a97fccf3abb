"""One decoder layer = one contiguous byte buffer, so that moving a layer is one copy.

A LayerLayout fixes where each tensor of a layer lives inside the buffer; every layer of a model
shares the layout, so any ring slot can hold any layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ALIGNMENT = 256  # bytes; keeps every tensor view aligned for vectorised kernels


@dataclass(slots=True, frozen=True)
class TensorSlot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def num_bytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


@dataclass(slots=True, frozen=True)
class LayerLayout:
    slots: tuple[TensorSlot, ...]
    num_bytes: int

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], dtype: torch.dtype) -> "LayerLayout":
        """Floating tensors are stored in `dtype`; integer (packed) tensors keep theirs."""
        slots, offset = [], 0
        for name, tensor in tensors.items():
            slot_dtype = dtype if tensor.is_floating_point() else tensor.dtype
            slots.append(TensorSlot(name, slot_dtype, tuple(tensor.shape), offset))
            offset += -(-slots[-1].num_bytes // ALIGNMENT) * ALIGNMENT
        return cls(tuple(slots), offset)

    def views(self, buffer: Tensor) -> dict[str, Tensor]:
        """buffer [num_bytes] uint8 -> named tensor views into it (no copy)."""
        return {s.name: buffer[s.offset:s.offset + s.num_bytes].view(s.dtype).view(s.shape) for s in self.slots}

    def pack_into(self, buffer: Tensor, tensors: dict[str, Tensor]) -> None:
        """Copies (and casts) a layer's tensors into `buffer`."""
        for name, view in self.views(buffer).items():
            view.copy_(tensors[name])


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
