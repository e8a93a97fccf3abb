"""A GGUF run on the CPU's int4 kernel (LoadOptions.cpu_kernel = "packed", offload/weights/packed_linear.py):
the matrices the kernel takes multiply packed in every tier and are never decoded, the others (F16 here) take
today's decode; the logits stay near the dense fp32 reference; a tree pass gives every row the bits a one-token
pass gives it, on the embedded default model, for trees of 1 to 1,024 nodes."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import offload.weights.gguf_source
from offload import LoadOptions, load_model
from offload.loader import build_engine, streaming_device_budget
from offload.model.config import ModelConfig
from offload.weights.formats import open_source
from offload.weights.ggml_types import GGMLType
from offload.weights.gguf_names import GGUF_LAYER_NAMES
from offload.weights.packed_linear import FUSED, Int4Head, Int4Weight
from offload.weights.resolve import resolve_model
from offload.weights.row_split import PromptRouting
from offload.weights.safetensors_io import write_safetensors
from offload.weights.source import CheckpointSource
import textdata
from spec.tree import Tree
from test_gguf_import import reference_tensors
from test_gguf_inplace import LAYERS, MATRIX_TYPES, _layer_shapes, _options, write_tiny_gguf

KERNEL_TYPES = {"Q4_K", "Q8_0"}     # of the tiny file's layer matrix types; its F16 ones are decoded


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """The tiny GGUF with its layers' Q6_K matrices made F16 (a type the kernel takes not)."""
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path / "cache"))
    wide = {f"blk.{i}.{GGUF_LAYER_NAMES[name]}": GGMLType.F16 for i in range(LAYERS)
          for j, (name, shape) in enumerate(_layer_shapes().items())
          if len(shape) == 2 and MATRIX_TYPES[(i + j) % len(MATRIX_TYPES)] == GGMLType.Q6_K}
    return write_tiny_gguf(tmp_path / "tiny.gguf", types=wide)


@pytest.fixture
def decoded_types(monkeypatch) -> list[str]:
    """The GGML type of every tensor the GGUF source dequantizes from here on."""
    seen, real = [], offload.weights.gguf_source.dequantize

    def recording(raw, qtype, shape, *args, **kwargs):
        seen.append(GGMLType(qtype).name)
        return real(raw, qtype, shape, *args, **kwargs)
    monkeypatch.setattr(offload.weights.gguf_source, "dequantize", recording)
    return seen


def _dense_reference(path, tmp_path):
    reference = tmp_path / "reference"
    reference.mkdir()
    (reference / "config.json").write_text((resolve_model(str(path)) / "config.json").read_text())
    write_safetensors(reference / "model.safetensors", reference_tensors(path))
    return build_engine(CheckpointSource(reference), _options(str(reference)))


