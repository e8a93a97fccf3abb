"""GGUF matrices multiplied packed by torch's CPU int4 kernel against a dense torch reference: the blocks decoded
by gguf_blocks (bit-exact to gguf.quants) and multiplied in float64. The kernel rounds activations, scales and
zeros to bf16 and its result to bf16; the bound checked is what those roundings allow, with u = 2^-8:

    |y - y_ref| <= u |y_ref| + (1 + u) * sum_k |x_k| * (u |w_k| + u (|(q_k - 8) s_k| + |z_k|)) + K 2^-23 sum_k |x_k w_k|

(measured on these random blocks: at most 0.09-0.15 of that bound; 1.2-1.6% of the rms output at worst, 0.3%
relative at the median). Each row's result must not depend on the rows beside it:
a tree of M rows gives every row the bits a one-row product gives it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from offload.weights import gguf_blocks, packed_linear
from offload.weights.ggml_types import GGMLType as T

ROOT = Path(__file__).resolve().parents[1]
U = 2.0 ** -8
SHAPES = [(64, 256), (48, 512), (128, 768)]
CASES = [(qtype, shape) for qtype in packed_linear.KERNEL_TYPES for shape in SHAPES]
IDS = [f"{q.name}-{n}x{k}" for q, (n, k) in CASES]


def _raw(qtype: T, shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(gguf_blocks.random_blocks(qtype, shape, np.random.default_rng(seed)))


def _groups(raw: torch.Tensor, qtype: T, shape: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """The mapping's codes, scales and zeros per weight, [N, K * repeat] float64 each."""
    num_out = shape[0]
    quants, scale, zero = packed_linear._GROUPS[qtype](raw.view(-1, gguf_blocks.block_geometry(qtype)[1]))
    by_weight = [t.double().reshape(num_out, -1, t.shape[-1], 1) for t in (scale, zero)]
    codes = quants.double().view(num_out, -1, quants.shape[1], packed_linear.GROUP)
    return codes, *(t.expand(*codes.shape) for t in by_weight)       # [N, blocks, groups, 32] each


