"""The synthetic GGUF of `bench stream --synthetic-gguf`: a tiny one loads in place and one streamed
pass moves exactly the file's decoder-layer bytes; the start bench times it in place and imported."""
from __future__ import annotations

import pytest

from bench.start_bench import run_start_bench
from bench.stream_bench import run_stream_bench
from bench.synthetic_gguf import SyntheticShape, layers_bytes, synthetic_gguf
from offload.weights.gguf_header import read_header

TINY = SyntheticShape(hidden_size=64, intermediate_size=128, num_heads=1, num_kv_heads=1, num_layers=6)


def test_synthetic_gguf_streams_its_layer_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path / "cache"))
    path = synthetic_gguf("q8_0", TINY, folder=tmp_path)
    assert path.stat().st_size < 5 * 2**20
    header = read_header(path)
    file_layer_bytes = sum(t.num_bytes for name, t in header.tensors.items() if name.startswith("blk."))
    assert file_layer_bytes == layers_bytes(TINY, "q8_0")

    result = run_stream_bench(str(path), None, "ram", [1], device="cpu", dtype="fp32", repeats=1)

    assert result["layers"]["ram"] == TINY.num_layers
    assert result["file_layer_bytes"] == file_layer_bytes
    assert result["passes"][0]["bytes_streamed"] == file_layer_bytes
    assert result["passes"][0]["decode_seconds"] > 0
    assert synthetic_gguf("q8_0", TINY, folder=tmp_path) == path     # cached: written once

    # `bench quant-disk --gguf`'s start figures, on the same file: in place and import, each loaded and answered
    start = run_start_bench(str(path), rounds=1)
    rows = start["seconds"]
    assert set(rows) == {"gguf-in-place", "gguf-import"}
    for row in rows.values():
        assert 0 < row["load"] <= row["load_and_first_forward"]
    expected = rows["gguf-in-place"]["load_and_first_forward"] / rows["gguf-import"]["load_and_first_forward"]
    assert abs(start["in_place_over_import_load_and_first_forward"] - expected) < 0.01



def test_the_requantized_default_holds_its_matrices_in_the_type_asked(tmp_path, monkeypatch):
    import torch
    from bench.synthetic_gguf import requantized_default
    from offload.weights.gguf_blocks import dequantize
    from offload.weights.resolve import default_model_gguf
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="choose one of q5_0, q5_1"):
        requantized_default("q6_k")
    path = requantized_default("q5_1")
    header, original = read_header(path), read_header(default_model_gguf())
    assert {t.type_name for n, t in header.tensors.items() if n.startswith("blk.") and len(t.shape) == 2} == {"Q5_1"}
    assert header.tensors["token_embd.weight"].type_name == original.tensors["token_embd.weight"].type_name
    info, before = header.tensors["blk.3.ffn_down.weight"], original.tensors["blk.3.ffn_down.weight"]

    def weights(file, tensor):
        with open(file, "rb") as f:
            f.seek(tensor.start)
            raw = torch.frombuffer(bytearray(f.read(tensor.num_bytes)), dtype=torch.uint8)
        return dequantize(raw, tensor.qtype, tuple(tensor.shape))
    # 5 bits over the 4-bit file's levels: within half a Q5_1 step of each weight (step = the block's range / 31)
    old, new = weights(default_model_gguf(), before), weights(path, info)
    blocks = old.view(-1, 32)
    step = (blocks.amax(1) - blocks.amin(1)) / 31
    assert ((new.view(-1, 32) - blocks).abs() <= step[:, None] * 0.51 + 1e-6).all()
