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
from . import spqr_packed
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
        views = self._views(index, stored)
        weights = packed_linears({name: self._matrix(views, name) for name in MATRICES}, dtype)
        rest = {name: t.to(dtype) for name, t in views.items() if "." not in name}
        return {**rest, **weights}

    def _views(self, index: int, stored: dict[str, Tensor]) -> dict[str, Tensor]:
        inner = self.inner[index]
        return inner.views(stored["packed"][:inner.num_bytes])

    # the CPU's int4 kernel (quant/spqr_packed.py; loader.on_packed_kernel) -----------------------------
    def kernel_layer(self, index: int, stored: dict[str, Tensor] | None, dtype: torch.dtype,
                     shared: bool = False, in_slot: bool = False) -> dict:
        """A layer for the CPU: w4 g32 matrices repacked for the int4 kernel (no dense copy), others decoded per
        use as decode_layer does. stored None: read from the file, the rest copied (a resident layer). in_slot (a
        ring slot's layer) changes nothing here: the repacked weights are made per pass."""
        views = self._views(index, self.layer(index) if stored is None else stored)
        weights = spqr_packed.from_spqr_layer({name: self._matrix(views, name) for name in MATRICES}, dtype)
        rest = {name: t.to(dtype, copy=stored is None) for name, t in views.items() if "." not in name}
        return {**rest, **weights}

    def kernel_head(self) -> spqr_packed.Q8Head | None:
        """The output matrix (lm_head, else the tied embedding) rounded to Q8_0 for the int4 kernel (None where
        the kernel takes no layer matrix: the whole model then decodes as without it)."""
        return spqr_packed.output_head(self._head()) if self._taken() else None

    def kernel_head_bytes(self, dtype: torch.dtype) -> int:
        """What the packed output matrix adds to the dense globals (a dense lm_head it replaces subtracted)."""
        if not self._taken():
            return 0
        head = self._head()
        untied = "lm_head" in self.global_tensors()
        return spqr_packed.head_bytes(tuple(head.shape)) - (head.numel() * dtype.itemsize if untied else 0)

    def _head(self) -> Tensor:
        tensors = self.global_tensors()
        return tensors.get("lm_head", tensors["embed"])

    def kernel_layer_bytes(self, dtype: torch.dtype) -> int:
        """The most bytes a layer holds for the CPU's kernel (its other tensors in `dtype`); 0 when the kernel
        takes no matrix (the layers stay packed, as without it)."""
        return max(self._kernel_bytes(layout, dtype) for layout in self.inner) if self._taken() else 0

    def _kernel_bytes(self, layout: LayerLayout, dtype: torch.dtype) -> int:
        slots = {slot.name: slot for slot in layout.slots}
        total = sum(s.num_bytes // s.dtype.itemsize * dtype.itemsize for n, s in slots.items() if "." not in n)
        for name, shape in self.shapes.items():
            if self._takes(shape):
                total += spqr_packed.kernel_bytes(shape, slots[f"{name}.outlier_values"].shape[0],
                                                  slots[f"{name}.perm"].shape[0] > 0)
            else:       # kept packed, decoded per use
                total += sum(s.num_bytes for n, s in slots.items() if n.startswith(f"{name}."))
        return total

    def _takes(self, shape: tuple[int, int]) -> bool:
        return spqr_packed.takes(self.quantization["bits"], self.quantization["groupsize"], shape)

    def _taken(self) -> list[str]:
        return [name for name, shape in self.shapes.items() if self._takes(shape)]

    def kernel_summary(self) -> str:
        """The status line of a CPU run on the int4 kernel: which matrices it multiplies, which are decoded."""
        q, count = self.quantization, self.config.num_layers
        kind = f"SpQR w{q['bits']} g{q['groupsize']}"
        taken = self._taken()
        line = "CPU packed int4 kernel: " + (f"{kind} x{len(taken) * count} (outliers added sparse), output "
                                             "matrix as Q8_0" if taken else "no matrix")
        decoded = len(self.shapes) - len(taken)
        return line + (f"; decoded to dense (the kernel takes SpQR w4 g32 only): {kind} x{decoded * count}"
                       if decoded else "")

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
