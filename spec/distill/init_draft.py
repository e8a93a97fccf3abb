"""Starting a distillation from a trained draft (`distill --init-draft DIR`), e.g. to widen its vocabulary.

The new vocabulary keeps every token of the initial draft and adds the most frequent others of the
corpus up to K. Kept tokens keep their trained head rows and biases; a new token starts from the
target's head row and the mean trained bias (as `--revocab` does). Layers and the final norm are the
initial draft's. With `--head-only` only the head rows and biases train: the draft's hidden states
stay as they were, so a small corpus is enough to fit the new rows.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from offload.weights.source import WeightSource
from offload.weights.safetensors_io import SafetensorsFile
from spec.draft_folder import VOCAB_MAP_KEY, read_draft_info
from spec.vocab_map import out_of_set_rows
from .draft_io import load_draft_module
from .draft_model import DraftModel, choose_vocab


def draft_vocab(folder: str | Path) -> Tensor:
    """[K0] int64 target ids of the draft's head rows."""
    read_draft_info(folder)
    return SafetensorsFile(Path(folder) / "model.safetensors").tensor(VOCAB_MAP_KEY).long()


def widened_vocab(counts: Tensor, kept: Tensor, vocab_top: int, always: set[int]) -> Tensor:
    """counts [V]; kept [K0] target ids -> [K] ascending ids: `kept`, `always` and the most frequent others,
    K = max(vocab_top, K0) unless the corpus has fewer distinct tokens."""
    return choose_vocab(counts, max(vocab_top, kept.numel() + len(always) + 1), always | set(kept.tolist()))


def draft_from_draft(folder: str | Path, source: WeightSource, vocab_map: Tensor) -> DraftModel:
    """The draft in `folder` over `vocab_map` [K] target ids (a superset or any other set of its own)."""
    old = load_draft_module(folder, embed=source.global_tensors()["embed"])
    rows = out_of_set_rows(old.vocab_map.cpu(), source.config.vocab_size)[vocab_map]          # [K], -1: new
    kept = rows >= 0
    globals_ = source.global_tensors()
    head = globals_.get("lm_head", globals_["embed"])[vocab_map].float()                      # [K, H]
    head[kept] = old.head.detach()[rows[kept]]
    bias = torch.full((vocab_map.numel(),), float(old.head_bias.detach().mean()))
    bias[kept] = old.head_bias.detach()[rows[kept]]
    layers = [{name: w.detach() for name, w in layer.weights.items()} for layer in old.layers]
    return DraftModel(old.config, old.embed, layers, old.norm, head, bias, vocab_map, old.num_frozen)


def freeze_all_but_head(model: DraftModel) -> None:
    """Only the head rows and biases train from here on."""
    for param in model.parameters():
        param.requires_grad_(False)
    model.head.requires_grad_(True)
    model.head_bias.requires_grad_(True)


def init_draft_recipe(folder: str | Path) -> dict:
    """What the new draft records about where it started (the folder's name, never a machine's path)."""
    info = read_draft_info(folder)
    return {"init_draft": Path(folder).name, "init_draft_vocab_top": info.vocab_top,
            "init_draft_steps": info.training.get("steps")}
