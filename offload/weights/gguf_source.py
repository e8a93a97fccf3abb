"""A GGUF file run in place: a WeightSource whose decoder layers are the file's raw GGUF blocks.

The file is memory-mapped, never converted. One layer's tensors are laid out as uint8 slots of one
packed buffer (each slot as large as that tensor's largest encoding over all layers: a Q4_K_M file mixes
Q4_K and Q6_K), so the RAM tier holds a layer's blocks as they are in the file and the disk tier reads
them with one pread per tensor. The ring moves the packed buffer to the compute device, where
`decode_layer` dequantizes it (gguf_blocks, bit-exact to gguf.quants in float32) just before its use into
one workspace every such layer reuses (with a decoder thread decoding ahead: one per ring slot). Layers
the planner keeps on the device are decoded once at load (`dense_layer`), the globals too, or kept packed
and decoded at each use into that same workspace.

llama.cpp stores the q/k rows of llama-family heads with the two rotary halves interleaved; the
loader's order has them one after the other. A matrix's GGUF blocks run along its rows, so the rows are
put back in order on the packed bytes (a copy of the small packed rows) before decoding: the same values
as permuting the decoded rows, as the import does."""
from __future__ import annotations

import math
import mmap
from collections import Counter
from pathlib import Path

import torch
from torch import Tensor

from offload.model.config import ModelConfig
from offload.weights.gguf_blocks import dequantize
from offload.weights.gguf_header import CorruptGgufError, GgufTensorInfo, read_header
from offload.weights.gguf_model import check_model_metadata
from offload.weights.gguf_names import (GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES, PERMUTED_LAYER_NAMES,
                                        SUPPORTED_GGUF_ARCHITECTURES)
