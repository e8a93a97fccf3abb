"""GGUF matrices multiplied by ggml's own CPU kernels (`--cpu-kernel ggml`).

torch's int4 kernel (packed_linear) reads 5 bits a weight and, from RAM, is slower than the products llama.cpp
runs on Q4_0/Q4_K blocks repacked into ggml's interleaved tiles: a 1B token's products took 34.6 / 33.8 / 38.7 ms
on the int4 kernel against 24.7 / 22.1 / 22.8 ms repacked (Q4_0 / Q4_K / Q4_K_M, 2 cores; ggml's plain layout is
no faster than the int4 kernel; bench/results/cpu_products_vs_ggml.json). This module calls those products
through the libggml that llama-cpp-python installs (ggml_lib.py: ctypes, no build here): Q4_0 and Q4_K
matrices are copied into ggml's repack buffer, the other types are read where they lie (a view of the mapped
file, or of a ring slot), and each product is a one-node ggml graph on ggml's CPU backend over torch's own x
and y. Streamed, the kernel layer cache (kernel_cache.py) holds each layer as ggml multiplies
it (stored_bytes: a repacked weight's tiles) and the ring's slots are ggml's own buffers (host_buffer), so a
streamed layer is multiplied where it was read (from_tiles), its slot's weights and graphs kept (WeightPool).

Row-exact (a row's bits never depend on the rows beside it: speculation stays exact, layers.py): measured on
this build, Q4_0 (repacked), Q4_1, Q5_0, Q5_1 and Q8_0 products give every row a one-row product's bits at any
row count; plain K-quants switch kernels from 8 rows and repacked Q4_K from 4, so those multiply at most
ROWS_PER_CALL rows a call, except prompt chunks (matmul_whole). One layout per type in every tier: repacked and
plain Q4_0 differ in their bits. tests/test_ggml_linear.py checks all of it against one-row products.
"""
from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from offload.disk_reads import DIRECT_ALIGN
from offload.weights.ggml_types import GGMLType as T
from offload.weights.gguf_blocks import packed_nbytes
from offload.weights.ggml_lib import (ALIGN, LIBRARY_ENV, Ggml, GgmlMissingError, Product, available,  # noqa: F401
                                       ggml, library_dir, loaded)
from offload.weights.packed_linear import FUSED

GGML_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
REPACKED = (T.Q4_0, T.Q4_K)   # kept in ggml's interleaved tiles (its repack buffer), as llama.cpp keeps them
_TAKEN, _REPACKED = frozenset(map(int, GGML_TYPES)), frozenset(map(int, REPACKED))
# rows per call that keep a one-row product's bits: K-quants switch kernels from 8 rows, repacked Q4_K from 4
ROWS_PER_CALL = {T.Q4_K: 3, T.Q5_K: 7, T.Q6_K: 7}
KEPT_ROWS = 8             # products of up to this many rows are built once per weight and kept


