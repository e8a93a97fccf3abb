"""Stored weight formats beyond plain checkpoints. The engine defines the interface (a WeightSource that
also lays out and decodes its layers, see weights.py); packages that implement a format (quant/'s
SpQR) register it, and the runtime does the registering, so offload/ never imports them."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

from .config import ModelConfig
from .weights import CheckpointSource, WeightSource


class WeightFormat(Protocol):
    name: str

    def claims(self, folder: Path) -> bool:
        """Whether `folder` holds weights in this format (config.json says so)."""
        ...

    def open(self, folder: Path, config: ModelConfig) -> WeightSource: ...


_FORMATS: dict[str, WeightFormat] = {}


def register_format(weight_format: WeightFormat) -> None:
    _FORMATS[weight_format.name] = weight_format


def open_source(folder: Path, config: ModelConfig) -> WeightSource:
    """The registered format that claims the folder, else a plain checkpoint."""
    for weight_format in _FORMATS.values():
        if weight_format.claims(folder):
            return weight_format.open(folder, config)
    return CheckpointSource(folder, config)
