"""Shared helpers: tiny random Hugging Face checkpoints and our model loaded from them.

Nothing here downloads anything: every checkpoint is built from a transformers config class with
random weights, saved as safetensors in a temporary folder, and loaded back by our own code.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from offload.model.config import ModelConfig
from offload.model.decoder import DecoderModel
from offload.loader import LoadOptions, build_engine
from offload.weights.source import CheckpointSource

CPU = torch.device("cpu")

BASE_CONFIG = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# family -> (transformers config class, family-specific defaults)
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralConfig, {"sliding_window": None, "head_dim": 16}),
    "qwen2": (transformers.Qwen2Config, {"use_sliding_window": False}),      # q/k/v biases
    "qwen3": (transformers.Qwen3Config, {"head_dim": 16, "use_sliding_window": False}),  # q/k norms
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """transformers initialises norms to 1 and biases to 0, which would make those code paths
    untestable; give every parameter random values of a scale that keeps logits O(1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[1]))


def make_tiny_checkpoint(tmp_path: Path, family: str, seed: int = 0, save_kwargs: dict | None = None,
                         **overrides) -> tuple[Path, torch.nn.Module]:
    """A random tiny `family` model saved (safetensors) under tmp_path; returns (folder, hf_model).
    The returned transformers model is in eval mode, float32, eager attention."""
    config_cls, family_defaults = FAMILIES[family]
    config = config_cls(**{**BASE_CONFIG, **family_defaults, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    _randomize(model, seed)
    folder = Path(tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, **(save_kwargs or {}))
    return folder, model


def load_ours(folder: Path, dtype: torch.dtype = torch.float32) -> DecoderModel:
    """Our runtime's model on CPU, built as offload/loader.py builds it (minus tokenizer)."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    source = CheckpointSource(folder, ModelConfig.from_file(folder))
    return build_engine(source, LoadOptions(device="cpu", dtype=names[dtype])).model


def hf_logits(hf_model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids).logits.float()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Memoised make_tiny_checkpoint: tiny_checkpoint(family, **overrides) -> (folder, hf_model)."""
    made: dict = {}

    def get(family: str, **overrides):
        key = (family, repr(sorted(overrides.items())))
        if key not in made:
            made[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(family), family, **overrides)
        return made[key]

    return get


def add_tiny_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A word-level tokenizer over tokens t0..t{V-1} ("t0" is the end of turn), so that a tiny random
    checkpoint loads like a real model folder (our loader and the draft/target tokenizer check read it)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["t0"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t0", "unk_token": "t1"}))
    return folder


def perturbed_copy(source, target, noise: float, seed: int):
    """A draft: the target's weights plus relative noise (noise 0: the target itself)."""
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, target / item.name)
    generator = torch.Generator().manual_seed(seed)
    for weights in source.glob("*.safetensors"):
        tensors = load_file(weights)
        tensors = {k: t + noise * t.std() * torch.randn(t.shape, generator=generator) for k, t in tensors.items()}
        save_file(tensors, target / weights.name, metadata={"format": "pt"})
    return target


def tiny_pair(root: Path, seed: int, vocab_size: int, noise: float, max_context: int, max_pass_tokens: int,
              chat_template: str | None = None):
    """A tiny random target and a perturbed draft saved as ordinary model folders, both loaded on the
    CPU in fp32 -> (target folder, draft folder, target LoadedModel, Draft)."""
    import json

    from offload import LoadOptions, load_model
    from spec import load_any_draft
    folder, _ = make_tiny_checkpoint(root / "target", "llama", seed=seed, vocab_size=vocab_size, num_hidden_layers=2)
    add_tiny_tokenizer(folder, vocab_size)
    draft_folder = perturbed_copy(folder, root / "draft", noise, seed)
    for item in (folder, draft_folder) if chat_template else ():
        config = json.loads((item / "tokenizer_config.json").read_text())
        (item / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat_template}))
    target = load_model(LoadOptions(str(folder), device="cpu", dtype="fp32", max_context=max_context,
                                    max_pass_tokens=max_pass_tokens))
    draft = load_any_draft(str(draft_folder), target, LoadOptions(device="cpu", dtype="fp32", max_context=max_context))
    return folder, draft_folder, target, draft
