"""The SpQR packed matrix: b-bit codes in groups of `groupsize` input columns, per-row group scale and
zero quantized again to `stats_bits` in runs of 16 rows, fp16 outliers by row (CSR), and the
act-order column permutation.

    W[:, perm] = Q,  Q[r, c] = (code[r, c] - zero[r, c // g]) * scale[r, c // g], except outliers
    scale[r, j] = (scale_code[r, j] - s_zero[r // 16, j]) * s_scale[r // 16, j]   (zero alike)

Bits per parameter: b + 2 * stats_bits / g + 64 / (16 * g) + 32 * outlier share (+ the permutation).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from offload.fused import OptionalKernel

from .packbits import pack, packed_bytes, packed_codes, unpack

FUSED = OptionalKernel("quant.spqr_triton", "SpQR")   # the Triton kernel, where it runs
STATS_RUN = 16          # rows sharing one fp16 scale/zero for the second-level statistics
PARTS = ("codes", "scale_codes", "zero_codes", "stat_params", "perm", "outlier_rows", "outlier_cols",
         "outlier_values")


@dataclass(slots=True)
class SpqrMatrix:
    shape: tuple[int, int]      # (out, in) of the dense weight
    bits: int
    groupsize: int
    stats_bits: int
    codes: Tensor               # [packed] uint8: out x in codes, columns in permuted order
    scale_codes: Tensor         # [packed] uint8: out x groups
    zero_codes: Tensor          # [packed] uint8: out x groups
    stat_params: Tensor         # [runs, groups, 4] fp16: scale's (scale, zero), zero's (scale, zero)
    perm: Tensor                # [in] int16/int32: column of W held by each permuted column; [0]: identity
    outlier_rows: Tensor        # [out + 1] int16 (int32 past 32767 outliers) CSR row pointers
    outlier_cols: Tensor        # [nnz] int16/int32 permuted column of each outlier
    outlier_values: Tensor      # [nnz] fp16 exact weights

    @property
    def is_permuted(self) -> bool:
        """False when quantized in input order (no act-order): no permutation is stored or applied."""
        return self.perm.numel() > 0

    @property
    def num_groups(self) -> int:
        return self.shape[1] // self.groupsize

    @property
    def num_outliers(self) -> int:
        return self.outlier_values.numel()

    def tensors(self, prefix: str) -> dict[str, Tensor]:
        return {f"{prefix}.{part}": getattr(self, part) for part in PARTS}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], prefix: str, shape: tuple[int, int], bits: int,
                     groupsize: int, stats_bits: int) -> "SpqrMatrix":
        parts = {part: tensors[f"{prefix}.{part}"] for part in PARTS}
        matrix = cls(shape, bits, groupsize, stats_bits, **parts)
        matrix.check(prefix)
        return matrix

    def check(self, name: str) -> None:
        """Raises ValueError when the parts do not fit the declared shape (a corrupt checkpoint)."""
        out, inp = self.shape
        runs = -(-out // STATS_RUN)
        expected = {"codes": (packed_bytes(out * inp, self.bits),),
                    "scale_codes": (packed_bytes(out * self.num_groups, self.stats_bits),),
                    "zero_codes": (packed_bytes(out * self.num_groups, self.stats_bits),),
                    "stat_params": (runs, self.num_groups, 4), "perm": (inp if self.is_permuted else 0,),
                    "outlier_rows": (out + 1,), "outlier_cols": (self.num_outliers,)}
        for part, shape in expected.items():
            if tuple(getattr(self, part).shape) != shape:
                raise ValueError(f"{name}.{part} has shape {tuple(getattr(self, part).shape)}, expected {shape}")

    @property
    def num_bytes(self) -> int:
        return sum(getattr(self, part).numel() * getattr(self, part).element_size() for part in PARTS)

    def dequantize(self, dtype: torch.dtype = torch.float32, permuted: bool = False,
                   fused: bool | None = None, statistics: Statistics | None = None) -> Tensor:
        """-> [out, in] dense weight on the parts' device (with `permuted`, its columns in the stored
        order: W[:, perm], which a caller multiplies with x[..., perm] to skip un-permuting). `fused`:
        the Triton kernel (None: on CUDA when Triton is installed), else vectorised torch, which takes
        the group statistics from `statistics` when given (decode_statistics)."""
        if fused is None:
            weight = _try_fused(self, dtype) if uses_fused_kernel(self) else None
            weight = self._dequantize_torch(dtype, statistics) if weight is None else weight
        else:
            weight = (FUSED.module.dequantize_permuted(self, dtype, STATS_RUN) if fused
                      else self._dequantize_torch(dtype, statistics))
        if self.num_outliers:
            rows = torch.repeat_interleave(torch.arange(self.shape[0], device=weight.device), self.outlier_rows.diff().long(),
                                           output_size=self.num_outliers)
            weight[rows, self.outlier_cols.long()] = self.outlier_values.to(dtype)
        if permuted or not self.is_permuted:
            return weight
        dense = torch.empty_like(weight)
        dense[:, self.perm.long()] = weight
        return dense

    def _dequantize_torch(self, dtype: torch.dtype, statistics: Statistics | None = None) -> Tensor:
        """[out, in] `dtype`, columns in stored order, outliers not yet applied."""
        out, inp = self.shape
        scale, zero = statistics or decode_statistics([self])[0]
        # (code - zero) * scale as code * scale + (-zero * scale), in place on the decoded codes (a broadcast
        # multiply and add run ~4x faster on CPU than one broadcast addcmul); in fp32, then cast once
        weight = unpack(self.codes, self.bits, out * inp, torch.float32).view(out, self.num_groups, self.groupsize)
        return weight.mul_(scale[..., None]).add_((-zero * scale)[..., None]).view(out, inp).to(dtype)


Statistics = tuple[Tensor, Tensor]     # per-row group scale and zero [out, groups] float32


def decode_statistics(matrices: list[SpqrMatrix]) -> list[Statistics]:
    """Each matrix's group scales and zeros, every code unpacked in one call and the second level applied
    once per group width: a layer's fourteen small decodes cost more in per-op overhead than in work (CPU,
    default model: 2.6 -> 1.4 -> 0.5 ms per layer)."""
    bits = matrices[0].stats_bits
    if any(m.stats_bits != bits for m in matrices):
        raise ValueError("matrices decoded together must share their statistics' bits")
    # scale streams, then zero streams, each in order of group width: matrices of one width and whole runs
    # of rows then sit next to one another in both halves
    order = sorted(range(len(matrices)), key=lambda i: matrices[i].num_groups)
    streams = [matrices[i].scale_codes for i in order] + [matrices[i].zero_codes for i in order]
    # each stream is whole packing groups, so the streams' codes follow one another in the concatenation
    lengths = [packed_codes(stream.numel(), bits) for stream in streams]
    values = unpack(torch.cat(streams), bits, sum(lengths), torch.float32).split(lengths)
    scales, zeros = values[:len(order)], values[len(order):]
    decoded: list[Statistics | None] = [None] * len(matrices)
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and _same_width_whole_runs(matrices[order[start]], matrices[order[end]]):
            end += 1
        members = [matrices[i] for i in order[start:end]]
        for index, statistics in zip(order[start:end], _second_level_together(members, scales[start:end],
                                                                               zeros[start:end])):
            decoded[index] = statistics
        start = end
    return decoded


def _same_width_whole_runs(a: SpqrMatrix, b: SpqrMatrix) -> bool:
    return a.num_groups == b.num_groups and a.shape[0] % STATS_RUN == 0 and b.shape[0] % STATS_RUN == 0


def _second_level_together(members: list[SpqrMatrix], scales: tuple[Tensor, ...],
                           zeros: tuple[Tensor, ...]) -> list[Statistics]:
    """Matrices of one group width: their unpacked statistics codes and run parameters concatenated by run,
    decoded in one broadcast op each (a lone matrix, or rows not whole runs, alone)."""
    if len(members) == 1:
        m, params = members[0], members[0].stat_params
        out, groups = m.shape[0], m.num_groups
        return [(_second_level(scales[0], params[..., 0], params[..., 1], out, groups),
                 _second_level(zeros[0], params[..., 2], params[..., 3], out, groups))]
    groups = members[0].num_groups
    rows = [m.shape[0] for m in members]
    # [4, runs, 1, groups]: each parameter contiguous (broadcasting a strided one over rows is ~2x slower)
    params = torch.cat([m.stat_params for m in members]).float().permute(2, 0, 1).contiguous()[:, :, None]

    def level(codes: tuple[Tensor, ...], scale: int, zero: int) -> list[Tensor]:
        joined = torch.cat([c[:out * groups] for c, out in zip(codes, rows)]).view(-1, STATS_RUN, groups)
        return list(((joined - params[zero]) * params[scale]).view(-1, groups).split(rows))
    return list(zip(level(scales, 0, 1), level(zeros, 2, 3)))


def uses_fused_kernel(matrix: SpqrMatrix) -> bool:
    """Whether dequantize() will try the Triton kernel (on CUDA, Triton installed, not failed here)."""
    return matrix.codes.device.type == "cuda" and FUSED.usable


def _try_fused(matrix: SpqrMatrix, dtype: torch.dtype) -> Tensor | None:
    """The fused kernel's output, or None (no Triton, or a kernel that failed here once: then a one-line
    warning and the torch path from then on)."""
    return FUSED.run("dequantize_permuted", matrix, dtype, STATS_RUN)


def _second_level(values: Tensor, scales: Tensor, zeros: Tensor, out: int, groups: int) -> Tensor:
    """Per-row group statistics [out, groups] (float32) from their unpacked codes (at least out x groups,
    row-major) and per-run fp16 scale and zero (scales, zeros [runs, groups])."""
    runs = scales.shape[0]
    if runs * STATS_RUN == out:         # whole runs (every width of the usual models): no padding rows
        padded = values[:out * groups].view(runs, STATS_RUN, groups)
    else:
        padded = values.new_zeros(runs * STATS_RUN * groups)
        padded[:out * groups] = values[:out * groups]
        padded = padded.view(runs, STATS_RUN, groups)
    return ((padded - zeros.float()[:, None]) * scales.float()[:, None]).view(-1, groups)[:out]


EXPECTED_OUTLIER_SHARE = 0.002      # what the default thresholds keep (measured on the default model)


def expected_bits_per_param(bits: int, groupsize: int = 16, stats_bits: int = 3) -> float:
    """For planning without a checkpoint: codes, second-level statistics, outliers at the default share
    (the permutation and row pointers add ~16 / rows + 16 / columns more, negligible at 70B widths)."""
    return bits + 2 * stats_bits / groupsize + 64 / (STATS_RUN * groupsize) + 32 * EXPECTED_OUTLIER_SHARE


class SpqrLinear:
    """A packed weight the layer math calls like a tensor: dequantized on its device once per use, then
    one dense matmul serves every token of the pass."""

    def __init__(self, matrix: SpqrMatrix, dtype: torch.dtype, statistics: Statistics | None = None) -> None:
        self.matrix, self.dtype, self.statistics = matrix, dtype, statistics
        self.weight: Tensor | None = None       # [out, in] permuted columns, once prepared

    def prepare(self) -> None:
        """Dequantizes now (the engine's loader thread does, ahead of the layer's compute)."""
        self.weight = self._dequantize()

    def matmul(self, x: Tensor) -> Tensor:
        """x [..., in] -> [..., out]: W x = W[:, perm] x[perm], so the inputs are gathered instead of
        the weight's columns scattered."""
        weight = self.weight if self.weight is not None else self._dequantize()
        if not self.matrix.is_permuted:
            return F.linear(x, weight)
        return F.linear(x[..., self.matrix.perm.long()], weight)

    def _dequantize(self) -> Tensor:
        return self.matrix.dequantize(self.dtype, permuted=True, statistics=self.statistics)

    def dense(self) -> Tensor:
        """[out, in] in the layer's own column order (W[:, perm] is what matmul multiplies)."""
        weight = self._dequantize()
        return weight[:, torch.argsort(self.matrix.perm.long())] if self.matrix.is_permuted else weight


