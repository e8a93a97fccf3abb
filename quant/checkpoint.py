"""The SpQR checkpoint folder, and the engine format that streams it.

    config.json              the source model's config plus `quantization_config` {"quant_method":
                             "specstream-spqr", "format_version": 1, "bits", "groupsize", "stats_bits",
                             "outlier_threshold", "act_order", ...}
    globals.safetensors      embedding, final norm, LM head (unquantized)
    layers/layer-NNNNN.safetensors
                             one uint8 tensor per decoder layer: the layer's packed buffer exactly as the
                             engine holds it (one read streams a layer); its metadata names the format and
                             version and carries the buffer's layout (name, dtype, shape, offset per part)
    tokenizer files          copied from the source model
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from offload.model.config import ModelConfig
from offload.weights.disk_errors import write_text_atomic
from offload.weights.packing import ALIGNMENT, LayerLayout, TensorSlot
from offload.weights.formats import packed_method
from offload.weights.safetensors_io import CorruptCheckpointError, SafetensorsFile, write_safetensors
from offload.weights.source import HF_GLOBAL_NAMES
from offload.weights.tokenizer import copy_tokenizer_files
from .spqr_format import SpqrMatrix, packed_linears

FORMAT_NAME, FORMAT_VERSION = "specstream-spqr", 2
# Version 2: a matrix quantized without act-order stores an empty permutation (none is gathered at run
# time); version 1 always stored one. Both load.
READABLE_VERSIONS = (1, 2)
MATRICES = ("q", "k", "v", "o", "gate", "up", "down")
GLOBALS_FILE = "globals.safetensors"


def matrix_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of every quantized matrix of a layer."""
    q, kv, hidden = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.hidden_size
    inter = config.intermediate_size
    return {"q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, q), "gate": (inter, hidden),
            "up": (inter, hidden), "down": (hidden, inter)}


def layer_path(folder: Path, index: int) -> Path:
    return folder / "layers" / f"layer-{index:05d}.safetensors"