def test_every_tier_multiplies_packed_and_decodes_only_what_the_kernel_cannot_take(tiny, tmp_path, decoded_types):
    dense = _dense_reference(tiny, tmp_path)
    ids = torch.randint(0, dense.model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    expected = dense.model.forward(ids, dense.model.new_cache(16)).logits
    resident = load_model(_options(str(tiny), cpu_kernel="packed"))
    folder = resolve_model(str(tiny))
    layer_bytes = open_source(folder, ModelConfig.from_file(folder)).layout(torch.float32).num_bytes
    options = _options(str(tiny), ram=layer_bytes, cpu_kernel="packed", ring_size=2)   # one layer in RAM, two on disk
    streamed = load_model(replace(options, gpu_mem=streaming_device_budget(options)))
    assert resident.plan.tier_of == ["device"] * 3 and streamed.plan.tier_of == ["ram", "disk", "disk"]
    types = {(i, name): info.type_name for i, layer in enumerate(resident.source._layers) for name, info in layer.items()}
    for (index, name), type_name in types.items():
        layer = resident.layers.resident[index]
        fused = next((f for f, parts in FUSED.items() if name in parts and f in layer), None)
        assert isinstance(layer[fused or name], Int4Weight) == (type_name in KERNEL_TYPES), (index, name, type_name)
        assert (fused or name) in layer and not (fused and name in layer)
    decoded_types.clear()
    got = resident.model.forward(ids, resident.model.new_cache(16)).logits
    for _ in range(2):      # streamed layers repacked pass after pass
        assert torch.equal(streamed.model.forward(ids, streamed.model.new_cache(16)).logits, got)
    assert set(decoded_types) == {"F16", "F32"}            # the streamed layers' others; nothing the kernel takes
    # the kernel rounds to bf16: on random weights the logits move by ~2% of their spread (rms), not more
    assert float((got - expected).pow(2).mean().sqrt()) < 0.05 * float(expected.std())
    assert not isinstance(resident.model.lm_head, Int4Head)   # the tiny vocabulary is not a multiple of 16 rows
    streamed.layers.close()


def test_the_status_line_names_what_the_kernel_multiplies_and_what_it_decodes(tiny):
    statuses = []
    load_model(_options(str(tiny), cpu_kernel="packed"), on_status=statuses.append)
    line = next(s for s in statuses if s.startswith("CPU packed int4 kernel"))
    taken, decoded = line.split("decoded to dense")
    assert "Q4_K x" in taken and "Q8_0 x" in taken and "F16 x" in decoded
    assert "Q6_K x1" in decoded             # the lm_head: Q6_K, but its rows (the tiny vocabulary) not a multiple of 16


def test_an_unknown_cpu_kernel_is_refused():
    with pytest.raises(ValueError, match="cpu kernel must be one of auto, dense, packed, ggml, got 'int3'"):
        LoadOptions(cpu_kernel="int3")


# the embedded default model: a tree pass against one-token passes, bit for bit ----------------------------
def _random_tree(num_nodes: int, generator: torch.Generator, vocab: int) -> Tree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, num_nodes)]
    depths = [0] * num_nodes
    for i in range(1, num_nodes):
        depths[i] = depths[parents[i]] + 1
    return Tree(torch.randint(0, vocab, (num_nodes,), generator=generator), torch.tensor(parents),
                torch.tensor(depths), torch.zeros(num_nodes))


def _path(tree: Tree, node: int) -> list[int]:
    nodes = [node]
    while tree.parents[nodes[-1]] >= 0:
        nodes.append(int(tree.parents[nodes[-1]]))
    return nodes[::-1]


@pytest.fixture(scope="module")
def default_packed():
    return load_model(LoadOptions(device="cpu", dtype="fp32", cpu_kernel="packed", max_context=2048,
                                  max_pass_tokens=1024))


@pytest.mark.e2e
@pytest.mark.parametrize("num_nodes", [1, 2, 3, 17, 64, 255, 1024])
def test_a_tree_pass_gives_each_row_the_bits_of_one_token_passes(default_packed, num_nodes):
    model, generator = default_packed.model, torch.Generator().manual_seed(num_nodes)
    prompt = default_packed.tokenizer.encode_chat([{"role": "user", "content": "Name three rivers in Europe."}])
    tree = _random_tree(num_nodes, generator, model.config.vocab_size)
    cache = model.new_cache(len(prompt) + num_nodes + 1)
    model.forward(torch.tensor([prompt]), cache, last_only=True)
    cache.commit()
    rows = model.forward(tree.tokens[None], cache, tree.positions(len(prompt)),
                         tree.attention_mask(len(prompt), model.device)).logits[0]          # [N, V]
    checked = sorted({0, num_nodes - 1, int(tree.depths.argmax()),
                      *torch.randint(0, num_nodes, (12,), generator=generator).tolist()})
    for node in checked:    # the node's path root -> node, one token per pass, as decoding would see it
        cache.truncate(len(prompt))
        for step in _path(tree, node):
            logits = model.forward(tree.tokens[step:step + 1][None], cache).logits[0, -1]   # [V]
            cache.commit()
        assert torch.equal(logits.view(torch.int32), rows[node].view(torch.int32)), node


