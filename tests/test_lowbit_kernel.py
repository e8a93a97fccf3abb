"""The fused CUDA product of a self-draft's low-bit substitutes (quant/lowbit_triton.py) against the dense reference
(the substitute dequantized by quant/lowbit.py, then torch's linear): its CUDA code run by Triton's CPU interpreter
here, on the GPU where one is lent."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from quant.lowbit import LowBitWeight, quantize_matrix

ROOT = Path(__file__).resolve().parents[1]
# (N, K): N neither a multiple of the kernel's 64 output rows nor K of its 64 input columns (K: whole groups of 32)
SHAPES = ((80, 96), (64, 64), (130, 160))
ROWS = (1, 5, 17, 40)
# bf16 on the GPU only: Triton 3.9's interpreter multiplies bf16 tiles wrongly (tl.dot of two bf16 16x16 tiles of
# randn is off by 1e10 there), the kernel's fp32 and fp16 products it runs right
DTYPES = ((torch.float32, 1e-4), (torch.float16, 2e-3), (torch.bfloat16, 2e-2))


def check_lowbit_kernel(device: str = "cpu") -> None:
    """The kernel (on `device`; on the CPU only under TRITON_INTERPRET=1) against the dense reference, fp32, fp16
    (and bf16 on a GPU), 2-4 bits, row counts across its 16/32/64-row tiles."""
    from quant import lowbit_triton
    generator = torch.Generator().manual_seed(0)
    for bits in (2, 3, 4):
        for num_out, num_in in SHAPES:
            matrix = quantize_matrix(torch.randn(num_out, num_in, generator=generator), bits, rounds=2)
            weight = LowBitWeight(matrix, torch.device(device))
            for dtype, tolerance in DTYPES[:None if device == "cuda" else 2]:
                for rows in ROWS:
                    x = torch.randn(rows, num_in, generator=generator).to(dtype)
                    expected = F.linear(x.double(), matrix.dequantize(torch.float64))
                    got = lowbit_triton.matmul(x.to(device), weight.packed, weight.scale, weight.offset, weight.shape,
                                               bits, matrix.group)
                    assert got.dtype == dtype and got.shape == (rows, num_out)
                    scale = expected.abs().max().item()
                    error = (got.double().cpu() - expected).abs().max().item() / scale
                    assert error < tolerance, (bits, num_out, num_in, dtype, rows, error)


def test_the_lowbit_kernel_equals_the_dense_reference_under_the_triton_interpreter():
    """The CUDA kernel's code, run by Triton's CPU interpreter (in a child process: the interpreter is chosen
    when Triton is first imported)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); "
                             "from test_lowbit_kernel import check_lowbit_kernel; check_lowbit_kernel()"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_lowbit_kernel_avoids_the_argument_names_older_triton_binders_use():
    """Triton 3.6's argument binder assigns `params`, `options` and `specialization` beside the kernel's own
    arguments (quant/spqr_triton.py's test says what that breaks on a GPU)."""
    pytest.importorskip("triton")
    from quant.lowbit_triton import _matmul_kernel
    assert not {"params", "options", "specialization"} & set(_matmul_kernel.arg_names)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_lowbit_kernel_on_cuda_equals_the_dense_reference():
    pytest.importorskip("triton")
    check_lowbit_kernel("cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_substitute_on_cuda_multiplies_through_the_kernel():
    pytest.importorskip("triton")
    from quant import lowbit
    matrix = quantize_matrix(torch.randn(256, 512), 3)
    weight, x = LowBitWeight(matrix, torch.device("cuda")), torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    expected = F.linear(x.double().cpu(), matrix.dequantize(torch.float64))
    got = weight.matmul(x)
    assert lowbit.FUSED.usable and not lowbit.FUSED.failures
    assert (got.double().cpu() - expected).abs().max().item() < 2e-2 * expected.abs().max().item()
