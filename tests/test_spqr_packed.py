"""SpQR w4 g32 matrices on the CPU's int4 kernel (quant/spqr_packed.py) against a dense torch reference: the
matrix dequantized (SpqrMatrix.dequantize, itself checked element by element in test_spqr_format.py) and multiplied
in float64. The kernel rounds activations, scales and zeros to bf16 and its result to bf16 (u = 2^-8), the sparse
outlier part is added in fp32 from fp32 activations, so with w the dense weight, g the grid weight the kernel holds
at each place ((q - 8) s + z there: w but at an outlier) and d = w - g (nonzero at outliers only):

    |y - y_ref| <= u |y_ref| + (1 + u) * sum_k |x_k| * (u |w_k| + u (|(q_k - 8) s_k| + |z_k|) + u |d_k|)
                   + K 2^-23 sum_k |x_k w_k|

(test_packed_linear.py's bound, with the u |d_k| the kernel's bf16 output adds over the outliers' grid values).
A row's result must not depend on the rows beside it; configurations the kernel cannot take keep today's decode."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import add_tiny_tokenizer, load_ours, make_tiny_checkpoint
from offload import LoadOptions
from offload.loader import streaming_device_budget
from quant import spqr_packed
from quant.packbits import unpack
from quant.quantize import QuantizeConfig, quantize
from quant.spqr_format import STATS_RUN, SpqrLinear, decode_statistics, pack_matrix
from runtime import load_model
from runtime.models import with_formats
from test_spqr_runtime import LAYERS, dense_reference

ROOT = Path(__file__).resolve().parents[1]
U = 2.0 ** -8


def random_g32(shape: tuple[int, int], num_outliers: int, stats_bits: int = 8, permuted: bool = True,
               bits: int = 4, groupsize: int = 32, seed: int = 0):
    """A packed SpQR matrix from random parts, statistics on a realistic scale (weights of ~0.05)."""
    out, inp = shape
    g = torch.Generator().manual_seed(seed)
    groups, runs = inp // groupsize, -(-out // STATS_RUN)
    codes = torch.randint(0, 1 << bits, (out, inp), generator=g)
    scale_codes, zero_codes = (torch.randint(0, 1 << stats_bits, (out, groups), generator=g) for _ in range(2))
    maxq = (1 << stats_bits) - 1
    params = torch.rand(runs, groups, 4, generator=g) * torch.tensor([0.01 / maxq, 0.0, 15.0 / maxq, 0.0])
    params[..., 0] += 0.001
    perm = torch.randperm(inp, generator=g) if permuted else torch.arange(0)
    mask = torch.zeros(out, inp, dtype=torch.bool)
    mask.view(-1)[torch.randperm(out * inp, generator=g)[:num_outliers]] = True
    values = torch.randn(out, inp, generator=g)              # outliers far off the grid (|w| ~ 1 against ~0.05)
    return pack_matrix(shape, bits, groupsize, stats_bits, codes, scale_codes, zero_codes, params, perm, mask, values)


def _bound(matrix, x: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """The docstring's bound for x [M, K] (permuted columns) against the matrix's dense permuted weight."""
    out, inp = matrix.shape
    scale, zero = (t.double().repeat_interleave(32, dim=1) for t in decode_statistics([matrix])[0])   # [N, K]
    codes = unpack(matrix.codes, 4, out * inp).view(out, inp).double()
    grid = (codes - zero) * scale
    dense = matrix.dequantize(permuted=True).double()
    spread = ((codes - 8) * scale).abs() + ((8 - zero) * scale).abs() + (dense - grid).abs()
    magnitude = x.double().abs() @ (U * dense.abs() + U * spread).T
    return U * expected.abs() + (1 + U) * magnitude + inp * 2.0 ** -23 * (x.double().abs() @ dense.abs().T)


@pytest.mark.parametrize("stats_bits", [3, 8])
@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("shape,num_outliers", [((64, 256), 0), ((48, 512), 1), ((192, 576), 40)])
def test_packed_product_is_the_dense_product_within_bf16_rounding(stats_bits, permuted, shape, num_outliers):
    matrix = random_g32(shape, num_outliers, stats_bits, permuted)
    weight = spqr_packed.from_spqr_layer({"o": matrix}, torch.float32)["o"]
    assert isinstance(weight, spqr_packed.SpqrInt4Weight)
    x = torch.randn(5, shape[1], generator=torch.Generator().manual_seed(1))           # [M, K] fp32
    permuted_x = x[:, matrix.perm.long()] if permuted else x
    expected = permuted_x.double() @ matrix.dequantize(permuted=True).double().T      # [M, N]
    actual = weight.matmul(x)
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    error = (actual.double() - expected).abs()
    bound = _bound(matrix, permuted_x, expected)
    assert (error <= bound).all(), f"worst error / bound {float((error / bound).max()):.3f}"
    assert float(error.max()) > 0                                                        # really computed in bf16


def test_every_row_gets_the_bits_it_gets_alone():
    matrix = random_g32((192, 576), 60)
    weight = spqr_packed.from_spqr_layer({"o": matrix}, torch.float32)["o"]
    x = torch.randn(1024, 576, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([weight.matmul(x[i:i + 1]) for i in range(len(x))])              # [1024, N]
    for num_rows in (1, 2, 3, 5, 16, 33, 100, 255, 1024):
        start = 1024 - num_rows
        assert torch.equal(weight.matmul(x[start:]).view(torch.int32), alone[start:].view(torch.int32)), num_rows


def test_stacked_weights_give_the_separate_products_bits_side_by_side():
    shapes = {"q": (576, 576), "k": (192, 576), "v": (192, 576), "gate": (256, 576), "up": (256, 576)}
    perm = torch.randperm(576, generator=torch.Generator().manual_seed(3))
    matrices = {name: random_g32(shape, 25, seed=i) for i, (name, shape) in enumerate(shapes.items())}
    for m in matrices.values():
        m.perm = perm.to(m.perm.dtype)                      # q/k/v (gate/up) share their input's act-order
    x = torch.randn(9, 576)
    separate = {name: spqr_packed.from_spqr_layer({name: m}, torch.float32)[name].matmul(x)
                for name, m in matrices.items()}
    fused = spqr_packed.from_spqr_layer(matrices, torch.float32)
    assert set(fused) == {"qkv", "gate_up"}
    for name, parts in (("qkv", ("q", "k", "v")), ("gate_up", ("gate", "up"))):
        assert torch.equal(fused[name].matmul(x), torch.cat([separate[p] for p in parts], dim=-1)), name
    matrices["up"] = random_g32((256, 576), 3, seed=9)     # its own permutation: not stacked with gate
    assert set(spqr_packed.from_spqr_layer(matrices, torch.float32)) == {"qkv", "gate", "up"}


REPACK_CHECK = """
import torch
from quant.packbits import pack
from quant.spqr_packed import repack_codes
for rows in (16, 48, 64, 80, 112, 192, 320):
    codes = torch.randint(0, 16, (rows, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
    expected = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
    assert torch.equal(repack_codes(pack(codes, 4), rows, 96), expected), rows
print(torch.backends.cpu.get_cpu_capability())
"""


@pytest.mark.parametrize("capability", [None, "avx2", "default"])
def test_stored_codes_are_repacked_as_torchs_converter_packs_them_on_each_dispatch(capability):
    """Straight from SpQR's code bytes (no unpacking) to the dispatch's layout, partial row blocks included."""
    env = {**os.environ, **({"ATEN_CPU_CAPABILITY": capability} if capability else {})}
    done = subprocess.run([sys.executable, "-c", REPACK_CHECK], env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    if capability:
        assert done.stdout.strip() == capability.upper()


@pytest.mark.parametrize("bits,groupsize,rows", [(3, 32, 64), (4, 16, 64), (4, 32, 40)])
def test_settings_the_kernel_cannot_take_keep_todays_decode(bits, groupsize, rows):
    matrix = random_g32((rows, 128), 5, stats_bits=3, bits=bits, groupsize=groupsize)
    weights = spqr_packed.from_spqr_layer({"o": matrix, "down": random_g32((64, 128), 2)}, torch.float32)
    assert isinstance(weights["o"], SpqrLinear) and isinstance(weights["down"], spqr_packed.SpqrInt4Weight)


# checkpoints end to end: a tiny model, and the embedded default model --------------------------------------
@pytest.fixture(scope="module")
def tiny_g32(tmp_path_factory):
    root = tmp_path_factory.mktemp("spqr_packed")
    folder, _ = make_tiny_checkpoint(root / "dense", "llama", num_hidden_layers=LAYERS, vocab_size=64)
    add_tiny_tokenizer(folder, 64)
    out = root / "w4g32"
    quantize(QuantizeConfig(str(folder), out, bits=4, groupsize=32, outlier_threshold=1.0, nsamples=8, seqlen=32))
    return root, out


def _options(folder, **kwargs) -> LoadOptions:
    return LoadOptions(str(folder), device="cpu", dtype="fp32", max_context=64, max_pass_tokens=16, **kwargs)


def test_every_tier_multiplies_packed_and_stays_near_the_dequantized_weights(tiny_g32):
    root, out = tiny_g32
    reference = load_ours(dense_reference(root, out))
    statuses = []
    resident = load_model(_options(out, cpu_kernel="packed"), on_status=statuses.append)
    layer_bytes = resident.plan.request.layer_bytes
    options = with_formats(_options(out, cpu_kernel="packed", ram=layer_bytes))
    streamed = load_model(replace(options, gpu_mem=streaming_device_budget(options)))
    assert resident.plan.tier_of == ["device"] * LAYERS and streamed.plan.tier_of == ["ram"] + ["disk"] * (LAYERS - 1)
    assert all(isinstance(resident.layers.resident[0][name], spqr_packed.SpqrInt4Weight)
               for name in ("qkv", "o", "gate_up", "down"))
    assert "CPU packed int4 kernel: SpQR w4 g32 x28 (outliers added sparse), output matrix as Q8_0" in statuses
    ids = torch.tensor([[3, 17, 5, 9, 31, 2, 40]])
    got = resident.model.forward(ids, resident.model.new_cache(16)).logits
    for _ in range(2):      # streamed layers repacked pass after pass
        assert torch.equal(streamed.model.forward(ids, streamed.model.new_cache(16)).logits, got)
    expected = reference.forward(ids, reference.new_cache(16)).logits
    assert float((got - expected).pow(2).mean().sqrt()) < 0.02 * float(expected.std())
    streamed.layers.close()


def test_a_checkpoint_the_kernel_cannot_take_is_decoded_and_named_in_the_status_line(tmp_path):
    folder, _ = make_tiny_checkpoint(tmp_path / "dense", "llama", num_hidden_layers=1, vocab_size=64)
    add_tiny_tokenizer(folder, 64)
    out = tmp_path / "w4g16"
    quantize(QuantizeConfig(str(folder), out, bits=4, groupsize=16, nsamples=2, seqlen=16))
    statuses = []
    loaded = load_model(_options(out, cpu_kernel="packed"), on_status=statuses.append)
    line = next(s for s in statuses if s.startswith("CPU packed int4 kernel"))
    assert line == "CPU packed int4 kernel: no matrix; decoded to dense (the kernel takes SpQR w4 g32 only): SpQR w4 g16 x7"
    assert isinstance(loaded.layers.resident[0]["q"], SpqrLinear)
    loaded.model.forward(torch.tensor([[1, 2, 3]]), loaded.model.new_cache(8))


def _round_to_nearest(weight: torch.Tensor, outlier_share: float):
    """weight [out, in] -> its SpQR w4 g32 packed form in input order, 8-bit statistics, by round-to-nearest (no
    calibration: seconds for the default model, whose Q4_1 weights sit on such a grid), the weights farthest
    from the grid kept as outliers."""
    from quant.spqr_format import _second_level, quantize_stats
    out, inp = weight.shape
    groups = weight.view(out, inp // 32, 32)
    low, high = groups.amin(-1), groups.amax(-1)                                       # [out, groups]
    scale = ((high - low) / 15).clamp(min=1e-8)
    stats = [quantize_stats(values, 8) for values in (scale, -low / scale)]
    (scale, zero) = (_second_level(codes.reshape(-1).float(), s, z, out, inp // 32) for codes, s, z in stats)
    codes = torch.round(groups / scale[..., None] + zero[..., None]).clamp(0, 15)
    error = (((codes - zero[..., None]) * scale[..., None]).view(out, inp) - weight).abs()
    mask = error >= error.flatten().kthvalue(max(1, int(error.numel() * (1 - outlier_share)))).values
    params = torch.stack([stats[0][1], stats[0][2], stats[1][1], stats[1][2]], dim=-1)   # [runs, groups, 4]
    return pack_matrix((out, inp), 4, 32, 8, codes.view(out, inp), stats[0][0], stats[1][0], params,
                       torch.arange(0), mask, weight)


@pytest.fixture(scope="module")
def default_w4g32(tmp_path_factory):
    """A SpQR w4 g32 checkpoint of the embedded default model (round-to-nearest, 0.02% outliers: its quantizer's
    share at these settings), loaded on the int4 kernel."""
    from offload.model.config import ModelConfig
    from offload.weights.formats import dense_source
    from offload.weights.resolve import resolve_model
    from quant.checkpoint import MATRICES, write_config, write_globals, write_layer
    out = tmp_path_factory.mktemp("default_w4g32")
    folder = resolve_model(None)
    source = dense_source(folder, ModelConfig.from_file(folder))
    for index in range(source.config.num_layers):
        weights = {name: t.float() for name, t in source.layer(index).items()}
        stored = {name: t for name, t in weights.items() if name not in MATRICES}
        for name in MATRICES:
            stored.update(_round_to_nearest(weights[name], 0.0002).tensors(name))
        write_layer(out, index, stored)
    write_globals(out, source.global_tensors())
    write_config(out, folder, {"bits": 4, "groupsize": 32, "stats_bits": 8, "act_order": False}, "default")
    return load_model(LoadOptions(str(out), device="cpu", dtype="fp32", cpu_kernel="packed", max_context=2048,
                                  max_pass_tokens=1024))


@pytest.mark.e2e
@pytest.mark.parametrize("num_nodes", [1, 3, 64, 1024])
def test_a_tree_pass_gives_each_row_the_bits_of_one_token_passes(default_w4g32, num_nodes):
    from test_packed_cpu import test_a_tree_pass_gives_each_row_the_bits_of_one_token_passes as tree_test
    assert isinstance(default_w4g32.layers.resident[0]["qkv"], spqr_packed.SpqrInt4Weight)
    assert default_w4g32.layers.resident[0]["qkv"].outlier_rows.numel() > 0
    tree_test(default_w4g32, num_nodes)


@pytest.mark.e2e
@pytest.mark.parametrize("dense_prompts", [False, True])
def test_packed_speculation_equals_packed_one_token_decoding(default_w4g32, dense_prompts):
    from offload.weights.row_split import PromptRouting
    from test_packed_cpu import test_packed_speculation_equals_packed_one_token_decoding as speculation_test
    speculation_test(default_w4g32, PromptRouting(1, 1) if dense_prompts else PromptRouting())
