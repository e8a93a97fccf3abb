"""Stored weight formats beyond plain checkpoints. The engine defines the interface (a WeightSource that
also lays out and decodes its layers, see source.py); packages that implement a format (quant/'s SpQR)
hand it to the loader through `LoadOptions.formats` (the runtime's composition root does), so offload/
never imports them and nothing registers on import. A folder whose config names a packed format that
was not passed is refused, never opened as a plain checkpoint."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from offload.model.config import ModelConfig
from offload.weights.gguf_model import gguf_file_of
from offload.weights.gguf_source import DenseGgufLayers, GgufSource
from offload.weights.source import CheckpointSource, WeightSource


class WeightFormat(Protocol):
    name: str

    def claims(self, folder: Path) -> bool:
        """Whether `folder` holds weights in this format (config.json says so)."""
        ...

    def open(self, folder: Path, config: ModelConfig) -> WeightSource: ...


def open_source(folder: Path, config: ModelConfig, formats: tuple[WeightFormat, ...] = ()) -> WeightSource:
    """A GGUF run in place (built in: the folder's gguf.json names the file), the format that claims the
    folder, else a plain checkpoint (unless config.json names a packed one)."""
    gguf_file = gguf_file_of(folder)
    if gguf_file is not None:
        return GgufSource(gguf_file, config)
    for weight_format in formats:
        if weight_format.claims(folder):
            return weight_format.open(folder, config)
    method = packed_method(folder)
    if method is not None:
        raise ValueError(f"{folder} holds '{method}' packed weights, a format this loader was not given "
                         f"(given: {', '.join(f.name for f in formats) or 'none'})")
    return CheckpointSource(folder, config)


def packed_method(folder: Path) -> str | None:
    """config.json's quantization_config.quant_method, if any."""
    path = folder / "config.json"
    if not path.is_file():
        return None
    try:
        quantization = json.loads(path.read_text()).get("quantization_config") or {}
    except (ValueError, AttributeError):
        return None
    return quantization.get("quant_method") if isinstance(quantization, dict) else None


def dense_source(folder: Path, config: ModelConfig) -> WeightSource:
    """A source whose `layer(i)` holds dense tensors, for code that reads weights rather than running them
    (quantization, embeddings): a checkpoint as it is, a GGUF decoded one layer at a time on the CPU."""
    source = open_source(folder, config)
    return DenseGgufLayers(source) if isinstance(source, GgufSource) else source
