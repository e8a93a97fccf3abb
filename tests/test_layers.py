"""offload/model/layers.py's RMSNorm: on the CPU in fp32 it is torch's fused kernel, which must give the bits of the
transformers formula (float32 mean of squares, rsqrt, scale) it replaces: a torch that changed them fails here."""
from __future__ import annotations

import pytest
import torch

from offload.model.layers import rms_norm


def _transformers_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@pytest.mark.parametrize("hidden", [64, 576, 2048, 4096, 8192])
@pytest.mark.parametrize("rows", [1, 3, 16, 257])
def test_the_fused_norm_gives_the_formulas_bits(hidden, rows):
    generator = torch.Generator().manual_seed(hidden + rows)
    x = torch.randn(1, rows, hidden, generator=generator) * torch.rand(1, rows, 1, generator=generator) * 10
    weight = torch.randn(hidden, generator=generator)
    assert torch.equal(rms_norm(x, weight, 1e-5), _transformers_rms_norm(x, weight, 1e-5))


def test_a_bf16_input_is_normalised_in_float32_and_scaled_in_bf16():
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    weight = torch.randn(64, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.bfloat16 and torch.equal(out, _transformers_rms_norm(x, weight, 1e-6))
