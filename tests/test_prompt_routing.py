"""Long prompt chunks on the CPU's int4 kernel (offload/weights/row_split.py): prompt rows attend in fp32 and
multiply the layer decoded dense, while the rows before them (trees, one-token rows) keep the packed path's
bits; resident and streamed layers route alike."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from offload import load_model
from offload.loader import streaming_device_budget
from offload.model.masks import causal_mask
from offload.model.slots import SlotCache, block_mask
from offload.weights.packed_linear import Int4Weight
from offload.weights.row_split import NEVER, PromptRouting, RowSplitWeight, split_rows
from test_gguf_inplace import _options, write_tiny_gguf

ALWAYS, PACKED = PromptRouting(1, 1), PromptRouting(NEVER, NEVER)
LAYERS = 4      # packed layers cost a ring slot's bytes resident: 3 would all stay resident beside a ring of 2


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path / "cache"))
    return str(write_tiny_gguf(tmp_path / "tiny.gguf", layers=LAYERS))


def _ids(model, count: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (1, count), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids: torch.Tensor, routing: PromptRouting, chunks: list | None = None) -> torch.Tensor:
    model.prompt_routing = routing
    chunks = [(0, ids.shape[1])] if chunks is None else chunks
    return model.forward(ids, model.new_cache(ids.shape[1] + 1), prompt_chunks=chunks).logits[0]   # [N, V]


def test_a_split_weight_keeps_the_packed_bits_before_its_start_and_multiplies_dense_after(tiny):
    loaded = load_model(_options(tiny, cpu_kernel="packed"))
    name, packed = next((n, w) for n, w in loaded.layers.resident[0].items() if isinstance(w, Int4Weight))
    layer = split_rows(loaded.layers.resident[0], loaded.layers.dense(0), [(3, 7)])
    assert isinstance(layer[name], RowSplitWeight) and torch.is_tensor(layer["input_norm"])
    x = torch.randn(1, 9, packed.shape[1], generator=torch.Generator().manual_seed(1))
    out = layer[name].matmul(x)                                                              # [1, 9, N]
    assert torch.equal(out[:, :3], packed.matmul(x[:, :3])) and torch.equal(out[:, 7:], packed.matmul(x[:, 7:]))
    dense = torch.cat([torch.nn.functional.linear(x[:, 3:7], w) for w in layer[name].dense], dim=-1)
    assert torch.equal(out[:, 3:7], dense) and not torch.equal(out[:, 3:7], packed.matmul(x[:, 3:7]))


def test_routed_prompts_stay_near_the_packed_pass_and_stream_as_they_run_resident(tiny):
    resident = load_model(_options(tiny, cpu_kernel="packed"))
    ids = _ids(resident.model, 12)
    packed, routed = _logits(resident.model, ids, PACKED), _logits(resident.model, ids, ALWAYS)
    assert not torch.equal(packed, routed)
    # fp32 against the kernel's bf16 rounding: the logits move by a few percent of their spread, not more
    assert float((packed - routed).pow(2).mean().sqrt()) < 0.05 * float(packed.std())
    calls = []
    options = _options(tiny, ram=1, cpu_kernel="packed", ring_size=2)
    streamed = load_model(replace(options, gpu_mem=streaming_device_budget(options)))
    assert streamed.plan.tier_of.count("disk") == LAYERS
    dense = streamed.layers.dense
    streamed.layers.dense = lambda index: calls.append(index) or dense(index)
    for _ in range(2):      # the dense layer decoded from the ring slot's bytes, pass after pass
        assert torch.equal(_logits(streamed.model, ids, ALWAYS), routed)
    assert calls == list(range(LAYERS)) * 2
    streamed.layers.close()


def test_rows_before_the_prompt_keep_their_bits(tiny):
    model = load_model(_options(tiny, cpu_kernel="packed")).model
    ids = _ids(model, 12)
    packed, routed = _logits(model, ids, PACKED), _logits(model, ids, ALWAYS, [(5, 12)])
    assert torch.equal(routed[:5], packed[:5]) and not torch.equal(routed[5:], packed[5:])


def test_a_tree_beside_a_routed_prompt_chunk_gets_the_bits_it_gets_alone(tiny):
    """The decode loop's pass: one sequence's tree first, another's prompt chunk after it; and the chunk gets the
    bits it gets alone (routing is decided chunk by chunk, not by the pass)."""
    model = load_model(_options(tiny, cpu_kernel="packed")).model
    model.prompt_routing = ALWAYS
    cache = SlotCache(model.config, 2, 64, model.device, model.cache_dtype)
    prompt, tree, joining = _ids(model, 6, 1)[0], _ids(model, 4, 2)[0], _ids(model, 12, 3)[0]
    cache.begin([(0, 6)])
    model.forward(prompt[None], cache, torch.arange(6)[None], causal_mask(0, 6, model.device), prompt_chunks=[(0, 6)])
    cache.commit(0)
    cache.begin([(0, 4)])
    positions = torch.arange(6, 10)
    alone = model.forward(tree[None], cache, positions[None], causal_mask(6, 4, model.device)).logits[0]
    cache.truncate(0, 6)
    cache.begin([(0, 4), (1, 12)])
    mask = block_mask([causal_mask(6, 4, model.device), causal_mask(0, 12, model.device)])
    beside = model.forward(torch.cat([tree, joining])[None], cache, torch.cat([positions, torch.arange(12)])[None],
                           mask, prompt_chunks=[(4, 16)]).logits[0]                         # [16, V]
    assert torch.equal(beside[:4], alone)
    cache.truncate(1, 0)
    cache.begin([(1, 12)])
    joined = model.forward(joining[None], cache, torch.arange(12)[None], causal_mask(0, 12, model.device),
                           prompt_chunks=[(0, 12)]).logits[0]                                # [12, V]
    assert torch.equal(beside[4:], joined)


def test_routing_is_decided_chunk_by_chunk():
    routing = PromptRouting(attention_rows=4, dense_rows=8)
    assert routing.fast([(0, 3), (3, 7), (7, 20)]) == ([(3, 7), (7, 20)], [(7, 20)])
    assert routing.fast(None) == ([], [])


def test_prompt_routing_thresholds_are_checked():
    with pytest.raises(ValueError, match="prompt routing thresholds must be >= 1 row"):
        PromptRouting(0, 5)