@dataclass(eq=False)
class GgmlWeight:
    """A [N, K] GGUF matrix multiplied from its blocks by ggml; `linear` (offload/model/layers.py) calls matmul."""
    raw: Tensor              # uint8 [N * row bytes], the blocks in place (kept alive while ggml reads them)
    qtype: int
    shape: tuple[int, int]   # (N, K)
    owns: bool = False       # raw is this weight's own copy (stacked blocks): refill copies new blocks into it
    tiles: bool = False      # raw lies in a host_buffer and holds the bytes as ggml multiplies them (stored_bytes)
    _context: int = field(default=0, repr=False)
    _buffer: int = field(default=0, repr=False)
    _tensor: int = field(default=0, repr=False)
    _products: dict = field(default_factory=dict, repr=False)
    is_row_exact = True

    def __post_init__(self) -> None:
        num_out, num_in = self.shape
        if self.raw.numel() != packed_nbytes(self.qtype, self.shape):
            raise ValueError(f"{T(self.qtype).name} {self.shape} needs {packed_nbytes(self.qtype, self.shape)} "
                             f"bytes, got {self.raw.numel()}")
        if not self.repacked and (self.raw.data_ptr() % ALIGN or not self.raw.is_contiguous()):
            self.raw, self.owns = _aligned_copy(self.raw), True
        lib = ggml()
        self._context = lib.context(lib.weight_context_bytes)
        self._tensor = lib.new_2d(self._context, int(self.qtype), num_in, num_out)
        if lib.nbytes(self._tensor) != self.raw.numel():
            raise ValueError(f"ggml sizes {T(self.qtype).name} {self.shape} at {lib.nbytes(self._tensor)} bytes, "
                             f"the file at {self.raw.numel()}")
        if self.tiles:                # ggml's bytes already, in a buffer of its repack type: placed, not repacked
            self._place_in_host_buffer(lib)
        elif self.repacked:     # ggml's own buffer: the blocks copied into its tiles
            self._buffer = lib.alloc_in(self._context, lib.repack_type)
            lib.tensor_set(self._tensor, self.raw.data_ptr(), 0, self.raw.numel())
        else:                         # the blocks where they are
            self._buffer = lib.place(self._tensor, self.raw.data_ptr(), self.raw.numel())

    @property
    def repacked(self) -> bool:
        return repacks(self.qtype, self.shape[0])

    def _place_in_host_buffer(self, lib: Ggml) -> None:
        start, size = self.raw.data_ptr(), self.raw.numel()
        found = next((buffer for begin, (end, buffer) in _HOST_BUFFERS.copy().items()     # (a finalizer may pop one)
                      if begin <= start and start + size <= end), None)
        if found is None or start % ALIGN or not self.raw.is_contiguous():
            raise ValueError("ggml's tiles must lie 32-byte aligned in a host_buffer")
        if lib.tensor_alloc(found, self._tensor, start) != 0:
            raise RuntimeError("ggml could not place a tensor in its own buffer")

    def stored_bytes(self) -> Tensor:
        """uint8 [nbytes]: a copy of this weight's bytes as ggml multiplies them (a repacked weight's tiles), which
        from_tiles takes back without repacking."""
        if not self.repacked or self.tiles:
            return self.raw.clone()
        data = ctypes.string_at(ggml().data(self._tensor), self.raw.numel())
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def refill(self, parts: list[Tensor]) -> bool:
        """New blocks of the same type and shape (parts stacked along N): the tensor, its buffer and its products
        stay. False where an in-place weight would have to read other memory (then make a new weight)."""
        if self.tiles:                # the tiles are read where they lie: only the same place will do
            return len(parts) == 1 and parts[0].data_ptr() == self.raw.data_ptr()
        if self.owns:                 # numpy on the calling thread: no OpenMP team of its own (host_io.copy_host)
            np.concatenate([part.numpy() for part in parts], out=self.raw.numpy())
        elif len(parts) > 1:
            return False
        elif self.repacked:
            self.raw = parts[0]
        elif parts[0].data_ptr() != self.raw.data_ptr():
            return False
        if self.repacked:
            ggml().tensor_set(self._tensor, self.raw.contiguous().data_ptr(), 0, self.raw.numel())
        return True

    def matmul(self, x: Tensor) -> Tensor:
        """x [..., K] -> x @ W^T [..., N] in x's dtype (ggml: x quantized to 8 bits per block, fp32 sums), every
        row with a one-row product's bits."""
        return self._matmul(x, whole=False)

    def matmul_whole(self, x: Tensor) -> Tensor:
        """matmul in one call whatever the rows: a K-quant row's bits then depend on the row count (prompt rows
        only, offload/weights/row_split.py)."""
        return self._matmul(x, whole=True)

    def _matmul(self, x: Tensor, whole: bool) -> Tensor:
        num_out, num_in = self.shape
        rows = x.reshape(-1, num_in)                                             # [M, K]
        count = rows.shape[0]
        step = count if whole else ROWS_PER_CALL.get(self.qtype, count)
        if count <= step:
            out = self._product(count).run(rows).clone()
        else:
            out = torch.cat([self._product(min(step, count - start)).run(rows[start:start + step]).clone()
                             for start in range(0, count, step)])
        return out.to(x.dtype).view(*x.shape[:-1], num_out)                     # [..., N]

    def _product(self, rows: int) -> Product:
        """The product for `rows` rows: kept for the few small row counts decoding and trees use, else made."""
        product = self._products.get(rows)
        if product is None:
            product = Product(ggml(), self._tensor, rows, *reversed(self.shape))
            if rows <= KEPT_ROWS:
                self._products[rows] = product
        return product

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def __del__(self) -> None:
        self._products.clear()              # their graphs point at this weight's tensor: freed first
        lib = loaded()
        if lib is not None and self._context:
            if self._buffer:
                lib.buffer_free(self._buffer)
            lib.free(self._context)
            self._context = 0


