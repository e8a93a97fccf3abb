"""SpQR w4 matrices with groups of 32 multiplied as stored on the CPU, by torch's int4 kernel
(offload/weights/packed_linear.py: w = (q - 8) * scale + zero per group of 32, bf16 scales and zeros),
their outliers added sparsely after it.

A group's statistics, decoded from their second level once per layer (decode_statistics), map exactly:

    SpQR    Q[r, c] = (code - zero) * scale              (c in permuted order; scale, zero of row r, group c // 32)
    kernel  w[r, c] = (code - 8) * scale + (8 - zero) * scale

so the codes go in as they are, with scale `scale` and zero `(8 - zero) * scale`, both rounded to bf16. An outlier
keeps its grid code, which the kernel multiplies too; the sparse part adds what the outlier differs by from the
kernel's own weight there, in fp32 on the kernel's output (rounded to bf16 and cast back to x's dtype):

    y = x[..., perm] @ w^T + x[..., perm] @ D^T,   D [N, K]: D[r, c] = outlier[r, c] - w[r, c], nnz = outliers

D is added by one index_add_ over its nonzeros (measured faster than a torch sparse CSR product at the default
model's 0.02% outlier share: bench/results/spqr_packed_cpu.json). Both parts compute each output row alone (the
kernel's rows; index_add_ adds a row's terms in the same order whatever the rows beside it), so a tree pass gives
every row a one-token pass's bits.

The output matrix, stored unquantized, is rounded to Q8_0 blocks (d = max |w| / 127 per 32, in fp16; lossless on the
default model, whose tied embedding was Q8_0) and multiplied as packed_linear's Int4Head does: two int4 products,
then the likely tokens' logits recomputed in float64 from those blocks (a dense fp32 head is not row-exact: its
one-row and many-row products round differently). Bits and group sizes the kernel cannot take (w3, groups of 16)
keep SpqrLinear's dequantize-then-multiply (takes())."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from offload.weights.ggml_types import GGMLType
from offload.weights.packed_linear import FUSED, GROUP, ROW_MULTIPLE, Int4Head, Int4Weight, from_gguf, pack_codes
from offload.weights.packed_linear import _ROW_BLOCK, kernel_bytes as int4_bytes
from .packbits import unpack
from .spqr_format import SpqrLinear, SpqrMatrix, Statistics, decode_statistics, packed_linears

KERNEL_BITS = 4


def takes(bits: int, groupsize: int, shape: tuple[int, int]) -> bool:
    """Whether an SpQR matrix of these settings and (out, in) shape multiplies on the int4 kernel."""
    return bits == KERNEL_BITS and groupsize == GROUP and shape[0] % ROW_MULTIPLE == 0


@dataclass(slots=True)
class SpqrInt4Weight:
    """A [N, K] SpQR matrix (or q/k/v, gate/up stacked along N) for the int4 kernel; layers.linear calls matmul."""
    weight: Int4Weight          # codes and group statistics, columns in permuted order
    perm: Tensor | None         # [K] int64: input column held by each permuted column; None: input order
    outlier_rows: Tensor        # [nnz] int64 output row of each outlier
    outlier_cols: Tensor        # [nnz] int64 its permuted input column
    outlier_deltas: Tensor      # [nnz] float32: the outlier minus the kernel's weight at its place
    is_row_exact = True         # a row's result never depends on the other rows (the layer attends to match)

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    def matmul(self, x: Tensor) -> Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        num_out, num_in = self.shape
        if self.perm is not None:
            x = x[..., self.perm]                                                  # [..., K] permuted
        out = self.weight.matmul(x)                                                # [..., N] a fresh tensor
        if self.outlier_rows.numel():
            terms = x.reshape(-1, num_in).index_select(1, self.outlier_cols).mul_(self.outlier_deltas)  # [M, nnz]
            out.view(-1, num_out).index_add_(1, self.outlier_rows, terms.to(out.dtype))
        return out

    @property
    def nbytes(self) -> int:
        parts = (self.outlier_rows, self.outlier_cols, self.outlier_deltas) + (() if self.perm is None else (self.perm,))
        return self.weight.nbytes + sum(t.numel() * t.element_size() for t in parts)


def kernel_bytes(shape: tuple[int, int], num_outliers: int, is_permuted: bool) -> int:
    """Bytes a SpqrInt4Weight of this matrix holds: half a byte of code and 1/8 byte of bf16 scale and zero per
    weight, 20 bytes per outlier, 8 per permuted column."""
    num_out, num_in = shape
    return num_out * num_in // 2 + num_out * num_in // GROUP * 4 + 20 * num_outliers + 8 * num_in * is_permuted


def from_spqr_layer(matrices: dict[str, SpqrMatrix], dtype: torch.dtype) -> dict[str, SpqrInt4Weight | SpqrLinear]:
    """A layer's matrices -> SpqrInt4Weights for those the kernel takes, q/k/v and gate/up stacked into one each
    ("qkv", "gate_up") where all are taken and share their input permutation; SpqrLinears (today's decode) for
    the rest."""
    taken = {name: m for name, m in matrices.items() if takes(m.bits, m.groupsize, m.shape)}
    weights: dict = packed_linears({n: m for n, m in matrices.items() if n not in taken}, dtype) \
        if len(taken) < len(matrices) else {}
    if not taken:
        return weights
    statistics = dict(zip(taken, decode_statistics(list(taken.values()))))
    done = set()
    for name, parts in FUSED.items():
        if all(p in taken for p in parts) and _same_permutation([taken[p] for p in parts]):
            weights[name] = _int4([taken[p] for p in parts], [statistics[p] for p in parts])
            done.update(parts)
    weights.update({n: _int4([m], [statistics[n]]) for n, m in taken.items() if n not in done})
    return weights


def _same_permutation(matrices: list[SpqrMatrix]) -> bool:
    first = matrices[0]
    return all(m.shape[1] == first.shape[1] and m.perm.numel() == first.perm.numel() and torch.equal(m.perm, first.perm)
               for m in matrices[1:])


def _int4(matrices: list[SpqrMatrix], statistics: list[Statistics]) -> SpqrInt4Weight:
    """Matrices sharing their input columns (and permutation), stacked along N -> one SpqrInt4Weight."""
    num_in = matrices[0].shape[1]
    raw = torch.cat([m.codes for m in matrices])                                   # [N * K / 2] the stack's code bytes
    num_out = raw.numel() * 2 // num_in
    scale = torch.cat([s for s, _ in statistics])                                  # [N, K / 32] float32
    zero = (8 - torch.cat([z for _, z in statistics])) * scale
    scale_zeros = torch.stack((scale.t(), zero.t()), dim=-1).to(torch.bfloat16)    # [K / 32, N, 2]
    weight = Int4Weight(repack_codes(raw, num_out, num_in), scale_zeros, (num_out, num_in))
    rows, cols, values = _outliers(matrices)
    codes = raw[rows * (num_in // 2) + cols // 2].bitwise_right_shift(4 * (cols % 2)) & 15     # [nnz]
    kernel = (codes.float() - 8) * scale_zeros[cols // GROUP, rows, 0].float() \
        + scale_zeros[cols // GROUP, rows, 1].float()                              # [nnz] the kernel's weights
    perm = matrices[0].perm.long() if matrices[0].is_permuted else None
    return SpqrInt4Weight(weight, perm, rows, cols, values - kernel)


def repack_codes(raw: Tensor, num_rows: int, width: int) -> Tensor:
    """SpQR's 4-bit code bytes [N * K / 2] (row-major, two columns per byte, the even one in the low nibble) ->
    [N, K / 2], what pack_codes makes of the unpacked codes, without unpacking them: in a whole row block of the
    running CPU's layout a byte pairs column k of rows r and r + block / 2, so it takes one nibble from each of two
    input bytes (the rows' bytes j = k // 2). Other rows (a last partial block, another dispatch) go by pack_codes."""
    packed = torch.empty(num_rows, width // 2, dtype=torch.uint8)
    block = _ROW_BLOCK.get(torch.backends.cpu.get_cpu_capability(), num_rows + 1)
    full = num_rows // block * block
    if full:
        lanes = raw[:full * width // 2].view(-1, 2, block // 32, 16, width // 2)      # [blocks, low/high, pairs, 16, K/2]
        low, high = lanes.unbind(1)
        out = packed[:full].view(-1, width // 2, 2, block // 32, 16)               # [blocks, K/2, even/odd, pairs, 16]
        out[:, :, 0] = ((low & 0x0F) | (high << 4)).permute(0, 3, 1, 2)          # columns 2j
        out[:, :, 1] = ((low >> 4) | (high & 0xF0)).permute(0, 3, 1, 2)          # columns 2j + 1
    if full < num_rows:
        rest = unpack(raw[full * width // 2:], KERNEL_BITS, (num_rows - full) * width).view(-1, width)
        pack_codes(rest, out=packed[full:])
    return packed


def _outliers(matrices: list[SpqrMatrix]) -> tuple[Tensor, Tensor, Tensor]:
    """Stacked matrices' outliers -> (rows [nnz] int64 in the stack, permuted columns [nnz] int64, values fp32)."""
    rows, offset = [], 0
    for m in matrices:
        counts = m.outlier_rows.diff().long()                                      # [out] outliers per row
        rows.append(torch.repeat_interleave(torch.arange(m.shape[0]), counts, output_size=m.num_outliers) + offset)
        offset += m.shape[0]
    return (torch.cat(rows), torch.cat([m.outlier_cols.long() for m in matrices]),
            torch.cat([m.outlier_values.float() for m in matrices]))


@dataclass(slots=True)
class Q8Head(Int4Head):
    """Int4Head over Q8_0 blocks made at load (not a view of a mapped file): its bytes count the blocks too."""

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.raw.numel()


def output_head(weight: Tensor) -> Q8Head | None:
    """The output matrix [V, K] as a Q8_0 Int4Head, or None where the kernel takes not its shape."""
    shape = tuple(weight.shape)
    if shape[0] % ROW_MULTIPLE or shape[1] % GROUP:
        return None
    raw = q8_0_blocks(weight)                                                      # [V * K / 32 * 34] uint8
    return Q8Head(from_gguf(raw, GGMLType.Q8_0, shape), raw.view(shape[0], -1), GGMLType.Q8_0)


def head_bytes(shape: tuple[int, int]) -> int:
    """Q8Head.nbytes of a [V, K] output matrix: the kernel's codes and statistics, and the Q8_0 blocks."""
    return int4_bytes(GGMLType.Q8_0, shape) + shape[0] * shape[1] // GROUP * (2 + GROUP)


def q8_0_blocks(weight: Tensor) -> Tensor:
    """[..., K] float -> GGUF Q8_0 blocks (fp16 d = max |w| / 127, then int8 q = round(w / d) per 32), uint8 bytes."""
    blocks = weight.float().reshape(-1, GROUP)                                     # [n, 32]
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half()                         # [n, 1]
    q = torch.round(blocks / d.float().clamp(min=torch.finfo(torch.float16).tiny)).clamp(-127, 127)
    return torch.cat([d.view(torch.uint8), q.to(torch.int8).view(torch.uint8)], dim=1).reshape(-1)
