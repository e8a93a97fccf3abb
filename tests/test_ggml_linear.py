"""GGUF matrices multiplied by ggml's own kernels (offload/weights/ggml_linear.py, `--cpu-kernel ggml`): the
product against a dense float64 reference of the same blocks, every row's bits those of a one-row product (what
keeps speculation exact), and a GGUF run through it: resident = streamed, speculative = one-token greedy.

These need ggml's CPU library (llama-cpp-python's, or the folder SPECSTREAM_GGML_LIB names); without it they
are skipped, except the one that checks the error a missing library gives."""
from __future__ import annotations

import gc
from dataclasses import replace

import numpy as np
import pytest
import torch

from offload import load_model
from offload.loader import streaming_device_budget
from offload.model.config import ModelConfig
from offload.weights import ggml_lib, ggml_linear, kernel_cache
from offload.weights.formats import open_source
from offload.weights.ggml_types import GGMLType as T
from offload.weights.gguf_blocks import dequantize, random_blocks
from offload.weights.resolve import resolve_model
from offload.weights.gguf_names import GGUF_LAYER_NAMES
from test_gguf_inplace import _options, write_tiny_gguf

needs_ggml = pytest.mark.skipif(not ggml_linear.available(), reason="no libggml (pip install llama-cpp-python)")


def _weight(qtype: T, shape: tuple[int, int], seed: int = 0) -> tuple[ggml_linear.GgmlWeight, torch.Tensor]:
    raw = torch.from_numpy(random_blocks(qtype, shape, np.random.default_rng(seed)))
    return ggml_linear.from_gguf(raw, qtype, shape), raw


@needs_ggml
@pytest.mark.parametrize("qtype", ggml_linear.GGML_TYPES, ids=lambda t: t.name)
def test_the_product_matches_the_blocks_decoded(qtype):
    weight, raw = _weight(qtype, (96, 512))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    expected = x.double() @ dequantize(raw, qtype, (96, 512), torch.float32).double().T
    got = weight.matmul(x)
    # ggml quantizes x to 8 bits per block of 32 (256 for K-quants): ~0.5-1% of the result's norm
    assert got.shape == (5, 96) and got.dtype == torch.float32
    assert float((got.double() - expected).norm() / expected.norm()) < 0.02


@needs_ggml
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [2, 7, 8, 23])
def test_every_row_gets_the_bits_of_a_one_row_product(qtype, rows):
    """From 8 rows ggml multiplies K-quants another way (other bits): the weight cuts them into 7-row calls."""
    weight, _ = _weight(qtype, (64, 256))
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    together = weight.matmul(x)
    alone = torch.cat([weight.matmul(x[i:i + 1]) for i in range(rows)])
    assert torch.equal(together.view(torch.int32), alone.view(torch.int32))


@needs_ggml
def test_unaligned_blocks_and_inputs_of_other_dtypes_are_taken():
    weight, raw = _weight(T.Q4_0, (64, 256))
    shifted = torch.empty(raw.numel() + 1, dtype=torch.uint8)[1:]       # blocks one byte off ggml's alignment
    shifted.copy_(raw)
    moved = ggml_linear.from_gguf(shifted, T.Q4_0, (64, 256))
    x = torch.randn(3, 4, 256, dtype=torch.float64)
    got = moved.matmul(x)
    assert got.shape == (3, 4, 64) and got.dtype == torch.float64
    assert torch.equal(got, weight.matmul(x.float()).double())


@needs_ggml
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_stacked_q_k_v_give_the_separate_products_bits(qtype):
    shapes = {"q": (128, 256), "k": (32, 256), "v": (32, 256), "o": (256, 256)}
    rng = np.random.default_rng(3)
    matrices = {name: (torch.from_numpy(random_blocks(qtype, shape, rng)), qtype, shape) for name, shape in shapes.items()}
    stacked = ggml_linear.from_gguf_layer(matrices)
    assert set(stacked) == {"qkv", "o"} and stacked["qkv"].shape == (192, 256)
    x = torch.randn(1, 9, 256, generator=torch.Generator().manual_seed(4))
    apart = torch.cat([ggml_linear.from_gguf(*matrices[name]).matmul(x) for name in ("q", "k", "v")], dim=-1)
    assert torch.equal(stacked["qkv"].matmul(x), apart)


