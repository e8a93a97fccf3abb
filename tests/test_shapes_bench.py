"""bench/shapes_bench.py's pure parts: the named 1B/8B shapes, a tiny synthetic Q4_0/Q4_1 file that our reader
takes (head size in its rope metadata, norms of ones), the bytes per token both engines read, and the ratios."""
from __future__ import annotations

import numpy as np
import pytest

from bench.shapes_cost import markdown_table, token_bytes, verdict
from bench.synthetic_gguf import NAMED_SHAPES, SyntheticShape, layers_bytes, synthetic_gguf
from offload.weights.sizes import use_more_bits
from offload.weights.gguf_header import read_header
from offload.weights.gguf_model import check_model_metadata
from offload.weights.packed_linear import kernel_bytes


def test_named_shapes_are_llama_1b_and_8b():
    one, eight = NAMED_SHAPES["1b"], NAMED_SHAPES["8b"]
    assert (one.head_dim, one.num_layers) == (64, 16) and (eight.head_dim, eight.num_layers) == (128, 32)
    assert one.layer_shapes()["attn_k.weight"] == (512, 2048)
    assert eight.layer_shapes()["ffn_down.weight"] == (4096, 14336)
    q4_0 = layers_bytes(eight, "q4_0")
    assert 3.9e9 < q4_0 < 4.0e9                     # 6.98B decoder parameters at 4.5 bits
    assert 1.05 * q4_0 < layers_bytes(eight, "q4_k_m") < 1.25 * q4_0     # Q6_K attn_v and ffn_down in some layers


def test_q4_k_m_raises_attn_v_and_ffn_down_where_llama_cpp_does(tmp_path):
    shape = SyntheticShape(hidden_size=256, intermediate_size=256, num_heads=2, num_kv_heads=1, num_layers=8)
    header = read_header(synthetic_gguf("q4_k_m", shape, folder=tmp_path))
    for index in range(shape.num_layers):
        raised = "Q6_K" if use_more_bits(index, shape.num_layers) else "Q4_K"
        assert [header.tensors[f"blk.{index}.{name}.weight"].type_name for name in ("attn_v", "ffn_down", "attn_q")] \
            == [raised, raised, "Q4_K"]
    assert layers_bytes(shape, "q4_k_m") == sum(t.num_bytes for n, t in header.tensors.items() if n.startswith("blk."))


@pytest.mark.parametrize("type_name", ["q4_0", "q4_1"])
def test_tiny_synthetic_file_reads_and_counts_its_bytes(tmp_path, type_name):
    shape = SyntheticShape(hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1, num_layers=2)
    path = synthetic_gguf(type_name, shape, folder=tmp_path)
    header = read_header(path)
    assert check_model_metadata(header) == "llama"
    assert header.metadata["llama.rope.dimension_count"] == 32           # the shape's head size, not the default's
    assert header.tensors["blk.1.ffn_up.weight"].type_name == type_name.upper()
    norm = header.tensors["blk.0.attn_norm.weight"]
    with open(path, "rb") as f:
        f.seek(norm.start)
        assert (np.frombuffer(f.read(64 * 4), dtype=np.float32) == 1).all()
    matrices = [t for t in header.tensors.values() if len(t.shape) == 2]    # tied: the embedding is the output
    assert token_bytes(path) == {"llama_cpp": sum(t.num_bytes for t in matrices),
                                 "ours_packed": sum(kernel_bytes(t.qtype, t.shape) for t in matrices)}


def test_verdict_and_table():
    row = {"file": "x.gguf", "file_bytes": 2e9, "bytes_per_token": {"llama_cpp": 1e9, "ours_packed": 1.2e9},
           "llama_cpp": {"tokens_per_second": 10.0, "seconds_per_token": 0.1, "prefill_tokens_per_second": 100.0},
           "ours_resident": {"tokens_per_second": 5.0, "seconds_per_token": 0.2, "prefill_tokens_per_second": 50.0,
                             "profile": {"step_ms": 210.0, "kernel_ms_per_token": 150.0}},
           "streamed": {"ram_dense": {"tokens_per_second": 1.5}}}
    row.update(verdict(row, 0.8))
    assert (row["decode_over_llama_cpp"], row["prefill_over_llama_cpp"], row["goal_met"]) == (0.5, 0.5, False)
    assert row["why"]["rest_ms"] == 60.0 and row["why"]["ours_kernel_gbps"] == 8.0
    assert row["why"]["llama_cpp_gbps"] == 10.0 and row["why"]["kernel_alone_over_llama_cpp"] == 0.667
    lines = markdown_table({"files": [row]}).splitlines()
    assert len(lines) == 3 and "| 0.5 (0.8) | - |" in lines[2] and "| 1.5 / - / - |" in lines[2]
    row.update(ours_ggml_over_llama_cpp=0.9, streamed={"ram_ggml": {"tokens_per_second": 3.0}})
    assert "| 0.5 (0.8) | 0.9 |" in markdown_table({"files": [row]}) and "| - / - / 3.0 |" in markdown_table({"files": [row]})


def test_the_wait_policy_is_one_openmp_knows():
    from bench.shapes_bench import ShapesBenchConfig
    assert ShapesBenchConfig(omp_wait_policy="default").omp_wait_policy == "default"
    with pytest.raises(ValueError, match="omp_wait_policy must be default, PASSIVE or ACTIVE"):
        ShapesBenchConfig(omp_wait_policy="spin")


def test_resident_kernels_are_packed_or_ggml():
    from bench.shapes_bench import ShapesBenchConfig
    assert ShapesBenchConfig(resident_kernels=("packed", "ggml")).resident_kernels == ("packed", "ggml")
    for kernels in (("int3",), ()):
        with pytest.raises(ValueError, match="resident kernels: packed, ggml"):
            ShapesBenchConfig(resident_kernels=kernels)
