"""The draft folder: a normal model folder our loader reads, plus what ties it to its target.

    config.json        the target's config with the draft's layer count, and a `specstream_draft` block:
                       {"format": "specstream-draft", "version": 1, "kind", "target_layers_reused",
                        "vocab_top", "tied_to_target_embedding": true, "target", "target_embedding_fingerprint"}
    model.safetensors  every matrix (model.layers.*.weight, lm_head.weight [K, H]) in int8 with
                       `<name>_scale` [rows, cols / 64] fp16 (absmax per group of 64 inputs); norms and
                       lm_head.bias [K] in fp16; specstream.vocab_map [K] int32 (target id per head row).
                       int8 halves the folder (3 layers + 4096 rows: 13 MB, not 24 MB + 3.5 MB of
                       tokenizer) and is dequantized once at load; the draft computes in the runtime dtype.
    tokenizer files    copied from the target, so tokenizer equality can be checked

The token embedding is not stored: it is the target's (frozen while training), read from the target
at load time and checked against a fingerprint. For SmolLM2-135M it is 49152 x 576 (56 MB in fp16),
more than twice the 25 MB a shipped draft may take, and a draft never runs without its target,
whose embedding is then already in memory and can be shared outright.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from offload.config import ModelConfig
from offload.safetensors_io import SafetensorsFile
from offload.sources import resolve_model
from offload.weights import HF_GLOBAL_NAMES, HF_LAYER_NAMES, CheckpointSource, layer_tensor_names

DRAFT_FORMAT, DRAFT_VERSION = "specstream-draft", 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
VOCAB_MAP_KEY = "specstream.vocab_map"
HEAD_BIAS_KEY = "lm_head.bias"
SCALE_SUFFIX = "_scale"
QUANT_GROUP = 64


class DraftFormatError(ValueError):
    """A draft folder is malformed, or its target's embedding is missing or different."""


@dataclass(slots=True)
class DraftInfo:
    kind: str                        # "early-exit" | "small"
    target_layers_reused: int        # first target layers copied and frozen (early-exit)
    vocab_top: int
    target: str                      # "default" (embedded model) or the target folder given to distill
    target_embedding_fingerprint: str
    init_layers: list[int] = field(default_factory=list)   # target layer each draft layer started from
    training: dict = field(default_factory=dict)           # recipe: steps, tokens, seconds, agreement

    def as_dict(self) -> dict:
        return {"format": DRAFT_FORMAT, "version": DRAFT_VERSION, "tied_to_target_embedding": True, **asdict(self)}

    @classmethod
    def from_dict(cls, raw: dict, folder: Path) -> "DraftInfo":
        if raw.get("format") != DRAFT_FORMAT or raw.get("version") != DRAFT_VERSION:
            raise DraftFormatError(f"{folder}: specstream_draft block is format {raw.get('format')!r} version "
                                   f"{raw.get('version')!r}; this build reads {DRAFT_FORMAT!r} version {DRAFT_VERSION}")
        names = ("kind", "target_layers_reused", "vocab_top", "target", "target_embedding_fingerprint",
                 "init_layers", "training")
        return cls(**{name: raw[name] for name in names if name in raw})


def is_draft_folder(path: str | Path) -> bool:
    config = Path(path).expanduser() / "config.json"
    return config.is_file() and "specstream_draft" in json.loads(config.read_text())


def read_draft_info(folder: str | Path) -> DraftInfo:
    folder = Path(folder)
    if not is_draft_folder(folder):
        raise DraftFormatError(f"{folder} is not a draft folder (no config.json with a specstream_draft block)")
    return DraftInfo.from_dict(json.loads((folder / "config.json").read_text())["specstream_draft"], folder)


def embedding_fingerprint(embed: Tensor) -> str:
    """Shape plus a hash of every 97th row in float32: cheap, and tells models apart."""
    rows = embed[::97].float().contiguous()
    digest = hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:16]
    return f"{tuple(embed.shape)}:{digest}"


def target_embedding(info: DraftInfo, folder: Path, target_folder: str | Path | None = None) -> Tensor:
    """[V, H] the target's token embedding, checked against the draft's fingerprint."""
    source_folder = Path(target_folder) if target_folder else resolve_model(None if info.target == "default"
                                                                            else info.target)
    embed = CheckpointSource(source_folder).global_tensors()["embed"]
    if embedding_fingerprint(embed) != info.target_embedding_fingerprint:
        raise DraftFormatError(f"draft {folder} was distilled from a target whose embedding differs from "
                               f"{source_folder}'s (fingerprint {info.target_embedding_fingerprint} vs "
                               f"{embedding_fingerprint(embed)}); use the draft with its own target")
    return embed


def dequantize_int8(quantized: Tensor, scale: Tensor) -> Tensor:
    """Inverse of quantize_int8: [R, C] float32."""
    rows, cols = quantized.shape
    grouped = quantized.float().reshape(rows, scale.shape[1], -1) * scale.float()[..., None]
    return grouped.reshape(rows, cols)


def read_draft_tensors(folder: Path, config: ModelConfig) -> tuple[list[dict[str, Tensor]], dict[str, Tensor]]:
    """(per-layer canonical tensors, {"norm", "lm_head", "head_bias", "vocab_map"}) as stored."""
    opened = SafetensorsFile(Path(folder) / "model.safetensors")

    def read(key: str) -> Tensor:
        tensor = opened.tensor(key)
        return dequantize_int8(tensor, opened.tensor(key + SCALE_SUFFIX)) if tensor.dtype == torch.int8 else tensor

    missing = [k for k in (HF_GLOBAL_NAMES["norm"], HF_GLOBAL_NAMES["lm_head"], HEAD_BIAS_KEY, VOCAB_MAP_KEY)
               if k not in opened.entries]
    if missing:
        raise DraftFormatError(f"{folder}/model.safetensors lacks {', '.join(missing)}")
    layers = [{name: read(f"model.layers.{i}.{HF_LAYER_NAMES[name]}") for name in layer_tensor_names(config)}
              for i in range(config.num_layers)]
    globals_ = {"norm": read(HF_GLOBAL_NAMES["norm"]), "lm_head": read(HF_GLOBAL_NAMES["lm_head"]),
                "head_bias": read(HEAD_BIAS_KEY), "vocab_map": opened.tensor(VOCAB_MAP_KEY).long()}
    if globals_["lm_head"].shape[0] != globals_["vocab_map"].numel():
        raise DraftFormatError(f"{folder}: LM head has {globals_['lm_head'].shape[0]} rows, vocab map "
                               f"{globals_['vocab_map'].numel()}")
    return layers, globals_
