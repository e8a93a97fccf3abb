"""A GGUF's decoder layers stored once in the CPU int4 kernel's layout, so a streamed layer is read and multiplied
as it lies: no repack per pass (offload/weights/packed_linear.py: the repack took 2.65 of a streamed Q4_1 layer's
4.1 ms from a cold disk, quant_disk_gguf_6.json).

The layout of the packed codes is the running CPU's dispatch (AVX512, AVX2) and torch's, so the file is keyed by
both, with the GGUF's name, size and modification time and the compute dtype; a file that fails its checks is made
again. Each layer is one uint8 tensor `layer.N` of the layout's bytes (codes, scales and zeros of every matrix
at the layout's places, norms in the compute dtype), so a layer streams as one contiguous read. Made on the first
start that streams a layer on the kernel: about the packed size of the layers (0.625 bytes a weight for Q4_0/Q4_1/
Q4_K, 1.25 for Q8_0). Only a GGUF whose every decoder matrix the kernel takes is served (a Q4_K_M file's Q6_K
matrices keep the per-pass repack and decode)."""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from contextlib import closing
from pathlib import Path

import torch
from torch import Tensor

from offload.weights import packed_linear
from offload.weights.gguf_source import GgufSource
from offload.weights.packing import LayerLayout
from offload.weights.safetensors_io import CorruptCheckpointError, SafetensorsFile, SafetensorsStreamWriter, TensorEntry

CACHE_FORMAT, CACHE_VERSION = "specstream-kernel-layers", 1


def kernel_cache_path(gguf, dtype: torch.dtype, root: Path) -> Path:
    """The cache file of `gguf`'s layers in this CPU's layout for compute in `dtype`."""
    stat = gguf.path.stat()
    key = json.dumps([gguf.path.name, stat.st_size, stat.st_mtime_ns, torch.backends.cpu.get_cpu_capability(),
                      torch.__version__, str(dtype), CACHE_VERSION])
    return root / "kernel_layers" / f"{gguf.path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"


def serves(gguf) -> bool:
    """Whether `gguf` is a GGUF whose every decoder matrix multiplies on the kernel (one layout fits every layer)."""
    return isinstance(gguf, GgufSource) and all(packed_linear.takes(info.qtype, info.shape)
                                                for layer in gguf._layers for info in layer.values()
                                                if len(info.shape) == 2)


def _flat(layer: dict) -> tuple[dict[str, Tensor], dict[str, list[int]]]:
    """A kernel layer (Int4Weights and tensors) -> named tensors, and each weight's [N, K, repeat]."""
    tensors, weights = {}, {}
    for name, value in layer.items():
        if isinstance(value, packed_linear.Int4Weight):
            tensors[f"{name}.codes"], tensors[f"{name}.scale_zeros"] = value.codes, value.scale_zeros
            weights[name] = [*value.shape, value.repeat]
        else:
            tensors[name] = value
    return tensors, weights


def build_kernel_cache(gguf, dtype: torch.dtype, path: Path, on_status=None) -> None:
    """Repacks every layer once and writes them (atomically: a temporary file renamed into place)."""
    started = time.perf_counter()
    first, weights = _flat(gguf.kernel_layer(0, None, dtype))
    layout = LayerLayout.from_tensors(first, None)
    metadata = {"format": CACHE_FORMAT, "version": str(CACHE_VERSION), "layout": json.dumps(layout.as_dict()),
                "weights": json.dumps(weights)}
    specs = {f"layer.{i}": (torch.uint8, (layout.num_bytes,)) for i in range(gguf.config.num_layers)}
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = torch.zeros(layout.num_bytes, dtype=torch.uint8)
    with SafetensorsStreamWriter(path, specs, metadata) as writer:
        for index in range(gguf.config.num_layers):
            tensors, these = _flat(gguf.kernel_layer(index, None, dtype)) if index else (first, weights)
            if these != weights or {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()} != \
                    {s.name: (s.dtype, s.shape) for s in layout.slots}:
                raise ValueError(f"layer {index} differs from layer 0 in the kernel's layout")
            layout.pack_into(buffer, tensors)
            writer.append(buffer)
    if on_status:
        on_status(f"GGUF layers stored in this CPU's int4 kernel layout once ({path.stat().st_size / 2**20:.0f} MiB "
                  f"in {time.perf_counter() - started:.1f} s, model cache): streamed layers skip the repack")


def _check_room(gguf, dtype: torch.dtype, path: Path) -> None:
    """Refuses (OSError) a file the disk would hold with less than a tenth of its size to spare."""
    path.parent.mkdir(parents=True, exist_ok=True)
    needed = gguf.config.num_layers * gguf.kernel_layer_bytes(dtype)
    free = shutil.disk_usage(path.parent).free
    if free < needed * 1.1:
        raise OSError(f"{needed / 2**30:.1f} GiB needed in {path.parent}, {free / 2**30:.1f} GiB free")