@needs_ggml
def test_prompt_chunks_go_in_one_call_and_the_other_rows_keep_their_bits():
    from offload.weights.row_split import WholeRowsWeight, whole_rows
    weight, _ = _weight(T.Q4_K, (64, 256))
    x = torch.randn(1, 30, 256, generator=torch.Generator().manual_seed(5))
    layer = whole_rows({"o": weight, "norm": torch.ones(3)}, [(4, 24)])
    assert isinstance(layer["o"], WholeRowsWeight) and isinstance(layer["norm"], torch.Tensor)
    got = layer["o"].matmul(x)
    assert torch.equal(got[:, 4:24], weight.matmul_whole(x[:, 4:24]))
    assert torch.equal(got[:, :4], weight.matmul(x[:, :4])) and torch.equal(got[:, 24:], weight.matmul(x[:, 24:]))
    assert whole_rows({"o": weight}, [])["o"] is weight


def test_a_missing_library_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv(ggml_linear.LIBRARY_ENV, str(tmp_path))
    monkeypatch.setattr(ggml_lib, "_LOADED", [])
    with pytest.raises(ggml_linear.GgmlMissingError, match="pip install llama-cpp-python, or set SPECSTREAM_GGML_LIB"):
        ggml_linear.ggml()
    assert not ggml_linear.available()


@needs_ggml
@pytest.mark.parametrize("qtype", ggml_linear.GGML_TYPES, ids=lambda t: t.name)
def test_stored_bytes_multiply_as_the_weight_they_came_from_in_a_host_buffer(qtype):
    """What the kernel layer cache stores of a weight (a repacked one's tiles) gives its products back from a
    host_buffer, a ring slot's memory, without repacking; the buffer is freed with its last tensor."""
    weight, raw = _weight(qtype, (64, 512), seed=3)
    stored = weight.stored_bytes()
    assert torch.equal(stored, raw) != weight.repacked            # tiles differ from the blocks; the rest are them
    slot = ggml_linear.host_buffer(stored.numel() + 4096)
    assert slot.data_ptr() % 4096 == 0
    slot[256:256 + stored.numel()].copy_(stored)
    tiles = ggml_linear.from_tiles(slot[256:256 + stored.numel()], qtype, (64, 512))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tiles.matmul(x), weight.matmul(x))
    with pytest.raises(ValueError, match="in a host_buffer"):
        ggml_linear.from_tiles(stored, qtype, (64, 512))          # tiles outside ggml's buffers are refused
    before = len(ggml_linear._HOST_BUFFERS)
    del slot, tiles
    gc.collect()
    assert len(ggml_linear._HOST_BUFFERS) == before - 1


def _tiny_of(tmp_path, qtype: T):
    names = [f"blk.{i}.{GGUF_LAYER_NAMES[name]}" for i in range(3) for name in ("q", "k", "v", "o", "gate", "up", "down")]
    return write_tiny_gguf(tmp_path / f"tiny-{qtype.name}.gguf", types=dict.fromkeys(names, qtype))


@pytest.mark.parametrize("found", [True, False], ids=["libggml", "no-libggml"])
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_auto_takes_ggml_for_the_types_it_tiles_where_it_is_found(tmp_path, monkeypatch, qtype, found):
    """--cpu-kernel auto (the commands' default): ggml for a GGUF mostly of Q4_0/Q4_K where a libggml is found, else
    the int4 kernel, whose status line then names what would be faster."""
    if found and not ggml_linear.available():
        pytest.skip("no libggml (pip install llama-cpp-python)")
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path / "cache"))
    if not found:
        monkeypatch.setenv(ggml_linear.LIBRARY_ENV, str(tmp_path))
        monkeypatch.setattr(ggml_lib, "_LOADED", [])
    statuses = []
    loaded = load_model(_options(str(_tiny_of(tmp_path, qtype)), cpu_kernel="auto"), on_status=statuses.append)
    line = next(s for s in statuses if s.startswith("CPU "))
    on_ggml = qtype == T.Q4_0 and found
    assert line.startswith("CPU ggml kernels: ") == on_ggml, line
    assert isinstance(loaded.layers.resident[0]["o"], ggml_linear.GgmlWeight) == on_ggml
    assert ("pip install llama-cpp-python" in line) == (qtype == T.Q4_0 and not found), line


