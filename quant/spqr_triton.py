"""Fused SpQR dequantization (Triton): one kernel reads a matrix's packed codes, its packed second-level
statistics and their fp16 run parameters, and writes the dense weight with its columns in stored
(permuted) order; torch then scatters the few outliers. SpqrMatrix.dequantize calls it for CUDA
tensors when Triton is installed; the torch path is the fallback. Importing this module imports Triton.

Per weight at flat index i = r * cols + c (bit streams are little-endian, code k at bits [k*b, (k+1)*b)):

    code   = bits [i*b, i*b + b) of `codes`             group j = c // groupsize, run u = r // 16
    scale  = (scale_code[r, j] - s_zero[u, j]) * s_scale[u, j]
    zero   = (zero_code[r, j] - z_zero[u, j]) * z_scale[u, j]
    weight = code * scale - zero * scale
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


BLOCK = 1024


@triton.jit
def _code(stream, index, num_bytes, valid, BITS: tl.constexpr):
    """The BITS-bit code number `index` of a little-endian bit stream (two bytes hold any code <= 8 bits; one where
    no code straddles two: 1, 2, 4 and 8 bits)."""
    bit = index * BITS
    byte = bit >> 3
    low = tl.load(stream + byte, mask=valid, other=0).to(tl.int32)
    if 8 % BITS == 0:
        code = (low >> (bit & 7).to(tl.int32)) & ((1 << BITS) - 1)
    else:
        high = tl.load(stream + byte + 1, mask=valid & (byte + 1 < num_bytes), other=0).to(tl.int32)
        code = ((low | (high << 8)) >> (bit & 7).to(tl.int32)) & ((1 << BITS) - 1)
    return code


@triton.jit
def _dequantize_kernel(codes, scale_codes, zero_codes, stat_params, out, rows, cols, code_bytes, stat_bytes,
                       BITS: tl.constexpr, STATS_BITS: tl.constexpr, GROUP: tl.constexpr, RUN: tl.constexpr,
                       BLOCK: tl.constexpr):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = index < rows * cols
    row, col = index // cols, index % cols
    groups = cols // GROUP
    stat = row * groups + col // GROUP
    param = stat_params + ((row // RUN) * groups + col // GROUP) * 4        # [runs, groups, 4] fp16
    s_scale = tl.load(param, mask=valid, other=0).to(tl.float32)
    s_zero = tl.load(param + 1, mask=valid, other=0).to(tl.float32)
    z_scale = tl.load(param + 2, mask=valid, other=0).to(tl.float32)
    z_zero = tl.load(param + 3, mask=valid, other=0).to(tl.float32)
    scale = (_code(scale_codes, stat, stat_bytes, valid, STATS_BITS).to(tl.float32) - s_zero) * s_scale
    zero = (_code(zero_codes, stat, stat_bytes, valid, STATS_BITS).to(tl.float32) - z_zero) * z_scale
    code = _code(codes, index, code_bytes, valid, BITS).to(tl.float32)
    tl.store(out + index, (code * scale + (-zero * scale)).to(out.dtype.element_ty), mask=valid)


def dequantize_permuted(matrix, dtype: torch.dtype, stats_run: int) -> Tensor:
    """quant.spqr_format.SpqrMatrix (its packed fields; this module imports nothing of the format) ->
    [out, in] `dtype` weight, columns in stored order, outliers not yet applied. stats_run: rows per
    second-level fp16 scale/zero."""
    rows, cols = matrix.shape
    weight = torch.empty(rows, cols, dtype=dtype, device=matrix.codes.device)
    grid = (triton.cdiv(rows * cols, BLOCK),)
    _dequantize_kernel[grid](matrix.codes, matrix.scale_codes, matrix.zero_codes, matrix.stat_params, weight, rows,
                             cols, matrix.codes.numel(), matrix.scale_codes.numel(), BITS=matrix.bits,
                             STATS_BITS=matrix.stats_bits, GROUP=matrix.groupsize, RUN=stats_run, BLOCK=BLOCK)
    return weight
