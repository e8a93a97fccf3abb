"""GGUF files run in place (offload/weights/gguf_source.py), against independent references: the embedded
default model against its dequantizing import (same fp32 weights, logits and greedy tokens), and a tiny
synthetic K-quant GGUF, streamed through the RAM and disk tiers, against gguf.quants.dequantize with
transformers' own q/k row permutation. Plus damaged files, refused before anything runs."""
from __future__ import annotations

import os
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from offload import LoadOptions, load_model
from offload.loader import build_engine, streaming_device_budget
from offload.model.config import ModelConfig
from offload.weights.formats import open_source
from offload.weights.gguf_blocks import random_blocks
from offload.weights.gguf_header import CorruptGgufError
from offload.weights.gguf_names import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES
from offload.weights.gguf_source import GgufSource
from offload.weights.resolve import resolve_model
from offload.weights.safetensors_io import write_safetensors
from offload.disk_reads import DirectReader
from offload.host_io import aligned_host
from offload.tiers import DiskTier
from offload.weights.source import CheckpointSource, HF_GLOBAL_NAMES, HF_LAYER_NAMES
from spec import DecodeConfig, Decoder, SamplingConfig
from test_gguf_import import _tokenizer, reference_tensors, write_metadata

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
HIDDEN, FF, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 3
# every K-quant block type the tiny model's matrices cycle through, and the globals' types
MATRIX_TYPES = [Q.Q4_K, Q.Q6_K, Q.Q8_0]


def _layer_shapes() -> dict[str, tuple[int, ...]]:
    head_dim = HIDDEN // HEADS
    q, kv = HEADS * head_dim, KV_HEADS * head_dim
    return {"q": (q, HIDDEN), "k": (kv, HIDDEN), "v": (kv, HIDDEN), "o": (HIDDEN, q), "gate": (FF, HIDDEN),
            "up": (FF, HIDDEN), "down": (HIDDEN, FF), "input_norm": (HIDDEN,), "post_norm": (HIDDEN,)}


