"""Bit packing: b-bit codes (b in 1..8) into a dense little-endian bit stream of uint8.

Codes are taken in groups whose bits fill whole bytes (3-bit: 8 codes -> 3 bytes; 4-bit: 2 -> 1), so
both directions are a handful of vectorised integer ops on any device.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def _group(bits: int) -> tuple[int, int]:
    """(codes per group, bytes per group)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"codes must have 1-8 bits, got {bits}")
    total = math.lcm(8, bits)
    return total // bits, total // 8


def packed_bytes(num_codes: int, bits: int) -> int:
    codes, nbytes = _group(bits)
    return -(-num_codes // codes) * nbytes


def packed_codes(num_bytes: int, bits: int) -> int:
    """How many codes `num_bytes` of whole packing groups hold (padding codes included)."""
    per_group, nbytes = _group(bits)
    if num_bytes % nbytes:
        raise ValueError(f"{num_bytes} bytes are not whole groups of {nbytes} for {bits}-bit codes")
    return num_bytes // nbytes * per_group


def pack(codes: Tensor, bits: int) -> Tensor:
    """codes [N] integers in [0, 2^bits) -> [packed_bytes(N, bits)] uint8."""
    per_group, nbytes = _group(bits)
    flat = codes.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= 1 << bits):
        raise ValueError(f"codes must lie in [0, {1 << bits})")
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % per_group)).view(-1, per_group)
    shifts = torch.arange(per_group, device=flat.device) * bits
    words = (flat << shifts).sum(-1)                                          # [G] up to 64 bits
    byte_shifts = torch.arange(nbytes, device=flat.device) * 8
    return ((words[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)


def unpack(packed: Tensor, bits: int, num_codes: int, dtype: torch.dtype = torch.uint8) -> Tensor:
    """Inverse of pack: [packed_bytes] uint8 -> [num_codes] codes as `dtype` (a float dtype converts them
    on the way: one write per code, no intermediate tensor of codes)."""
    per_group, nbytes = _group(bits)
    grouped = packed.view(-1, nbytes)
    out = torch.empty(grouped.shape[0], per_group, dtype=dtype, device=packed.device)
    mask = (1 << bits) - 1
    for j in range(per_group):
        # code j holds stream bits [j*bits, (j+1)*bits): the rest of one byte, plus the low bits of the next
        byte, shift = divmod(j * bits, 8)
        code = grouped[:, byte] >> shift if shift else grouped[:, byte]      # a zero shift would copy
        if shift + bits > 8:
            code = code | (grouped[:, byte + 1] << (8 - shift))
        out[:, j] = code & mask if shift + bits != 8 else code
    return out.view(-1)[:num_codes]
