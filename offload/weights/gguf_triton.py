"""Q4_K and Q6_K decoding, one Triton kernel each, bit-exact to gguf_blocks.dequantize (and so to gguf's numpy
reference): a Q4_K_M file holds both. Importing this module imports Triton; on the CPU it runs only under
TRITON_INTERPRET=1.

Per output element i of super-block b = i // 256 (144 bytes: d | dmin | scales[12] | qs[128]),
sub-block j = (i % 256) // 32, position p = i % 32:

    q  = nibble (j % 2) of qs[32 * (j // 2) + p]
    sc, m = get_scale_min_k4(j, scales):  j < 4: s[j] & 63, s[j + 4] & 63
                                          j >= 4: (s[j + 4] & 15) | (s[j - 4] >> 6) << 4,
                                                  (s[j + 4] >> 4) | (s[j] >> 6) << 4
    w  = (d * sc) * q - (dmin * m)        every product rounded to f32 before the next operation

Q6_K, per element i of super-block b (210 bytes: ql[128] | qh[64] | scales[16] int8 | d), half h = (i % 256) // 128,
quarter k = (i % 128) // 32, position l = i % 32:

    q  = (nibble (k // 2) of ql[64 * h + 32 * (k % 2) + l]) | (bits [2k, 2k + 2) of qh[32 * h + l]) << 4
    w  = (d * scales[8 * h + l // 16 + 2 * k]) * (q - 32)

The launches turn off Triton's multiply-add fusion (enable_fp_fusion=False): an fma rounds once where
the reference rounds twice.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024
SUPER_BLOCK = 256
SUPER_BLOCK_BYTES = 144
Q6_K_BYTES = 210


@triton.jit
def _q4_k_kernel(raw, halves, out, numel, BLOCK: tl.constexpr):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = index < numel
    block, element = index // 256, index % 256
    sub, pos = element // 32, element % 32
    base = raw + block * 144
    quant_byte = tl.load(base + 16 + (sub // 2) * 32 + pos, mask=valid, other=0).to(tl.int32)
    q = (quant_byte >> ((sub % 2) * 4)) & 15
    scales = base + 4
    low = sub < 4
    s_j = tl.load(scales + sub, mask=valid, other=0).to(tl.int32)
    s_j4 = tl.load(scales + sub + 4, mask=valid, other=0).to(tl.int32)
    s_jm4 = tl.load(scales + tl.where(low, sub, sub - 4), mask=valid, other=0).to(tl.int32)
    sc = tl.where(low, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4))
    mn = tl.where(low, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
    d = tl.load(halves + block * 72, mask=valid, other=0).to(tl.float32)        # fp16 at byte 0
    dmin = tl.load(halves + block * 72 + 1, mask=valid, other=0).to(tl.float32)  # fp16 at byte 2
    scale = d * sc.to(tl.float32)
    shift = dmin * mn.to(tl.float32)
    weight = scale * q.to(tl.float32) - shift
    tl.store(out + index, weight.to(out.dtype.element_ty), mask=valid)


@triton.jit
def _q6_k_kernel(raw, halves, out, numel, BLOCK: tl.constexpr):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = index < numel
    block, element = index // 256, index % 256
    half, quarter, pos = element // 128, (element % 128) // 32, element % 32
    base = raw + block * 210
    low = tl.load(base + 64 * half + 32 * (quarter % 2) + pos, mask=valid, other=0).to(tl.int32)
    high = tl.load(base + 128 + 32 * half + pos, mask=valid, other=0).to(tl.int32)
    q = (tl.where(quarter < 2, low & 15, low >> 4) | (((high >> (2 * quarter)) & 3) << 4)) - 32
    sc = tl.load(base + 192 + 8 * half + pos // 16 + 2 * quarter, mask=valid, other=0).to(tl.int32)
    sc = tl.where(sc > 127, sc - 256, sc)                                       # int8 stored as uint8
    d = tl.load(halves + block * 105 + 104, mask=valid, other=0).to(tl.float32)  # fp16 at byte 208
    weight = (d * sc.to(tl.float32)) * q.to(tl.float32)
    tl.store(out + index, weight.to(out.dtype.element_ty), mask=valid)


def dequantize_q4_k(raw: Tensor, shape: tuple[int, ...], out_dtype: torch.dtype = torch.float32,
                    out: Tensor | None = None) -> Tensor:
    """Q4_K bytes uint8 [numel / 256 * 144] -> values `shape` in `out_dtype` (a cast of the f32 value)."""
    return _launch(_q4_k_kernel, "Q4_K", SUPER_BLOCK_BYTES, raw, shape, out_dtype, out)


def dequantize_q6_k(raw: Tensor, shape: tuple[int, ...], out_dtype: torch.dtype = torch.float32,
                    out: Tensor | None = None) -> Tensor:
    """Q6_K bytes uint8 [numel / 256 * 210] -> values `shape` in `out_dtype` (a cast of the f32 value)."""
    return _launch(_q6_k_kernel, "Q6_K", Q6_K_BYTES, raw, shape, out_dtype, out)


def _launch(kernel, name: str, block_bytes: int, raw: Tensor, shape: tuple[int, ...], out_dtype: torch.dtype,
            out: Tensor | None) -> Tensor:
    shape = tuple(int(s) for s in shape)
    numel = 1
    for size in shape:
        numel *= size
    expected = numel // SUPER_BLOCK * block_bytes
    if not shape or shape[-1] % SUPER_BLOCK or raw.dtype != torch.uint8 or raw.numel() != expected:
        raise ValueError(f"{name} tensor of shape {shape} needs a last dim that is a multiple of {SUPER_BLOCK} "
                         f"and {expected} uint8 bytes, got {raw.numel()} {raw.dtype} elements")
    if raw.data_ptr() % 2 or raw.storage_offset() % 2 or not raw.is_contiguous():
        raw = raw.clone(memory_format=torch.contiguous_format)                  # the fp16 view needs 2-byte alignment
    raw = raw.view(-1)                                                          # [num_bytes]
    result = out if out is not None else torch.empty(shape, dtype=out_dtype, device=raw.device)
    if tuple(result.shape) != shape or not result.is_contiguous() or result.device != raw.device:
        raise ValueError(f"out must be a contiguous tensor of shape {shape} on {raw.device}; "
                         f"got {tuple(result.shape)} on {result.device}")
    grid = (triton.cdiv(numel, BLOCK),)
    kernel[grid](raw, raw.view(torch.float16), result, numel, BLOCK=BLOCK, enable_fp_fusion=False)
    return result
