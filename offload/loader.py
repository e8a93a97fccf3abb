"""Loading a model for inference: resolve the source, read config + tokenizer, build the forward."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import ModelConfig
from .devices import choose_device, choose_dtype
from .model import DecoderModel
from .resident import ResidentLayers, to_device
from .sources import resolve_model
from .tokenizer import Tokenizer
from .weights import CheckpointSource


@dataclass(slots=True)
class LoadOptions:
    model: str | None = None        # None: the embedded default model
    device: str = "auto"
    dtype: str = "auto"
    allow_download: bool = False

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "bf16", "fp16", "fp32"):
            raise ValueError(f"dtype must be auto, bf16, fp16 or fp32, got {self.dtype!r}")


@dataclass(slots=True)
class LoadedModel:
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    model: DecoderModel
    stop_ids: set[int] = field(default_factory=set)
    resident_bytes: int = 0


def load_model(options: LoadOptions, on_status=None) -> LoadedModel:
    path = resolve_model(options.model, options.allow_download, on_status)
    config = ModelConfig.from_file(path)
    device = choose_device(options.device)
    dtype = choose_dtype(options.dtype, device)
    source = CheckpointSource(path, config)
    tokenizer = Tokenizer(path)
    globals_ = to_device(source.global_tensors(), device, dtype)
    layers = ResidentLayers(source, device, dtype)
    model = DecoderModel(config, globals_, layers, device, dtype)
    resident = layers.num_bytes + sum(t.numel() * t.element_size() for t in globals_.values())
    return LoadedModel(path, config, tokenizer, model, stop_token_ids(path, config, tokenizer), resident)


def stop_token_ids(path: Path, config: ModelConfig, tokenizer: Tokenizer) -> set[int]:
    """EOS ids from the generation config and model config, plus the chat template's end-of-turn."""
    ids = set(config.eos_token_ids) | tokenizer.end_of_turn_ids()
    generation = path / "generation_config.json"
    if generation.exists():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    return ids