@pytest.mark.e2e
@pytest.mark.parametrize("routing", [PromptRouting(), PromptRouting(1, 1)], ids=["default", "prompts-dense"])
def test_packed_speculation_equals_packed_one_token_decoding(default_packed, routing):
    """Through the decode loop (a slot cache of float64 keys): the default draft's trees at budget 16 give the
    tokens one-token greedy decoding gives, on two chat prompts; also where every prompt chunk attends in fp32
    and multiplies dense (row_split.py), since both runs prefill alike."""
    from spec import DecodeConfig, Decoder, FixedBudget, SamplingConfig, Speculator, default_draft_for, load_any_draft
    target = default_packed
    target.model.prompt_routing = routing
    draft = load_any_draft(str(default_draft_for(None)), target, LoadOptions(device="cpu", max_context=2048))
    config = DecodeConfig(24, 2048, max_pass_tokens=1024)
    reference = Decoder(target.model, target.stop_ids, config)
    speculative = Decoder(target.model, target.stop_ids, config, Speculator(draft, 2048, 16), FixedBudget(16))
    assert reference.cache.keys.dtype == torch.float64
    for row in textdata.records(textdata.CHAT_PROMPTS)[:2]:
        ids = target.tokenizer.encode_chat([{"role": "user", "content": row["prompt"]}])
        result = speculative.generate(ids, SamplingConfig())
        assert result.token_ids == reference.generate(ids, SamplingConfig()).token_ids
        assert result.stats.tokens_per_pass > 1
    target.model.prompt_routing = PromptRouting()


@pytest.mark.e2e
def test_the_packed_plan_counts_what_the_packed_session_holds():
    """The commands' default on the CPU (RuntimeConfig): packed layers, the packed head beside the dense
    embedding and a float64 KV cache, each planned at the bytes held."""
    from runtime.session import RuntimeConfig, Session
    with Session(RuntimeConfig(budget=16, device="cpu", max_context=1024)) as session:
        plan, target = session.target.plan, session.target
        assert isinstance(target.model.lm_head, Int4Head) and session.decoder.cache.keys.dtype == torch.float64
        items = {i.component.split(" (")[0]: i.num_bytes for i in plan.items if i.tier == "device"}
        assert items["embeddings, final norm, LM head"] == target.global_bytes
        assert next(v for k, v in items.items() if k.startswith("KV cache")) == session.decoder.cache.num_bytes
        layers = sum(v for k, v in items.items() if k.startswith(("decoder", "ring")))
        assert layers == target.layers.device_bytes < target.config.num_layers * target.config.layer_param_count


@pytest.mark.e2e
def test_the_default_model_packed_gives_the_same_tokens_resident_and_streamed_from_ram_and_disk():
    from spec import DecodeConfig, Decoder, SamplingConfig
    options = LoadOptions(device="cpu", dtype="fp32", cpu_kernel="packed", max_context=256, max_pass_tokens=64)
    tokens = {}
    for tier, ram in (("device", None), ("ram", None), ("disk", 1)):
        streamed = replace(options, ram=ram)
        if tier != "device":
            streamed.gpu_mem = streaming_device_budget(streamed)
        loaded = load_model(streamed)
        assert loaded.plan.tier_of.count(tier) >= 20, loaded.plan.tier_of
        ids = loaded.tokenizer.encode_chat([{"role": "user", "content": "Name three primary colors."}])
        tokens[tier] = Decoder(loaded.model, loaded.stop_ids, DecodeConfig(24, 256)).generate(ids, SamplingConfig()).token_ids
        loaded.layers.close()
    assert tokens["ram"] == tokens["device"] and tokens["disk"] == tokens["device"]
