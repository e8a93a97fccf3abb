"""A GGUF's streamed layers on the CPU's int4 kernel read from the kernel layer cache (offload/weights/kernel_cache.py):
the same bits as resident layers repacked at load, nothing repacked per pass, the file keyed by the CPU's dispatch,
a damaged file made again; layers that differ in type (a Q4_K_M file's Q6_K in some layers) stored as variants,
the types the kernel takes not kept as raw blocks and decoded as the GGUF's own."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from offload import LoadOptions, load_model
from offload.loader import plan_for, streaming_device_budget
from offload.model.config import ModelConfig
from offload.weights import kernel_cache, packed_linear
from offload.weights.formats import open_source
from offload.weights.gguf_names import GGUF_LAYER_NAMES
from offload.weights.resolve import resolve_model
from test_gguf_inplace import _layer_shapes, write_tiny_gguf


LAYERS = 8     # a 2-slot ring beside 3 layers would hold them all resident


def _uniform(path, types_by_layer):
    """A tiny GGUF whose layer i's matrices are all of types_by_layer[i]."""
    types = {f"blk.{i}.{GGUF_LAYER_NAMES[name]}": types_by_layer[i]
             for i in range(LAYERS) for name, shape in _layer_shapes().items() if len(shape) == 2}
    return write_tiny_gguf(path, types=types, layers=LAYERS)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _options(path, **kwargs) -> LoadOptions:
    return LoadOptions(str(path), device="cpu", dtype="fp32", max_context=64, max_pass_tokens=16, cpu_kernel="packed",
                       **kwargs)


def _streamed(path, statuses=None, ram: int | None = 1):
    """Loaded with every layer it can stream streamed, from disk (ram=1) or from RAM (ram=None)."""
    options = _options(path, ram=ram)
    options = replace(options, gpu_mem=streaming_device_budget(options))
    return load_model(options, statuses.append if statuses is not None else None), options


