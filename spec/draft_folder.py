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

from offload.model.config import ModelConfig
from offload.weights.formats import open_source
from offload.weights.gguf_source import expected_shapes
from offload.weights.safetensors_io import SafetensorsFile
from offload.weights.resolve import resolve_model
from offload.weights.source import HF_GLOBAL_NAMES, HF_LAYER_NAMES, layer_tensor_names

DRAFT_FORMAT, DRAFT_VERSION = "specstream-draft", 1
DRAFT_KINDS = ("early-exit", "small")
VOCAB_MAP_KEY = "specstream.vocab_map"
HEAD_BIAS_KEY = "lm_head.bias"
SCALE_SUFFIX = "_scale"
QUANT_GROUP = 64


class DraftFormatError(ValueError):
    """A draft folder is malformed, or its target's embedding is missing or different."""


_INFO_TYPES = {"kind": str, "target_layers_reused": int, "vocab_top": int, "target": str,
               "target_embedding_fingerprint": str, "init_layers": list, "training": dict}
_REQUIRED_INFO = tuple(_INFO_TYPES)[:5]      # the last two may be absent


@dataclass(slots=True)
class DraftInfo:
    kind: str                        # one of DRAFT_KINDS
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
        path = folder / "config.json"
        if not isinstance(raw, dict) or raw.get("format") != DRAFT_FORMAT or raw.get("version") != DRAFT_VERSION:
            raw = raw if isinstance(raw, dict) else {}
            raise DraftFormatError(f"{folder}: specstream_draft block is format {raw.get('format')!r} version "
                                   f"{raw.get('version')!r}; this build reads {DRAFT_FORMAT!r} version {DRAFT_VERSION}")
        missing = [name for name in _REQUIRED_INFO if name not in raw]
        if missing:
            raise DraftFormatError(f"{path}: specstream_draft block lacks {', '.join(missing)}")
        for name, kind in _INFO_TYPES.items():
            value = raw.get(name, kind())
            if not isinstance(value, kind) or isinstance(value, bool):
                raise DraftFormatError(f"{path}: specstream_draft {name} must be {kind.__name__}, got {value!r}")
        if raw["kind"] not in DRAFT_KINDS or raw["vocab_top"] < 1 or raw["target_layers_reused"] < 0:
            raise DraftFormatError(f"{path}: specstream_draft needs kind in {', '.join(DRAFT_KINDS)}, vocab_top "
                                   f"> 0 and target_layers_reused >= 0, got {raw['kind']!r}, {raw['vocab_top']}, "
                                   f"{raw['target_layers_reused']}")
        return cls(**{name: raw[name] for name in _INFO_TYPES if name in raw})


def is_draft_folder(path: str | Path) -> bool:
    return "specstream_draft" in _read_config(Path(path).expanduser())


def _read_config(folder: Path) -> dict:
    """config.json as a dict ({} where there is none); one that is unreadable or not a JSON object is refused."""
    path = folder / "config.json"
    if not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text())
    except OSError as err:          # a directory, or a file this user may not read
        raise DraftFormatError(f"{path} cannot be read ({err.strerror or err})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DraftFormatError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise DraftFormatError(f"{path} is not a JSON object")
    return raw


def read_model_config(folder: Path) -> ModelConfig:
    """A draft's model config (a draft folder's or an ordinary model folder's), refused in one line naming
    config.json where it is missing, unreadable, not JSON, or lacks or mistypes a field."""
    path = folder / "config.json"
    if not path.exists():
        raise DraftFormatError(f"{folder} is not a model folder (no config.json)")
    raw = _read_config(folder)
    try:
        return ModelConfig.from_dict(raw)
    except (KeyError, TypeError, ValueError) as err:
        problem = f"lacks {err}" if isinstance(err, KeyError) else str(err)
        raise DraftFormatError(f"{path}: not a usable model config ({problem})") from None


def read_draft_info(folder: str | Path) -> DraftInfo:
    """The specstream_draft block, after checking the folder's model config parses."""
    folder = Path(folder)
    raw = _read_config(folder)
    if "specstream_draft" not in raw:
        raise DraftFormatError(f"{folder} is not a draft folder (no config.json with a specstream_draft block)")
    read_model_config(folder)
    return DraftInfo.from_dict(raw["specstream_draft"], folder)


def embedding_fingerprint(embed: Tensor) -> str:
    """Shape plus a hash of every 97th row in float32: cheap, and tells models apart."""
    rows = embed[::97].float().cpu().contiguous()
    digest = hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:16]
    return f"{tuple(embed.shape)}:{digest}"


def target_embedding(info: DraftInfo, folder: Path, target_folder: str | Path | None = None) -> Tensor:
    """[V, H] the target's token embedding, checked against the draft's fingerprint."""
    source_folder = Path(target_folder) if target_folder else resolve_model(None if info.target == "default"
                                                                            else info.target)
    embed = open_source(source_folder, ModelConfig.from_file(source_folder)).global_tensors()["embed"]
    if embedding_fingerprint(embed) != info.target_embedding_fingerprint:
        raise DraftFormatError(f"draft {folder} was distilled from a target whose embedding differs from "
                               f"{source_folder}'s (fingerprint {info.target_embedding_fingerprint} vs "
                               f"{embedding_fingerprint(embed)}); use the draft with its own target")
    return embed


