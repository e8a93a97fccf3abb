"""The safetensors reader/writer and the checkpoint folder on top of it."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload.weights.safetensors_io import CorruptCheckpointError, SafetensorsFile, write_safetensors
from offload.weights.source import CheckpointSource

from conftest import load_ours, make_tiny_checkpoint


def _sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=gen),
        "u8_odd": torch.arange(3, dtype=torch.uint8),      # leaves the following tensors unaligned
        "bf16": torch.randn(4, 2, generator=gen).bfloat16(),
        "f16": torch.randn(7, generator=gen).half(),
        "f64": torch.randn(2, 2, 2, generator=gen).double(),
        "i64": torch.randint(-2**40, 2**40, (5,), generator=gen),
        "i32": torch.randint(-2**20, 2**20, (2, 3), generator=gen, dtype=torch.int32),
        "i16": torch.randint(-300, 300, (3,), generator=gen, dtype=torch.int16),
        "i8": torch.randint(-100, 100, (4,), generator=gen, dtype=torch.int8),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "non_contiguous": torch.randn(4, 6, generator=gen)[:, ::2],
    }


def test_round_trip_all_dtypes(tmp_path):
    tensors = _sample_tensors()
    path = tmp_path / "x.safetensors"
    write_safetensors(path, tensors, {"format": "pt", "note": "hi"})
    assert not list(tmp_path.glob("*.tmp"))            # the temp file was renamed into place
    opened = SafetensorsFile(path)
    assert opened.metadata == {"format": "pt", "note": "hi"}
    assert set(opened.entries) == set(tensors)
    for name, expected in tensors.items():
        got = opened.tensor(name)
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert torch.equal(got, expected), name
        assert opened.entries[name].num_bytes == expected.numel() * expected.element_size()


def test_written_file_is_readable_by_the_safetensors_library(tmp_path):
    tensors = _sample_tensors()
    write_safetensors(tmp_path / "x.safetensors", tensors)
    reference = load_file(tmp_path / "x.safetensors")
    assert set(reference) == set(tensors)
    for name, expected in tensors.items():
        assert torch.equal(reference[name], expected), name


def test_reads_files_written_by_the_safetensors_library(tmp_path):
    tensors = {k: v.contiguous() for k, v in _sample_tensors().items()}
    tensors["scalar"] = torch.tensor(2.5)
    save_file(tensors, tmp_path / "y.safetensors", metadata={"format": "pt"})
    opened = SafetensorsFile(tmp_path / "y.safetensors")
    assert opened.metadata == {"format": "pt"}
    for name, expected in tensors.items():
        got = opened.tensor(name)
        assert got.shape == expected.shape and torch.equal(got, expected), name


def test_views_are_copy_on_write(tmp_path):
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"a": torch.ones(4)})
    opened = SafetensorsFile(path)
    view = opened.tensor("a")
    view.mul_(3)                                          # writes only the private mapping
    assert torch.equal(SafetensorsFile(path).tensor("a"), torch.ones(4))


def test_round_trip_scalar(tmp_path):
    path = tmp_path / "s.safetensors"
    write_safetensors(path, {"scalar": torch.tensor(3.5, dtype=torch.float64)})
    got = SafetensorsFile(path).tensor("scalar")
    assert got.shape == () and got.item() == 3.5


# ---- corrupt files: every error is a CorruptCheckpointError naming the file -------------------

def _valid_file(tmp_path):
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"w": torch.arange(12, dtype=torch.float32).view(3, 4), "b": torch.ones(4)})
    return path


def _raw_file(path, header: dict | bytes, data: bytes, header_len: int | None = None):
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(encoded) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", length) + encoded + data)
    return path


def _assert_corrupt(path, *fragments):
    with pytest.raises(CorruptCheckpointError) as info:
        SafetensorsFile(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.mark.parametrize("cut", [1, 30])
def test_truncated_data_raises(tmp_path, cut):
    path = _valid_file(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[:-cut])
    _assert_corrupt(path, "truncated")


def test_truncated_inside_header_raises(tmp_path):
    path = _valid_file(tmp_path)
    path.write_bytes(path.read_bytes()[:20])
    _assert_corrupt(path, "header length")


@pytest.mark.parametrize("size", [0, 5])
def test_too_short_for_header_raises(tmp_path, size):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x01" * size)
    _assert_corrupt(path, "too short")


def test_bad_header_length_raises(tmp_path):
    path = _raw_file(tmp_path / "big.safetensors", {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                     b"\0" * 4, header_len=2**40)
    _assert_corrupt(path, "header length")


def test_header_length_too_small_gives_invalid_json(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    encoded = json.dumps(header).encode()
    path = _raw_file(tmp_path / "short_header.safetensors", encoded, b"\0" * 4, header_len=len(encoded) - 3)
    _assert_corrupt(path, "JSON")


@pytest.mark.parametrize("offsets", [[0, 16], [8, 24], [400, 416]])
def test_data_offsets_out_of_range_raise(tmp_path, offsets):
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": offsets}}
    path = _raw_file(tmp_path / "offsets.safetensors", header, b"\0" * 12)   # 12 data bytes only
    _assert_corrupt(path, "'a'", "beyond the file size")


@pytest.mark.parametrize("offsets", [[-4, 12], [0, 12], [4, 0]])
def test_data_offsets_inconsistent_with_shape_raise(tmp_path, offsets):
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": offsets}}
    path = _raw_file(tmp_path / "span.safetensors", header, b"\0" * 64)
    _assert_corrupt(path, "'a'")


@pytest.mark.parametrize("entry", [{"shape": [1], "data_offsets": [0, 4]},
                                   {"dtype": "F32", "shape": [1]},
                                   {"dtype": "NOPE", "shape": [1], "data_offsets": [0, 4]},
                                   "not-a-dict"])
def test_malformed_entries_raise(tmp_path, entry):
    path = _raw_file(tmp_path / "malformed.safetensors", {"a": entry}, b"\0" * 4)
    _assert_corrupt(path, "'a'")


@pytest.mark.parametrize("header", [b"[1, 2, 3]", b'"text"', b"12345678"])
def test_header_not_an_object_raises(tmp_path, header):
    path = _raw_file(tmp_path / "not_object.safetensors", header, b"")
    _assert_corrupt(path)


# ---- checkpoint folders ---------------------------------------------------------------------

def test_checkpoint_missing_tensor_is_named(tmp_path):
    folder, _ = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    tensors = load_file(folder / "model.safetensors")
    missing = "model.layers.1.mlp.up_proj.weight"
    del tensors[missing]
    (folder / "model.safetensors").unlink()
    write_safetensors(folder / "model.safetensors", tensors)
    with pytest.raises(CorruptCheckpointError) as info:
        CheckpointSource(folder)
    assert missing in str(info.value) and str(folder) in str(info.value)


def test_checkpoint_missing_lm_head_when_untied_is_named(tmp_path):
    folder, _ = make_tiny_checkpoint(tmp_path / "ckpt", "qwen2")
    tensors = load_file(folder / "model.safetensors")
    del tensors["lm_head.weight"]
    write_safetensors(folder / "model.safetensors", tensors)
    with pytest.raises(CorruptCheckpointError, match="lm_head.weight"):
        CheckpointSource(folder)


def test_checkpoint_with_corrupt_file_fails_at_open(tmp_path):
    folder, _ = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError) as info:
        CheckpointSource(folder)
    assert str(weights) in str(info.value)


def test_checkpoint_without_weights_raises(tmp_path):
    folder, _ = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        CheckpointSource(folder)


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    single, hf_model = make_tiny_checkpoint(tmp_path / "single", "qwen3")
    sharded, _ = make_tiny_checkpoint(tmp_path / "sharded", "qwen3", save_kwargs={"max_shard_size": "60KB"})
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    source = CheckpointSource(sharded)
    assert sorted(p.name for p in source.file_paths()) == shards
    for key in ("embed", "norm", "lm_head"):
        assert torch.equal(source.global_tensors()[key], CheckpointSource(single).global_tensors()[key])
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    a, b = load_ours(single), load_ours(sharded)
    torch.testing.assert_close(a.forward(ids, a.new_cache(10)).logits, b.forward(ids, b.new_cache(10)).logits,
                               atol=0, rtol=0)
    with torch.no_grad():
        expected = hf_model(ids).logits
    torch.testing.assert_close(b.forward(ids, b.new_cache(10)).logits, expected, atol=1e-4, rtol=0)


def test_layer_names_and_shapes(tmp_path):
    folder, hf_model = make_tiny_checkpoint(tmp_path / "ckpt", "qwen3")
    source = CheckpointSource(folder)
    layer = source.layer(1)
    assert set(layer) == {"input_norm", "q", "k", "v", "o", "post_norm", "gate", "up", "down", "q_norm", "k_norm"}
    hf_layer = hf_model.model.layers[1]
    assert torch.equal(layer["k"], hf_layer.self_attn.k_proj.weight.detach())
    assert torch.equal(layer["k_norm"], hf_layer.self_attn.k_norm.weight.detach())
    assert torch.equal(layer["down"], hf_layer.mlp.down_proj.weight.detach())