def _per_weight(qtype: T, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """[N, blocks, groups, 32] values at the widened input's places -> [N, K] per weight: Q8_0's hi and lo products
    summed, a 5/6-bit type's 16 hi places (against 16 x) and 16 lo places (against x) of each group combined."""
    if qtype == T.Q8_0:
        values = values.sum(2, keepdim=True)
    if packed_linear._form(qtype)[1]:
        pairs = values.reshape(*values.shape[:3], 2, packed_linear.SUB_BLOCK)
        values = 16 * pairs[..., 0, :] + pairs[..., 1, :]
    return values.reshape(shape)


@pytest.mark.parametrize("qtype,shape", CASES, ids=IDS)
def test_the_mapping_reproduces_the_decoded_weights(qtype, shape):
    raw = _raw(qtype, shape)
    codes, scale, zero = _groups(raw, qtype, shape)
    weights = _per_weight(qtype, (codes - 8) * scale + zero, shape)                 # [N, K]
    spread = _per_weight(qtype, ((codes - 8) * scale).abs() + zero.abs(), shape)
    dense = gguf_blocks.dequantize(raw, qtype, shape).double()
    # exact up to the float32 roundings of the zero (8 d sc - dmin m; 8 d sc / 17) and of the reference's products
    assert ((weights - dense).abs() <= 2.0 ** -22 * spread).all()


@pytest.mark.parametrize("qtype,shape", CASES, ids=IDS)
def test_packed_product_is_the_dense_product_within_bf16_rounding(qtype, shape):
    raw = _raw(qtype, shape)
    packed = packed_linear.from_gguf(raw, qtype, shape)
    x = torch.randn(5, shape[1], generator=torch.Generator().manual_seed(1))       # [M, K] fp32
    dense = gguf_blocks.dequantize(raw, qtype, shape).double()                       # [N, K]
    expected = x.double() @ dense.T                                                  # [M, N]
    actual = packed.matmul(x)
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    codes, scale, zero = _groups(raw, qtype, shape)
    spread = _per_weight(qtype, ((codes - 8) * scale).abs() + zero.abs(), shape)     # [N, K]
    magnitude = x.double().abs() @ (U * dense.abs() + U * spread).T
    bound = U * expected.abs() + (1 + U) * magnitude + shape[1] * 2.0 ** -23 * (x.double().abs() @ dense.abs().T)
    error = (actual.double() - expected).abs()
    assert (error <= bound).all(), f"worst error / bound {float((error / bound).max()):.3f}"
    assert float(error.max()) > 0                                                    # really computed in bf16


@pytest.mark.parametrize("qtype,shape", [(T.Q4_1, (192, 576)), (T.Q6_K, (192, 512)), (T.Q5_1, (192, 576))],
                         ids=["q4_1", "q6_k", "q5_1"])
def test_every_row_gets_the_bits_it_gets_alone(qtype, shape):
    packed = packed_linear.from_gguf(_raw(qtype, shape), qtype, shape)
    x = torch.randn(1024, shape[1], generator=torch.Generator().manual_seed(2))
    alone = torch.cat([packed.matmul(x[i:i + 1]) for i in range(len(x))])           # [1024, N]
    for num_rows in (1, 2, 3, 4, 5, 7, 16, 33, 100, 255, 512, 1024):
        start = 1024 - num_rows
        assert torch.equal(packed.matmul(x[start:]).view(torch.int32), alone[start:].view(torch.int32)), num_rows


def test_stacked_weights_give_the_separate_products_bits_side_by_side():
    shapes = {"q": (576, 768), "k": (192, 768), "v": (192, 768), "gate": (256, 768), "up": (256, 768)}
    matrices = {name: (_raw(qtype, shape, seed=i), qtype, shape)
                for i, ((name, shape), qtype) in enumerate(zip(shapes.items(), [T.Q4_1, T.Q4_K, T.Q4_0, T.Q8_0, T.Q8_0]))}
    x = torch.randn(9, 768)
    separate = {name: packed_linear.from_gguf(*spec).matmul(x) for name, spec in matrices.items()}
    fused = packed_linear.from_gguf_layer(matrices)
    assert set(fused) == {"qkv", "gate_up"}
    for name, parts in packed_linear.FUSED.items():
        assert torch.equal(fused[name].matmul(x), torch.cat([separate[part] for part in parts], dim=-1)), name
    odd = {**matrices, "k": (_raw(T.Q4_1, (48, 768)), T.Q4_1, (48, 768)), "up": matrices["q"]}
    assert set(packed_linear.from_gguf_layer(odd)) == {"q", "k", "v", "gate", "up"}   # 48 rows; Q8_0 beside Q4_1


def test_a_three_dim_input_keeps_its_leading_dims():
    qtype, shape = T.Q8_0, (64, 256)
    packed = packed_linear.from_gguf(_raw(qtype, shape), qtype, shape)
    x = torch.randn(2, 3, shape[1])
    assert torch.equal(packed.matmul(x), packed.matmul(x.view(6, -1)).view(2, 3, -1))


PACK_CHECK = """
import torch
from offload.weights.packed_linear import pack_codes
for rows in (16, 32, 48, 64, 80, 112, 192, 320):
    codes = torch.randint(0, 16, (rows, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(pack_codes(codes), torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)), rows
print(torch.backends.cpu.get_cpu_capability())
"""


@pytest.mark.parametrize("capability", [None, "avx2", "default"])
def test_codes_are_packed_as_torchs_converter_packs_them_on_each_dispatch(capability):
    """The layout is the CPU dispatch's (AVX512 and AVX2 interleave row blocks): checked against torch's own
    converter in this process and in processes told to dispatch as AVX2 and as plain C++."""
    env = {**os.environ, **({"ATEN_CPU_CAPABILITY": capability} if capability else {})}
    done = subprocess.run([sys.executable, "-c", PACK_CHECK], env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    if capability:
        assert done.stdout.strip() == capability.upper()


def test_repacking_in_row_chunks_gives_the_whole_layout(monkeypatch):
    qtype, shape = T.Q4_K, (320, 512)
    raw = _raw(qtype, shape)
    whole = packed_linear.from_gguf(raw, qtype, shape)
    monkeypatch.setattr(packed_linear, "REPACK_CODES", 64 * 512)          # 64 rows at a time
    chunked = packed_linear.from_gguf(raw, qtype, shape)
    assert torch.equal(whole.codes, chunked.codes) and torch.equal(whole.scale_zeros, chunked.scale_zeros)


def test_an_unaligned_view_of_the_blocks_is_read_as_its_bytes():
    qtype, shape = T.Q4_1, (64, 256)
    raw = _raw(qtype, shape)
    shifted = torch.empty(raw.numel() + 1, dtype=torch.uint8)
    shifted[1:] = raw
    assert torch.equal(packed_linear.from_gguf(shifted[1:], qtype, shape).codes,
                       packed_linear.from_gguf(raw, qtype, shape).codes)


def test_kernel_bytes_counts_what_the_weight_holds():
    for qtype in packed_linear.KERNEL_TYPES:
        shape = (64, 512)
        assert packed_linear.from_gguf(_raw(qtype, shape), qtype, shape).nbytes == packed_linear.kernel_bytes(
            qtype, shape)


@pytest.mark.parametrize("qtype,shape", [(T.F16, (64, 256)), (T.BF16, (64, 256)), (T.Q4_0, (40, 256)),
                                         (T.Q4_0, (256,))])
def test_types_and_shapes_the_kernel_cannot_take_are_refused(qtype, shape):
    assert not packed_linear.takes(qtype, shape)
    with pytest.raises(ValueError, match="cannot multiply packed"):
        packed_linear.from_gguf(torch.zeros(gguf_blocks.packed_nbytes(qtype, shape), dtype=torch.uint8), qtype,
                                shape)


def test_a_dense_matrix_is_held_as_q8_0_and_a_decoded_q8_0_comes_back_to_its_blocks():
    from quant.lowbit import int8_head
    shape = (128, 256)
    weights = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    raw = torch.from_numpy(gguf_blocks.quantize_reference(T.Q8_0, weights))          # what a GGUF writer stores
    decoded = gguf_blocks.dequantize(raw, T.Q8_0, shape)                             # [N, K] fp32
    again, blocks = int8_head(decoded), packed_linear.from_gguf(raw, T.Q8_0, shape)
    assert torch.equal(again.codes, blocks.codes) and torch.equal(again.scale_zeros, blocks.scale_zeros)
    dense = torch.randn(*shape, generator=torch.Generator().manual_seed(2))          # not on a Q8_0 grid
    x = torch.randn(3, shape[1], generator=torch.Generator().manual_seed(3))
    expected, actual = x @ dense.T, int8_head(dense).matmul(x)
    # 8 bits a weight (scale: max |w| / 127 per 32) and bf16 activations: a percent of the product's magnitude
    assert ((actual - expected).abs() <= 0.02 * (x.abs() @ dense.abs().T)).all()
    assert packed_linear.dense_q8_bytes(shape) == packed_linear.kernel_bytes(T.Q8_0, shape) == again.nbytes
    assert packed_linear.dense_q8_bytes((100, 256)) == 0                             # rows the kernel cannot take
    with pytest.raises(ValueError, match="int8 head"):
        int8_head(torch.zeros(100, 256))
