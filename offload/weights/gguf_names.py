"""GGUF names (llama.cpp's standardized tensor names and architectures) mapped to the Hugging Face
names our loader reads (offload/weights/source.py)."""
from __future__ import annotations

import re

from offload.weights.source import HF_GLOBAL_NAMES, HF_LAYER_NAMES

# GGUF `general.architecture` -> whether llama.cpp permuted the q/k rows of this file's attention
# (its Llama converter interleaves the two rotary halves of every head; transformers undoes it for
# "llama" only, which also covers Mistral and SmolLM2 GGUFs)
SUPPORTED_GGUF_ARCHITECTURES = {"llama": True, "mistral": False, "qwen2": False, "qwen3": False}

# transformers model_type (what its GGUF config reader makes of the file) -> config.json `architectures`
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
}

GGUF_GLOBAL_NAMES = {"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
GGUF_LAYER_NAMES = {
    "input_norm": "attn_norm.weight",
    "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "o": "attn_output.weight",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "post_norm": "ffn_norm.weight",
    "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight",
}
PERMUTED_LAYER_NAMES = {"q": "heads", "k": "kv_heads", "q_bias": "heads", "k_bias": "kv_heads"}

_GLOBAL_TO_HF = {GGUF_GLOBAL_NAMES[k]: HF_GLOBAL_NAMES[k] for k in GGUF_GLOBAL_NAMES}
_LAYER_TO_CANONICAL = {v: k for k, v in GGUF_LAYER_NAMES.items()}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def check_architecture(architecture: str, path: object) -> None:
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {architecture!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})")


def hf_tensor_name(gguf_name: str) -> tuple[str, str | None] | None:
    """(Hugging Face name, which head count permuted its rows or None), or None for a tensor our
    loader does not read (e.g. llama.cpp's `rope_freqs.weight`, which transformers skips too)."""
    if gguf_name in _GLOBAL_TO_HF:
        return _GLOBAL_TO_HF[gguf_name], None
    match = _BLOCK.fullmatch(gguf_name)
    canonical = _LAYER_TO_CANONICAL.get(match.group(2)) if match else None
    if canonical is None:
        return None
    return f"model.layers.{match.group(1)}.{HF_LAYER_NAMES[canonical]}", PERMUTED_LAYER_NAMES.get(canonical)
