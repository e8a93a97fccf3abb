"""The packed SpQR path against a dense reference written from the format's definition, element by element;
bit packing; and the quantizer's error feedback against round-to-nearest."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quant.packbits import pack, packed_bytes, unpack
from quant.spqr import SpqrConfig, quantize_matrix
from quant.spqr_format import STATS_RUN, SpqrLinear, SpqrMatrix, pack_matrix

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("count", [1, 7, 8, 9, 1000])
def test_pack_round_trips_and_is_dense(bits, count):
    codes = torch.randint(0, 1 << bits, (count,), generator=torch.Generator().manual_seed(bits * count))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_bytes(count, bits) <= math.ceil(count * bits / 8) + 8
    assert torch.equal(unpack(packed, bits, count), codes.to(torch.uint8))
    assert torch.equal(unpack(packed, bits, count, torch.float32), codes.float())     # decoded straight to floats


def test_pack_is_little_endian_bit_stream():
    codes = [1, 2, 3, 4, 5, 6, 7, 0]
    word = sum(code << (3 * i) for i, code in enumerate(codes))          # code i at bits 3i..3i+2
    assert pack(torch.tensor(codes), 3).tolist() == list(word.to_bytes(3, "little")) == [209, 88, 31]
    with pytest.raises(ValueError):
        pack(torch.tensor([8]), 3)


def reference_dense(shape, bits, groupsize, stats_bits, codes, scale_codes, zero_codes, params, perm, outliers):
    """The format's definition, one element at a time (independent of the vectorised decoder)."""
    out, inp = shape
    permuted = torch.zeros(out, inp, dtype=torch.float64)
    for r in range(out):
        run = r // STATS_RUN
        for c in range(inp):
            j = c // groupsize
            s_scale, s_zero, z_scale, z_zero = (float(torch.tensor(v, dtype=torch.float16)) for v in params[run][j])
            scale = (float(scale_codes[r, j]) - s_zero) * s_scale
            zero = (float(zero_codes[r, j]) - z_zero) * z_scale
            permuted[r, c] = (float(codes[r, c]) - zero) * scale
    for (r, c), value in outliers.items():
        permuted[r, c] = float(torch.tensor(value, dtype=torch.float16))
    dense = torch.zeros_like(permuted)
    for c in range(inp):
        dense[:, int(perm[c])] = permuted[:, c]
    return dense


def random_matrix(bits, shape, num_outliers, seed=0):
    """-> (a packed matrix from random parts, its dense reference [out, in] float64)."""
    out, inp = shape
    groupsize, stats_bits, g = 16, 3, torch.Generator().manual_seed(out * inp + bits + num_outliers + seed)
    groups, runs = inp // groupsize, -(-out // STATS_RUN)
    codes = torch.randint(0, 1 << bits, (out, inp), generator=g)
    scale_codes = torch.randint(0, 1 << stats_bits, (out, groups), generator=g)
    zero_codes = torch.randint(0, 1 << stats_bits, (out, groups), generator=g)
    params = torch.rand(runs, groups, 4, generator=g) * torch.tensor([0.01, 2.0, 0.5, 1.0])
    perm = torch.randperm(inp, generator=g)
    mask = torch.zeros(out, inp, dtype=torch.bool)
    mask.view(-1)[torch.randperm(out * inp, generator=g)[:num_outliers]] = True
    values = torch.randn(out, inp, generator=g)
    matrix = pack_matrix(shape, bits, groupsize, stats_bits, codes, scale_codes, zero_codes, params, perm, mask, values)
    matrix.check("test")
    outliers = {(int(r), int(c)): float(values[r, c]) for r, c in mask.nonzero()}
    return matrix, reference_dense(shape, bits, groupsize, stats_bits, codes, scale_codes, zero_codes,
                                   params.tolist(), perm, outliers)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("shape", [(16, 32), (48, 64), (20, 16)])
@pytest.mark.parametrize("num_outliers", [0, 1, 13])
def test_packed_dequantization_equals_the_dense_reference(bits, shape, num_outliers):
    out, inp = shape
    groupsize, stats_bits, g = 16, 3, torch.Generator().manual_seed(7)
    matrix, expected = random_matrix(bits, shape, num_outliers)
    torch.testing.assert_close(matrix.dequantize(fused=False).double(), expected, rtol=1e-6, atol=1e-6)
    x = torch.randn(3, inp, generator=g)
    torch.testing.assert_close(SpqrLinear(matrix, torch.float32).matmul(x), x @ expected.float().T, rtol=1e-5, atol=1e-5)
    parts = matrix.tensors("m")
    assert SpqrMatrix.from_tensors(parts, "m", shape, bits, groupsize, stats_bits).num_outliers == num_outliers
    parts["m.perm"] = parts["m.perm"][:-1]
    with pytest.raises(ValueError, match="m.perm"):
        SpqrMatrix.from_tensors(parts, "m", shape, bits, groupsize, stats_bits)


