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


def unpack(packed: Tensor, bits: int, num_codes: int) -> Tensor:
    """Inverse of pack: [packed_bytes] uint8 -> [num_codes] uint8 codes."""
    if bits == 8:
        return packed[:num_codes]
    if bits == 4:                                  # two codes per byte, low nibble first
        return torch.stack((packed & 0xF, packed >> 4), dim=-1).view(-1)[:num_codes]
    per_group, nbytes = _group(bits)
    wide = torch.int32 if nbytes <= 3 else torch.int64   # a 3-bit group is 24 bits: int32 ops suffice
    grouped = packed.to(wide).view(-1, nbytes)
    byte_shifts = torch.arange(nbytes, device=packed.device, dtype=wide) * 8
    words = (grouped << byte_shifts).sum(-1, dtype=wide)                      # [G]
    shifts = torch.arange(per_group, device=packed.device, dtype=wide) * bits
    codes = (words[:, None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:num_codes].to(torch.uint8)
