"""GGUF block decoding in torch against gguf's own numpy reference, bit for bit."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as reference_dequantize

from offload.weights import gguf_blocks

ROOT = Path(__file__).resolve().parents[1]

SUPER_BLOCK_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)


def _shapes(qtype: T) -> list[tuple[int, ...]]:
    shapes = [(8, 256), (3, 512)]
    return shapes if qtype in SUPER_BLOCK_TYPES else shapes + [(5, 64), (2, 3, 96)]


CASES = [(qtype, shape) for qtype in gguf_blocks.SUPPORTED_TYPES for shape in _shapes(qtype)]


def _packed(qtype: T, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return gguf_blocks.random_blocks(qtype, shape, np.random.default_rng(seed))     # [packed_nbytes] uint8


def _reference(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> torch.Tensor:
    values = reference_dequantize(raw.reshape(int(np.prod(shape[:-1])), -1), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def _assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # int32 views also tell -0.0 from +0.0, which torch.equal on floats would not
    assert actual.dtype == expected.dtype == torch.float32 and actual.shape == expected.shape
    assert torch.isfinite(expected).all()
    assert torch.equal(actual.cpu().view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("qtype,shape", CASES, ids=[f"{q.name}-{'x'.join(map(str, s))}" for q, s in CASES])
def test_matches_gguf_reference_bit_exact(qtype: T, shape: tuple[int, ...]) -> None:
    raw = _packed(qtype, shape)
    assert raw.nbytes == gguf_blocks.packed_nbytes(qtype, shape)
    decoded = gguf_blocks.dequantize(torch.from_numpy(raw), qtype, shape)
    _assert_bits_equal(decoded, _reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", gguf_blocks.REFERENCE_QUANTIZED_TYPES, ids=lambda q: q.name)
def test_decodes_gguf_quantized_weights(qtype: T) -> None:
    weights = np.random.default_rng(1).standard_normal((4, 128)).astype(np.float32)
    raw = gguf_blocks.quantize_reference(qtype, weights)
    decoded = gguf_blocks.dequantize(torch.from_numpy(raw), qtype, weights.shape)
    _assert_bits_equal(decoded, _reference(raw, qtype, weights.shape))
    assert (decoded - torch.from_numpy(weights)).abs().max() < 0.25


def test_unaligned_raw_bytes() -> None:
    raw = _packed(T.F32, (4, 8))
    shifted = torch.from_numpy(np.concatenate([np.zeros(1, np.uint8), raw]))[1:]  # data pointer off by one
    _assert_bits_equal(gguf_blocks.dequantize(shifted, T.F32, (4, 8)), _reference(raw, T.F32, (4, 8)))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_out_workspace_is_reused(out_dtype: torch.dtype) -> None:
    shape = (4, 512)
    out = torch.full(shape, float("nan"), dtype=out_dtype)
    for seed in (0, 1):                             # the second decode overwrites the first
        raw = _packed(T.Q4_K, shape, seed)
        result = gguf_blocks.dequantize(torch.from_numpy(raw), T.Q4_K, shape, out_dtype, out=out)
        assert result is out
        assert torch.equal(out, _reference(raw, T.Q4_K, shape).to(out_dtype))
    assert torch.equal(gguf_blocks.dequantize(torch.from_numpy(raw), T.Q4_K, shape, out_dtype), out)


def test_out_of_wrong_shape_or_dtype_is_rejected() -> None:
    raw = torch.from_numpy(_packed(T.Q8_0, (2, 64)))
    with pytest.raises(ValueError, match="out must be"):
        gguf_blocks.dequantize(raw, T.Q8_0, (2, 64), out=torch.empty(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must be"):
        gguf_blocks.dequantize(raw, T.Q8_0, (2, 64), out=torch.empty(64, 2))


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.Q2_K, T.Q3_K, T.IQ4_XS], ids=lambda q: q.name)
def test_unsupported_type_is_named(qtype: T) -> None:
    for call in (lambda: gguf_blocks.block_geometry(qtype), lambda: gguf_blocks.packed_nbytes(qtype, (1, 256)),
                 lambda: gguf_blocks.dequantize(torch.zeros(1024, dtype=torch.uint8), qtype, (1, 256))):
        with pytest.raises(ValueError, match=rf"{qtype.name} is not supported.*Q4_0.*Q6_K"):
            call()


def test_wrong_byte_count_names_expected_and_got() -> None:
    raw = torch.zeros(1000, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"Q4_K tensor of shape \(8, 256\) needs 1152 uint8 bytes, got 1000"):
        gguf_blocks.dequantize(raw, T.Q4_K, (8, 256))


def test_partial_block_row_is_rejected() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        gguf_blocks.packed_nbytes(T.Q6_K, (4, 128))


def test_geometry() -> None:
    assert gguf_blocks.block_geometry(T.Q4_K) == (256, 144)
    assert gguf_blocks.block_geometry(T.Q8_0) == (32, 34)
    assert gguf_blocks.packed_nbytes(T.Q6_K, (2, 512)) == 4 * 210
    assert gguf_blocks.packed_nbytes(T.BF16, (3, 5)) == 30


def test_reference_quantizer_refuses_k_quants() -> None:
    with pytest.raises(ValueError, match="cannot produce Q4_K"):
        gguf_blocks.quantize_reference(T.Q4_K, np.zeros((1, 256), np.float32))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("qtype", gguf_blocks.SUPPORTED_TYPES, ids=lambda q: q.name)
def test_cuda_matches_reference(qtype: T) -> None:
    shape = (16, 1024)
    raw = _packed(qtype, shape)
    decoded = gguf_blocks.dequantize(torch.from_numpy(raw).cuda(), qtype, shape)
    assert decoded.is_cuda
    _assert_bits_equal(decoded, _reference(raw, qtype, shape))


def check_triton_k_quants(device: str = "cpu") -> None:
    """The Triton Q4_K and Q6_K kernels (on the CPU only under TRITON_INTERPRET=1) against the torch decoder, bit
    for bit."""
    from offload.weights import gguf_triton

    kernels = {T.Q4_K: gguf_triton.dequantize_q4_k, T.Q6_K: gguf_triton.dequantize_q6_k}
    for qtype, kernel in kernels.items():
        for shape, seed in (((3, 256), 0), ((5, 512), 1), ((2, 3, 768), 2)):
            raw = torch.from_numpy(_packed(qtype, shape, seed)).to(device)
            expected = gguf_blocks.dequantize(raw.cpu(), qtype, shape)
            _assert_bits_equal(kernel(raw, shape), expected)
            _assert_bits_equal(kernel(raw, shape), _reference(raw.cpu().numpy(), qtype, shape))
            narrowed = kernel(raw, shape, torch.bfloat16).cpu()
            if device == "cpu":     # the interpreter emulates f32 -> bf16 rounding loosely (no ties-to-even)
                torch.testing.assert_close(narrowed, expected.bfloat16(), rtol=2 ** -7, atol=0)
            else:
                assert torch.equal(narrowed, expected.bfloat16())


def test_triton_k_quant_kernels_under_the_interpreter() -> None:
    """The kernels' code, run by Triton's CPU interpreter (in a child process: the interpreter is chosen
    when Triton is first imported)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = ("import sys; sys.path.insert(0, 'tests'); from test_gguf_blocks import check_triton_k_quants; "
            "check_triton_k_quants()")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_k_quant_kernels_on_cuda() -> None:
    pytest.importorskip("triton")
    check_triton_k_quants("cuda")


