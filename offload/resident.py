"""The simplest layer provider: every layer copied to the compute device once, at load."""
from __future__ import annotations

import torch
from torch import Tensor

from .weights import WeightSource


def to_device(tensors: dict[str, Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
    """Floating tensors are cast to the compute dtype; packed (integer) tensors keep theirs."""
    return {name: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
            for name, t in tensors.items()}


class ResidentLayers:
    def __init__(self, source: WeightSource, device: torch.device, dtype: torch.dtype) -> None:
        self._layers = [to_device(source.layer(i), device, dtype) for i in range(source.config.num_layers)]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self._layers for t in layer.values())

    def begin_pass(self, num_tokens: int) -> None:
        pass

    def get(self, index: int) -> dict[str, Tensor]:
        return self._layers[index]

    def release(self, index: int) -> None:
        pass

    def end_pass(self) -> None:
        pass

    def abort(self) -> None:
        pass
