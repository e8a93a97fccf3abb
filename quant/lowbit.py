"""Low-bit group-wise weights without calibration: the substitutes a self-draft runs in place of streamed layers.

Each group of `group` consecutive input columns of a row holds codes q in [0, 2^bits) and an affine map
w ~ scale * q + offset (fp16 scale and offset: 32 bits per group). Round-to-nearest from the group's min and max
wastes levels on the extremes; here the map is refined from the weights alone (no calibration data), in the
spirit of HQQ's optimized scales and zeros: alternate (a) the best codes for the map (round and clamp) and (b)
the least-squares map for the codes (a line fit of w on q per group). Each half-step cannot raise the group's
squared error, so a few rounds settle; at 3 and 2 bits they cut it by a fifth to a third against min-max.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from offload.fused import OptionalKernel
from offload.weights.ggml_types import GGMLType
from offload.weights.packed_linear import GROUP, ROW_MULTIPLE, Int4Weight, from_gguf, pack_codes, takes_dense
from .packbits import pack, packed_bytes, unpack

REFINE_ROUNDS = 12
FUSED = OptionalKernel("quant.lowbit_triton", "low-bit substitutes")    # the CUDA kernel, where Triton runs
FUSED_ROWS = 256              # a draft round's rows: a longer input (a catch-up) is dequantized and multiplied densely
CHUNK_ROWS = 4096             # rows quantized at once: temporaries stay a few hundred MB at 70B widths


@dataclass(slots=True)
class LowBitMatrix:
    codes: Tensor        # [N, K] uint8 in [0, 2^bits)
    scale: Tensor        # [N, K / group] fp16
    offset: Tensor       # [N, K / group] fp16: w = scale * q + offset
    bits: int
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """-> [N, K] in dtype."""
        num_out, num_in = self.shape
        codes = self.codes.view(num_out, -1, self.group).to(dtype)
        return (codes * self.scale[..., None].to(dtype) + self.offset[..., None].to(dtype)).view(num_out, num_in)

    @property
    def nbytes(self) -> int:
        """Stored at `bits` per code (bit-packed) plus fp16 scale and offset per group."""
        return packed_bytes(self.codes.numel(), self.bits) + 2 * self.scale.numel() * 2


def quantize_matrix(weight: Tensor, bits: int, group: int = 32, rounds: int = REFINE_ROUNDS) -> LowBitMatrix:
    """weight [N, K] (K a multiple of group) -> its low-bit form (computed in float32 on weight's device)."""
    if not 2 <= bits <= 8:
        raise ValueError(f"low-bit weights take 2-8 bits, got {bits}")
    num_out, num_in = weight.shape
    if num_in % group:
        raise ValueError(f"{num_in} input columns do not divide into groups of {group}")
    parts = [_quantize_rows(weight[start:start + CHUNK_ROWS].float(), bits, group, rounds)
             for start in range(0, num_out, CHUNK_ROWS)]
    codes, scale, offset = (torch.cat(values) for values in zip(*parts))
    return LowBitMatrix(codes, scale, offset, bits, group)


def _quantize_rows(weight: Tensor, bits: int, group: int, rounds: int) -> tuple[Tensor, Tensor, Tensor]:
    num_out = weight.shape[0]
    w = weight.view(num_out, -1, group)                                       # [n, G, g]
    max_code = (1 << bits) - 1
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((high - low) / max_code).clamp(min=1e-8)                         # [n, G, 1]
    offset = low
    for _ in range(rounds):
        codes = ((w - offset) / scale).round_().clamp_(0, max_code)
        scale, offset = _line_fit(codes, w, scale, offset)
    scale, offset = scale.half().float(), offset.half().float()               # as stored
    codes = ((w - offset) / scale.clamp(min=1e-8)).round_().clamp_(0, max_code)
    return codes.to(torch.uint8).view(num_out, -1), scale[..., 0].half(), offset[..., 0].half()


def _line_fit(codes: Tensor, w: Tensor, scale: Tensor, offset: Tensor) -> tuple[Tensor, Tensor]:
    """Least-squares scale and offset of w ~ scale * codes + offset per group (kept where codes are constant)."""
    mean_q, mean_w = codes.mean(-1, keepdim=True), w.mean(-1, keepdim=True)
    centred = codes - mean_q
    variance = (centred * centred).mean(-1, keepdim=True)
    covariance = (centred * (w - mean_w)).mean(-1, keepdim=True)
    fitted = variance > 1e-12
    new_scale = torch.where(fitted, covariance / variance.clamp(min=1e-12), scale).clamp(min=1e-8)
    new_offset = torch.where(fitted, mean_w - new_scale * mean_q, offset)
    return new_scale, new_offset


def relative_error(weight: Tensor, matrix: LowBitMatrix) -> float:
    """||W - Q(W)||_F / ||W||_F: the quantizer's own report of what it lost."""
    weight = weight.float()
    return float((weight - matrix.dequantize(torch.float32)).norm() / weight.norm().clamp(min=1e-30))


# --- stored form (the model cache) ----------------------------------------------------------------------
def to_tensors(matrix: LowBitMatrix, prefix: str) -> dict[str, Tensor]:
    """Bit-packed codes, scale and offset under `prefix.` (safetensors-ready)."""
    return {f"{prefix}.codes": pack(matrix.codes.reshape(-1), matrix.bits), f"{prefix}.scale": matrix.scale,
            f"{prefix}.offset": matrix.offset}


def from_tensors(tensors: dict[str, Tensor], prefix: str, shape: tuple[int, int], bits: int,
                 group: int) -> LowBitMatrix:
    """The inverse of to_tensors, checked against the expected shape (a cache file is untrusted input)."""
    num_out, num_in = shape
    scale, offset, packed = (tensors[f"{prefix}.{name}"] for name in ("scale", "offset", "codes"))
    groups = (num_out, num_in // group)
    if tuple(scale.shape) != groups or tuple(offset.shape) != groups or scale.dtype != torch.float16 \
            or offset.dtype != torch.float16 or packed.dtype != torch.uint8 \
            or packed.numel() != packed_bytes(num_out * num_in, bits):
        raise ValueError(f"low-bit matrix {prefix} does not match its shape {shape} at {bits} bits")
    codes = unpack(packed, bits, num_out * num_in).view(num_out, num_in)
    return LowBitMatrix(codes, scale, offset, bits, group)


class LowBitWeight:
    """A low-bit matrix the layer math multiplies (offload/model/layers.linear): on CUDA from its packed codes by
    the fused kernel, elsewhere dequantized at each use. Holds the codes bit-packed: bits + 32 / group bits per
    weight."""

    def __init__(self, matrix: LowBitMatrix, device: torch.device) -> None:
        self.shape, self.bits, self.group = matrix.shape, matrix.bits, matrix.group
        self.packed = pack(matrix.codes.reshape(-1), matrix.bits).to(device)
        self.scale, self.offset = matrix.scale.to(device), matrix.offset.to(device)

    def matmul(self, x: Tensor) -> Tensor:
        """x [..., K] -> [..., N]. On CUDA, a draft round's rows go through the fused kernel (quant/lowbit_triton.py)
        where Triton runs; otherwise the weight is unpacked and dequantized for this product."""
        if x.is_cuda and x.numel() <= FUSED_ROWS * self.shape[1]:
            out = FUSED.run("matmul", x, self.packed, self.scale, self.offset, self.shape, self.bits, self.group)
            if out is not None:
                return out
        return self.dense_matmul(x)

    def dense_matmul(self, x: Tensor) -> Tensor:
        """matmul's torch path: the weight unpacked and dequantized in x's dtype for this product."""
        codes = unpack(self.packed, self.bits, self.shape[0] * self.shape[1]).view(self.shape)
        matrix = LowBitMatrix(codes, self.scale, self.offset, self.bits, self.group)
        return F.linear(x, matrix.dequantize(x.dtype))

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + 2 * self.scale.numel() * 2


def substitute_weight(matrix: LowBitMatrix, device: torch.device):
    """What a substitute layer multiplies with: on a CPU, torch's int4 kernel when the matrix suits it (codes of up
    to 4 bits in groups of 32, rows a multiple of 16: w = (q - 8) * scale + zero, zero = offset + 8 * scale, the
    layout of offload/weights/packed_linear.py, 4 bits per code whatever `bits`); else a LowBitWeight."""
    num_out, num_in = matrix.shape
    if device.type != "cpu" or matrix.bits > 4 or matrix.group != GROUP or num_out % ROW_MULTIPLE:
        return LowBitWeight(matrix, device)
    scale = matrix.scale.float()
    scale_zeros = torch.stack((scale, matrix.offset.float() + 8 * scale), dim=-1)       # [N, G, 2]
    return DraftInt4Weight(pack_codes(matrix.codes), scale_zeros.transpose(0, 1).to(torch.bfloat16).contiguous(),
                           (num_out, num_in))


class DraftInt4Weight(Int4Weight):
    """Int4Weight for a draft: its rows need no bitwise agreement with a one-token pass (only the target's
    verification does), so a layer built of these attends in its own dtype, not float64 (layers.py)."""
    __slots__ = ()
    is_row_exact = False


def substitute_bytes(num_params: int, bits: int, group: int, device_is_cpu: bool) -> int:
    """Device bytes of `num_params` weights as substitute_weight holds them (CPU int4 kernel: 4 bits a code)."""
    code_bits = 4 if device_is_cpu and bits <= 4 and group == 32 else bits
    return num_params * code_bits // 8 + num_params // group * 4


# --- a draft's output matrix on a CPU -----------------------------------------------------------------------
def int8_head(weight: Tensor) -> DraftInt4Weight:
    """weight [N, K] float -> its symmetric 8-bit form in groups of 32 (GGUF Q8_0: d = max |w| / 127, q =
    round(w / d); a Q8_0 matrix decoded to float comes back to its own codes), multiplied by the int4 kernel as two
    products (offload/weights/packed_linear.py). A self-draft scores tokens with it where the target's head is a
    dense float matrix: at one row 0.8 ms against 9.7 ms of fp32 for the default model's 49,152 x 576 head."""
    num_out, num_in = weight.shape
    if not takes_dense((num_out, num_in)):
        raise ValueError(f"an int8 head needs rows a multiple of {ROW_MULTIPLE} and columns of {GROUP}, "
                         f"got {tuple(weight.shape)}")
    blocks = torch.empty(num_out * num_in // GROUP, 2 + GROUP, dtype=torch.uint8)     # Q8_0: fp16 d, 32 int8
    for start in range(0, num_out, CHUNK_ROWS):
        rows = weight[start:start + CHUNK_ROWS].float().reshape(-1, GROUP)             # [n, 32]
        d = (rows.abs().amax(-1, keepdim=True) / 127).half()
        inverse = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
        first = start * num_in // GROUP
        out = blocks[first:first + rows.shape[0]]
        out[:, :2] = d.view(torch.uint8)
        out[:, 2:] = (rows * inverse).round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    packed = from_gguf(blocks.view(-1), GGMLType.Q8_0, (num_out, num_in))
    return DraftInt4Weight(packed.codes, packed.scale_zeros, packed.shape, packed.repeat)
