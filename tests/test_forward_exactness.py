"""Our layer-wise forward against transformers' reference implementation, on tiny random models."""
from __future__ import annotations

import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from offload.model.config import ModelConfig
from trees import tree_mask
from offload.model.rope import inverse_frequencies

from conftest import hf_logits, load_ours

ATOL = 1e-4  # fp32 vs fp32: differences are summation-order rounding only

LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 10000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}

# id -> (family, config overrides, prompt length)
CASES = {
    "llama": ("llama", {}, 20),
    "mistral": ("mistral", {}, 20),
    "qwen2": ("qwen2", {}, 20),
    "qwen3": ("qwen3", {}, 20),
    # 100-token prompts: positions past original_max_position_embeddings (64) exercise the scaling
    "llama-rope-linear": ("llama", {"rope_parameters": LINEAR}, 100),
    "llama-rope-llama3": ("llama", {"rope_parameters": LLAMA3}, 100),
    "llama-rope-yarn": ("llama", {"rope_parameters": YARN}, 100),
    # extras: a sliding window shorter than the prompt, and tied embeddings (no lm_head tensor)
    "mistral-sliding-window": ("mistral", {"sliding_window": 8}, 20),
    "llama-tied": ("llama", {"tie_word_embeddings": True}, 20),
}
BASIC = ["llama", "mistral", "qwen2", "qwen3"]


def _case(tiny_checkpoint, case_id):
    family, overrides, length = CASES[case_id]
    folder, hf_model = tiny_checkpoint(family, **overrides)
    return folder, hf_model, length


