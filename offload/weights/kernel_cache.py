"""A GGUF's decoder layers stored once in the CPU int4 kernel's layout, so a streamed layer is read and multiplied
as it lies: no repack per pass (offload/weights/packed_linear.py: the repack took 2.65 of a streamed Q4_1 layer's
4.1 ms from a cold disk, quant_disk_gguf_6.json).

The layout of the packed codes is the running CPU's dispatch (AVX512, AVX2) and torch's, so the file is keyed by
both, with the GGUF's name, size and modification time; a file that fails its checks is made again. Each layer is
one uint8 tensor `layer.N`: the codes and scales of every matrix the kernel takes (q/k/v and gate/up fused as
packed_linear fuses them), then every other tensor's raw GGUF blocks (norms; F16 matrices), decoded before use
as the file's own blocks are. Layers whose types differ (Q4_K_M: Q6_K attn_v and ffn_down in some layers only) have
different inner layouts, "variants", each stored in the header; streaming sees one uint8 slot as large as the
largest variant, so any ring slot holds any layer and a layer streams as one contiguous read. Made on the first
start that streams a layer on the kernel: about the packed size of the layers (0.625 bytes a weight for
Q4_0/Q4_1/Q4_K, 1.25 for Q8_0 and the 5/6-bit types, the file's size for the rest).

With `--cpu-kernel ggml` the file holds each matrix as ggml multiplies it instead (Q4_0/Q4_K in ggml's repacked
tiles, the rest as the GGUF's blocks; the same size as the file's), keyed by the libggml build, and the ring's
slots are ggml's own buffers (ggml_linear.host_buffer), so a streamed layer is multiplied where it was read."""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from offload.weights import ggml_linear, packed_linear
from offload.weights.gguf_blocks import packed_nbytes
from offload.weights.gguf_source import GgufSource
from offload.weights.packing import ALIGNMENT, LayerLayout, TensorSlot
from offload.weights.safetensors_io import CorruptCheckpointError, SafetensorsFile, SafetensorsStreamWriter, TensorEntry

CACHE_FORMAT, CACHE_VERSION = "specstream-kernel-layers", 3
GGML_FORMAT = "specstream-ggml-layers"
BLOB = "layer"      # the one slot streaming sees


@dataclass(slots=True, frozen=True)
class Variant:
    """One inner layout of a cached layer: where each tensor lies in its bytes, and what each is."""
    layout: LayerLayout
    weights: tuple[tuple[str, int, int, int, int], ...]   # (name, N, K, repeat, interleave) of Int4Weights "name.*";
                                                       # on ggml (name, N, K, GGUF type, 0) of GgmlWeights "name"
    blocks: tuple[str, ...]                            # tensors kept as raw GGUF blocks (uint8 slots)

    def as_dict(self) -> dict:
        return {"layout": self.layout.as_dict(), "weights": [list(w) for w in self.weights],
                "blocks": list(self.blocks)}


def kernel_cache_path(gguf, root: Path) -> Path:
    """The cache file of `gguf`'s layers in this CPU's layout."""
    stat = gguf.path.stat()
    on_ggml = _on_ggml(gguf)
    layout_of = ggml_linear.build_key() if on_ggml else [torch.backends.cpu.get_cpu_capability(), torch.__version__]
    key = json.dumps([gguf.path.name, stat.st_size, stat.st_mtime_ns, *layout_of, CACHE_VERSION])
    kind = "-ggml" if on_ggml else ""
    return root / "kernel_layers" / f"{gguf.path.stem}{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"


def _on_ggml(gguf) -> bool:
    return getattr(gguf, "kernel", None) is ggml_linear


def _format(gguf) -> str:
    return GGML_FORMAT if _on_ggml(gguf) else CACHE_FORMAT


def serves(gguf) -> bool:
    """Whether `gguf` is a GGUF with a decoder matrix the kernel takes (else there is nothing to store)."""
    return isinstance(gguf, GgufSource) and any(gguf.kernel_split(i)[0] for i in range(gguf.config.num_layers))


def _flat(weights: dict, blocks: dict[str, Tensor]) -> dict[str, Tensor]:
    """A layer's Int4Weights and raw blocks -> the named tensors a variant's layout places."""
    tensors = {}
    for name, weight in weights.items():
        if isinstance(weight, ggml_linear.GgmlWeight):
            tensors[name] = weight.stored_bytes()
        else:
            tensors[f"{name}.codes"], tensors[f"{name}.scale_zeros"] = weight.codes, weight.scale_zeros
    return {**tensors, **blocks}