def _blocks(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """[rows, row bytes] uint8 blocks (GGUFWriter reads the logical shape back from them)."""
    data = random_blocks(qtype, shape, rng)
    return data.reshape(shape[0], -1) if len(shape) > 1 else data


def write_tiny_gguf(path: Path, *, heads: int = HEADS, kv_heads: int = KV_HEADS, block_count: int | None = None,
                    types: dict[str, Q] | None = None, seed: int = 0, layers: int = LAYERS) -> Path:
    """A tiny llama GGUF of random blocks, `layers` layers of HEADS heads whatever the metadata says (`heads`,
    `kv_heads`, `block_count`, default `layers`). `types` overrides a tensor's type (GGUF name -> type)."""
    block_count = layers if block_count is None else block_count
    tokens = _tokenizer()[0]
    rng, types = np.random.default_rng(seed), types or {}
    writer = gguf.GGUFWriter(str(path), "llama")
    write_metadata(writer, layers=block_count, hidden=HIDDEN, ff=FF, heads=heads, kv_heads=kv_heads,
                   head_dim=HIDDEN // HEADS, vocab=len(tokens))
    tensors = {GGUF_GLOBAL_NAMES["embed"]: ((len(tokens), HIDDEN), Q.Q8_0),
               GGUF_GLOBAL_NAMES["norm"]: ((HIDDEN,), Q.F32), GGUF_GLOBAL_NAMES["lm_head"]: ((len(tokens), HIDDEN), Q.Q6_K)}
    for i in range(layers):
        for j, (name, shape) in enumerate(_layer_shapes().items()):
            qtype = Q.F32 if len(shape) == 1 else MATRIX_TYPES[(i + j) % len(MATRIX_TYPES)]
            tensors[f"blk.{i}.{GGUF_LAYER_NAMES[name]}"] = (shape, qtype)
    for name, (shape, qtype) in tensors.items():
        qtype = types.get(name, qtype)
        data = _blocks(qtype, shape, rng) if qtype != Q.Q2_K else rng.integers(0, 256, (shape[0], shape[1] // 256 * 84),
                                                                               dtype=np.uint8)
        writer.add_tensor(name, data, raw_dtype=qtype)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECSTREAM_CACHE", str(folder / "cache"))
        path = write_tiny_gguf(folder / "tiny.gguf")
        resolve_model(str(path))   # the config + tokenizer folder, written once for the module
    return path


def _options(model: str, **kwargs) -> LoadOptions:
    return LoadOptions(model, device="cpu", dtype="fp32", max_context=64, max_pass_tokens=16, **kwargs)


def _hf_name(canonical: str, index: int | None) -> str:
    return HF_GLOBAL_NAMES[canonical] if index is None else f"model.layers.{index}.{HF_LAYER_NAMES[canonical]}"


# the embedded default model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_pair():
    """(in place, imported) loads of the embedded default model."""
    return load_model(LoadOptions(device="cpu", dtype="fp32")), load_model(LoadOptions(device="cpu", dtype="fp32",
                                                                                      gguf_import=True))


@pytest.mark.e2e
def test_default_model_in_place_equals_its_import(default_pair):
    in_place, imported = default_pair
    assert isinstance(in_place.source, GgufSource) and isinstance(imported.source, CheckpointSource)
    assert not list(in_place.path.glob("*.safetensors"))    # no weights copied
    assert in_place.config == imported.config and in_place.stop_ids == imported.stop_ids
    expected = imported.source.global_tensors()
    for name, tensor in in_place.source.global_tensors().items():
        assert torch.equal(tensor, expected[name]), name
    for index in range(in_place.config.num_layers):
        expected = imported.source.layer(index)
        for name, tensor in in_place.layers.get(index).items():   # resident: decoded once at load
            assert torch.equal(tensor, expected[name]), (index, name)
    ids = in_place.tokenizer.encode_chat([{"role": "user", "content": "What is 2+2?"}])
    logits = [m.model.forward(torch.tensor([ids]), m.model.new_cache(64)).logits for m in default_pair]
    assert torch.equal(logits[0], logits[1])
    answers = [Decoder(m.model, m.stop_ids, DecodeConfig(16, 256)).generate(ids, SamplingConfig()).token_ids
               for m in default_pair]
    assert answers[0] == answers[1]
    assert in_place.tokenizer.decode(answers[0]).startswith("The answer to this classic math problem")


def test_default_model_streams_a_third_of_the_imported_bytes(default_pair):
    in_place, imported = default_pair
    packed = in_place.source.packed_bytes()
    dense = imported.config.num_layers * imported.config.layer_param_count * 4
    assert packed < dense / 5      # Q4_1 (5 bits per weight plus fp32 norms) against fp32


# a tiny synthetic K-quant file -------------------------------------------------------------------
def test_tiny_gguf_decodes_to_the_gguf_reference(tiny, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tiny.parent / "cache"))
    folder = resolve_model(str(tiny))
    source = open_source(folder, ModelConfig.from_file(folder))
    expected = reference_tensors(tiny)            # gguf.quants + transformers' reverse permutation
    assert set(source.type_counts()) == {"Q4_K", "Q6_K", "Q8_0", "F32"}
    for name, tensor in source.global_tensors().items():
        assert torch.equal(tensor, expected[_hf_name(name, None)]), name
    for index in range(LAYERS):
        for name, tensor in source.dense_layer(index, CPU, torch.float32).items():
            assert torch.equal(tensor, expected[_hf_name(name, index)]), (index, name)


@pytest.mark.parametrize("direct", [False, True])
def test_a_disk_layer_read_whole_gives_the_files_bytes_in_the_layouts_types(tiny, tmp_path, monkeypatch, direct):
    """read_span (O_DIRECT straight into a host buffer) hands back every tensor's stored bytes; without
    O_DIRECT there is no span read, and read_into lands the same bytes at the layout's places."""
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tiny.parent / "cache"))
    folder = resolve_model(str(tiny))
    source = open_source(folder, ModelConfig.from_file(folder))
    layout = source.layout(torch.float32)
    tier = DiskTier(source, layout, direct=direct)
    if direct and not tier.is_direct:
        pytest.skip("this file system refuses O_DIRECT")
    span = aligned_host(max(layout.num_bytes, tier.span_bytes(list(range(LAYERS)))), pin=False)
    for index in range(LAYERS):
        expected = {name: raw.clone() for name, raw in source.layer(index).items()}
        if direct:
            got = tier.typed_views(tier.read_span(index, span))
        else:
            assert tier.span_plan(index) is None and tier.span_bytes([index]) == 0
            tier.read_into(index, span)
            got = {name: view[:expected[name].numel()] for name, view in layout.views(span).items()}
        assert set(got) == set(expected)
        for name, raw in expected.items():
            assert torch.equal(got[name][:raw.numel()], raw), (index, name)
    tier.close()