def _aligned_copy(tensor: Tensor) -> Tensor:
    """A contiguous copy whose data starts on an ALIGN boundary (torch's CPU allocator aligns to 64 bytes)."""
    copy = tensor.contiguous().clone()
    if copy.data_ptr() % ALIGN:
        raise RuntimeError("torch allocated CPU memory off a 32-byte boundary")
    return copy


def repacks(qtype: int, rows: int) -> bool:
    """Whether a GgmlWeight of this type and row count holds its own (repacked) copy of the blocks rather than
    reading them in place: ggml's tiles take 8 rows at a time."""
    return int(qtype) in _REPACKED and rows % 8 == 0 and ggml().repack_type is not None


def takes(qtype: int, shape: tuple[int, ...]) -> bool:
    """Whether ggml multiplies this GGUF tensor here: a matrix of one of GGML_TYPES."""
    return len(shape) == 2 and int(qtype) in _TAKEN


def kernel_bytes(qtype: int, shape: tuple[int, ...]) -> int:
    """Bytes a GgmlWeight holds: the file's blocks."""
    return packed_nbytes(qtype, shape)


def from_gguf(raw: Tensor, qtype: int, shape: tuple[int, int]) -> GgmlWeight:
    return GgmlWeight(raw, T(qtype), tuple(shape))


def from_tiles(raw: Tensor, qtype: int, shape: tuple[int, int]) -> GgmlWeight:
    """A weight over stored_bytes lying in a host_buffer (a ring slot read from the kernel layer cache)."""
    return GgmlWeight(raw, T(qtype), tuple(shape), tiles=True)


_HOST_BUFFERS: dict[int, tuple[int, int]] = {}     # start address -> (end address, ggml buffer) of host_buffers
# huge pages for a slot, as numpy asks for its large arrays (disk_reads.aligned_buffer): O_DIRECT reads into 4 KiB
# pages ran at two thirds of the rate (docs/streaming.md); a hint, ignored where the kernel has none
_LIBC, MADV_HUGEPAGE = ctypes.CDLL(None, use_errno=True), 14


def host_buffer(num_bytes: int) -> Tensor:
    """[num_bytes] uint8 memory of ggml's repack buffer type starting on a DIRECT_ALIGN boundary (a ring slot that
    O_DIRECT reads land in): ggml multiplies tiles stored there as they lie (from_tiles). Freed with the last
    tensor over it."""
    lib = ggml()
    buffer = lib.buffer_alloc(lib.repack_type or lib.cpu_type, num_bytes + DIRECT_ALIGN)
    if not buffer:
        raise MemoryError(f"ggml could not allocate {num_bytes} bytes")
    base = lib.buffer_base(buffer)
    start = base + (-base % DIRECT_ALIGN)
    _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(num_bytes - num_bytes % DIRECT_ALIGN), MADV_HUGEPAGE)
    memory = (ctypes.c_uint8 * num_bytes).from_address(start)
    _HOST_BUFFERS[start] = (start + num_bytes, buffer)
    weakref.finalize(memory, _free_host_buffer, start)
    return torch.frombuffer(memory, dtype=torch.uint8)


def _free_host_buffer(start: int) -> None:
    _end, buffer = _HOST_BUFFERS.pop(start)
    lib = loaded()
    if lib is not None:
        lib.buffer_free(buffer)


