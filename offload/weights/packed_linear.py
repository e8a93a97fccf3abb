"""GGUF 4- and 8-bit matrices multiplied as they are stored, on the CPU, by torch's int4 kernel.

torch's `_weight_int4pack_mm_for_cpu` computes x @ W^T for W [N, K] held as uint4 codes q in groups of 32
along K with one scale and one zero per group: w = (q - 8) * scale + zero. On x86 (AVX512, AVX2) its
vectorized loop takes bf16 activations, scales and zeros, dequantizes each group of 32 in fp32 registers,
accumulates in fp32 over k in order and rounds the result to bf16; other dtypes fall to a scalar loop
25-40x slower. Each output row is computed alone (the same fp32 operations whatever the number of rows M
and the row's place among them), so a tree pass multiplies each row exactly as a one-token pass does.

GGUF blocks map onto it with group 32, exactly before the bf16 rounding of scales and zeros:

    Q4_0  w = d * (q - 8)                 scale d,          zero 0
    Q4_1  w = d * q + m                   scale d,          zero m + 8d
    Q4_K  w = (d sc_j) q - (dmin m_j)     scale d sc_j,     zero 8 d sc_j - dmin m_j    per sub-block j of 32
    Q8_0  w = d * q, q int8 = 16 hi + lo: two products over K, summed in one by doubling K (x' = [x, x]):
          hi = (q >> 4) + 8 with scale 16d, zero 0; lo = q & 15 with scale d, zero 8d
    5- and 6-bit types, w = s q + b per 16 weights (Q5_0: s = d, b = -16d; Q5_1: d, m; Q5_K: d sc_j, -dmin m_j;
          Q6_K: d sc_j, -32 d sc_j), q = 16 hi + lo: one group of 32 per 16 weights, its 16 codes hi + c against
          16 x and its 16 codes lo against x (x' = [16 x_j, x_j] per 16: 16 x is exact in bf16), scale s and zero
          z = (b + s (136 - 16c)) / 17, since 16 (hi + c - 8) + (lo - 8) = q + 16c - 136 and the zero meets 17 x;
          c = 8 - 2^(bits - 5) centres the high codes (Q6_K: c = 6, z = 8 s / 17)

Error against decode-then-fp32 (tests/test_packed_linear.py states the bound it checks): activations,
scales and zeros rounded to bf16 (relative 2^-8 each: bf16 keeps 8 significant bits) and the output rounded
to bf16 (relative 2^-8).

The packed code layout is the running CPU's (AVX512 interleaves 64 rows, AVX2 32): it is made here, at load
for resident layers, and for streamed ones per pass or once into the kernel layer cache, a file keyed by the
dispatch (offload/weights/kernel_cache.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from offload.weights.gguf_blocks import (_half, _nibbles, _q5_quants, _scale_min_k4, _two_halves, _word_nibbles,
                                         dequantize, five_bit_k_codes, packed_nbytes, six_bit_codes)
from offload.weights.ggml_types import QUANT_SIZES, GGMLType as T

GROUP = 32
KERNEL_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K)
WIDE_TYPES = (T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K)   # 5/6-bit codes as a high and a low code (Int4Weight.interleave)
SUB_BLOCK = 16               # their weights per group: an input chunk taken as [16 x, x]
REPACK_CODES = 1 << 20       # codes repacked at once: every temporary stays cache-sized (as gguf_blocks decodes)
ROW_MULTIPLE = 16            # the kernel's N must be a multiple of 16
HEAD_CHUNK = 4096            # output rows recomputed at once


def takes(qtype: int, shape: tuple[int, ...]) -> bool:
    """Whether a GGUF tensor of this type and (torch-order) shape multiplies packed."""
    return len(shape) == 2 and int(qtype) in [int(t) for t in KERNEL_TYPES] and shape[0] % ROW_MULTIPLE == 0


def takes_dense(shape: tuple[int, ...]) -> bool:
    """Whether a dense float [N, K] matrix can be quantized to Q8_0 for the kernel (quant/lowbit.int8_head)."""
    return len(shape) == 2 and shape[0] % ROW_MULTIPLE == 0 and shape[1] % GROUP == 0


def dense_q8_bytes(shape: tuple[int, int]) -> int:
    """Bytes of a dense matrix held as Q8_0 by the kernel (0: its shape does not suit the kernel)."""
    return kernel_bytes(T.Q8_0, shape) if takes_dense(shape) else 0


def draft_head_copy_bytes(shape: tuple[int, int], head_is_packed: bool, device: torch.device) -> int:
    """Bytes of the 8-bit copy a self-draft scores with (spec/self_draft.draft_head, quant/lowbit.int8_head): made on
    a CPU of a dense float output matrix the kernel takes; 0 where there is none (a packed head is shared)."""
    return 0 if head_is_packed or device.type != "cpu" else dense_q8_bytes(shape)


@dataclass(slots=True)
class Int4Weight:
    """A [N, K] weight in torch's CPU int4 layout; `linear` (offload/model/layers.py) calls its matmul."""
    codes: Tensor            # [N, K * repeat / 2] uint8, the running CPU's packed layout
    scale_zeros: Tensor      # [K * repeat / 32, N, 2] bf16
    shape: tuple[int, int]   # (N, K), the logical weight's
    repeat: int = 1          # 2: the input is doubled along K (Q8_0's high and low nibble products; WIDE_TYPES')
    interleave: bool = False  # the doubled input is [16 x, x] per 16 (WIDE_TYPES), not [x, x] (Q8_0)
    is_row_exact = True      # a row's result never depends on the other rows (the layer attends to match)

    def matmul(self, x: Tensor) -> Tensor:
        """x [..., K] -> x @ W^T [..., N] in x's dtype (computed from bf16 x, rounded to bf16)."""
        num_out, num_in = self.shape
        rows = x.reshape(-1, num_in).to(torch.bfloat16)                          # [M, K]
        if self.interleave:
            chunks = rows.view(-1, num_in // SUB_BLOCK, 1, SUB_BLOCK)               # [M, K / 16, 1, 16]
            rows = torch.cat([chunks * 16, chunks], dim=2).view(-1, 2 * num_in)     # [M, 2K]
        elif self.repeat == 2:
            rows = torch.cat([rows, rows], dim=1)                                # [M, 2K]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.contiguous(), self.codes, GROUP, self.scale_zeros)
        return out.to(x.dtype).view(*x.shape[:-1], num_out)                    # [..., N]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scale_zeros.numel() * self.scale_zeros.element_size()

    def rows(self, start: int, stop: int) -> Int4Weight:
        """Output rows [start, stop) (multiples of 64: whole row blocks), views of this weight's storage."""
        return Int4Weight(self.codes[start:stop], self.scale_zeros[:, start:stop], (stop - start, self.shape[1]),
                          self.repeat, self.interleave)


@dataclass(slots=True)
class Int4Head:
    """The output matrix: its product by the int4 kernel, then every logit within `margin` of its row's largest
    recomputed from the matrix's decoded rows in float64 (rounded to fp32). Logits near 25 are 0.125 apart in
    bf16, so the kernel's own result ties the top candidates often and argmax picks the lower id; the exact
    recomputation keeps greedy choices and the likely tokens' scores those of the fp32 hidden state. Each row
    recomputes its own candidates alone: a tree row's logits stay those of a one-token pass."""
    weight: Int4Weight
    raw: Tensor              # [N, row bytes] uint8, the matrix's GGUF blocks (a view of the mapped file)
    qtype: int
    margin: float = 2.0      # logits; the kernel's error on a logit near 25 is ~0.1-0.2

    def matmul(self, x: Tensor) -> Tensor:
        """x [..., K] -> logits [..., N] float32."""
        num_out, num_in = self.weight.shape
        logits = self.weight.matmul(x).float()                                    # [..., N]
        rows, flat = x.reshape(-1, num_in), logits.view(-1, num_out)               # [M, K], [M, N]
        near = flat >= flat.max(dim=-1, keepdim=True).values - self.margin        # [M, N]
        row_ids, token_ids = near.nonzero(as_tuple=True)                          # [C] each
        for start in range(0, len(row_ids), HEAD_CHUNK):
            r, t = row_ids[start:start + HEAD_CHUNK], token_ids[start:start + HEAD_CHUNK]
            weights = dequantize(self.raw[t].reshape(-1), self.qtype, (len(t), num_in))     # [c, K] fp32
            flat[r, t] = (weights.double() * rows[r].double()).sum(-1).float()
        return logits

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}     # products over the same input