def test_tiny_gguf_streamed_through_ram_and_disk_matches_the_dense_reference(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tiny.parent / "cache"))
    folder = resolve_model(str(tiny))
    reference = tmp_path / "reference"      # the reference blocks' dense decode, as a plain checkpoint
    reference.mkdir()
    (reference / "config.json").write_text((folder / "config.json").read_text())
    write_safetensors(reference / "model.safetensors", reference_tensors(tiny))
    dense = build_engine(CheckpointSource(reference), _options(str(reference)))
    layer_bytes = open_source(folder, ModelConfig.from_file(folder)).layout(torch.float32).num_bytes
    options = _options(str(tiny), ram=layer_bytes)    # one layer in RAM, the others read from disk
    streamed = load_model(replace(options, gpu_mem=streaming_device_budget(options)))
    assert streamed.plan.tier_of == ["ram", "disk", "disk"]
    ids = torch.randint(0, streamed.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    expected = dense.model.forward(ids, dense.model.new_cache(16)).logits
    for _ in range(2):   # every layer decodes into the one shared workspace, pass after pass
        got = streamed.model.forward(ids, streamed.model.new_cache(16)).logits
        assert torch.isfinite(expected).all() and torch.equal(got, expected)
    assert streamed.layers.total.bytes_by_tier["disk"] == 4 * layer_bytes
    assert [key[0] for key in streamed.source._workspaces] == ["shared"]
    # on a file system with O_DIRECT, the disk layers were read whole into the ring's buffers and used there
    assert (streamed.layers.disk.span_plan(1) is not None) == DirectReader.supported(tiny)
    streamed.layers.close()
    ahead_options = replace(options, decode_ahead=True)
    ahead = load_model(replace(ahead_options, gpu_mem=streaming_device_budget(ahead_options)))
    assert ahead.plan.tier_of == ["ram", "disk", "disk"]
    for _ in range(2):   # a decoder thread decodes each layer ahead into its ring slot's own workspace
        assert torch.equal(ahead.model.forward(ids, ahead.model.new_cache(16)).logits, expected)
    assert len(ahead.source._workspaces) == len(ahead.layers.slots) > 1
    ahead.layers.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_every_tier_decodes_gguf_layers_through_one_workspace(device, tmp_path, cache, monkeypatch):
    """Resident layers kept packed, others streamed from RAM (pinned on CUDA, copied on the copy stream) and
    from disk: each decodes just before its use into the one shared workspace; pass after pass, the dense
    reference's logits on the same device."""
    import offload.loader
    monkeypatch.setitem(offload.loader.DECODE_VS_TRANSFER, False, 0.25)     # the CPU plans as CUDA does
    path = write_tiny_gguf(tmp_path / "six.gguf", layers=6)
    reference = tmp_path / "reference"
    reference.mkdir()
    (reference / "config.json").write_text((resolve_model(str(path)) / "config.json").read_text())
    write_safetensors(reference / "model.safetensors", reference_tensors(path))
    settings = dict(device=device, dtype="fp32", max_context=64, max_pass_tokens=16)
    dense = build_engine(CheckpointSource(reference), LoadOptions(str(reference), **settings))
    folder = resolve_model(str(path))
    layer_bytes = open_source(folder, ModelConfig.from_file(folder)).layout(torch.float32).num_bytes
    options = LoadOptions(str(path), ram=2 * layer_bytes, **settings)
    options.gpu_mem = streaming_device_budget(options) + 2 * layer_bytes    # room for two packed layers
    streamed = load_model(options)
    assert streamed.plan.request.resident_packed and streamed.plan.tier_of == ["device"] * 2 + ["ram"] * 2 + ["disk"] * 2
    ids = torch.randint(0, streamed.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2)).to(device)
    expected = dense.model.forward(ids, dense.model.new_cache(16)).logits
    for _ in range(3):
        assert torch.equal(streamed.model.forward(ids, streamed.model.new_cache(16)).logits, expected)
    assert [key[0] for key in streamed.source._workspaces] == ["shared"]
    # disk layers read whole by O_DIRECT where the file system allows it (on CUDA: copied tensor by tensor)
    assert (streamed.layers.disk.span_plan(4) is not None) == streamed.layers.disk.is_direct
    streamed.layers.close()