@pytest.mark.parametrize("bits", [3, 4])
def test_a_layers_statistics_decoded_together_equal_each_matrix_alone(bits):
    """decode_statistics unpacks every matrix's statistics in one call; rows x groups not a multiple of 8
    (20 x 1) leave padding codes inside the concatenated stream, which must not shift the next matrix.
    Matrices of one group width in whole runs of rows (the 64-wide ones, 20 rows of that width apart) take
    their second level together; the dense reference checks each one."""
    from quant.spqr_format import decode_statistics, packed_linears
    shapes = (((20, 16), 1), ((48, 64), 0), ((16, 32), 13), ((20, 64), 2), ((32, 64), 3), ((20, 16), 0), ((16, 64), 0))
    layer = {f"m{i}": random_matrix(bits, shape, outliers, seed=i) for i, (shape, outliers) in enumerate(shapes)}
    together = decode_statistics([matrix for matrix, _ in layer.values()])
    for (matrix, _), (scale, zero) in zip(layer.values(), together):
        alone_scale, alone_zero = decode_statistics([matrix])[0]
        assert scale.shape == (matrix.shape[0], matrix.num_groups)
        assert torch.equal(scale, alone_scale) and torch.equal(zero, alone_zero)
    x = torch.randn(2, 64)
    for name, linear in packed_linears({name: matrix for name, (matrix, _) in layer.items()}, torch.float32).items():
        expected = layer[name][1].float()
        inputs = x[:, :expected.shape[1]]
        torch.testing.assert_close(linear.matmul(inputs), inputs @ expected.T, rtol=1e-5, atol=1e-5)