def _prompt(length: int, seed: int = 1, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case_id", list(CASES))
def test_logits_match_transformers(tiny_checkpoint, case_id):
    folder, hf_model, length = _case(tiny_checkpoint, case_id)
    ours = load_ours(folder)
    ids = _prompt(length)
    expected = hf_logits(hf_model, ids)
    cache = ours.new_cache(length)
    got = ours.forward(ids, cache).logits
    assert got.shape == expected.shape == (1, length, 256)
    assert expected.abs().max() > 1.0  # the comparison is not between near-zero numbers
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert cache.length == 0 and cache.num_pending == length  # forward appends, never commits


def test_rope_scaling_changes_logits(tiny_checkpoint):
    """Guards the rope cases above: at these positions the scaling really matters."""
    default_folder, _ = tiny_checkpoint("llama")
    ids = _prompt(100)
    base = load_ours(default_folder).forward(ids, load_ours(default_folder).new_cache(100)).logits
    for case_id in ("llama-rope-linear", "llama-rope-llama3", "llama-rope-yarn"):
        folder, _, _ = _case(tiny_checkpoint, case_id)
        model = load_ours(folder)
        scaled = model.forward(ids, model.new_cache(100)).logits
        assert (scaled - base).abs().max() > 1e-2, case_id


@pytest.mark.parametrize("rope_parameters", [LINEAR, LLAMA3, YARN,
                                             {**YARN, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
                                             {**YARN, "attention_factor": 0.8}],
                         ids=["linear", "llama3", "yarn", "yarn-betas-no-truncate", "yarn-attention-factor"])
@pytest.mark.parametrize("head_dim", [16, 128])
def test_inverse_frequencies_match_transformers(rope_parameters, head_dim):
    import transformers
    hf_config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                         max_position_embeddings=256, rope_parameters=dict(rope_parameters))
    expected, expected_scale = ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](hf_config, torch.device("cpu"))
    ours = ModelConfig.from_dict({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    got, scale = inverse_frequencies(ours.rope, head_dim, ours.max_position)
    torch.testing.assert_close(got, expected.float(), atol=0, rtol=1e-6)
    assert scale == pytest.approx(expected_scale, rel=1e-12)


@pytest.mark.parametrize("case_id", BASIC + ["mistral-sliding-window", "llama-rope-yarn"])
def test_prefill_then_decode_matches_full_forward(tiny_checkpoint, case_id):
    folder, hf_model, _ = _case(tiny_checkpoint, case_id)
    ours = load_ours(folder)
    length, prefill = 20, 6
    ids = _prompt(length, seed=2)
    full = ours.forward(ids, ours.new_cache(length)).logits
    reference = hf_logits(hf_model, ids)

    cache = ours.new_cache(length)
    steps = [ours.forward(ids[:, :prefill], cache).logits]
    cache.commit()
    for i in range(prefill, length):
        steps.append(ours.forward(ids[:, i:i + 1], cache).logits)
        cache.commit()
        assert cache.length == i + 1
    incremental = torch.cat(steps, dim=1)
    torch.testing.assert_close(incremental, full, atol=ATOL, rtol=0)
    torch.testing.assert_close(incremental, reference, atol=ATOL, rtol=0)


def test_last_only_returns_last_position(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen2")
    ours = load_ours(folder)
    ids = _prompt(12)
    full = ours.forward(ids, ours.new_cache(12)).logits
    last = ours.forward(ids, ours.new_cache(12), last_only=True).logits
    assert last.shape == (1, 1, 256)
    torch.testing.assert_close(last, full[:, -1:], atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", BASIC)
def test_bf16_close_to_fp32(tiny_checkpoint, family):
    folder, _ = tiny_checkpoint(family)
    ids = _prompt(20)
    fp32 = load_ours(folder, torch.float32)
    bf16 = load_ours(folder, torch.bfloat16)
    cache = bf16.new_cache(20)
    out = bf16.forward(ids, cache, return_hidden=True)
    expected = fp32.forward(ids, fp32.new_cache(20)).logits
    # the plumbing: weights, cache and activations are bf16; logits come back as float32
    assert cache.keys.dtype == torch.bfloat16 and out.hidden.dtype == torch.bfloat16
    assert bf16.layers.get(0)["q"].dtype == torch.bfloat16 and bf16.embed.dtype == torch.bfloat16
    assert out.logits.dtype == torch.float32
    error = (out.logits - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert 0 < error < 0.1 * scale, (error, scale)   # really computed in bf16, yet close
    agreement = (out.logits.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agreement >= 0.8


PARENTS = [-1, 0, 0, 1, 1, 2, 5]


def _depths(parents: list[int]) -> list[int]:
    depths = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def _path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("case_id", BASIC + ["mistral-sliding-window"])
def test_tree_forward_matches_each_path_alone(tiny_checkpoint, case_id):
    folder, hf_model, _ = _case(tiny_checkpoint, case_id)
    ours = load_ours(folder)
    prefix_len = 10
    prefix = _prompt(prefix_len, seed=3)
    nodes = _prompt(len(PARENTS), seed=4)

    cache = ours.new_cache(32)
    ours.forward(prefix, cache)
    cache.commit()
    parents = torch.tensor(PARENTS)
    positions = (prefix_len + torch.tensor(_depths(PARENTS)))[None]
    tree = ours.forward(nodes, cache, positions=positions, mask=tree_mask(parents, cache.length)).logits
    assert tree.shape == (1, len(PARENTS), 256)

    for node in range(len(PARENTS)):
        path = nodes[:, _path(PARENTS, node)]
        sequence = torch.cat((prefix, path), dim=1)
        fresh = ours.new_cache(32)
        ours.forward(prefix, fresh)          # prefix then path, causally, on a fresh cache
        fresh.commit()
        alone = ours.forward(path, fresh).logits[:, -1]
        torch.testing.assert_close(tree[:, node], alone, atol=ATOL, rtol=0, msg=f"node {node}")
        torch.testing.assert_close(tree[:, node], hf_logits(hf_model, sequence)[:, -1], atol=ATOL, rtol=0,
                                   msg=f"node {node} vs transformers")


def test_tree_mask_shape_and_ancestors():
    mask = tree_mask(torch.tensor(PARENTS), 3)
    assert mask.shape == (7, 10) and mask.dtype == torch.bool
    assert mask[:, :3].all()
    for node in range(7):
        expected = set(_path(PARENTS, node))
        assert {j for j in range(7) if mask[node, 3 + j]} == expected


@pytest.mark.parametrize("family", BASIC)
def test_return_hidden_is_final_norm_output(tiny_checkpoint, family):
    folder, hf_model = tiny_checkpoint(family)
    ours = load_ours(folder)
    ids = _prompt(16, seed=5)
    captured = {}

    def keep(_module, _inputs, output):
        captured["last_layer"] = output[0] if isinstance(output, tuple) else output

    handle = hf_model.model.layers[-1].register_forward_hook(keep)
    try:
        with torch.no_grad():
            hf_out = hf_model(ids, output_hidden_states=True)
    finally:
        handle.remove()
    with torch.no_grad():
        normed = hf_model.model.norm(captured["last_layer"])
    out = ours.forward(ids, ours.new_cache(16), return_hidden=True)
    assert out.hidden.shape == (1, 16, 64)
    torch.testing.assert_close(out.hidden, normed, atol=ATOL, rtol=0)
    # transformers 5 reports the final-norm output as the last hidden state
    torch.testing.assert_close(out.hidden, hf_out.hidden_states[-1], atol=ATOL, rtol=0)
    assert ours.forward(ids, ours.new_cache(16)).hidden is None


def test_a_block_pass_computes_what_one_token_passes_compute(tiny_checkpoint):
    """As tests/test_pass_invariance.py on the default model: in fp32 a chain's block pass gives one-token greedy decoding's logits (so
    its choices); in bf16 it is really computed in bf16 (differences exist) and still close."""
    from offload.model.pass_check import compare_passes
    folder, _ = tiny_checkpoint("llama")
    fp32 = compare_passes(load_ours(folder, torch.float32), [3, 7, 11, 5, 2], 16)
    assert fp32["positions"] == 16 and fp32["flips"] == 0 and fp32["max_logit_difference"] < 1e-4
    bf16 = compare_passes(load_ours(folder, torch.bfloat16), [3, 7, 11, 5, 2], 16)
    assert 0 < bf16["max_logit_difference"] < 0.5 and len(bf16["margins_at_flips"]) == bf16["flips"]
