"""One decoder layer = one contiguous byte buffer, so that moving a layer is one copy.

A LayerLayout fixes where each tensor of a layer lives inside the buffer; every layer of a model
shares the layout, so any ring slot can hold any layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from offload.weights.safetensors_io import DTYPE_NAMES, DTYPES

ALIGNMENT = 256  # bytes; keeps every tensor view aligned for vectorised kernels


@dataclass(slots=True, frozen=True)
class TensorSlot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(slots=True, frozen=True)
class LayerLayout:
    slots: tuple[TensorSlot, ...]
    num_bytes: int

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], dtype: torch.dtype | None) -> "LayerLayout":
        """Floating tensors are stored in `dtype` (None: their own); integer (packed) tensors keep theirs."""
        slots, offset = [], 0
        for name, tensor in tensors.items():
            slot_dtype = dtype if tensor.is_floating_point() and dtype is not None else tensor.dtype
            slots.append(TensorSlot(name, slot_dtype, tuple(tensor.shape), offset))
            offset += -(-slots[-1].num_bytes // ALIGNMENT) * ALIGNMENT
        return cls(tuple(slots), offset)

    def views(self, buffer: Tensor) -> dict[str, Tensor]:
        """buffer [num_bytes] uint8 -> named tensor views into it (no copy)."""
        return {s.name: buffer[s.offset:s.offset + s.num_bytes].view(s.dtype).view(s.shape) for s in self.slots}

    def pack_into(self, buffer: Tensor, tensors: dict[str, Tensor]) -> None:
        """Copies (and casts) a layer's tensors into `buffer`. A byte blob may be shorter than its slot
        (packed layers differ in size; the slot holds the largest)."""
        for name, view in self.views(buffer).items():
            tensor = tensors[name]
            if view.dim() == 1 and tensor.dim() == 1 and tensor.numel() < view.numel():
                view = view[:tensor.numel()]
            view.copy_(tensor)

    def as_dict(self) -> dict:
        return {"num_bytes": self.num_bytes, "slots": [[s.name, DTYPE_NAMES[s.dtype], list(s.shape), s.offset]
                                                       for s in self.slots]}

    @classmethod
    def from_dict(cls, raw: dict) -> "LayerLayout":
        slots = tuple(TensorSlot(name, DTYPES[dtype], tuple(shape), offset) for name, dtype, shape, offset in raw["slots"])
        layout = cls(slots, int(raw["num_bytes"]))
        if any(s.offset + s.num_bytes > layout.num_bytes for s in slots):
            raise ValueError("a layer layout's slots overrun its size")
        return layout