@needs_ggml
def test_a_gguf_on_ggml_gives_the_same_logits_resident_and_streamed(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    statuses = []
    resident = load_model(_options(str(path), cpu_kernel="ggml"), on_status=statuses.append)
    assert any(s.startswith("CPU ggml kernels: ") for s in statuses), statuses
    layer = resident.layers.resident[0]
    assert isinstance(layer["q"], ggml_linear.GgmlWeight) and "qkv" not in layer
    folder = resolve_model(str(path))
    layer_bytes = open_source(folder, ModelConfig.from_file(folder)).layout(torch.float32).num_bytes
    options = _options(str(path), ram=layer_bytes, cpu_kernel="ggml", ring_size=1)   # 3 layers of 0.5 MB fit 2 slots
    streamed = load_model(replace(options, gpu_mem=streaming_device_budget(options)))
    assert streamed.plan.tier_of == ["ram", "disk", "disk"]
    ids = torch.randint(0, resident.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    expected = resident.model.forward(ids, resident.model.new_cache(16)).logits
    for _ in range(2):
        assert torch.equal(streamed.model.forward(ids, streamed.model.new_cache(16)).logits, expected)
    streamed.layers.close()


@needs_ggml
@pytest.mark.parametrize("cached", [True, False], ids=["tiles-from-the-kernel-cache", "no-room-for-the-cache"])
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0], ids=lambda t: t.name)
def test_a_ring_slot_keeps_its_stacked_weights_for_each_layer_it_holds(tmp_path, monkeypatch, qtype, cached):
    """Every matrix of one type, so q/k/v and gate/up stack (Q4_0: repacked tiles; Q8_0: blocks in place): a ring of
    one slot takes the streamed layers in turn, its 4 weights made once and kept (WeightPool), and every pass gives
    the resident logits. Streamed layers read ggml's bytes from the kernel layer cache into the slot, ggml's own
    buffer; where the cache cannot be stored, the slot's weights are refilled from the GGUF's blocks (repacked,
    stacked) per pass."""
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path / "cache"))
    if not cached:
        def full(*args):
            raise OSError("no room")
        monkeypatch.setattr(kernel_cache, "_check_room", full)
    path = _tiny_of(tmp_path, qtype)
    resident = load_model(_options(str(path), cpu_kernel="ggml"))
    assert {"qkv", "gate_up"} <= set(resident.layers.resident[0])
    folder = resolve_model(str(path))
    layer_bytes = open_source(folder, ModelConfig.from_file(folder)).layout(torch.float32).num_bytes
    options = _options(str(path), ram=3 * layer_bytes, cpu_kernel="ggml", ring_size=1)
    streamed = load_model(replace(options, gpu_mem=streaming_device_budget(options)))
    assert streamed.plan.tier_of[1:] == ["ram", "ram"]
    generator = torch.Generator().manual_seed(0)
    for rows in (5, 1, 12):
        ids = torch.randint(0, resident.config.vocab_size, (1, rows), generator=generator)
        expected = resident.model.forward(ids, resident.model.new_cache(16)).logits
        assert torch.equal(streamed.model.forward(ids, streamed.model.new_cache(16)).logits, expected)
    streamed.layers.close()
    assert isinstance(streamed.source, kernel_cache.KernelCachedSource) == cached
    pools = streamed.source._pools if cached else streamed.source._ggml_pools
    assert len(pools) == 1                                                  # one slot
    weights = list(next(iter(pools.values()))._weights.values())
    assert len(weights) == 4 and all(weight.tiles == cached for weight in weights)     # made once


@needs_ggml
@pytest.mark.e2e
def test_speculation_on_ggml_equals_one_token_greedy_decoding():
    """The default model (Q4_1 layers, a Q8_0 head) through ggml: the shipped draft's trees at budget 16 give the
    tokens one-token greedy decoding gives."""
    from offload import LoadOptions
    from spec import DecodeConfig, Decoder, FixedBudget, SamplingConfig, Speculator, default_draft_for, load_any_draft
    import textdata
    target = load_model(LoadOptions(device="cpu", dtype="fp32", cpu_kernel="ggml", max_context=1024,
                                    max_pass_tokens=64))
    draft = load_any_draft(str(default_draft_for(None)), target, LoadOptions(device="cpu", max_context=1024))
    config = DecodeConfig(24, 1024, max_pass_tokens=64)
    reference = Decoder(target.model, target.stop_ids, config)
    speculative = Decoder(target.model, target.stop_ids, config, Speculator(draft, 1024, 16), FixedBudget(16))
    for row in textdata.records(textdata.CHAT_PROMPTS)[:2]:
        ids = target.tokenizer.encode_chat([{"role": "user", "content": row["prompt"]}])
        result = speculative.generate(ids, SamplingConfig())
        assert result.token_ids == reference.generate(ids, SamplingConfig()).token_ids
        assert result.stats.tokens_per_pass > 1
