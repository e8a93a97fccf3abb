"""A self-draft's substitutes multiplied on a CUDA device straight from their packed codes (Triton): one kernel reads
a tile of bit-packed codes, their group's fp16 scale and offset, rebuilds the weights in registers and multiplies
them by the input rows. No dense copy of the matrix is written, so a draft round reads bits + 1 bits per weight
instead of unpacking, dequantizing and re-reading a dense one (quant/lowbit.LowBitWeight's torch path).
LowBitWeight.matmul calls it for CUDA inputs of up to lowbit.FUSED_ROWS rows when Triton is installed. Importing
this module imports Triton.

For out[m, n] = sum_k x[m, k] * w[n, k], with codes a little-endian bit stream (code i = n * K + k at bits
[i*b, i*b + b), quant/packbits.py) and g = k // group:

    w[n, k] = code(n * K + k) * scale[n, g] + offset[n, g]
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .spqr_triton import _code

BLOCK_N, BLOCK_K = 64, 64


@triton.jit
def _matmul_kernel(x, packed, scale, offset, out, rows, num_out, num_in, code_bytes, x_stride, out_stride,
                   BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)                    # [BLOCK_M]
    col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                    # [BLOCK_N] output features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    groups = num_in // GROUP
    for start in range(0, num_in, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)                                       # [BLOCK_K]
        a = tl.load(x + row[:, None].to(tl.int64) * x_stride + k[None, :],
                    mask=(row[:, None] < rows) & (k[None, :] < num_in), other=0.0)          # [BLOCK_M, BLOCK_K]
        valid = (col[:, None] < num_out) & (k[None, :] < num_in)                             # [BLOCK_N, BLOCK_K]
        code = _code(packed, col[:, None].to(tl.int64) * num_in + k[None, :], code_bytes, valid, BITS)
        stat = col[:, None].to(tl.int64) * groups + k[None, :] // GROUP
        s = tl.load(scale + stat, mask=valid, other=0.0).to(tl.float32)
        o = tl.load(offset + stat, mask=valid, other=0.0).to(tl.float32)
        w = (code.to(tl.float32) * s + o).to(a.dtype)
        if IEEE:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
    tl.store(out + row[:, None].to(tl.int64) * out_stride + col[None, :], acc.to(out.dtype.element_ty),
             mask=(row[:, None] < rows) & (col[None, :] < num_out))


def matmul(x: Tensor, packed: Tensor, scale: Tensor, offset: Tensor, shape: tuple[int, int], bits: int,
           group: int) -> Tensor:
    """x [..., K] (fp32, fp16 or bf16) times the [N, K] low-bit weight (packed [bytes] uint8, scale and offset
    [N, K / group] fp16) transposed -> [..., N] in x's dtype, accumulated in fp32."""
    num_out, num_in = shape
    rows = x.reshape(-1, num_in)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], num_out, dtype=x.dtype, device=x.device)
    block_m = 16 if rows.shape[0] <= 16 else 32 if rows.shape[0] <= 32 else 64
    grid = (triton.cdiv(rows.shape[0], block_m), triton.cdiv(num_out, BLOCK_N))
    _matmul_kernel[grid](rows, packed, scale, offset, out, rows.shape[0], num_out, num_in, packed.numel(),
                         rows.stride(0), out.stride(0), BITS=bits, GROUP=group, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
                         BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32)
    return out.view(*x.shape[:-1], num_out)
