"""Rotary position embeddings: inverse frequencies for each supported scaling, and their application."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from offload.model.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_position: int) -> tuple[Tensor, float]:
    """Returns (inv_freq [head_dim/2] float32, attention scale applied to cos/sin)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim, max_position)
    return inv_freq, 1.0


def _llama3(inv_freq: Tensor, rope: RopeConfig) -> Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, a smooth ramp in between.
    old_context = rope.original_max_position or 8192
    low_wavelen = old_context / rope.low_freq_factor
    high_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, head_dim: int, max_position: int) -> tuple[Tensor, float]:
    # YaRN: interpolate low frequencies by `factor`, extrapolate high ones, linear ramp between
    # the dimensions that complete beta_fast and beta_slow rotations over the original context.
    original = rope.original_max_position or max_position
    factor = rope.factor
    scale = rope.attention_factor
    if scale is None:
        scale = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0

    def correction_dim(num_rotations: float) -> float:
        return head_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(scale)


class Rotary:
    """Precomputed inverse frequencies on the compute device; cos/sin made per call from positions."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int, device: torch.device) -> None:
        inv_freq, self.attention_scale = inverse_frequencies(rope, head_dim, max_position)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [B, N] int -> cos, sin [B, 1, N, D] in `dtype` (computed in float32); sin's first half
        negated, as apply_rotary takes it."""
        angles = positions.float()[..., None] * self.inv_freq  # [B, N, D/2]
        angles = torch.cat((angles, angles), dim=-1)
        cos = (angles.cos() * self.attention_scale).to(dtype)
        sin = (angles.sin() * self.attention_scale).to(dtype)
        sin[..., :sin.shape[-1] // 2].neg_()
        return cos[:, None], sin[:, None]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, N, D] rotated by angle pairs (first half, second half); sin from Rotary.cos_sin (first half
    negated). (x2 * -s) is (-x2 * s) bit for bit: the same rotation as cat(-x2, x1) * sin, in 4 ops, not 7."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
