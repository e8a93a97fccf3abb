"""SpQR for one weight matrix: GPTQ's column-by-column quantization with error feedback through the
inverse Hessian, act-order, small groups with second-level statistics, and unstructured outliers.

With H = 2/N sum x x^T the layer's input statistics and U the upper Cholesky factor of H^-1 (d_j its
diagonal), quantizing column j with error e_j = (w_j - q_j) / d_j and updating the later columns by
-e_j U[j, j+1:] keeps the layer output error minimal (OBS/GPTQ). A weight whose scaled error e^2
exceeds tau * mean_j(Var(W[:, j]) / d_j^2) is an outlier: kept exactly (16 bits), its error zero.
Group statistics are fitted without the weights that look like outliers (leave-one-out error); the zero
points, quantized again to stats_bits per run of 16 rows, are integers (GPTQ) or real (SpQR: the grid
spans the group's range exactly), per run whichever leaves the smaller scaled error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .spqr_format import STATS_RUN, SpqrMatrix, _second_level, pack_matrix, quantize_stats

ALGORITHM = 3                  # 3: per run of rows, integer or real zero points (a cache of quantized models keys on it)
FULL_PRECISION_STATS = 16      # stats_bits meaning "group scale and zero kept in fp16" (plain GPTQ)


@dataclass(slots=True)
class SpqrConfig:
    bits: int = 4
    groupsize: int = 16
    stats_bits: int = 3                      # FULL_PRECISION_STATS: fp16 group statistics
    outlier_threshold: float = 0.2           # tau; math.inf: no outliers
    damping: float = 1.0                     # added to diag(H), times its mean
    act_order: bool = True
    blocksize: int = 128

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ValueError(f"bits must lie in 2..8, got {self.bits}")
        if self.groupsize < 2 or self.blocksize % self.groupsize:
            raise ValueError(f"groupsize must be >= 2 and divide the block size {self.blocksize}, got {self.groupsize}")
        if self.stats_bits not in range(2, 9) and self.stats_bits != FULL_PRECISION_STATS:
            raise ValueError(f"stats bits must lie in 2..8 or be {FULL_PRECISION_STATS}, got {self.stats_bits}")
        if self.outlier_threshold <= 0 or self.damping < 0:
            raise ValueError("the outlier threshold must be > 0 and the damping >= 0")


@dataclass(slots=True)
class QuantizedMatrix:
    dequantized: Tensor          # [out, in] float32: what the runtime computes with
    packed: SpqrMatrix | None    # the stored form (None for fp16 group statistics: a baseline only)
    relative_error: float        # ||(W - Q) X||^2 / ||W X||^2 under the calibration Hessian
    outlier_share: float
    bits_per_param: float        # from the bytes the stored form takes


def quantize_matrix(weight: Tensor, hessian: Tensor, config: SpqrConfig) -> QuantizedMatrix:
    """weight [out, in], hessian [in, in] (float32) -> the quantized matrix and its error report."""
    out, inp = weight.shape
    if inp % config.groupsize:
        raise ValueError(f"a {out}x{inp} matrix cannot be quantized in groups of {config.groupsize} input columns")
    original = weight.float()
    W, H = original.clone(), hessian.float().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = torch.argsort(H.diagonal(), descending=True) if config.act_order else torch.arange(inp)
    W, H = W[:, perm], H[perm][:, perm]
    H.diagonal().add_(config.damping * H.diagonal().mean())
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    d = U.diagonal()
    threshold = config.outlier_threshold * float((W.var(dim=0) / d.square()).mean())
    state = _State.new(out, inp, config)
    for start in range(0, inp, config.blocksize):
        end = min(start + config.blocksize, inp)
        errors = _quantize_block(W, U, d, start, end, threshold, state, config)
        W[:, end:] -= errors @ U[start:end, end:]
    packed = state.pack((out, inp), perm, W, config)
    if packed is not None:     # what the runtime will compute with (equal to W up to float rounding)
        dequantized = packed.dequantize()
    else:
        dequantized = torch.empty_like(W)
        dequantized[:, perm] = W
    bits = 8 * packed.num_bytes / W.numel() if packed else _full_precision_bits(state, W, perm, config)
    return QuantizedMatrix(dequantized, packed, relative_error(original, dequantized, hessian),
                           float(state.outliers.float().mean()), bits)


@dataclass(slots=True)
class _State:
    codes: Tensor            # [out, in] uint8, permuted columns
    outliers: Tensor         # [out, in] bool
    scale_codes: Tensor      # [out, groups] uint8 (or fp16 statistics in full precision)
    zero_codes: Tensor
    stat_params: Tensor      # [runs, groups, 4]
    group_scale: Tensor      # [out] the current group's dequantized statistics
    group_zero: Tensor

    @classmethod
    def new(cls, out: int, inp: int, config: SpqrConfig) -> "_State":
        groups, runs = inp // config.groupsize, -(-out // STATS_RUN)
        return cls(torch.zeros(out, inp, dtype=torch.uint8), torch.zeros(out, inp, dtype=torch.bool),
                   torch.zeros(out, groups), torch.zeros(out, groups), torch.zeros(runs, groups, 4),
                   torch.ones(out), torch.zeros(out))

    def pack(self, shape: tuple[int, int], perm: Tensor, W: Tensor, config: SpqrConfig) -> SpqrMatrix | None:
        if config.stats_bits == FULL_PRECISION_STATS:
            return None
        return pack_matrix(shape, config.bits, config.groupsize, config.stats_bits, self.codes,
                           self.scale_codes.to(torch.uint8), self.zero_codes.to(torch.uint8), self.stat_params,
                           perm if config.act_order else perm[:0], self.outliers, W)


def _quantize_block(W: Tensor, U: Tensor, d: Tensor, start: int, end: int, threshold: float, state: _State,
                    config: SpqrConfig) -> Tensor:
    """Quantizes columns [start, end) in place, updating the block's later columns; -> errors [out, n]."""
    maxq = (1 << config.bits) - 1
    errors = torch.zeros(W.shape[0], end - start)
    for column in range(start, end):
        if column % config.groupsize == 0:
            _fit_group(W[:, column:column + config.groupsize], d[column:column + config.groupsize],
                       column // config.groupsize, threshold, state, config)
        w = W[:, column]
        code = torch.round(w / state.group_scale + state.group_zero).clamp(0, maxq)
        quantized = (code - state.group_zero) * state.group_scale
        if math.isfinite(threshold):
            is_outlier = ((w - quantized) / d[column]).square() > threshold
            quantized = torch.where(is_outlier, w.half().float(), quantized)     # stored in fp16
            state.outliers[:, column] = is_outlier
        error = (w - quantized) / d[column]
        state.codes[:, column] = code.to(torch.uint8)
        W[:, column] = quantized
        W[:, column + 1:end] -= error[:, None] * U[column, column + 1:end]
        errors[:, column - start] = error
    return errors


def _fit_group(group: Tensor, d: Tensor, index: int, threshold: float, state: _State, config: SpqrConfig) -> None:
    """Min-max scale and zero per row over the group's likely inliers, quantized again to stats_bits."""
    maxq = (1 << config.bits) - 1
    inliers = group
    if math.isfinite(threshold):
        suspect = _leave_one_out_error(group, d, maxq) > threshold                 # [out, g]
        fill = (group * ~suspect).sum(1, keepdim=True) / (~suspect).sum(1, keepdim=True).clamp(min=1)
        inliers = torch.where(suspect, fill, group)
    low, high = inliers.amin(1), inliers.amax(1)
    scale = ((high - low) / maxq).clamp(min=1e-8)
    if config.stats_bits == FULL_PRECISION_STATS:      # plain GPTQ: an integer zero point
        zero = torch.round(-low / scale).clamp(0, maxq)
        state.group_scale, state.group_zero = scale.half().float(), zero
        state.scale_codes[:, index], state.zero_codes[:, index] = state.group_scale, zero
        return
    scale_codes, scale_scale, scale_zero = quantize_stats(scale[:, None], config.stats_bits)
    out = group.shape[0]
    # The stored statistics, decoded exactly as the runtime decodes them, are the ones the codes use.
    decoded_scale = _second_level(scale_codes.reshape(-1).float(), scale_scale, scale_zero, out, 1)[:, 0]
    zero_codes, zero_params, decoded_zero = _choose_zeros(inliers, d, low, scale, decoded_scale, maxq,
                                                            config.stats_bits)
    params = torch.cat((scale_scale, scale_zero, zero_params), dim=-1)                       # [runs, 4]
    state.stat_params[:, index] = params
    state.scale_codes[:, index], state.zero_codes[:, index] = scale_codes[:, 0].float(), zero_codes.float()
    state.group_scale, state.group_zero = decoded_scale, decoded_zero


def _choose_zeros(inliers: Tensor, d: Tensor, low: Tensor, scale: Tensor, decoded_scale: Tensor, maxq: int,
                  stats_bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """The zero points of a column of groups, quantized again to stats_bits: per run of rows, the integer
    zeros (GPTQ's) or the real ones (SpQR's: the grid spans [low, high] exactly), whichever leaves the run's
    inliers the smaller scaled error. -> (codes [out], run params [runs, 2], decoded zeros [out])."""
    out = inliers.shape[0]
    runs = -(-out // STATS_RUN)
    candidates = []
    for zero in (torch.round(-low / scale).clamp(0, maxq), -low / scale):
        codes, zero_scale, zero_zero = quantize_stats(zero[:, None], stats_bits)
        decoded = _second_level(codes.reshape(-1).float(), zero_scale, zero_zero, out, 1)[:, 0]
        quantized = (torch.round(inliers / decoded_scale[:, None] + decoded[:, None]).clamp(0, maxq)
                     - decoded[:, None]) * decoded_scale[:, None]
        row_error = ((inliers - quantized) / d).square().sum(1)
        run_error = torch.cat((row_error, row_error.new_zeros(runs * STATS_RUN - out))).view(runs, -1).sum(1)
        candidates.append((codes[:, 0], torch.cat((zero_scale, zero_zero), dim=-1), decoded, run_error))
    (codes_a, params_a, decoded_a, error_a), (codes_b, params_b, decoded_b, error_b) = candidates
    real_runs = error_b < error_a                                                             # [runs]
    real_rows = real_runs.repeat_interleave(STATS_RUN)[:out]
    return (torch.where(real_rows, codes_b, codes_a), torch.where(real_runs[:, None], params_b, params_a),
            torch.where(real_rows, decoded_b, decoded_a))


def _leave_one_out_error(group: Tensor, d: Tensor, maxq: int) -> Tensor:
    """[out, g]: each weight's scaled squared error when its group's min-max statistics leave it out."""
    size = group.shape[1]
    others = group[:, None, :].expand(-1, size, -1)[:, ~torch.eye(size, dtype=torch.bool)].view(-1, size, size - 1)
    low, high = others.amin(-1), others.amax(-1)                                   # [out, g]
    scale = ((high - low) / maxq).clamp(min=1e-8)
    zero = torch.round(-low / scale)
    quantized = (torch.round(group / scale + zero).clamp(0, maxq) - zero) * scale
    return ((group - quantized) / d).square()


def _full_precision_bits(state: _State, W: Tensor, perm: Tensor, config: SpqrConfig) -> float:
    """Plain GPTQ's true cost: codes, a 16-bit scale and zero per row and group, 16-bit outliers with
    their 16-bit column, the permutation."""
    out, inp = W.shape
    outliers = int(state.outliers.sum())
    return (config.bits * out * inp + 32 * out * (inp // config.groupsize) + 32 * outliers
            + 16 * inp * config.act_order) / (out * inp)


def relative_error(original: Tensor, quantized: Tensor, hessian: Tensor) -> float:
    """||(W - Q) X||^2 / ||W X||^2 with H = X X^T (up to a constant)."""
    delta = original - quantized
    error = float(torch.einsum("ij,jk,ik->", delta, hessian.float(), delta))
    reference = float(torch.einsum("ij,jk,ik->", original, hessian.float(), original))
    return error / max(reference, 1e-30)