def test_a_failing_fused_kernel_warns_once_and_leaves_the_torch_path(monkeypatch):
    """A Triton build that cannot compile here: one warning, then the torch decoder, never a crash."""
    from offload.fused import OptionalKernel
    calls = []

    class Broken:
        def dequantize_q4_k(self, *args):
            calls.append(args)
            raise RuntimeError("no kernel image for this GPU")

    kernel = OptionalKernel("offload.weights.gguf_triton", "GGUF Q4_K")
    kernel.module = Broken()
    monkeypatch.setattr(gguf_blocks, "FUSED_K_QUANTS", kernel)
    raw = torch.from_numpy(_packed(T.Q4_K, (2, 256)))
    with pytest.warns(RuntimeWarning, match="GGUF Q4_K: the fused Triton kernel failed"):
        assert kernel.run("dequantize_q4_k", raw, (2, 256), torch.float32, None) is None
    assert kernel.run("dequantize_q4_k", raw, (2, 256), torch.float32, None) is None
    assert len(calls) == 1 and not kernel.usable
    assert OptionalKernel("no_such_module_anywhere", "x").module is None      # no Triton: no kernel


def test_the_ggml_type_table_agrees_with_the_gguf_package():
    """The runtime's own table (it reads headers without importing gguf) names and sizes every type as
    gguf does, and holds every type gguf had when it was written."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from offload.weights.ggml_types import QUANT_SIZES, GGMLType, type_name
    for member in GGMLType:
        assert GGMLQuantizationType(member.value).name == member.name
        assert QUANT_SIZES[member] == GGML_QUANT_SIZES[GGMLQuantizationType(member.value)], member.name
    assert {t.value for t in GGMLQuantizationType if t.value <= 35} <= {t.value for t in GGMLType}
    newer = [t for t in GGMLQuantizationType if t.value not in {m.value for m in GGMLType}]
    assert all(type_name(t.value) == t.name for t in newer)      # named by gguf where the table lacks them
    assert type_name(1000) == "unknown type 1000"


def test_a_later_start_does_not_import_the_gguf_package():
    """Reading a GGUF's header and decoding its blocks use the runtime's own GGML table (importing gguf
    costs 0.1 s of every start); only the first start, which writes the config and tokenizer, reads the
    file with gguf's reader."""
    repo = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-X", "importtime", str(repo / "cli.py"), "run", "Hi", "--max-new-tokens", "1"]
    subprocess.run(command, capture_output=True, check=True, cwd=repo)          # the first start, if any
    imported = subprocess.run(command, capture_output=True, text=True, check=True, cwd=repo).stderr
    modules = [line.rsplit("|", 1)[-1].strip() for line in imported.splitlines() if line.startswith("import time:")]
    assert "torch" in modules and not [m for m in modules if m == "gguf" or m.startswith("gguf.")]