def from_gguf_layer(matrices: dict[str, tuple[Tensor, int, tuple[int, int]]]) -> dict[str, Int4Weight]:
    """A layer's matrices (name -> raw blocks, GGUF type, shape; all of types the kernel takes) -> Int4Weights,
    q/k/v and gate/up stacked along N into one each ("qkv", "gate_up") where they share the input width and
    type family and have N a multiple of 64: one product (and one cast of its input) for several, written in
    place (no concatenation). Bitwise the separate products side by side: the kernel computes each block of 64
    (AVX512; 32 AVX2) output rows alone."""
    weights = empty_layer({name: (qtype, shape) for name, (_, qtype, shape) in matrices.items()})
    for name, weight in weights.items():
        row = 0
        for part in FUSED[name] if name in FUSED and name not in matrices else (name,):
            raw, qtype, shape = matrices[part]
            from_gguf(raw, qtype, shape, out=weight.rows(row, row + shape[0]))
            row += shape[0]
    return weights


def empty_layer(specs: dict[str, tuple[int, tuple[int, int]]], device: str | torch.device = "cpu"
                ) -> dict[str, Int4Weight]:
    """The Int4Weights from_gguf_layer makes of matrices of these (GGUF type, shape), unfilled: on the "meta"
    device, the kernel's layout of a layer without repacking one."""
    weights = {}
    for name, parts in FUSED.items():
        found = [specs[part] for part in parts if part in specs]
        if len(found) < len(parts) or any(shape[0] % 64 for _, shape in found) or \
                len({(shape[1], _form(qtype)) for qtype, shape in found}) != 1:
            continue
        weights[name] = _empty(sum(shape[0] for _, shape in found), found[0][1][1], *_form(found[0][0]), device=device)
    done = {part for name in weights for part in FUSED[name]}
    weights.update({name: _empty(*shape, *_form(qtype), device=device) for name, (qtype, shape) in specs.items()
                    if name not in done})
    return weights


