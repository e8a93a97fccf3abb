"""Weight sources: where a model's tensors come from, one decoder layer at a time.

Canonical names inside one layer: input_norm, q, k, v, o, q_bias, k_bias, v_bias, q_norm, k_norm,
post_norm, gate, up, down. Global names: embed, norm, lm_head (absent when tied to embed).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from offload.model.config import ModelConfig
from offload.weights.packing import LayerLayout
from offload.weights.safetensors_io import CorruptCheckpointError, SafetensorsFile, TensorEntry

HF_LAYER_NAMES = {
    "input_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
}
HF_GLOBAL_NAMES = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def layer_tensor_names(config: ModelConfig) -> list[str]:
    """Canonical names a layer of this config carries, in a fixed order."""
    names = ["input_norm", "q", "k", "v", "o", "post_norm", "gate", "up", "down"]
    if config.attention_bias:
        names += ["q_bias", "k_bias", "v_bias"]
    if config.has_qk_norm:
        names += ["q_norm", "k_norm"]
    return names


class WeightSource(Protocol):
    config: ModelConfig

    def global_tensors(self) -> dict[str, Tensor]: ...

    def layer(self, index: int) -> dict[str, Tensor]: ...

    def layout(self, dtype: torch.dtype) -> LayerLayout:
        """The one-buffer layout every layer fits (ring slots and tiers use it)."""
        ...

    def decode_layer(self, index: int, stored: dict[str, Tensor], dtype: torch.dtype, shared: bool = False) -> dict:
        """A layer's stored tensors (views on the compute device) -> what the layer math takes: tensors,
        or packed weights with `matmul(x)` and optionally `prepare()` (decode now, ahead of use). `shared`:
        the layer is used before the next shared decode, so dense results may go to one reused workspace."""
        ...

    def layer_entries(self, index: int) -> dict[str, tuple[Path, TensorEntry]]: ...

    def file_paths(self) -> list[Path]: ...


class CheckpointSource:
    """A Hugging Face checkpoint folder: one or many memory-mapped safetensors files."""

    def __init__(self, folder: str | Path, config: ModelConfig | None = None) -> None:
        self.folder = Path(folder)
        self.config = config or ModelConfig.from_file(self.folder)
        self._files: dict[str, SafetensorsFile] = {}
        self._where = self._locate_tensors()
        self._check_complete()

    def _locate_tensors(self) -> dict[str, str]:
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors weights in {self.folder}")
        where: dict[str, str] = {}
        for name in files:  # every file's header is validated before any generation starts
            opened = self._files[name] = SafetensorsFile(self.folder / name)
            where.update({tensor: name for tensor in opened.entries})
        return where

    def _check_complete(self) -> None:
        needed = [HF_GLOBAL_NAMES["embed"], HF_GLOBAL_NAMES["norm"]]
        if not self.config.tie_word_embeddings:
            needed.append(HF_GLOBAL_NAMES["lm_head"])
        for i in range(self.config.num_layers):
            needed += [self._layer_key(i, n) for n in layer_tensor_names(self.config)]
        missing = [n for n in needed if n not in self._where]
        if missing:
            raise CorruptCheckpointError(
                f"{self.folder}: {len(missing)} expected tensors are missing, first {missing[0]!r}")

    @staticmethod
    def _layer_key(index: int, name: str) -> str:
        return f"model.layers.{index}.{HF_LAYER_NAMES[name]}"

    def _get(self, key: str) -> Tensor:
        return self._files[self._where[key]].tensor(key)

    def global_tensors(self) -> dict[str, Tensor]:
        out = {"embed": self._get(HF_GLOBAL_NAMES["embed"]), "norm": self._get(HF_GLOBAL_NAMES["norm"])}
        if not self.config.tie_word_embeddings:
            out["lm_head"] = self._get(HF_GLOBAL_NAMES["lm_head"])
        return out

    def layer(self, index: int) -> dict[str, Tensor]:
        return {n: self._get(self._layer_key(index, n)) for n in layer_tensor_names(self.config)}

    def layout(self, dtype: torch.dtype) -> LayerLayout:
        return LayerLayout.from_tensors(self.layer(0), dtype)

    def decode_layer(self, index: int, stored: dict[str, Tensor], dtype: torch.dtype,
                     shared: bool = False) -> dict[str, Tensor]:
        return stored

    def layer_entries(self, index: int) -> dict[str, tuple[Path, TensorEntry]]:
        """Where each tensor of a layer lies on disk: (file, header entry with absolute offsets)."""
        out = {}
        for name in layer_tensor_names(self.config):
            key = self._layer_key(index, name)
            opened = self._files[self._where[key]]
            out[name] = (opened.path, opened.entries[key])
        return out

    def file_paths(self) -> list[Path]:
        return [f.path for f in self._files.values()]
