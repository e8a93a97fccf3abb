"""offload/model/config.py: parsing Hugging Face config.json files."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from offload.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig, UnsupportedModelError
from offload.model.rope import inverse_frequencies

LLAMA_31 = {  # the shape of Meta-Llama-3.1-8B's config.json (pre-transformers-5 rope format)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_unsupported_architecture_is_named_with_supported_list():
    raw = {**LLAMA_31, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_dict(raw)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    for name in SUPPORTED_ARCHITECTURES:
        assert name in message
    assert isinstance(info.value, ValueError)


def test_unsupported_model_type_without_architectures_is_named():
    raw = {k: v for k, v in LLAMA_31.items() if k != "architectures"}
    with pytest.raises(UnsupportedModelError, match="falcon"):
        ModelConfig.from_dict({**raw, "model_type": "falcon"})


def test_unsupported_rope_type_raises():
    with pytest.raises(UnsupportedModelError, match="longrope"):
        ModelConfig.from_dict({**LLAMA_31, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})


def test_llama31_old_rope_format_parses():
    config = ModelConfig.from_dict(LLAMA_31)
    assert config.family == "llama"
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (32, 32, 8, 128)
    assert config.rope == RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position=8192)
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert config.bos_token_id == 128000
    assert config.torch_dtype == "bfloat16" and config.max_position == 131072
    assert not config.attention_bias and config.sliding_window is None


def test_llama31_inverse_frequencies_match_transformers():
    """The old-format dict means the same to us as to transformers (which standardises it)."""
    config = ModelConfig.from_dict(LLAMA_31)
    hf = transformers.LlamaConfig(**{k: v for k, v in LLAMA_31.items() if k != "torch_dtype"})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    got, scale = inverse_frequencies(config.rope, config.head_dim, config.max_position)
    assert scale == 1.0
    torch.testing.assert_close(got, expected.float(), atol=0, rtol=1e-6)


def test_old_rope_format_with_type_key():
    raw = {**LLAMA_31, "rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}
    rope = ModelConfig.from_dict(raw).rope
    assert (rope.rope_type, rope.factor, rope.theta) == ("linear", 4.0, 10000.0)


def test_new_rope_parameters_format():
    raw = {k: v for k, v in LLAMA_31.items() if k not in ("rope_theta", "rope_scaling")}
    raw["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                              "rope_theta": 1000000.0, "beta_fast": 16}
    rope = ModelConfig.from_dict(raw).rope
    assert (rope.rope_type, rope.factor, rope.theta) == ("yarn", 4.0, 1000000.0)
    assert (rope.original_max_position, rope.beta_fast, rope.beta_slow) == (32768, 16.0, 1.0)


def test_default_rope_when_absent():
    raw = {k: v for k, v in LLAMA_31.items() if k not in ("rope_theta", "rope_scaling")}
    assert ModelConfig.from_dict(raw).rope == RopeConfig()


def _qwen2(**extra) -> dict:
    raw = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256).to_dict()
    raw["architectures"] = ["Qwen2ForCausalLM"]
    return {**raw, **extra}


def test_qwen2_without_sliding_window_flag_has_no_window():
    # Qwen2.5 checkpoints ship "sliding_window": 32768 with "use_sliding_window": false
    config = ModelConfig.from_dict(_qwen2(sliding_window=32768, use_sliding_window=False))
    assert config.family == "qwen2" and config.sliding_window is None
    assert config.attention_bias   # Qwen2 always has q/k/v biases
    missing_flag = _qwen2(sliding_window=4096)
    missing_flag.pop("use_sliding_window")
    assert ModelConfig.from_dict(missing_flag).sliding_window is None


def test_qwen2_with_sliding_window_flag_keeps_window():
    assert ModelConfig.from_dict(_qwen2(sliding_window=4096, use_sliding_window=True)).sliding_window == 4096


def test_mistral_keeps_sliding_window():
    raw = transformers.MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     sliding_window=4096).to_dict()
    config = ModelConfig.from_dict({**raw, "architectures": ["MistralForCausalLM"]})
    assert config.family == "mistral" and config.sliding_window == 4096


def test_qwen3_family_has_qk_norm_and_explicit_head_dim():
    raw = transformers.Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32).to_dict()
    config = ModelConfig.from_dict({**raw, "architectures": ["Qwen3ForCausalLM"]})
    assert config.has_qk_norm and config.head_dim == 32 and not config.attention_bias


def test_from_file_reads_folder_and_reports_bad_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31))
    assert ModelConfig.from_file(tmp_path) == ModelConfig.from_dict(LLAMA_31)
    assert ModelConfig.from_file(tmp_path / "config.json").family == "llama"
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_file(tmp_path)
    with pytest.raises(FileNotFoundError):
        ModelConfig.from_file(tmp_path / "missing")


def test_param_counts_match_transformers(tiny_checkpoint):
    for family in ("llama", "qwen2", "qwen3"):
        folder, hf_model = tiny_checkpoint(family)
        config = ModelConfig.from_file(folder)
        layer = sum(p.numel() for p in hf_model.model.layers[0].parameters())
        total = sum(p.numel() for p in hf_model.parameters())
        assert config.layer_param_count == layer, family
        assert config.global_param_count + config.num_layers * layer == total, family


@pytest.mark.parametrize("field, value", [("num_heads", 0), ("hidden_size", -1), ("num_kv_heads", 3)])
def test_invalid_sizes_raise(field, value):
    kwargs = dict(family="llama", vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=2, rms_norm_eps=1e-6, max_position=16)
    with pytest.raises(ValueError):
        ModelConfig(**{**kwargs, field: value})


def test_invalid_rope_values_raise():
    with pytest.raises(ValueError):
        RopeConfig(theta=0.0)
    with pytest.raises(ValueError):
        RopeConfig(factor=-2.0)
