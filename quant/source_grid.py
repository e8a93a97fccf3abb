"""Recognises weights that already lie on a blockwise 4-bit grid, as a model imported from a GGUF Q4_1 file
does: per row and block of 32 inputs, w = d * q + m with q in 0..15, the block's minimum at q = 0 and its
maximum at q = 15 (Q4_1's d is (max - min) / 15). Groups of 32 in input order find that grid again exactly
(`quantize --groupsize 32 --stats-bits 8 --no-act-order`); act-order's groups mix blocks and cannot."""
from __future__ import annotations

import torch
from torch import Tensor

Q4_1_BLOCK, Q4_1_LEVELS = 32, 16


def on_block_grid(weight: Tensor, block: int = Q4_1_BLOCK, levels: int = Q4_1_LEVELS, tolerance: float = 1e-3) -> bool:
    """weight [out, in]: whether every block of `block` inputs per row holds values min + k * (max - min) /
    (levels - 1) for integers k (to `tolerance` of a step; constant blocks count as on the grid)."""
    rows, cols = weight.shape
    if cols % block:
        return False
    blocks = weight.float().reshape(rows, cols // block, block)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    step = (high - low) / (levels - 1)
    steps = (blocks - low) / torch.where(step > 0, step, torch.ones_like(step))
    return bool(((steps - steps.round()).abs() <= tolerance).all())


def aligned_settings_hint(weights: dict[str, Tensor], bits: int, groupsize: int, stats_bits: int,
                          act_order: bool) -> str | None:
    """One line suggesting the aligned settings when a layer's matrices (name -> [out, in]) sit on Q4_1's
    grid and the chosen w4 settings would not keep to it; None otherwise."""
    aligned = (groupsize == Q4_1_BLOCK and not act_order and stats_bits >= 8)
    if bits != 4 or aligned or not weights or not all(on_block_grid(w) for w in weights.values()):
        return None
    return ("the source's weights lie on a GGUF Q4_1 grid (blocks of 32 inputs): --groupsize 32 --stats-bits 8 "
            "--no-act-order keeps to it at the same bits per parameter")