class KernelCachedSource:
    """A GgufSource whose decoder layers stream from the kernel cache file: `layer`, `layer_entries`, `layout` and
    a streamed layer's `kernel_layer` read it; resident layers, globals, the dense decode of long prompts and the
    rest are the GGUF's."""

    def __init__(self, gguf, path: Path) -> None:
        self.gguf, self.config, self.path = gguf, gguf.config, Path(path)
        self._file = SafetensorsFile(self.path)
        self._layout, self._weights = self._check()

    def _check(self) -> tuple[LayerLayout, dict[str, tuple[int, int, int]]]:
        meta = self._file.metadata
        try:
            if meta.get("format") != CACHE_FORMAT or meta.get("version") != str(CACHE_VERSION):
                raise ValueError("not a kernel layer cache of this version")
            layout = LayerLayout.from_dict(json.loads(meta["layout"]))
            weights = {name: tuple(int(v) for v in shape) for name, shape in json.loads(meta["weights"]).items()}
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptCheckpointError(f"{self.path}: {err}") from err
        for index in range(self.config.num_layers):
            entry = self._file.entries.get(f"layer.{index}")
            if entry is None or entry.dtype != torch.uint8 or entry.num_bytes != layout.num_bytes:
                raise CorruptCheckpointError(f"{self.path}: layer {index} is missing or of the wrong size")
        for name, (num_out, num_in, repeat) in weights.items():
            codes, scale_zeros = (next((s for s in layout.slots if s.name == f"{name}.{part}"), None)
                                  for part in ("codes", "scale_zeros"))
            width = num_in * repeat
            if codes is None or scale_zeros is None or codes.shape != (num_out, width // 2) \
                    or scale_zeros.shape != (width // packed_linear.GROUP, num_out, 2):
                raise CorruptCheckpointError(f"{self.path}: weight {name} does not match its layout")
        return layout, weights

    def __getattr__(self, name: str):
        if name == "gguf":               # not yet set (a copy under construction): no recursion
            raise AttributeError(name)
        return getattr(self.gguf, name)   # globals, resident layers, status lines, keys: the GGUF's

    def layout(self, dtype: torch.dtype) -> LayerLayout:
        return self._layout

    def layer(self, index: int) -> dict[str, Tensor]:
        """A layer's stored tensors, views into the mapped cache file (the RAM tier packs them)."""
        return self._layout.views(self._file.tensor(f"layer.{index}"))

    def layer_entries(self, index: int) -> dict[str, tuple[Path, TensorEntry]]:
        base = self._file.entries[f"layer.{index}"].start
        return {slot.name: (self.path, TensorEntry(slot.name, slot.dtype, slot.shape, base + slot.offset,
                                                   base + slot.offset + slot.num_bytes))
                for slot in self._layout.slots}

    def kernel_layer(self, index: int, stored: dict[str, Tensor] | None, dtype: torch.dtype,
                     shared: bool = False) -> dict:
        """A streamed layer's Int4Weights and tensors as views of its stored bytes (nothing repacked); a resident
        one (stored None) repacked from the GGUF into memory of its own."""
        if stored is None:
            return self.gguf.kernel_layer(index, None, dtype)
        layer = {name: stored[name].to(dtype) for name in stored
                 if not name.endswith((".codes", ".scale_zeros"))}
        for name, (num_out, num_in, repeat) in self._weights.items():
            layer[name] = packed_linear.Int4Weight(stored[f"{name}.codes"], stored[f"{name}.scale_zeros"],
                                                   (num_out, num_in), repeat)
        return layer

    def decode_layer(self, index: int, stored: dict[str, Tensor], dtype: torch.dtype, shared: bool = False) -> dict:
        """The layer dense (a long prompt's rows): decoded from the GGUF's blocks."""
        return self.gguf.decode_layer(index, self.gguf.layer(index), dtype, shared)

    def close(self) -> None:
        self._file.close()


def kernel_layout(gguf, dtype: torch.dtype, root: Path) -> LayerLayout:
    """The cache's layer layout (read from the file where it exists, else from layer 0's shapes)."""
    path = kernel_cache_path(gguf, dtype, root)
    if path.is_file():
        try:
            with closing(KernelCachedSource(gguf, path)) as cached:
                return cached.layout(dtype)
        except (OSError, CorruptCheckpointError):
            pass
    return LayerLayout.from_tensors(_flat(gguf.kernel_layer_meta(dtype))[0], None)


def open_kernel_cache(gguf, dtype: torch.dtype, root: Path, on_status=None) -> KernelCachedSource | None:
    """The GGUF's layers from the kernel cache (made where missing or damaged); None where it cannot be (the
    layers then repack per pass, and a status line says why)."""
    path = kernel_cache_path(gguf, dtype, root)
    for attempt in range(2):
        try:
            if attempt or not path.is_file():
                _check_room(gguf, dtype, path)
                build_kernel_cache(gguf, dtype, path, on_status)
            return KernelCachedSource(gguf, path)
        except (OSError, ValueError) as err:        # CorruptCheckpointError is a ValueError: made again, once
            error = err
    if on_status:
        on_status(f"streamed layers repack per pass: the kernel layer cache could not be stored ({error})")
    return None
