"""Vectorized torch decoding of GGUF (ggml) tensors, bit-exact to gguf.quants.dequantize in float32.

Runs on whatever device holds the raw bytes (CPU or CUDA), with no Python loop over blocks; on CUDA,
Q4_K and Q6_K go through gguf_triton's fused kernels where Triton is installed (same bits, one launch). Every
decoder repeats the float32 operation order of gguf's numpy reference: fp16 fields widened to f32,
scale products (d * sc) rounded to f32 before they meet the quants, products before sums, never a
fused multiply-add. Subtracting the integer offset (8, 16, 32) from a quant in f32 is exact, so it
equals the reference's int8 subtraction.

Block layouts (little-endian bytes; d, m, dmin are fp16; q_i is element i of the block):

    Q8_0  d | qs[32] int8                     w = d * q
    Q4_0  d | qs[16]                          w = d * (q - 8)   q_i: low nibble of qs[i % 16] (i < 16), else high
    Q4_1  d | m | qs[16]                      w = d * q + m
    Q5_0  d | qh[4] | qs[16]                  w = d * (q - 16)  bit 4 of q_i = bit i of qh (as uint32)
    Q5_1  d | m | qh[4] | qs[16]              w = d * q + m
    Q4_K  d | dmin | scales[12] | qs[128]     w = (d * sc_j) * q - (dmin * m_j), sub-block j of 32:
          j = 2c + h takes nibble h (low, high) of qs[32c : 32c + 32]; sc_j, m_j 6-bit (get_scale_min_k4)
    Q5_K  d | dmin | scales[12] | qh[32] | qs[128]    as Q4_K, bit 4 of sub-block j = bit j of qh[0:32]
    Q6_K  ql[128] | qh[64] | scales[16] int8 | d      w = (d * sc_j) * (q - 32), sub-block j of 16
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from offload.fused import OptionalKernel
from offload.weights.ggml_types import QUANT_SIZES as GGML_QUANT_SIZES, GGMLType as T

SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K)
# gguf.quants.quantize implements these (the K-quants only decode in the gguf package)
REFERENCE_QUANTIZED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)

FUSED_K_QUANTS = OptionalKernel("offload.weights.gguf_triton", "GGUF Q4_K/Q6_K")
FUSED_TYPES = {T.Q4_K: "dequantize_q4_k", T.Q6_K: "dequantize_q6_k"}      # its function for each type
CPU_CHUNK_ELEMENTS = 1 << 20
DEVICE_CHUNK_ELEMENTS = 1 << 26

# byte offset of every fp16 field in a block, and whether random_blocks may make it negative
_HALF_FIELDS = {
    T.Q8_0: ((0, True),), T.Q4_0: ((0, True),), T.Q5_0: ((0, True),),
    T.Q4_1: ((0, True), (2, True)), T.Q5_1: ((0, True), (2, True)),
    T.Q4_K: ((0, False), (2, False)), T.Q5_K: ((0, False), (2, False)), T.Q6_K: ((208, False),),
}


def _supported_names() -> str:
    return ", ".join(t.name for t in SUPPORTED_TYPES)


def _check_type(qtype: T) -> T:
    qtype = T(qtype)
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"GGML type {qtype.name} is not supported; supported types: {_supported_names()}")
    return qtype


def block_geometry(qtype: T) -> tuple[int, int]:
    """(elements per block, bytes per block); F32/F16/BF16 count one element as a block."""
    return GGML_QUANT_SIZES[_check_type(qtype)]


def packed_nbytes(qtype: T, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of logical (torch-order) `shape` occupies; its last dim must fill whole blocks."""
    block_size, block_bytes = block_geometry(qtype)
    if len(shape) == 0 or shape[-1] % block_size != 0:
        raise ValueError(f"{T(qtype).name} needs a last dim that is a multiple of {block_size}, got shape {tuple(shape)}")
    return int(np.prod(shape)) // block_size * block_bytes


def _two_halves(blocks: Tensor) -> Tensor:
    """The fp16 fields at bytes 0 and 2 of every block (d and m, or d and dmin), widened: [n, 2] float32."""
    return blocks[:, :4].contiguous().view(torch.float16).float()