def _mixes(tmp_path) -> dict:
    """GGUFs of uniform layers, of layers alternating Q4_K and Q8_0 (Q8_0 doubles the codes), and the tiny
    default's mix (Q4_K, Q6_K, Q8_0) with some F16 matrices (kept as raw blocks, decoded per pass) -> their number
    of variants (None: several)."""
    wide = {f"blk.{i}.attn_v.weight": Q.F16 for i in range(0, LAYERS, 2)}
    return {_uniform(tmp_path / "q4k.gguf", [Q.Q4_K] * LAYERS): 1,
            _uniform(tmp_path / "alternating.gguf", [Q.Q4_K, Q.Q8_0] * (LAYERS // 2)): 2,
            write_tiny_gguf(tmp_path / "tiny.gguf", layers=LAYERS, types=wide): None}


@pytest.mark.parametrize("tier", ["disk", "ram"])
@pytest.mark.parametrize("mix", [0, 1, 2])
def test_streamed_layers_read_the_cache_with_the_bits_of_resident_ones(tmp_path, cache, monkeypatch, tier, mix):
    path, num_variants = list(_mixes(tmp_path).items())[mix]
    resident = load_model(_options(path))
    statuses = []
    streamed, options = _streamed(path, statuses, ram=1 if tier == "disk" else None)
    assert streamed.plan.tier_of.count(tier) >= LAYERS - 2, streamed.plan.tier_of
    assert isinstance(streamed.source, kernel_cache.KernelCachedSource)
    assert any(line.startswith("GGUF layers stored in this CPU's int4 kernel layout") for line in statuses)
    found = kernel_cache.variants(streamed.source.gguf)[0]
    assert len(found) == num_variants if num_variants else len(found) > 1
    assert streamed.plan.request.layer_bytes == streamed.source.layout(torch.float32).num_bytes
    assert plan_for(options).request.layer_bytes == streamed.plan.request.layer_bytes     # planned as loaded
    repacks = []
    ids = torch.randint(0, resident.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    expected = resident.model.forward(ids, resident.model.new_cache(16)).logits
    with monkeypatch.context() as patch:
        patch.setattr(packed_linear, "from_gguf", lambda *a, **k: repacks.append(a) or None)
        for _ in range(2):
            assert torch.equal(streamed.model.forward(ids, streamed.model.new_cache(16)).logits, expected)
    assert repacks == []                                        # streamed layers are multiplied as read
    streamed.layers.close()
    again = []
    reopened, _ = _streamed(path, again, ram=1 if tier == "disk" else None)   # the next start reads the stored file
    assert isinstance(reopened.source, kernel_cache.KernelCachedSource) and not any("stored" in s for s in again)
    reopened.layers.close()


def _stored_cache(path):
    """The kernel cache file a streamed load of `path` makes (the load closed)."""
    first, _ = _streamed(path)
    first.layers.close()
    first.source.close()
    return first.source.path


def test_a_cache_of_another_gguf_of_the_same_name_is_refused(tmp_path, cache):
    """A cache whose variants are not the GGUF's (the file replaced, its key forged) fails its check."""
    stored = _stored_cache(_uniform(tmp_path / "m.gguf", [Q.Q4_K] * LAYERS))
    (tmp_path / "other").mkdir()
    other = _uniform(tmp_path / "other" / "m.gguf", [Q.Q4_K, Q.Q8_0] * (LAYERS // 2))
    folder = resolve_model(str(other))
    with pytest.raises(kernel_cache.CorruptCheckpointError, match="not this GGUF's"):
        kernel_cache.KernelCachedSource(open_source(folder, ModelConfig.from_file(folder)), stored)


def test_a_damaged_cache_is_made_again(tmp_path, cache):
    path = _uniform(tmp_path / "q4k.gguf", [Q.Q4_K] * LAYERS)
    stored = _stored_cache(path)
    stored.write_bytes(stored.read_bytes()[:1000])              # truncated
    statuses = []
    second, _ = _streamed(path, statuses)
    assert isinstance(second.source, kernel_cache.KernelCachedSource)
    assert any("stored" in line for line in statuses)
    second.layers.close()


def test_a_gguf_without_a_matrix_the_kernel_takes_is_not_cached(tmp_path, cache):
    path = _uniform(tmp_path / "f16.gguf", [Q.F16] * LAYERS)
    streamed, _ = _streamed(path)
    assert not kernel_cache.serves(streamed.source) and not isinstance(streamed.source, kernel_cache.KernelCachedSource)
    streamed.layers.close()


def test_the_cache_is_keyed_by_the_cpus_dispatch(tmp_path, cache, monkeypatch):
    path = _uniform(tmp_path / "q4k.gguf", [Q.Q4_K] * LAYERS)
    folder = resolve_model(str(path))
    source = open_source(folder, ModelConfig.from_file(folder))
    here = kernel_cache.kernel_cache_path(source, cache)
    other = "AVX2" if torch.backends.cpu.get_cpu_capability() != "AVX2" else "AVX512"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other)
    assert kernel_cache.kernel_cache_path(source, cache) != here


def test_a_disk_without_room_keeps_the_repack_and_says_why(tmp_path, cache, monkeypatch):
    import shutil
    path = _uniform(tmp_path / "q4k.gguf", [Q.Q4_K] * LAYERS)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1000))
    statuses = []
    streamed, _ = _streamed(path, statuses)
    assert not isinstance(streamed.source, kernel_cache.KernelCachedSource)
    assert any("repack per pass" in line and "GiB free" in line for line in statuses)
    assert not list((cache / "kernel_layers").glob("*"))       # nothing half-written left behind
    streamed.layers.close()


@pytest.mark.parametrize("qtype, num_variants", [(Q.Q4_0, 1), (Q.Q8_0, 2), (Q.Q6_K, 2), (Q.F16, 2)],
                         ids=["q4_0", "q8_0", "q6_k", "f16"])
def test_the_variants_from_shapes_are_the_repacked_layers(tmp_path, cache, qtype, num_variants):
    """A layer's variant is read from its tensors' types and shapes (nothing repacked): its layout is where the
    repacked layer lands (fused q/k/v and gate/up, Q8_0's doubled width, the raw blocks of the rest), and the
    streaming layout is the largest variant. Q4_0 and Q4_K layers share one (the kernel's layout is the same)."""
    types = [Q.Q4_K, qtype] * (LAYERS // 2)
    folder = resolve_model(str(_uniform(tmp_path / "m.gguf", types)))
    source = open_source(folder, ModelConfig.from_file(folder))
    found, of_layer = kernel_cache.variants(source)
    assert of_layer == [0, num_variants - 1] * (LAYERS // 2) and len(found) == num_variants
    for index in (0, 1):
        raw = source.layer(index)
        weights = source.kernel_weights(index, raw)
        tensors = kernel_cache._flat(weights, {name: raw[name] for name in found[of_layer[index]].blocks})
        assert [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()] == \
            [(s.name, s.dtype, s.shape) for s in found[of_layer[index]].layout.slots]
        assert ("qkv" in weights) == (types[index] != Q.F16)              # F16: raw blocks, decoded per pass
    assert kernel_cache.kernel_layout(source).num_bytes >= max(v.layout.num_bytes for v in found)