def write_layer(folder: Path, index: int, tensors: dict[str, Tensor]) -> int:
    """Packs a quantized layer into one buffer and writes it (atomically); returns its bytes."""
    layout = LayerLayout.from_tensors(tensors, None)
    blob = torch.zeros(layout.num_bytes, dtype=torch.uint8)
    layout.pack_into(blob, tensors)
    path = layer_path(folder, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": FORMAT_NAME, "version": str(FORMAT_VERSION), "layout": json.dumps(layout.as_dict())}
    write_safetensors(path, {_layer_key(index): blob}, metadata)
    return layout.num_bytes


def write_globals(folder: Path, tensors: dict[str, Tensor]) -> None:
    named = {HF_GLOBAL_NAMES[name]: t.contiguous() for name, t in tensors.items()}
    write_safetensors(folder / GLOBALS_FILE, named, {"format": FORMAT_NAME, "version": str(FORMAT_VERSION)})


def write_config(folder: Path, source_folder: Path, quantization: dict, source_name: str | None = None) -> None:
    """`source_name` "default": the embedded model's checkpoint, which then runs with its shipped draft."""
    raw = json.loads((source_folder / "config.json").read_text())
    if source_name:
        raw["specstream_source"] = source_name
    raw["quantization_config"] = {"quant_method": FORMAT_NAME, "format_version": FORMAT_VERSION, **quantization}
    write_text_atomic(folder / "config.json", json.dumps(raw, indent=2) + "\n")
    copy_tokenizer_files(source_folder, folder)


def _layer_key(index: int) -> str:
    return f"model.layers.{index}.packed"


class SpqrFormat:
    """Handed to the loader by the runtime: claims folders whose config names this format."""
    name = FORMAT_NAME

    def claims(self, folder: Path) -> bool:
        return packed_method(folder) == FORMAT_NAME

    def open(self, folder: Path, config: ModelConfig) -> "SpqrSource":
        return SpqrSource(folder, config)


class SpqrSource:
    """A WeightSource over a SpQR folder: every layer one packed buffer, decoded on the compute device."""

    def __init__(self, folder: Path, config: ModelConfig) -> None:
        self.folder, self.config = Path(folder), config
        self.quantization = _read_quantization(self.folder)
        self.shapes = matrix_shapes(config)
        self._files = [SafetensorsFile(layer_path(self.folder, i)) if layer_path(self.folder, i).exists()
                       else _missing(layer_path(self.folder, i)) for i in range(config.num_layers)]
        self.inner = [self._check_layer(i, opened) for i, opened in enumerate(self._files)]
        self._globals = SafetensorsFile(self.folder / GLOBALS_FILE)

    def _check_layer(self, index: int, opened: SafetensorsFile) -> LayerLayout:
        """The layer's inner layout, checked against its file and the model's shapes (before generation)."""
        where = f"{opened.path}"
        if opened.metadata.get("format") != FORMAT_NAME or opened.metadata.get("version") not in map(str, READABLE_VERSIONS):
            raise CorruptCheckpointError(f"{where}: format {opened.metadata.get('format')!r} version "
                                         f"{opened.metadata.get('version')!r}; this build reads {FORMAT_NAME} "
                                         f"versions {READABLE_VERSIONS}")
        try:
            layout = LayerLayout.from_dict(json.loads(opened.metadata["layout"]))
        except (KeyError, ValueError, TypeError) as err:
            raise CorruptCheckpointError(f"{where}: unreadable layer layout ({err})") from None
        entry = opened.entries.get(_layer_key(index))
        if entry is None or entry.num_bytes != layout.num_bytes:
            raise CorruptCheckpointError(f"{where}: packed layer holds {entry.num_bytes if entry else 0} bytes, its "
                                         f"layout {layout.num_bytes}")
        views = layout.views(opened.tensor(_layer_key(index)))
        try:
            for name in MATRICES:
                self._matrix(views, name)
        except (KeyError, ValueError) as err:
            raise CorruptCheckpointError(f"{where}: {err}") from None
        return layout

    def _matrix(self, views: dict[str, Tensor], name: str) -> SpqrMatrix:
        q = self.quantization
        return SpqrMatrix.from_tensors(views, name, self.shapes[name], q["bits"], q["groupsize"], q["stats_bits"])

    # WeightSource ---------------------------------------------------------------------------------
    def global_tensors(self) -> dict[str, Tensor]:
        out = {name: self._globals.tensor(key) for name, key in HF_GLOBAL_NAMES.items() if key in self._globals.entries}
        return out

    def layer(self, index: int) -> dict[str, Tensor]:
        return {"packed": self._files[index].tensor(_layer_key(index))}

    def layer_entries(self, index: int):
        opened = self._files[index]
        return {"packed": (opened.path, opened.entries[_layer_key(index)])}

    def layout(self, dtype: torch.dtype) -> LayerLayout:
        largest = max(layout.num_bytes for layout in self.inner)
        size = -(-largest // ALIGNMENT) * ALIGNMENT
        return LayerLayout((TensorSlot("packed", torch.uint8, (size,), 0),), size)

    def decode_layer(self, index: int, stored: dict[str, Tensor], dtype: torch.dtype, shared: bool = False) -> dict:
        inner = self.inner[index]
        views = inner.views(stored["packed"][:inner.num_bytes])
        weights = packed_linears({name: self._matrix(views, name) for name in MATRICES}, dtype)
        rest = {name: t.to(dtype) for name, t in views.items() if "." not in name}
        return {**rest, **weights}

    def file_paths(self) -> list[Path]:
        return [opened.path for opened in self._files] + [self._globals.path]

    def packed_bytes(self) -> int:
        return sum(layout.num_bytes for layout in self.inner)


def _read_quantization(folder: Path) -> dict:
    raw = json.loads((folder / "config.json").read_text()).get("quantization_config", {})
    if raw.get("format_version") not in READABLE_VERSIONS:
        raise CorruptCheckpointError(f"{folder / 'config.json'}: {FORMAT_NAME} format version "
                                     f"{raw.get('format_version')!r}; this build reads versions {READABLE_VERSIONS}")
    for key in ("bits", "groupsize", "stats_bits"):
        if not isinstance(raw.get(key), int):
            raise CorruptCheckpointError(f"{folder / 'config.json'}: quantization_config lacks {key}")
    return raw


def _missing(path: Path):
    raise CorruptCheckpointError(f"{path} is missing (an unfinished quantization? rerun it with --resume)")