def from_gguf_layer(matrices: dict[str, tuple[Tensor, int, tuple[int, int]]], pool: "WeightPool | None" = None,
                    own: bool = False) -> dict[str, GgmlWeight]:
    """A layer's matrices (name -> raw blocks, GGUF type, shape) -> GgmlWeights, q/k/v and gate/up stacked into
    one each ("qkv", "gate_up": their blocks concatenated, one call and one quantized x for several) where they
    share type and width and have row counts of a multiple of 8 (ggml's tiles of rows: a stacked weight's rows
    keep the bits of the separate products'), as packed_linear stacks them. With a pool (a streamed layer's ring
    slot), the slot's weights from its earlier layers are refilled instead of made anew. own: every weight holds
    its blocks in memory of its own (a resident layer: not the mapped file, which the page cache could drop)."""
    def made(parts: list[Tensor], qtype: T, shape: tuple[int, int]) -> GgmlWeight:
        if len(parts) > 1 or (own and not repacks(qtype, shape[0])):   # (a repacked weight is ggml's own copy)
            return GgmlWeight(torch.cat(parts), qtype, shape, owns=True)
        return from_gguf(parts[0], qtype, shape)

    pool = WeightPool() if pool is None else pool      # a pool of its own: every weight made
    return {name: pool.weight(name, parts, qtype, shape, made)
            for name, (parts, qtype, shape) in stacking(matrices).items()}


def stacking(matrices: dict[str, tuple[Tensor, int, tuple[int, int]]]) -> dict[str, tuple[list[Tensor], T, tuple]]:
    """name -> (the raw blocks of its parts, type, stacked shape): q/k/v and gate/up where they stack."""
    stacked, done = {}, set()
    for name, parts in FUSED.items():
        found = [matrices[part] for part in parts if part in matrices]
        if len(found) < len(parts) or len({(qtype, shape[1]) for _, qtype, shape in found}) != 1 or \
                any(shape[0] % 8 for _, _, shape in found):
            continue
        qtype, width = found[0][1], found[0][2][1]
        stacked[name] = ([raw for raw, _, _ in found], T(qtype), (sum(shape[0] for _, _, shape in found), width))
        done.update(parts)
    stacked.update({name: ([raw], T(qtype), tuple(shape)) for name, (raw, qtype, shape) in matrices.items()
                    if name not in done})
    return stacked


class WeightPool:
    """The GgmlWeights of one ring slot, kept across passes: a streamed layer's matrices come to the same slot
    again and again, so their ggml tensors, repack buffers and product graphs are made once and refilled per
    pass (repacked tiles rewritten from the new blocks, stacked blocks copied in, in-place ones as they lie)
    instead of allocated, page-faulted and freed per layer. One variant of a layer per (name, type, shape)."""

    def __init__(self) -> None:
        self._weights: dict[tuple, GgmlWeight] = {}

    def weight(self, name: str, parts: list[Tensor], qtype: int, shape: tuple[int, int], make) -> GgmlWeight:
        """The slot's weight `name` refilled with `parts`, or make(parts, qtype, shape) where it has none that takes
        them."""
        key = (name, int(qtype), tuple(shape))
        weight = self._weights.get(key)
        if weight is None or not weight.refill(parts):
            weight = self._weights[key] = make(parts, T(qtype), tuple(shape))
        return weight

    def tiles(self, name: str, raw: Tensor, qtype: int, shape: tuple[int, int]) -> GgmlWeight:
        """The slot's weight over stored_bytes at `raw` (from_tiles), made where the slot has none there."""
        return self.weight(name, [raw], qtype, shape, lambda parts, qtype, shape: from_tiles(parts[0], qtype, shape))


def slot_pool(pools: dict[int, WeightPool], stored: Tensor) -> WeightPool:
    """The WeightPool of the ring slot whose buffer holds `stored` (keyed by its storage, as workspaces are)."""
    return pools.setdefault(stored.untyped_storage().data_ptr(), WeightPool())


def build_key() -> list:
    """What ggml's layout of a tensor depends on: the library build (its file) and the CPU it repacks for."""
    stat = (library_dir() / "libggml-cpu.so").resolve().stat()
    return ["ggml", stat.st_size, stat.st_mtime_ns, torch.backends.cpu.get_cpu_capability()]


def empty_layer(specs: dict[str, tuple[int, tuple[int, int]]], device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """The bytes from_gguf_layer holds per weight (q/k/v and gate/up stacked as it stacks them), unfilled (on
    "meta": a layer's layout without reading it)."""
    stacked = stacking({name: (None, qtype, shape) for name, (qtype, shape) in specs.items()})
    return {name: torch.empty(packed_nbytes(qtype, shape), dtype=torch.uint8, device=device)
            for name, (_, qtype, shape) in stacked.items()}