def test_resident_layers_kept_packed_decode_at_each_use_to_the_dense_reference(tmp_path, cache, monkeypatch):
    """Where decoding costs less than streaming (DECODE_VS_TRANSFER), the planner keeps resident layers
    packed (more of them fit) and one shared workspace takes each at its use: same logits, pass after pass."""
    import offload.loader
    path = write_tiny_gguf(tmp_path / "eight.gguf", layers=8)
    reference = tmp_path / "reference"
    reference.mkdir()
    (reference / "config.json").write_text((resolve_model(str(path)) / "config.json").read_text())
    write_safetensors(reference / "model.safetensors", reference_tensors(path))
    dense = build_engine(CheckpointSource(reference), _options(str(reference)))
    options = _options(str(path), ring_size=1)
    options.gpu_mem = streaming_device_budget(options, resident_layers=2)     # room for two decoded layers
    decoded = load_model(options)
    assert decoded.plan.tier_of.count("device") == 2 and not decoded.plan.request.resident_packed
    monkeypatch.setitem(offload.loader.DECODE_VS_TRANSFER, False, 0.1)
    packed = load_model(options)
    assert packed.plan.request.resident_packed and packed.plan.tier_of.count("device") > 2
    assert any("packed: decoded at each use" in item.component for item in packed.plan.items), packed.plan.items
    assert packed.layers.resident[0]["q"].dtype == torch.uint8            # held as the file's blocks
    ids = torch.randint(0, packed.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    expected = dense.model.forward(ids, dense.model.new_cache(16)).logits
    for _ in range(2):
        assert torch.equal(packed.model.forward(ids, packed.model.new_cache(16)).logits, expected)
    for model in (decoded, packed):
        model.layers.close()


# damaged files --------------------------------------------------------------------------------------
def _refusal(path: Path) -> str:
    with pytest.raises(CorruptGgufError) as caught:
        load_model(_options(str(path)))
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    return message


def test_truncated_file_is_refused_naming_the_tensor(tiny, tmp_path, cache):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:-1000])
    message = _refusal(cut)
    assert "truncated" in message and "'blk.2.ffn_norm.weight'" in message   # the file's last tensor


def _patched(source: Path, out: Path, name: str, rows: int | None = None, qtype: int | None = None) -> Path:
    """A copy of `source` whose header gives tensor `name` another row count (ne[1]) or ggml type id."""
    raw = bytearray(source.read_bytes())
    encoded = name.encode()
    at = raw.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)     # its n_dims
    num_dims = struct.unpack_from("<I", raw, at)[0]
    if rows is not None:
        struct.pack_into("<Q", raw, at + 4 + 8, rows)
    if qtype is not None:
        struct.pack_into("<I", raw, at + 4 + 8 * num_dims, qtype)
    out.write_bytes(bytes(raw))
    return out