def check_shared_embedding(info: DraftInfo, folder: Path, embed: Tensor) -> None:
    """A running target's embedding [V, H] handed to a draft must have the shape the draft was trained with
    (values may differ: a GGUF copy of the same target dequantizes to other numbers)."""
    trained = str(info.target_embedding_fingerprint).split(":")[0]
    if trained != str(tuple(embed.shape)):
        raise DraftFormatError(f"draft {folder} was distilled from a target whose embedding is {trained}, this "
                               f"target's is {tuple(embed.shape)}; use the draft with its own target")


def dequantize_int8(quantized: Tensor, scale: Tensor) -> Tensor:
    """Inverse of quantize_int8: [R, C] float32."""
    rows, cols = quantized.shape
    grouped = quantized.float().reshape(rows, scale.shape[1], -1) * scale.float()[..., None]
    return grouped.reshape(rows, cols)


def draft_shapes(config: ModelConfig, num_rows: int) -> dict[str, tuple[int, ...]]:
    """Every tensor a draft of this config with `num_rows` head rows stores (HF names) -> its shape."""
    layer = expected_shapes(config)
    shapes = {f"model.layers.{i}.{HF_LAYER_NAMES[name]}": layer[name] for i in range(config.num_layers)
              for name in layer_tensor_names(config)}
    hidden = config.hidden_size
    shapes.update({HF_GLOBAL_NAMES["norm"]: (hidden,), HF_GLOBAL_NAMES["lm_head"]: (num_rows, hidden),
                   HEAD_BIAS_KEY: (num_rows,), VOCAB_MAP_KEY: (num_rows,)})
    return shapes


def check_draft_file(opened: SafetensorsFile, config: ModelConfig) -> None:
    """Refuses a model.safetensors whose tensors are missing or not the shapes config.json implies."""
    vocab_map = opened.entries.get(VOCAB_MAP_KEY)
    if vocab_map is None or len(vocab_map.shape) != 1:
        raise DraftFormatError(f"{opened.path} lacks a one-dimensional {VOCAB_MAP_KEY} (the head's target ids)")
    shapes = draft_shapes(config, vocab_map.shape[0])
    missing = [key for key in shapes if key not in opened.entries]
    if missing:
        raise DraftFormatError(f"{opened.path} lacks {len(missing)} of the {len(shapes)} tensors config.json "
                               f"implies, first {missing[0]!r}")
    for key, shape in shapes.items():
        entry = opened.entries[key]
        if entry.shape != shape:
            raise DraftFormatError(f"{opened.path}: tensor {key!r} has shape {list(entry.shape)}, config.json "
                                   f"implies {list(shape)}")
        if entry.dtype == torch.int8:
            _check_scale(opened, key, shape)


def _check_scale(opened: SafetensorsFile, key: str, shape: tuple[int, ...]) -> None:
    """An int8 matrix [R, C] needs its fp16 scale [R, G] with G dividing C."""
    scale = opened.entries.get(key + SCALE_SUFFIX)
    if len(shape) != 2 or scale is None or len(scale.shape) != 2 or scale.shape[0] != shape[0] or \
            not scale.shape[1] or shape[1] % scale.shape[1]:
        raise DraftFormatError(f"{opened.path}: int8 tensor {key!r} needs a {key + SCALE_SUFFIX!r} of shape "
                               f"[rows, groups dividing the columns] (tensor shape {list(shape)})")


def read_draft_tensors(folder: Path, config: ModelConfig) -> tuple[list[dict[str, Tensor]], dict[str, Tensor]]:
    """(per-layer canonical tensors, {"norm", "lm_head", "head_bias", "vocab_map"}) as stored."""
    opened = SafetensorsFile(Path(folder) / "model.safetensors")
    check_draft_file(opened, config)

    def read(key: str) -> Tensor:
        tensor = opened.tensor(key)
        return dequantize_int8(tensor, opened.tensor(key + SCALE_SUFFIX)) if tensor.dtype == torch.int8 else tensor

    layers = [{name: read(f"model.layers.{i}.{HF_LAYER_NAMES[name]}") for name in layer_tensor_names(config)}
              for i in range(config.num_layers)]
    globals_ = {"norm": read(HF_GLOBAL_NAMES["norm"]), "lm_head": read(HF_GLOBAL_NAMES["lm_head"]),
                "head_bias": read(HEAD_BIAS_KEY), "vocab_map": opened.tensor(VOCAB_MAP_KEY).long()}
    ids = globals_["vocab_map"]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size):
        raise DraftFormatError(f"{opened.path}: {VOCAB_MAP_KEY} holds ids outside the target vocabulary "
                               f"[0, {config.vocab_size})")
    return layers, globals_
