"""Baselines SpQR is measured against, as dequantized weights held in memory: round-to-nearest with a 16-bit
scale and zero per group, plain GPTQ (fp16 group statistics, no outliers), bitsandbytes NF4."""
from __future__ import annotations

import logging
import math
import sys

import torch
from torch import Tensor

from offload.weights.source import CheckpointSource
from .calibrate import LayerRunner
from .checkpoint import MATRICES
from .quantize import quantize_layer
from .spqr import FULL_PRECISION_STATS, SpqrConfig

NF4_BLOCK = 64


def round_to_nearest(weight: Tensor, bits: int, groupsize: int) -> Tensor:
    """Min-max asymmetric quantization per row and group of input columns (scale/zero kept in fp16)."""
    out, inp = weight.shape
    if inp % groupsize:
        raise ValueError(f"{inp} input columns do not divide into groups of {groupsize}")
    maxq = (1 << bits) - 1
    groups = weight.float().view(out, inp // groupsize, groupsize)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / maxq).clamp(min=1e-8).half().float()
    zero = (-low / scale).half().float()                                   # fp16 zero: the grid spans [low, high]
    return ((torch.round(groups / scale + zero).clamp(0, maxq) - zero) * scale).view(out, inp)


def rtn_bits(bits: int, groupsize: int) -> float:
    return bits + 32 / groupsize


def nf4(weight: Tensor) -> Tensor:
    """bitsandbytes' NF4 (blocks of 64, fp32 absmax per block), dequantized."""
    bnb = _bitsandbytes_functional()
    packed, state = bnb.quantize_4bit(weight.float().contiguous(), blocksize=NF4_BLOCK, quant_type="nf4")
    return bnb.dequantize_4bit(packed, state).view(weight.shape).float()


NF4_BITS = 4 + 32 / NF4_BLOCK


def _bitsandbytes_functional():
    """bitsandbytes.functional, imported without its CPU backend's attempt to download a kernel from the
    Hugging Face Hub (made at import time when the `kernels` package is installed): nothing here fetches
    at run time, and NF4's quantize/dequantize do not use that kernel."""
    if "bitsandbytes.functional" not in sys.modules and "kernels" not in sys.modules:
        sys.modules["kernels"] = None                      # `from kernels import ...` raises ImportError
        quiet = logging.getLogger("bitsandbytes.backends.cpu.ops")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            import bitsandbytes.functional
        finally:
            del sys.modules["kernels"]
            quiet.setLevel(level)
    import bitsandbytes.functional as bnb
    return bnb


def transformed_layers(source: CheckpointSource, transform) -> list[dict[str, Tensor]]:
    """Every layer with its matrices replaced by transform(weight)."""
    layers = []
    for index in range(source.config.num_layers):
        weights = {name: t.float() for name, t in source.layer(index).items()}
        layers.append({**weights, **{name: transform(weights[name]) for name in MATRICES}})
    return layers


def gptq_layers(source: CheckpointSource, calibration: Tensor, bits: int, groupsize: int = 16,
                on_layer=None) -> tuple[list[dict[str, Tensor]], float]:
    """Plain GPTQ (act-order, fp16 group statistics, no outliers), calibrated like SpQR
    -> (dequantized layers, bits per parameter)."""
    config = SpqrConfig(bits, groupsize, FULL_PRECISION_STATS, math.inf)
    hidden = torch.nn.functional.embedding(calibration, source.global_tensors()["embed"]).float()
    runner = LayerRunner(source.config, calibration.shape[1])
    layers, bits_sum, params = [], 0.0, 0
    for index in range(source.config.num_layers):
        weights = {name: t.float() for name, t in source.layer(index).items()}
        quantized, _, report = quantize_layer(weights, runner.hessians(hidden, weights, index), config)
        hidden = runner.run(hidden, quantized, index)
        layers.append(quantized)
        bits_sum += report["bits_per_param"] * report["params"]
        params += report["params"]
        if on_layer:
            on_layer(index)
    return layers, bits_sum / params


class InMemorySource(CheckpointSource):
    """A checkpoint whose decoder layers are replaced by tensors held in memory (a baseline's weights)."""

    def __init__(self, base: CheckpointSource, layers: list[dict[str, Tensor]]) -> None:
        self.__dict__.update(base.__dict__)
        self._layers = layers

    def layer(self, index: int) -> dict[str, Tensor]:
        return self._layers[index]