def check_fused_kernel(device: str = "cpu") -> None:
    """The Triton kernel (on `device`; on the CPU only under TRITON_INTERPRET=1) against the dense
    reference, in fp32 and bf16, over bits, shapes (rows not a multiple of 16 included) and outliers."""
    for bits in (2, 3, 4):
        for shape in ((16, 32), (48, 64), (20, 16)):
            for num_outliers in (0, 13):
                matrix, expected = random_matrix(bits, shape, num_outliers, seed=1)
                parts = {name: t.to(device) for name, t in matrix.tensors("m").items()}
                matrix = SpqrMatrix.from_tensors(parts, "m", shape, bits, 16, 3)
                fused = matrix.dequantize(fused=True)
                assert fused.device.type == torch.device(device).type
                torch.testing.assert_close(fused.double().cpu(), expected, rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(matrix.dequantize(torch.bfloat16, fused=True),
                                           matrix.dequantize(torch.bfloat16, fused=False))
                assert matrix.dequantize(fused=None).device == fused.device


def test_fused_kernel_equals_the_dense_reference_under_the_triton_interpreter():
    """The CUDA kernel's code, run by Triton's CPU interpreter (in a child process: the interpreter is
    chosen when Triton is first imported)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); "
                             "from test_spqr_format import check_fused_kernel; check_fused_kernel()"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_kernel_on_cuda_equals_the_dense_reference():
    pytest.importorskip("triton")
    check_fused_kernel("cuda")


def test_a_fused_kernel_that_fails_falls_back_to_torch_with_one_warning(monkeypatch):
    import quant.spqr_format as fmt
    from offload.fused import OptionalKernel
    calls = []

    class Broken:
        def dequantize_permuted(self, matrix, dtype, stats_run):
            calls.append(dtype)
            raise RuntimeError("no kernel image is available for this GPU")

    kernel = OptionalKernel("quant.spqr_triton", "SpQR")
    kernel.module = Broken()
    monkeypatch.setattr(fmt, "FUSED", kernel)
    matrix, _ = random_matrix(4, (16, 32), 1)
    with pytest.warns(RuntimeWarning, match="fused Triton kernel failed"):
        assert fmt._try_fused(matrix, torch.float32) is None
    assert fmt._try_fused(matrix, torch.float32) is None and len(calls) == 1     # not retried


def _problem(out=64, inp=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, inp, generator=g) * 0.02
    # correlated inputs (as activations are): what GPTQ's error feedback exploits
    x = torch.randn(2048, 24, generator=g) @ torch.randn(24, inp, generator=g) + 0.3 * torch.randn(2048, inp, generator=g)
    return weight, 2 * x.T @ x / x.shape[0]


def test_quantizer_output_is_what_the_packed_form_decodes_to():
    weight, hessian = _problem()
    result = quantize_matrix(weight, hessian, SpqrConfig(3))
    assert torch.equal(result.packed.dequantize(), result.dequantized)
    x = torch.randn(5, weight.shape[1])
    torch.testing.assert_close(SpqrLinear(result.packed, torch.float32).matmul(x), x @ result.dequantized.T)
    assert result.outlier_share > 0 and result.bits_per_param == 8 * result.packed.num_bytes / weight.numel()


def test_error_feedback_beats_round_to_nearest_and_outliers_lower_the_error():
    weight, hessian = _problem()
    rtn_like = quantize_matrix(weight, torch.eye(weight.shape[1]), SpqrConfig(3, outlier_threshold=math.inf,
                                                                             act_order=False))
    from quant.spqr import relative_error
    rtn_error = relative_error(weight, rtn_like.dequantized, hessian)
    gptq = quantize_matrix(weight, hessian, SpqrConfig(3, outlier_threshold=math.inf))
    spqr = quantize_matrix(weight, hessian, SpqrConfig(3, outlier_threshold=0.2))
    assert gptq.relative_error < 0.8 * rtn_error
    assert spqr.relative_error < gptq.relative_error and gptq.outlier_share == 0


@pytest.mark.parametrize("bad", [dict(bits=1), dict(groupsize=24), dict(stats_bits=12), dict(outlier_threshold=0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        SpqrConfig(**bad)


def test_second_level_statistics_of_a_run_without_range_decode_exactly():
    """Sixteen rows with the same zero point (common at 3 bits) once made the run's zero overflow fp16
    (-4 / 1e-8), which decoded to NaN and spread through GPTQ's error feedback."""
    from quant.packbits import pack, unpack
    from quant.spqr_format import STATS_RUN, _second_level, quantize_stats
    values = torch.cat((torch.full((STATS_RUN, 1), 4.0), torch.arange(STATS_RUN, dtype=torch.float32)[:, None] % 8,
                        torch.full((STATS_RUN, 1), 0.0123), torch.full((STATS_RUN, 1), -2.5),
                        torch.zeros(STATS_RUN, 1)))            # [5 runs, 1]; all zeros: a 0 / 0 once
    codes, scale, zero = quantize_stats(values, 3)
    assert torch.isfinite(scale).all() and torch.isfinite(zero).all() and (zero.abs() <= 1024).all()
    decoded = _second_level(unpack(pack(codes, 3), 3, codes.numel(), torch.float32), scale.half(), zero.half(),
                            values.shape[0], 1)
    torch.testing.assert_close(decoded[:2 * STATS_RUN], values[:2 * STATS_RUN], rtol=0, atol=0)
    torch.testing.assert_close(decoded, values, rtol=1e-3, atol=0)
    assert torch.equal(decoded[-STATS_RUN:], values[-STATS_RUN:])


def test_fused_kernel_arguments_avoid_the_names_older_triton_binders_use():
    """Triton 3.6's generated argument binder assigns `params`, `options` and `specialization` in the same
    scope as the kernel's arguments: a kernel argument of such a name fails on a GPU with 'failed to
    specialize argument of type: dict' (seen on an H200), although the interpreter runs it."""
    pytest.importorskip("triton")
    from quant.spqr_triton import _dequantize_kernel
    assert not {"params", "options", "specialization"} & set(_dequantize_kernel.arg_names)


def test_a_group_whose_weights_share_one_sign_keeps_its_range():
    # a zero point clamped to the code range would put this grid at [0, 15 * scale]: every weight clipped
    weight, hessian = _problem(seed=3)
    shifted = weight.abs() + 0.05                                   # every group positive
    result = quantize_matrix(shifted, hessian, SpqrConfig(4, outlier_threshold=math.inf))
    assert result.relative_error < 1e-3 and result.outlier_share == 0


def test_groups_in_input_order_reproduce_weights_already_on_a_blockwise_4_bit_grid():
    """A GGUF Q4_1 source (the default model's) holds, per row and block of 32 inputs, d * q + m with q in
    0..15: groups of 32 in input order with real zero points and 8-bit statistics find that grid again;
    act-order's groups mix blocks and cannot."""
    weight, hessian = _problem(seed=4)
    blocks = weight.view(weight.shape[0], -1, 32)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    step = (high - low) / 15
    on_grid = (torch.round((blocks - low) / step) * step + low).view_as(weight)
    aligned = quantize_matrix(on_grid, hessian, SpqrConfig(4, 32, stats_bits=8, outlier_threshold=math.inf,
                                                          act_order=False))
    mixed = quantize_matrix(on_grid, hessian, SpqrConfig(4, 16, outlier_threshold=math.inf))
    assert aligned.packed.perm.numel() == 0 and not aligned.packed.is_permuted     # input order: none stored
    assert aligned.relative_error < 0.05 * mixed.relative_error


def test_weights_on_a_q4_1_grid_are_recognised_and_the_aligned_settings_suggested():
    from quant.source_grid import aligned_settings_hint, on_block_grid
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    blocks = weight.view(8, 2, 32)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    on_grid = (torch.round((blocks - low) / ((high - low) / 15)) * (high - low) / 15 + low).view(8, 64)
    assert on_block_grid(on_grid) and not on_block_grid(weight) and not on_block_grid(on_grid[:, :48])
    assert "--no-act-order" in aligned_settings_hint({"q": on_grid}, 4, 16, 3, True)
    assert aligned_settings_hint({"q": on_grid}, 4, 32, 8, False) is None      # already aligned
    assert aligned_settings_hint({"q": on_grid}, 3, 16, 3, True) is None       # 3 bits cannot keep 16 levels
    assert aligned_settings_hint({"q": weight}, 4, 16, 3, True) is None