from offload.weights import ggml_linear, packed_linear
from offload.weights.packing import ALIGNMENT, LayerLayout, TensorSlot
from offload.weights.safetensors_io import TensorEntry
from offload.weights.source import layer_tensor_names


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical layer name -> its torch shape under `config`."""
    hidden, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    return {"input_norm": (hidden,), "post_norm": (hidden,), "q": (q, hidden), "k": (kv, hidden),
            "v": (kv, hidden), "o": (hidden, q), "gate": (inter, hidden), "up": (inter, hidden),
            "down": (hidden, inter), "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,),
            "q_norm": (config.head_dim,), "k_norm": (config.head_dim,)}


class GgufSource:
    """The WeightSource of one GGUF file (see the module docstring); every check runs at open."""

    def __init__(self, path: str | Path, config: ModelConfig) -> None:
        self.path, self.config = Path(path), config
        header = read_header(self.path)
        arch = check_model_metadata(header)
        self._tensors = header.tensors
        permuted = SUPPORTED_GGUF_ARCHITECTURES[arch]
        self._heads = {"heads": config.num_heads, "kv_heads": config.num_kv_heads} if permuted else {}
        self._layers = [self._layer_infos(i) for i in range(config.num_layers)]
        self._globals = self._global_infos()
        self._layout = self._packed_layout()
        self.kernel = packed_linear           # the CPU's product of a GGUF's blocks: torch's int4 kernel, or ggml's
        self._ggml_pools: dict[int, ggml_linear.WeightPool] = {}     # ring slot (its storage) -> its ggml weights
        with open(self.path, "rb") as handle:   # copy-on-write: tensors are views, the file is never written
            self._map = mmap.mmap(handle.fileno(), header.file_size, access=mmap.ACCESS_COPY)
        self._workspaces: dict[tuple, dict[str, Tensor]] = {}   # the shared one per device, one per ring slot

    def _info(self, gguf_name: str, shape: tuple[int, ...] | None) -> GgufTensorInfo:
        info = self._tensors.get(gguf_name)
        if info is None:
            raise CorruptGgufError(f"{self.path}: tensor {gguf_name!r} is missing")
        if shape is not None and info.shape != shape:
            raise CorruptGgufError(f"{self.path}: tensor {gguf_name!r} has shape {list(info.shape)}; the metadata "
                                   f"implies {list(shape)}")
        return info

    def _layer_infos(self, index: int) -> dict[str, GgufTensorInfo]:
        shapes = expected_shapes(self.config)
        infos = {name: self._info(f"blk.{index}.{GGUF_LAYER_NAMES[name]}", shapes[name])
                 for name in layer_tensor_names(self.config)}
        for name, info in infos.items():
            heads = self._num_heads(name)
            if heads and info.shape[0] % (2 * heads):
                raise CorruptGgufError(f"{self.path}: tensor {info.name!r}: {info.shape[0]} rows do not split into "
                                       f"{heads} rotary heads")
        return infos

    def _global_infos(self) -> dict[str, GgufTensorInfo]:
        names = ["embed", "norm"] + ([] if self.config.tie_word_embeddings else ["lm_head"])
        infos = {name: self._info(GGUF_GLOBAL_NAMES[name], None) for name in names}
        for name, info in infos.items():
            if info.shape[-1] != self.config.hidden_size:
                raise CorruptGgufError(f"{self.path}: tensor {info.name!r} has shape {list(info.shape)}; the metadata "
                                       f"implies a last dimension of {self.config.hidden_size}")
        return infos

    def _num_heads(self, name: str) -> int:
        kind = PERMUTED_LAYER_NAMES.get(name)
        return self._heads.get(kind, 0) if kind else 0

    def _packed_layout(self) -> LayerLayout:
        slots, offset = [], 0
        for name in layer_tensor_names(self.config):
            size = max(layer[name].num_bytes for layer in self._layers)
            slots.append(TensorSlot(name, torch.uint8, (size,), offset))
            offset += -(-size // ALIGNMENT) * ALIGNMENT
        return LayerLayout(tuple(slots), offset)

    def _raw(self, info: GgufTensorInfo) -> Tensor:
        """[num_bytes] uint8, a view into the mapped file."""
        return torch.frombuffer(memoryview(self._map)[info.start:info.start + info.num_bytes], dtype=torch.uint8)

    # WeightSource ---------------------------------------------------------------------------------
    def global_tensors(self) -> dict[str, Tensor]:
        """Decoded once, in the dtype the import would store (fp32 up to 1B parameters, else bf16)."""
        dtype = torch.bfloat16 if self.config.torch_dtype == "bfloat16" else torch.float32
        return {name: dequantize(self._raw(info), info.qtype, info.shape, dtype) for name, info in self._globals.items()}

    def global_numels(self) -> dict[str, int]:
        """Each global's element count, read from the header (nothing decoded)."""
        return {name: math.prod(info.shape) for name, info in self._globals.items()}

    def layer(self, index: int) -> dict[str, Tensor]:
        """A layer's raw blocks, views into the mapped file (the RAM tier packs them)."""
        return {name: self._raw(info) for name, info in self._layers[index].items()}

    def layer_entries(self, index: int) -> dict[str, tuple[Path, TensorEntry]]:
        return {name: (self.path, TensorEntry(info.name, torch.uint8, (info.num_bytes,), info.start,
                                              info.start + info.num_bytes))
                for name, info in self._layers[index].items()}

    def layout(self, dtype: torch.dtype) -> LayerLayout:
        return self._layout

    def decode_layer(self, index: int, stored: dict[str, Tensor], dtype: torch.dtype,
                     shared: bool = False) -> dict[str, Tensor]:
        """A packed layer (a ring slot's, or a resident one) -> dense tensors in `dtype`. `shared`: written into
        the one workspace on its device that every layer decoded just before its use shares (valid until the
        next such decode); else into the workspace of the ring slot holding `stored` (valid until the slot
        holds its next layer, which the ring never loads before this one is released)."""
        return self._decode(index, stored, self._workspace(stored, dtype, shared, tuple(self._layers[index])))

    def _workspace(self, stored: dict[str, Tensor], dtype: torch.dtype, shared: bool,
                   names: tuple[str, ...]) -> dict[str, Tensor]:
        first = next(iter(stored.values()))
        # a ring slot's workspace is keyed by the slot's buffer (its storage), wherever in it the layer lies
        key = ("shared", first.device, dtype) if shared else (first.untyped_storage().data_ptr(), dtype)
        workspace = self._workspaces.get(key + names)
        if workspace is None:
            workspace = self._workspaces[key + names] = self._empty_layer(first.device, dtype, names)
        return workspace

    def file_paths(self) -> list[Path]:
        return [self.path]

    # decoding -------------------------------------------------------------------------------------
    def dense_layer(self, index: int, device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
        """A layer decoded into fresh tensors on `device` (resident layers, quantization)."""
        raw = {name: t.to(device) for name, t in self.layer(index).items()}
        return self._decode(index, raw, self._empty_layer(device, dtype, tuple(self._layers[index])))

    def dense_layer_bytes(self, dtype: torch.dtype) -> int:
        """One layer decoded in `dtype`: a resident layer's bytes, and a ring slot's workspace."""
        return sum(math.prod(info.shape) for info in self._layers[0].values()) * dtype.itemsize

    def _empty_layer(self, device: torch.device, dtype: torch.dtype, names: tuple[str, ...]) -> dict[str, Tensor]:
        return {name: torch.empty(self._layers[0][name].shape, dtype=dtype, device=device) for name in names}

    def _rows(self, name: str, info: GgufTensorInfo, stored: Tensor) -> Tensor:
        """A matrix's raw blocks with its rows in the loader's order."""
        raw, heads = stored[:info.num_bytes], self._num_heads(name)
        return unpermute_rows(raw, info.shape[0], heads) if heads and len(info.shape) == 2 else raw

    def _decode(self, index: int, stored: dict[str, Tensor], out: dict[str, Tensor]) -> dict[str, Tensor]:
        """Decodes the tensors `out` names into it."""
        for name in out:
            info, heads = self._layers[index][name], self._num_heads(name)
            raw = self._rows(name, info, stored[name])
            dequantize(raw, info.qtype, info.shape, out[name].dtype, out=out[name])
            if heads and len(info.shape) == 1:
                out[name].copy_(unpermute_rows(out[name].clone(), info.shape[0], heads))
        return dict(out)

    def type_counts(self) -> Counter:
        """GGML type name -> how many of the tensors this source reads have it."""
        infos = [*self._globals.values(), *(info for layer in self._layers for info in layer.values())]
        return Counter(info.type_name for info in infos)

    def describe(self) -> str:
        counts = ", ".join(f"{name} x{count}" for name, count in self.type_counts().most_common())
        return f"GGUF in place: {counts} ({self.path.name})"

    def packed_bytes(self) -> int:
        """Bytes of all decoder layers as stored (what one pass streams when every layer streams)."""
        return sum(info.num_bytes for layer in self._layers for info in layer.values())

    # the CPU's packed product (packed_linear: torch's int4 kernel; ggml_linear: ggml's) ---------------------
    def use_ggml(self) -> None:
        """Multiplies on the CPU through ggml's kernels from the blocks in place (GgmlMissingError without it)."""
        ggml_linear.ggml()
        self.kernel = ggml_linear

    def suits_ggml(self) -> bool:
        """Whether most of the layers' matrix bytes are of the types ggml repacks into its tiles (Q4_0, Q4_K), where
        its products beat the int4 kernel's (docs/gguf.md "ggml's own kernels")."""
        matrices = [info for layer in self._layers for info in layer.values() if len(info.shape) == 2]
        tiled = sum(info.num_bytes or 0 for info in matrices if info.qtype in ggml_linear.REPACKED)
        return 2 * tiled > sum(info.num_bytes or 0 for info in matrices)

    def kernel_split(self, index: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Layer `index`'s tensor names: (the matrices the int4 kernel takes, the rest: decoded before use)."""
        infos = self._layers[index]
        kernel = tuple(name for name, info in infos.items() if self.kernel.takes(info.qtype, info.shape))
        return kernel, tuple(name for name in infos if name not in kernel)

    def kernel_layer(self, index: int, stored: dict[str, Tensor] | None, dtype: torch.dtype,
                     shared: bool = False, in_slot: bool = False) -> dict:
        """A layer for the CPU: the matrices the int4 kernel takes repacked from their blocks (Int4Weight, made
        anew: no dense copy), the rest decoded as decode_layer does. stored None: read from the file, the rest
        decoded into fresh tensors (a resident layer; ggml's matrices copied out of the mapped file, which the
        page cache could drop)."""
        kernel, rest = self.kernel_split(index)
        resident = stored is None
        if resident:
            stored = self.layer(index)
            layer = self._decode(index, stored, self._empty_layer(torch.device("cpu"), dtype, rest))
        else:
            layer = self.decode_blocks(index, {name: stored[name] for name in rest}, dtype, shared)
        return {**layer, **self.kernel_weights(index, stored, in_slot, own=resident)}

    def kernel_specs(self, index: int) -> dict[str, tuple[None, int, tuple[int, int]]]:
        """Layer `index`'s kernel matrices as from_gguf_layer takes them, without their blocks: name -> (None, GGUF
        type, shape)."""
        infos = self._layers[index]
        return {name: (None, infos[name].qtype, infos[name].shape) for name in self.kernel_split(index)[0]}

    def kernel_weights(self, index: int, stored: dict[str, Tensor], in_slot: bool = False, own: bool = False) -> dict:
        """Layer `index`'s kernel matrices repacked from their raw blocks in `stored` (q/k/v, gate/up fused).
        in_slot: `stored` lies in a ring slot, whose ggml weights are kept and refilled pass after pass; own: ggml
        weights copy blocks they would read in place (out of the mapped file, which the page cache could drop)."""
        infos = self._layers[index]
        matrices = {name: (self._rows(name, infos[name], stored[name]), infos[name].qtype, infos[name].shape)
                    for name in self.kernel_split(index)[0]}
        if self.kernel is not ggml_linear:
            return self.kernel.from_gguf_layer(matrices)
        pool = ggml_linear.slot_pool(self._ggml_pools, next(iter(stored.values()))) if in_slot else None
        return ggml_linear.from_gguf_layer(matrices, pool, own)

    def decode_blocks(self, index: int, blocks: dict[str, Tensor], dtype: torch.dtype,
                      shared: bool = False) -> dict[str, Tensor]:
        """Some of layer `index`'s tensors decoded from their raw blocks into a workspace (decode_layer's)."""
        if not blocks:
            return {}
        return self._decode(index, blocks, self._workspace(blocks, dtype, shared, tuple(blocks)))

    def kernel_layer_meta(self, dtype: torch.dtype, index: int = 0) -> dict:
        """Layer `index`'s kernel_layer on the "meta" device: its tensors' names, shapes and dtypes, nothing
        repacked."""
        infos, (kernel, rest) = self._layers[index], self.kernel_split(index)
        return {**{name: torch.empty(infos[name].shape, dtype=dtype, device="meta") for name in rest},
                **self.kernel.empty_layer({name: (infos[name].qtype, infos[name].shape) for name in kernel}, "meta")}

    def block_bytes(self, index: int, name: str) -> int:
        """Bytes of layer `index`'s tensor `name` as stored in the file."""
        return self._layers[index][name].num_bytes

    def kernel_head(self) -> packed_linear.Int4Head | None:
        """The output matrix (lm_head, else the tied embedding) for the int4 kernel, or None if it takes not."""
        info = self._globals.get("lm_head", self._globals["embed"])
        if not self.kernel.takes(info.qtype, info.shape):
            return None
        weight = self.kernel.from_gguf(self._raw(info), info.qtype, info.shape)
        raw = weight.raw if self.kernel is ggml_linear else self._raw(info)     # ggml's: the blocks it multiplies
        return packed_linear.Int4Head(weight, raw.view(info.shape[0], -1), info.qtype)

    def kernel_head_bytes(self, dtype: torch.dtype) -> int:
        """What the packed output matrix adds to the dense globals (a dense lm_head it replaces subtracted)."""
        info = self._globals.get("lm_head", self._globals["embed"])
        if not self.kernel.takes(info.qtype, info.shape):
            return 0
        replaced = math.prod(info.shape) * dtype.itemsize if "lm_head" in self._globals else 0
        return self.kernel.kernel_bytes(info.qtype, info.shape) - replaced

    def kernel_layer_bytes(self, dtype: torch.dtype) -> int:
        """The most bytes a layer holds for the CPU's kernel (its other tensors decoded in `dtype`)."""
        return max(sum(self.kernel.kernel_bytes(info.qtype, info.shape) if self.kernel.takes(info.qtype, info.shape)
                       else math.prod(info.shape) * dtype.itemsize for info in layer.values()) for layer in self._layers)

    def kernel_summary(self) -> str:
        """The status line of a CPU run on the int4 kernel: which matrices it multiplies, which are decoded."""
        head = self._globals.get("lm_head", self._globals["embed"])
        matrices = [head] + [info for layer in self._layers for info in layer.values() if len(info.shape) == 2]
        taken = Counter(info.type_name for info in matrices if self.kernel.takes(info.qtype, info.shape))
        decoded = Counter(info.type_name for info in matrices if not self.kernel.takes(info.qtype, info.shape))
        line = "CPU ggml kernels: " if self.kernel is ggml_linear else "CPU packed int4 kernel: "
        line += ", ".join(f"{n} x{c}" for n, c in taken.most_common()) or "no matrix"
        line += ("; decoded to dense (the kernel takes not): " + ", ".join(
            f"{n} x{c}" for n, c in decoded.most_common()) if decoded else "")
        if self.kernel is packed_linear and self.suits_ggml() and not ggml_linear.available():
            line += "; ggml's kernels would be faster on these types: pip install llama-cpp-python"
        return line


class DenseGgufLayers:
    """A GgufSource read as dense fp32 tensors on the CPU, one layer at a time (the quantizer's view)."""

    def __init__(self, source: GgufSource) -> None:
        self.source, self.config = source, source.config

    def global_tensors(self) -> dict[str, Tensor]:
        return self.source.global_tensors()

    def layer(self, index: int) -> dict[str, Tensor]:
        return self.source.dense_layer(index, torch.device("cpu"), torch.float32)

    def file_paths(self) -> list[Path]:
        return self.source.file_paths()


def unpermute_rows(values: Tensor, num_rows: int, num_heads: int) -> Tensor:
    """[num_rows * row_size] (bytes or values) in llama.cpp's q/k row order -> a contiguous copy in the
    loader's: within a head, rows [D/2, 2] (rotary pairs interleaved) become [2, D/2] (halves apart)."""
    half = num_rows // num_heads // 2
    return values.view(num_heads, half, 2, -1).transpose(1, 2).reshape(-1)