def _variant_of(gguf, index: int) -> Variant:
    """Layer `index`'s variant, from its tensors' types and shapes (nothing repacked)."""
    kernel, rest = gguf.kernel_split(index)
    blocks = {name: torch.empty(gguf.block_bytes(index, name), dtype=torch.uint8, device="meta") for name in rest}
    if _on_ggml(gguf):           # the stacked matrices' bytes, as many as the blocks'
        stacked = ggml_linear.stacking(gguf.kernel_specs(index))
        tensors = {name: torch.empty(packed_nbytes(qtype, shape), dtype=torch.uint8, device="meta")
                   for name, (_, qtype, shape) in stacked.items()}
        return Variant(LayerLayout.from_tensors({**tensors, **blocks}, None),
                       tuple((name, *shape, int(qtype), 0) for name, (_, qtype, shape) in stacked.items()), rest)
    meta = gguf.kernel_layer_meta(torch.float32, index)
    weights = {name: value for name, value in meta.items() if isinstance(value, packed_linear.Int4Weight)}
    return Variant(LayerLayout.from_tensors(_flat(weights, blocks), None),
                   tuple((name, *w.shape, w.repeat, int(w.interleave)) for name, w in weights.items()), rest)


def variants(gguf) -> tuple[list[Variant], list[int]]:
    """The distinct variants of `gguf`'s layers, and each layer's index among them."""
    found, of_layer = [], []
    for index in range(gguf.config.num_layers):
        variant = _variant_of(gguf, index)
        if variant not in found:
            found.append(variant)
        of_layer.append(found.index(variant))
    return found, of_layer


