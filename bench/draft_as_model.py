"""A model with natural weights for `bench quant`: the shipped draft as a standalone 3-layer causal LM.

The default target's weights are dequantized Q4_1, which flatters every 4-bit method. The draft's
layers were trained for 10,000 steps from there, so they no longer sit on any grid (stored in int8
with a scale per 64 inputs, far finer than the 3-4 bits under test). The standalone model is the
draft's layers and final norm, the target's token embedding, and an LM head over the full vocabulary:
the draft's trained rows for its own tokens and zero rows (logit 0) for the rest, which the draft
never learned to score (the draft's small row biases, std 0.05, are dropped: a plain Llama head has none).

    python cli.py bench quant --natural-weights --json     (the model written to the cache, then measured)
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from offload.weights.gguf_import import cache_root
from offload.weights.resolve import resolve_model
from offload.weights.source import HF_GLOBAL_NAMES, HF_LAYER_NAMES, CheckpointSource
from offload.weights.tokenizer import copy_tokenizer_files
from spec.distill.draft_io import load_draft_module
from spec.draft import default_draft_for


def natural_weights_model() -> Path:
    """The standalone model of the default target's shipped draft, (re)written under the cache (a few MB)."""
    return write_draft_as_model(cache_root() / "natural_weights")


def write_draft_as_model(out: Path, draft_folder: Path | None = None) -> Path:
    target_folder = resolve_model(None, gguf_import=True)
    target = CheckpointSource(target_folder)
    draft = load_draft_module(draft_folder or default_draft_for(None), embed=target.global_tensors()["embed"])
    globals_ = target.global_tensors()
    head = torch.zeros_like(globals_["embed"], dtype=torch.float32)                 # [V, H]
    head[draft.vocab_map] = draft.head.detach()
    tensors = {HF_GLOBAL_NAMES["embed"]: globals_["embed"].float(), HF_GLOBAL_NAMES["norm"]: draft.norm.detach(),
               HF_GLOBAL_NAMES["lm_head"]: head}
    for index, layer in enumerate(draft.layers):
        for name, weight in layer.weights.items():
            tensors[f"model.layers.{index}.{HF_LAYER_NAMES[name]}"] = weight.detach().float().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target_folder / "config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    config.update(num_hidden_layers=len(draft.layers), tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_tokenizer_files(target_folder, out)
    return out