def _half(blocks: Tensor, offset: int) -> Tensor:
    """The fp16 field at byte `offset` of every block, widened to float32."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()   # [n, 1]


def _split_nibbles(packed: Tensor, out: Tensor) -> None:
    """packed [..., L] uint8 -> out [..., 2, L] of any dtype: low nibbles first, then high nibbles."""
    out[..., 0, :].copy_(packed & 0x0F)
    out[..., 1, :].copy_(packed >> 4)


def _nibbles(packed: Tensor, groups: int) -> Tensor:
    """packed [n, groups * L] uint8 -> quants [n, groups, 2, L] uint8 (_split_nibbles per group)."""
    q = torch.empty(packed.shape[0], groups, 2, packed.shape[1] // groups, dtype=torch.uint8, device=packed.device)
    packed = packed.view(packed.shape[0], groups, -1)
    torch.bitwise_and(packed, 0x0F, out=q[..., 0, :])
    torch.bitwise_right_shift(packed, 4, out=q[..., 1, :])
    return q


def _word_nibbles(blocks: Tensor, word: int, count: int) -> Tensor:
    """The nibbles of `count` 4-byte-aligned int32 words from word index `word` of each block, worked a
    word (8 nibbles) at a time: blocks [n, block_bytes] -> quants [n, 2 * 4 * count] uint8, as _nibbles."""
    words = blocks.view(torch.int32)[:, word:word + count]                      # [n, count]
    q = torch.empty(blocks.shape[0], 2, count, dtype=torch.int32, device=blocks.device)
    torch.bitwise_and(words, 0x0F0F0F0F, out=q[:, 0])
    torch.bitwise_right_shift(words, 4, out=q[:, 1]).bitwise_and_(0x0F0F0F0F)   # masks the sign extension
    return q.view(torch.uint8).view(blocks.shape[0], -1)


def _or_high_bits(q: Tensor, packed: Tensor, width: int) -> None:
    """q [..., 8 // width, L] |= field k of packed [..., L] (bits [k * width, (k + 1) * width)) << 4."""
    # one scalar shift per field: torch's tensor-by-tensor uint8 shift is ~10x slower on the CPU
    mask = (1 << width) - 1
    for k in range(8 // width):
        q[..., k, :].bitwise_or_(((packed >> (k * width)) & mask) << 4)


def _centered(q: Tensor, offset: int) -> Tensor:
    """uint8 quants in [0, 2 * offset) -> q - offset as int8 (exact, as the reference's int8 subtraction)."""
    return q.view(torch.int8).sub_(offset)


def _f32(blocks: Tensor, out: Tensor) -> None:        # blocks [n, 4] -> out [n, 1]
    out.view(-1).copy_(blocks.view(-1).view(torch.float32))


def _f16(blocks: Tensor, out: Tensor) -> None:        # blocks [n, 2] -> out [n, 1]
    out.view(-1).copy_(blocks.view(-1).view(torch.float16))


def _bf16(blocks: Tensor, out: Tensor) -> None:       # blocks [n, 2] -> out [n, 1]
    # bf16 is the high half of an f32: sign-extend to int32, then shift the 16 bits into place
    bits = out.view(-1).view(torch.int32)
    bits.copy_(blocks.view(-1).view(torch.int16))
    bits.bitwise_left_shift_(16)


def _q8_0(blocks: Tensor, out: Tensor) -> None:       # blocks [n, 34] -> out [n, 32]
    torch.mul(blocks[:, 2:].view(torch.int8), _half(blocks, 0), out=out)


def _q4_0(blocks: Tensor, out: Tensor) -> None:       # blocks [n, 18] -> out [n, 32]
    torch.mul(_centered(_nibbles(blocks[:, 2:], 1), 8).view(-1, 32), _half(blocks, 0), out=out)


def _q4_1(blocks: Tensor, out: Tensor) -> None:       # blocks [n, 20] -> out [n, 32]
    d, m = _two_halves(blocks).unbind(1)                                         # [n] each
    torch.mul(_word_nibbles(blocks, 1, 4), d.unsqueeze(1), out=out)
    out.add_(m.unsqueeze(1))


def _q5_quants(qh: Tensor, qs: Tensor) -> Tensor:
    """qh [n, 4], qs [n, 16] -> 5-bit quants [n, 32] uint8."""
    q = _nibbles(qs, 1)                                                          # [n, 1, 2, 16]
    _or_high_bits(q.view(-1, 4, 8, 1), qh.unsqueeze(-1), 1)                     # q_i takes bit i % 8 of qh[i // 8]
    return q.view(-1, 32)


def _q5_0(blocks: Tensor, out: Tensor) -> None:       # blocks [n, 22] -> out [n, 32]
    torch.mul(_centered(_q5_quants(blocks[:, 2:6], blocks[:, 6:]), 16), _half(blocks, 0), out=out)


def _q5_1(blocks: Tensor, out: Tensor) -> None:       # blocks [n, 24] -> out [n, 32]
    torch.mul(_q5_quants(blocks[:, 4:8], blocks[:, 8:]), _half(blocks, 0), out=out)
    out.add_(_half(blocks, 2))


def _scale_min_k4(scales: Tensor) -> Tensor:
    """12 packed bytes [n, 12] -> 6-bit scales and mins of the 8 sub-blocks, uint8 [n, 2, 8].

    Bytes 0-3 hold sc0-3 in their low 6 bits, 4-7 hold m0-3; bytes 8-11 hold the low nibbles of
    sc4-7 and (high nibble) m4-7, whose top 2 bits are the spare top bits of bytes 0-3 / 4-7.
    Worked four bytes at a time as little-endian int32 words; every mask keeps whole bytes apart."""
    low_sc, low_m, tail = scales.view(torch.int32).unbind(1)                   # [n] each
    high_sc = (tail & 0x0F0F0F0F) | ((low_sc >> 2) & 0x30303030)
    high_m = ((tail >> 4) & 0x0F0F0F0F) | ((low_m >> 2) & 0x30303030)
    words = torch.stack([low_sc & 0x3F3F3F3F, high_sc, low_m & 0x3F3F3F3F, high_m], dim=1)   # [n, 4]
    return words.view(torch.uint8).view(-1, 2, 8)


# The K-quants widen their quants with a copy and scale in place: on the CPU a uint8-by-float multiply
# broadcast over sub-blocks runs slower than the two passes (the 32-blocks' one scale per row is faster fused).
def _apply_k4_scales(blocks: Tensor, out: Tensor) -> None:
    """out [n, 256] holding quants 0..31 -> (d * sc_j) * q - (dmin * m_j) per sub-block j of 32."""
    d_dmin = _two_halves(blocks).unsqueeze(-1)                                   # [n, 2, 1]
    scale, shift = (d_dmin * _scale_min_k4(blocks[:, 4:16]).float()).unbind(1)    # [n, 8] each
    out.view(-1, 8, 32).mul_(scale.unsqueeze(-1)).sub_(shift.unsqueeze(-1))


def _q4_k(blocks: Tensor, out: Tensor) -> None:       # blocks [n, 144] -> out [n, 256]
    _split_nibbles(blocks[:, 16:].view(-1, 4, 32), out.view(-1, 4, 2, 32))
    _apply_k4_scales(blocks, out)


def five_bit_k_codes(blocks: Tensor) -> Tensor:
    """Q5_K blocks [n, 176] -> their codes q in 0..31, [n, 256] uint8 in the weights' order."""
    q = _nibbles(blocks[:, 48:], 4)                                              # [n, 4, 2, 32]
    _or_high_bits(q.view(-1, 8, 32), blocks[:, 16:48], 1)
    return q.view(-1, 256)


def _q5_k(blocks: Tensor, out: Tensor) -> None:       # blocks [n, 176] -> out [n, 256]
    out.copy_(five_bit_k_codes(blocks))
    _apply_k4_scales(blocks, out)


def six_bit_codes(blocks: Tensor) -> Tensor:
    """Q6_K blocks [n, 210] -> their codes q in 0..63, [n, 256] uint8 in the weights' order."""
    # each 128-element half h takes ql[64h : 64h + 64] (low nibbles, then high) and 2-bit fields of qh[32h : 32h + 32]
    q = _nibbles(blocks[:, :128], 2)                                             # [n, 2, 2, 64]
    _or_high_bits(q.view(-1, 2, 4, 32), blocks[:, 128:192].view(-1, 2, 32), 2)
    return q.view(-1, 256)


def _q6_k(blocks: Tensor, out: Tensor) -> None:       # blocks [n, 210] -> out [n, 256]
    scale = (_half(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()).unsqueeze(-1)   # [n, 16, 1]
    out.copy_(_centered(six_bit_codes(blocks), 32)).view(-1, 16, 16).mul_(scale)


_DECODERS = {
    T.F32: _f32, T.F16: _f16, T.BF16: _bf16, T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1,
    T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}


def _check_out(out: Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {shape} on {device}; "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")


def _chunk_blocks(device: torch.device, block_size: int) -> int:
    """Blocks decoded per step. On the CPU small steps keep every temporary cache-sized and recycled
    by the allocator (fresh multi-MB buffers cost more in page faults than the decode itself); on an
    accelerator large steps keep kernel launches few while bounding a bf16/fp16 decode's fp32 temporary."""
    elements = CPU_CHUNK_ELEMENTS if device.type == "cpu" else DEVICE_CHUNK_ELEMENTS
    return max(1, elements // block_size)


def dequantize(raw: Tensor, qtype: T, shape: tuple[int, ...], out_dtype: torch.dtype = torch.float32,
               out: Tensor | None = None) -> Tensor:
    """A GGUF tensor's raw bytes -> its values, shape `shape` (torch order), on raw's device.

    raw: uint8 [packed_nbytes(qtype, shape)], row-major in ggml order (the last dim is contiguous).
    Decoding is in float32; another floating `out_dtype` (bf16, fp16) gets a cast of that result,
    made chunk by chunk through a float32 workspace of at most one chunk. `out`, when given, receives
    the result and is returned. The result never shares memory with `raw`."""
    qtype, shape = _check_type(qtype), tuple(int(s) for s in shape)
    expected = packed_nbytes(qtype, shape)
    if raw.dtype != torch.uint8 or raw.numel() != expected:
        raise ValueError(f"{qtype.name} tensor of shape {shape} needs {expected} uint8 bytes, "
                         f"got {raw.numel()} {raw.dtype} elements")
    if not out_dtype.is_floating_point:
        raise ValueError(f"out_dtype must be a floating dtype such as torch.float32 or torch.bfloat16, got {out_dtype}")
    if out is not None:
        _check_out(out, shape, out_dtype, raw.device)
    if raw.data_ptr() % 4 != 0 or raw.storage_offset() % 4 != 0 or not raw.is_contiguous():
        raw = raw.clone(memory_format=torch.contiguous_format)                  # int32/f32 views need 4-byte alignment
    if raw.is_cuda and qtype in FUSED_TYPES:
        fused = FUSED_K_QUANTS.run(FUSED_TYPES[qtype], raw, shape, out_dtype, out)
        if fused is not None:
            return fused
    result = out if out is not None else torch.empty(shape, dtype=out_dtype, device=raw.device)
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks, targets = raw.reshape(-1, block_bytes), result.view(-1, block_size)   # [n, block_bytes], [n, block_size]
    step = _chunk_blocks(raw.device, block_size)
    workspace = None if out_dtype == torch.float32 else torch.empty(
        min(step, len(blocks)), block_size, dtype=torch.float32, device=raw.device)   # [step, block_size]
    for start in range(0, len(blocks), step):
        target = targets[start:start + step]
        values = target if workspace is None else workspace[:len(target)]
        _DECODERS[qtype](blocks[start:start + step], values)
        if workspace is not None:
            target.copy_(values)
    return result


def _random_halves(count: int, is_signed: bool, generator: np.random.Generator) -> np.ndarray:
    """`count` finite fp16 scales with |x| log-uniform in [1e-4, 1e-1], as uint8 [count, 2]."""
    values = np.exp(generator.uniform(np.log(1e-4), np.log(1e-1), count))
    if is_signed:
        values *= generator.choice([-1.0, 1.0], count)
    return values.astype(np.float16).view(np.uint8).reshape(count, 2)


def _random_floats(qtype: T, count: int, generator: np.random.Generator) -> np.ndarray:
    values = generator.standard_normal(count, dtype=np.float32) * np.float32(0.05)
    if qtype == T.F32:
        return values.view(np.uint8)
    if qtype == T.F16:
        return values.astype(np.float16).view(np.uint8)
    return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)    # bf16: truncated f32


def random_blocks(qtype: T, shape: tuple[int, ...], generator: np.random.Generator) -> np.ndarray:
    """Valid random packed bytes (uint8 [packed_nbytes]) for a `shape` tensor of `qtype`.

    Quants and packed sub-block scales are uniform random bits; every fp16 scale is finite, positive
    (signed for the 32-blocks' d and m) with |x| in [1e-4, 1e-1]; F32/F16/BF16 hold N(0, 0.05^2)."""
    qtype = _check_type(qtype)
    num_bytes = packed_nbytes(qtype, shape)
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    if block_size == 1:
        return _random_floats(qtype, num_bytes // block_bytes, generator)
    data = np.frombuffer(bytearray(generator.bytes(num_bytes)), dtype=np.uint8)
    blocks = data.reshape(-1, block_bytes)                                     # [n, block_bytes]
    for offset, is_signed in _HALF_FIELDS[qtype]:
        blocks[:, offset:offset + 2] = _random_halves(blocks.shape[0], is_signed, generator)
    return data


def quantize_reference(qtype: T, weights: np.ndarray) -> np.ndarray:
    """float weights [..., K] -> packed uint8 bytes [packed_nbytes] via gguf.quants.quantize."""
    qtype = _check_type(qtype)
    if qtype not in REFERENCE_QUANTIZED_TYPES:
        names = ", ".join(t.name for t in REFERENCE_QUANTIZED_TYPES)
        raise ValueError(f"gguf.quants.quantize cannot produce {qtype.name}; it can produce: {names}")
    packed_nbytes(qtype, weights.shape)
    from gguf.quants import quantize as gguf_quantize          # the reference, for tests and benchmarks only
    return np.ascontiguousarray(gguf_quantize(weights.astype(np.float32), qtype)).view(np.uint8).reshape(-1)