def kernel_layout(gguf, found: list[Variant] | None = None) -> LayerLayout:
    """The layout streaming sees: one uint8 slot as large as the largest variant (of `found`, else the GGUF's)."""
    size = max(variant.layout.num_bytes for variant in found or variants(gguf)[0])
    return LayerLayout((TensorSlot(BLOB, torch.uint8, (size,), 0),), -(-size // ALIGNMENT) * ALIGNMENT)


def build_kernel_cache(gguf, path: Path, found: list[Variant], of_layer: list[int], on_status=None) -> None:
    """Repacks every layer once and writes them (atomically: a temporary file renamed into place); `found` and
    `of_layer` are variants(gguf)."""
    started = time.perf_counter()
    metadata = {"format": _format(gguf), "version": str(CACHE_VERSION),
                "variants": json.dumps([v.as_dict() for v in found]), "layer_variants": json.dumps(of_layer)}
    specs = {f"layer.{i}": (torch.uint8, (found[v].layout.num_bytes,)) for i, v in enumerate(of_layer)}
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = torch.zeros(max(v.layout.num_bytes for v in found), dtype=torch.uint8)
    with SafetensorsStreamWriter(path, specs, metadata, align=ALIGNMENT) as writer:     # layers start aligned
        for index, number in enumerate(of_layer):
            layout = found[number].layout
            raw = gguf.layer(index)
            tensors = _flat(gguf.kernel_weights(index, raw), {name: raw[name] for name in found[number].blocks})
            if [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()] != \
                    [(s.name, s.dtype, s.shape) for s in layout.slots]:
                raise ValueError(f"layer {index} repacked does not match its layout")
            layout.pack_into(buffer[:layout.num_bytes], tensors)
            writer.append(buffer[:layout.num_bytes])
    if on_status:
        mixed = f" ({len(found)} layer variants)" if len(found) > 1 else ""
        kind = "ggml's layout" if _on_ggml(gguf) else "this CPU's int4 kernel layout"
        on_status(f"GGUF layers stored in {kind} once ({path.stat().st_size / 2**20:.0f} MiB "
                  f"in {time.perf_counter() - started:.1f} s, model cache{mixed}): streamed layers skip the repack")


def _check_room(path: Path, found: list[Variant], of_layer: list[int]) -> None:
    """Refuses (OSError) a file the disk would hold with less than a tenth of its size to spare."""
    path.parent.mkdir(parents=True, exist_ok=True)
    needed = sum(found[v].layout.num_bytes for v in of_layer)
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
        self._variants, self._of_layer = self._check(*variants(gguf))
        self._layout = kernel_layout(gguf, self._variants)
        self._pools: dict[int, ggml_linear.WeightPool] = {}       # on ggml: a ring slot's weights, kept
        # on ggml the ring's slots are ggml's buffers, whose tiles it multiplies where they lie
        self.slot_buffer = ggml_linear.host_buffer if _on_ggml(gguf) else None

    def _check(self, found: list[Variant], of_layer: list[int]) -> tuple[list[Variant], list[int]]:
        """The file's variants must be those of the GGUF's layers, and each layer's bytes its variant's size."""
        meta = self._file.metadata
        try:
            if meta.get("format") != _format(self.gguf) or meta.get("version") != str(CACHE_VERSION):
                raise ValueError("not a kernel layer cache of this version")
            if json.loads(meta["variants"]) != [v.as_dict() for v in found] or \
                    json.loads(meta["layer_variants"]) != of_layer:
                raise ValueError("its layers' layouts are not this GGUF's")
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptCheckpointError(f"{self.path}: {err}") from err
        for index, number in enumerate(of_layer):
            entry = self._file.entries.get(f"layer.{index}")
            if entry is None or entry.dtype != torch.uint8 or entry.num_bytes != found[number].layout.num_bytes:
                raise CorruptCheckpointError(f"{self.path}: layer {index} is missing or of the wrong size")
        return found, of_layer

    def __getattr__(self, name: str):
        if name == "gguf":               # not yet set (a copy under construction): no recursion
            raise AttributeError(name)
        return getattr(self.gguf, name)   # globals, resident layers, status lines, keys: the GGUF's

    def layout(self, dtype: torch.dtype) -> LayerLayout:
        return self._layout

    def layer(self, index: int) -> dict[str, Tensor]:
        """A layer's stored bytes, a view into the mapped cache file (the RAM tier packs them)."""
        return {BLOB: self._file.tensor(f"layer.{index}")}

    def layer_entries(self, index: int) -> dict[str, tuple[Path, TensorEntry]]:
        entry = self._file.entries[f"layer.{index}"]
        return {BLOB: (self.path, TensorEntry(BLOB, torch.uint8, (entry.num_bytes,), entry.start, entry.end))}

    def kernel_layer(self, index: int, stored: dict[str, Tensor] | None, dtype: torch.dtype,
                     shared: bool = False, in_slot: bool = False) -> dict:
        """A streamed layer's Int4Weights (or GgmlWeights, kept per ring slot) as views of its stored bytes
        (nothing repacked), its other tensors decoded from their blocks; a resident one (stored None) repacked
        from the GGUF into memory of its own."""
        if stored is None:
            return self.gguf.kernel_layer(index, None, dtype)
        variant = self._variants[self._of_layer[index]]
        views = variant.layout.views(stored[BLOB][:variant.layout.num_bytes])
        if self.slot_buffer is not None:
            pool = ggml_linear.slot_pool(self._pools, stored[BLOB])
            weights = {name: pool.tiles(name, views[name], qtype, (num_out, num_in))
                       for name, num_out, num_in, qtype, _ in variant.weights}
        else:
            weights = {name: packed_linear.Int4Weight(views[f"{name}.codes"], views[f"{name}.scale_zeros"],
                                                      (num_out, num_in), repeat, bool(interleave))
                       for name, num_out, num_in, repeat, interleave in variant.weights}
        return {**self.gguf.decode_blocks(index, {name: views[name] for name in variant.blocks}, dtype, shared),
                **weights}

    def decode_layer(self, index: int, stored: dict[str, Tensor], dtype: torch.dtype, shared: bool = False) -> dict:
        """The layer dense (a long prompt's rows): decoded from the GGUF's blocks."""
        return self.gguf.decode_layer(index, self.gguf.layer(index), dtype, shared)

    def close(self) -> None:
        self._file.close()


def open_kernel_cache(gguf, root: Path, on_status=None) -> KernelCachedSource | None:
    """The GGUF's layers from the kernel cache (made where missing or damaged); None where it cannot be (the
    layers then repack per pass, and a status line says why)."""
    path, (found, of_layer) = kernel_cache_path(gguf, root), variants(gguf)
    for attempt in range(2):
        try:
            if attempt or not path.is_file():
                _check_room(path, found, of_layer)
                build_kernel_cache(gguf, path, found, of_layer, on_status)
            return KernelCachedSource(gguf, path)
        except (OSError, ValueError) as err:        # CorruptCheckpointError is a ValueError: made again, once
            error = err
    if on_status:
        on_status(f"streamed layers repack per pass: the kernel layer cache could not be stored ({error})")
    return None
