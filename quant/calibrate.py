"""Layer-wise calibration: the calibration sequences' hidden states flow through the decoder one layer at
a time (through the already quantized earlier layers); each layer's matrices collect their input
Hessians from one forward, are quantized, and the quantized layer produces the next layer's inputs."""
from __future__ import annotations

import torch
from torch import Tensor

from offload.model.config import ModelConfig
from offload.model.layers import decoder_layer
from offload.model.rope import Rotary
from .checkpoint import MATRICES


class PassThroughCache:
    """A cache that keeps nothing: every calibration sequence is seen whole in one pass."""
    length = 0
    num_slots = 0

    def append(self, layer: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        return keys, values


class HessianCollector:
    """Stands in for a weight in the layer math: computes x W^T and accumulates H = 2/N sum x x^T."""

    def __init__(self, weight: Tensor) -> None:
        self.weight = weight
        self.hessian = torch.zeros(weight.shape[1], weight.shape[1])
        self.num_rows = 0

    def matmul(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        total = self.num_rows + rows.shape[0]
        self.hessian.mul_(self.num_rows / total).addmm_(rows.T, rows, alpha=2 / total)
        self.num_rows = total
        return torch.nn.functional.linear(x, self.weight)


class LayerRunner:
    """Runs one decoder layer over all calibration sequences (in batches), with any weights."""

    def __init__(self, config: ModelConfig, seqlen: int, batch_size: int = 8) -> None:
        self.config, self.batch_size = config, batch_size
        rotary = Rotary(config.rope, config.head_dim, config.max_position, torch.device("cpu"))
        positions = torch.arange(seqlen)[None]
        self.cos, self.sin = rotary.cos_sin(positions, torch.float32)
        self.mask = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()[None, None]

    @torch.inference_mode()
    def run(self, hidden: Tensor, weights: dict, index: int) -> Tensor:
        """hidden [S, T, H] float32 -> the layer's outputs [S, T, H]."""
        out = torch.empty_like(hidden)
        for start in range(0, hidden.shape[0], self.batch_size):
            batch = hidden[start:start + self.batch_size]
            out[start:start + self.batch_size] = decoder_layer(batch, weights, self.config, index, self.cos, self.sin,
                                                               self.mask, PassThroughCache())
        return out

    def hessians(self, hidden: Tensor, weights: dict[str, Tensor], index: int) -> dict[str, Tensor]:
        """Each matrix's input Hessian [in, in] over the calibration sequences."""
        collectors = {name: HessianCollector(weights[name].float()) for name in MATRICES}
        self.run(hidden, {**weights, **collectors}, index)
        return {name: collector.hessian for name, collector in collectors.items()}
