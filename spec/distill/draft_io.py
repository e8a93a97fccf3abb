"""Writing a draft folder (the format is described in spec/draft_folder.py, which reads it)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from offload.model.config import ModelConfig
from offload.weights.disk_errors import write_text_atomic
from offload.weights.safetensors_io import write_safetensors
from offload.weights.source import HF_GLOBAL_NAMES, HF_LAYER_NAMES
from offload.weights.tokenizer import copy_tokenizer_files
from spec.draft_folder import (DRAFT_FORMAT, HEAD_BIAS_KEY, QUANT_GROUP, SCALE_SUFFIX, VOCAB_MAP_KEY,
                               DraftInfo, read_draft_info, read_draft_tensors, target_embedding)
from .draft_model import DraftModel


def save_draft(folder: str | Path, model: DraftModel, info: DraftInfo, target_folder: str | Path) -> int:
    """Writes the draft folder (int8 matrices, fp16 vectors); returns the bytes of model.safetensors."""
    folder, target_folder = Path(folder), Path(target_folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Tensor] = {}
    named = {f"model.layers.{i}.{HF_LAYER_NAMES[n]}": w for i, layer in enumerate(model.layers)
             for n, w in layer.weights.items()}
    named[HF_GLOBAL_NAMES["norm"]] = model.norm
    named[HF_GLOBAL_NAMES["lm_head"]] = model.head
    for key, weight in named.items():
        if weight.dim() == 2:
            tensors[key], tensors[key + SCALE_SUFFIX] = quantize_int8(weight.detach())
        else:
            tensors[key] = weight.detach().half()
    tensors[HEAD_BIAS_KEY] = model.head_bias.detach().half()
    tensors[VOCAB_MAP_KEY] = model.vocab_map.int()
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt", "specstream": DRAFT_FORMAT})
    raw = json.loads((target_folder / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    raw.update(num_hidden_layers=len(model.layers), tie_word_embeddings=False, torch_dtype="float16",
               dtype="float16", specstream_draft=info.as_dict())
    write_text_atomic(folder / "config.json", json.dumps(raw, indent=2) + "\n")
    copy_tokenizer_files(target_folder, folder)
    return (folder / "model.safetensors").stat().st_size


def quantize_int8(weight: Tensor, group: int = QUANT_GROUP) -> tuple[Tensor, Tensor]:
    """weight [R, C] -> (int8 [R, C], fp16 scale [R, C / group]): symmetric absmax per group of
    `group` consecutive inputs (one group per row when C is not a multiple of it)."""
    rows, cols = weight.shape
    group = group if cols % group == 0 else cols
    grouped = weight.float().reshape(rows, cols // group, group)
    scale = (grouped.abs().amax(-1) / 127).clamp(min=1e-8).half()                    # [R, C / group]
    quantized = (grouped / scale.float()[..., None]).round().clamp(-127, 127).to(torch.int8)
    return quantized.reshape(rows, cols), scale


def load_draft_module(folder: str | Path, embed: Tensor | None = None,
                      target_folder: str | Path | None = None) -> DraftModel:
    """The draft as a trainable float32 module (to continue training or to inspect it)."""
    folder = Path(folder)
    info = read_draft_info(folder)
    config = ModelConfig.from_file(folder)
    layers, globals_ = read_draft_tensors(folder, config)
    if embed is None:
        embed = target_embedding(info, folder, target_folder)
    return DraftModel(config, embed.float(), layers, globals_["norm"], globals_["lm_head"], globals_["head_bias"],
                      globals_["vocab_map"], info.target_layers_reused if info.kind == "early-exit" else 0)