def test_tensor_larger_than_its_bytes_is_refused(tiny, tmp_path, cache):
    path = _patched(tiny, tmp_path / "overlap.gguf", "blk.1.ffn_up.weight", rows=2 * FF)
    message = _refusal(path)
    assert "'blk.1.ffn_up.weight'" in message and "does not match its type and shape" in message


def test_unsupported_type_names_the_tensor_and_the_fallback(tmp_path, cache):
    path = write_tiny_gguf(tmp_path / "q2k.gguf", types={"blk.0.ffn_gate.weight": Q.Q2_K})
    message = _refusal(path)
    assert "'blk.0.ffn_gate.weight' is Q2_K" in message and "Q4_K" in message and "--gguf-import" in message


def test_unknown_type_id_is_refused_naming_the_tensor(tiny, tmp_path, cache):
    path = _patched(tiny, tmp_path / "unknown.gguf", "blk.2.attn_v.weight", qtype=99)
    message = _refusal(path)
    assert "'blk.2.attn_v.weight' is unknown type 99" in message and "--gguf-import" not in message


@pytest.mark.parametrize("overrides, fragment", [
    ({"heads": 3, "kv_heads": 1}, "llama.attention.head_count 3 does not divide llama.embedding_length 256"),
    ({"kv_heads": 3}, "is not a positive multiple of llama.attention.head_count_kv 3"),
    ({"block_count": 4}, "llama.block_count is 4 but block 3 has no tensors"),
    ({"block_count": 2}, "llama.block_count is 2 but tensors name block 2"),
])
def test_inconsistent_metadata_is_refused(tmp_path, cache, overrides, fragment):
    path = write_tiny_gguf(tmp_path / "bad.gguf", **overrides)
    assert fragment in _refusal(path)


def test_the_import_stays_available(tiny, cache):
    statuses = []
    loaded = load_model(_options(str(tiny), gguf_import=True), on_status=statuses.append)
    assert isinstance(loaded.source, CheckpointSource) and list(loaded.path.glob("*.safetensors"))
    assert statuses[-1] == f"GGUF imported to fp32 at {loaded.path}"
    statuses.clear()
    in_place = load_model(_options(str(tiny)), on_status=statuses.append)
    assert statuses[-1].startswith("GGUF in place: ") and "Q4_K x" in statuses[-1]
    assert in_place.config == loaded.config


@pytest.mark.e2e
def test_cli_names_the_path_it_runs_and_refuses_a_damaged_file_in_one_message(tiny, tmp_path):
    env = {**os.environ, "SPECSTREAM_CACHE": str(tmp_path / "cache")}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "cli.py"), "run", "the", "--raw", "--no-draft",
                               "--max-new-tokens", "1", "--budget", "1", *args], capture_output=True, text=True,
                              timeout=300, cwd=ROOT, env=env)

    imported = cli("--target", str(tiny), "--gguf-import")
    assert imported.returncode == 0, imported.stderr
    assert "GGUF imported to fp32 at" in imported.stderr
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:-1000])
    refused = cli("--target", str(cut))
    message = refused.stderr.replace("\n", "")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert str(cut) in message and "'blk.2.ffn_norm.weight'" in message and "truncated" in message


def test_planning_a_gguf_decodes_no_global(tiny, monkeypatch):
    """The budget helpers count the globals from the header: a 70B's embedding is a GB of blocks."""
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tiny.parent / "cache"))
    from offload.loader import largest_batch_for
    options = _options(str(tiny))
    expected = streaming_device_budget(options)
    folder = resolve_model(str(tiny))
    source = open_source(folder, ModelConfig.from_file(folder))
    assert sum(source.global_numels().values()) == sum(t.numel() for t in source.global_tensors().values())
    monkeypatch.setattr(GgufSource, "global_tensors", lambda self: pytest.fail("decoded a global"))
    assert streaming_device_budget(options) == expected and largest_batch_for(options, 4) >= 1