def kernel_bytes(qtype: int, shape: tuple[int, ...]) -> int:
    """Bytes an Int4Weight of this GGUF tensor holds: half a byte and 1/8 byte of scale and zero per code."""
    codes = shape[0] * shape[1] * _form(qtype)[0]
    return codes // 2 + codes // GROUP * 4


def _form(qtype: int) -> tuple[int, bool]:
    """(repeat, interleave) of an Int4Weight of this GGUF type: how its input is widened."""
    wide = int(qtype) in [int(t) for t in WIDE_TYPES]
    return (2, wide) if wide or int(qtype) == int(T.Q8_0) else (1, False)


def _empty(num_out: int, num_in: int, repeat: int = 1, interleave: bool = False,
           device: str | torch.device = "cpu") -> Int4Weight:
    width = num_in * repeat
    return Int4Weight(torch.empty(num_out, width // 2, dtype=torch.uint8, device=device),
                      torch.empty(width // GROUP, num_out, 2, dtype=torch.bfloat16, device=device), (num_out, num_in),
                      repeat, interleave)


def from_gguf(raw: Tensor, qtype: int, shape: tuple[int, int], out: Int4Weight | None = None) -> Int4Weight:
    """A GGUF matrix's raw blocks (uint8 [packed_nbytes], rows in torch order) -> its Int4Weight (written into
    `out` when given: rows of a stacked weight)."""
    qtype = T(qtype)
    if not takes(qtype, shape):
        raise ValueError(f"{qtype.name} {tuple(shape)} cannot multiply packed: the int4 kernel takes "
                         f"{', '.join(t.name for t in KERNEL_TYPES)} matrices of a multiple of {ROW_MULTIPLE} rows")
    num_out, num_in = shape
    if raw.numel() != packed_nbytes(qtype, shape):
        raise ValueError(f"{qtype.name} {tuple(shape)} needs {packed_nbytes(qtype, shape)} bytes, got {raw.numel()}")
    if raw.data_ptr() % 4 != 0 or not raw.is_contiguous():
        raw = raw.clone(memory_format=torch.contiguous_format)                  # int32 views need 4-byte alignment
    out = _empty(num_out, num_in, *_form(qtype)) if out is None else out
    codes, scale_zeros, width = out.codes, out.scale_zeros, num_in * out.repeat
    repeat = 2 if qtype == T.Q8_0 else 1      # groups per block taken apart: Q8_0's hi products, then its lo ones
    row_bytes = raw.numel() // num_out
    block_bytes = QUANT_SIZES[qtype][1]
    step = max(1, REPACK_CODES // width // 64) * 64       # a multiple of 64 rows: the layout's row blocks stay whole
    for start in range(0, num_out, step):
        stop = min(num_out, start + step)
        blocks = raw[start * row_bytes:stop * row_bytes].view(-1, block_bytes)    # [rows * blocks per row, bytes]
        quants, scale, zero = _GROUPS[qtype](blocks)                              # [n, g, 32] uint8, [n, g] f32 x2
        quants = quants.view(stop - start, -1, GROUP)
        if repeat == 2:   # each block's high nibbles, then its low ones: the hi products over K, then the lo ones
            quants = quants.view(stop - start, -1, 2, GROUP).transpose(1, 2)
        pack_codes(quants.reshape(stop - start, width), out=codes[start:stop])
        scale_zeros[:, start:stop, 0] = _by_group(scale, stop - start, repeat).t()
        scale_zeros[:, start:stop, 1] = _by_group(zero, stop - start, repeat).t()
    return out


# Rows interleaved per byte by torch's converter (aten/src/ATen/native/cpu/int4mm_kernel.cpp), by CPU dispatch:
# a block of 64 rows (AVX512: byte d of column k pairs rows d and d + 32, byte 16 + d rows 16 + d and 48 + d) or
# 32 (AVX2: rows d and d + 16); a last block of 16, 32 or 48 rows, and every row elsewhere, pairs rows 2i, 2i + 1.
_ROW_BLOCK = {"AVX512": 64, "AVX2": 32}


def pack_codes(codes: Tensor, out: Tensor | None = None) -> Tensor:
    """codes [N, K] uint8 in 0..15 -> [N, K / 2] uint8 (into `out`, contiguous, when given), what
    _convert_weight_to_int4pack_for_cpu makes of them as int32 on this CPU, built with a few uint8 operations
    (the converter's loop over int32 copies runs slower than decoding the blocks to fp32)."""
    num_rows, width = codes.shape
    packed = torch.empty(num_rows, width // 2, dtype=torch.uint8) if out is None else out
    block = _ROW_BLOCK.get(torch.backends.cpu.get_cpu_capability())
    if block is None:
        return packed.copy_(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
    full = num_rows // block * block
    lanes = codes[:full].view(-1, 2, block // 32, 16, width)                    # [blocks, low/high, pairs, 16, K]
    pairs = lanes[:, 1].bitwise_left_shift(4).bitwise_or_(lanes[:, 0])          # [blocks, pairs, 16, K]
    packed[:full].view(-1, width, block // 32, 16).copy_(pairs.permute(0, 3, 1, 2))
    tail = codes[full:].view(-1, 2, width)                                       # [rows / 2, even/odd, K]
    packed[full:].view(width, -1).copy_(tail[:, 1].bitwise_left_shift(4).bitwise_or_(tail[:, 0]).t())
    return packed


def _by_group(values: Tensor, num_rows: int, repeat: int) -> Tensor:
    """[n blocks, groups per block] -> [rows, width / 32] in the codes' group order."""
    values = values.view(num_rows, -1, repeat, values.shape[-1] // repeat)
    return values.transpose(1, 2).reshape(num_rows, -1)


# Each maps blocks [n, block bytes] -> (codes [n, groups, 32] uint8 in 0..15, scale [n, groups], zero [n, groups]
# float32) with w = (code - 8) * scale + zero equal to gguf_blocks' decoding of the block (before bf16 rounding).
def _q4_0(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    d = _half(blocks, 0)                                                          # [n, 1]
    return _nibbles(blocks[:, 2:], 1).view(-1, 1, GROUP), d, torch.zeros_like(d)


def _q4_1(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    d, m = _two_halves(blocks).unbind(1)                                          # [n] each
    return _word_nibbles(blocks, 1, 4).view(-1, 1, GROUP), d[:, None], (m + 8 * d)[:, None]


def _q4_k(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    d_dmin = _two_halves(blocks).unsqueeze(-1)                                   # [n, 2, 1]
    scale, shift = (d_dmin * _scale_min_k4(blocks[:, 4:16]).float()).unbind(1)    # [n, 8] each
    # sub-block j = 2c + h: nibble h of qs[32c : 32c + 32], worked 8 bytes at a time on contiguous int64 words
    # (uint8 reorders and strided int32 writes ran 2-4x slower)
    words = blocks[:, 16:].contiguous().view(torch.int64).view(-1, 4, 4)           # [n, chunk, 4 words]
    low, high = words & 0x0F0F0F0F0F0F0F0F, (words >> 4).bitwise_and_(0x0F0F0F0F0F0F0F0F)
    return torch.stack([low, high], dim=2).view(torch.uint8).view(-1, 8, GROUP), scale, 8 * scale - shift


def _q8_0(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    q = blocks[:, 2:].view(torch.int8)                                            # [n, 32]
    high = (q >> 4).add_(8).view(torch.uint8)                                     # arithmetic shift: -8..7 -> 0..15
    low = q.view(torch.uint8) & 0x0F
    d = _half(blocks, 0)                                                          # [n, 1]
    return (torch.stack([high, low], dim=1), torch.cat([16 * d, d], dim=1),
            torch.cat([torch.zeros_like(d), 8 * d], dim=1))


def _wide(q: Tensor, scale: Tensor, base: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """Codes q [n, 16 k] in 0..2^bits - 1 with w = scale * q + base per 16 (scale, base [n, k]) -> one group of 32
    per 16 weights: its high codes + c, then its low ones (module docstring)."""
    c = 8 - 2 ** (bits - 5)
    q = q.view(q.shape[0], -1, 1, SUB_BLOCK)                                       # [n, k, 1, 16]
    codes = torch.cat([(q >> 4).add_(c), q & 0x0F], dim=2)                         # [n, k, 2, 16]
    return codes.view(q.shape[0], -1, GROUP), scale, (base + scale * (136 - 16 * c)) / 17


def _q5_0(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    d = _half(blocks, 0).expand(-1, 2)                                            # [n, 2]
    return _wide(_q5_quants(blocks[:, 2:6], blocks[:, 6:]), d, -16 * d, 5)


def _q5_1(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    d, m = _half(blocks, 0).expand(-1, 2), _half(blocks, 2).expand(-1, 2)        # [n, 2] each
    return _wide(_q5_quants(blocks[:, 4:8], blocks[:, 8:]), d, m, 5)


def _q5_k(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    d_dmin = _two_halves(blocks).unsqueeze(-1)                                   # [n, 2, 1]
    scale, shift = (d_dmin * _scale_min_k4(blocks[:, 4:16]).float()).unbind(1)    # [n, 8] each: per 32
    return _wide(five_bit_k_codes(blocks), scale.repeat_interleave(2, 1), -shift.repeat_interleave(2, 1), 5)


def _q6_k(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    scale = _half(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()      # [n, 16]
    return _wide(six_bit_codes(blocks), scale, -32 * scale, 6)


_GROUPS = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k, T.Q8_0: _q8_0, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q5_K: _q5_k,
           T.Q6_K: _q6_k}