def packed_linears(matrices: dict[str, SpqrMatrix], dtype: torch.dtype) -> dict[str, SpqrLinear]:
    """A layer's packed weights; where the torch path will dequantize them, their group statistics are
    decoded together up front."""
    if any(uses_fused_kernel(m) for m in matrices.values()):
        return {name: SpqrLinear(m, dtype) for name, m in matrices.items()}
    statistics = decode_statistics(list(matrices.values()))
    return {name: SpqrLinear(m, dtype, stats) for (name, m), stats in zip(matrices.items(), statistics)}


FP16_TINIEST = 2.0 ** -24  # fp16's smallest positive value
ZERO_LIMIT = 1024.0      # |zero| of the second-level statistics stays below this (fp16 holds it exactly)


def quantize_stats(values: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """values [out, groups] -> (codes [out, groups] in [0, 2^bits), scale [runs, groups], zero [runs, groups])
    with min-max per run of STATS_RUN rows; scale/zero rounded to fp16 as stored. The zero stays a float,
    so every run's minimum is represented (a positive scale never rounds to 0)."""
    out, groups = values.shape
    runs = -(-out // STATS_RUN)
    padded = torch.cat((values, values[-1:].expand(runs * STATS_RUN - out, -1))).view(runs, STATS_RUN, groups)
    low, high = padded.amin(1), padded.amax(1)                                     # [runs, groups]
    maxq = (1 << bits) - 1
    # A run of equal values (e.g. sixteen rows whose zero points are all 4) has no range: its scale is
    # then a power-of-two fraction of the values, so the zero (at most 2^10) fits fp16 and decodes them exactly.
    floor = torch.maximum(low.abs(), high.abs()) / ZERO_LIMIT
    scale = torch.maximum((high - low) / maxq, floor).half().float()
    scale = torch.where(scale > 0, scale, FP16_TINIEST)     # a run of zeros: 0 / 0 would decode to NaN
    zero = (-low / scale).half().float()
    codes = torch.round(padded / scale[:, None] + zero[:, None]).clamp(0, maxq)
    return codes.view(-1, groups)[:out].to(torch.uint8), scale, zero


def pack_matrix(shape: tuple[int, int], bits: int, groupsize: int, stats_bits: int, codes: Tensor,
                scale_codes: Tensor, zero_codes: Tensor, stat_params: Tensor, perm: Tensor,
                outlier_mask: Tensor, permuted_weight: Tensor) -> SpqrMatrix:
    """Assembles the stored form from unpacked parts: codes [out, in] (permuted columns), stats codes
    [out, groups], stat_params [runs, groups, 4], perm [in] or [0] (input order: none stored),
    outlier_mask / permuted_weight [out, in]."""
    out, inp = shape
    index_dtype = torch.int16 if inp <= torch.iinfo(torch.int16).max else torch.int32
    rows, cols = outlier_mask.nonzero(as_tuple=True)
    counts = torch.bincount(rows, minlength=out)
    row_ptr = torch.cat((counts.new_zeros(1), counts.cumsum(0)))
    row_ptr = row_ptr.to(torch.int16 if int(row_ptr[-1]) <= torch.iinfo(torch.int16).max else torch.int32)
    return SpqrMatrix(shape, bits, groupsize, stats_bits, pack(codes, bits), pack(scale_codes, stats_bits),
                      pack(zero_codes, stats_bits), stat_params.half(), perm.to(index_dtype), row_ptr,
                      cols.to(index_dtype), permuted_weight[rows, cols].half())
