"""Re-choosing a draft's vocabulary when its corpus has grown (`distill --resume --revocab`).

The K most frequent target tokens of the grown corpus replace the old K. A token in both sets keeps
its trained head row, bias and Adam moments; a new token starts from the target's head row (as a
fresh draft would), the mean bias and zero moments. The checkpoint is rewritten atomically and records
its vocabulary, so a run stopped between the two writes finishes the change on the next resume.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from spec.vocab_map import out_of_set_rows
from .draft_model import DraftModel
from .checkpoint import CheckpointError, read_checkpoint, write_checkpoint


def _remap_rows(old: Tensor, rows: Tensor, fresh: Tensor) -> Tensor:
    """old [K_old, ...]; rows [K] old row of each new token (-1: new token); fresh [K, ...] -> [K, ...]."""
    kept = rows >= 0
    out = fresh.to(old.dtype).clone()
    out[kept] = old[rows[kept]]
    return out


def revocab_checkpoint(checkpoint_path: Path, model: DraftModel, old_map: Tensor, new_map: Tensor) -> int:
    """Rewrites the training checkpoint for `new_map`; `model` is the freshly built draft over `new_map`
    (its head rows are the target's). Returns how many rows kept their trained values."""
    payload = read_checkpoint(checkpoint_path)
    if torch.equal(payload.get("vocab_map", old_map).cpu(), new_map.cpu()):
        return new_map.numel()
    rows = out_of_set_rows(old_map.cpu(), model.config.vocab_size)[new_map.cpu()]     # [K]
    weights = payload["model"]
    if "head" not in weights or "head_bias" not in weights or weights["head"].shape[0] != old_map.numel():
        raise CheckpointError(f"{checkpoint_path} lacks a head of {old_map.numel()} rows (the vocabulary it was "
                              f"trained on): it is not this run's checkpoint")
    fresh_head = model.head.detach().cpu()                                          # [K, H]
    fresh_bias = torch.full_like(model.head_bias.detach().cpu(), float(weights["head_bias"].mean()))
    weights["head"] = _remap_rows(weights["head"], rows, fresh_head)
    weights["head_bias"] = _remap_rows(weights["head_bias"], rows, fresh_bias)
    params = list(model.trainable_parameters())
    for param in (model.head, model.head_bias):
        state = payload["optimizer"]["state"].get(next(i for i, p in enumerate(params) if p is param))
        for key in ("exp_avg", "exp_avg_sq"):
            if state is not None and key in state:
                state[key] = _remap_rows(state[key], rows, torch.zeros_like(param.detach().cpu()))
    payload["vocab_map"] = new_map.cpu()
    write_checkpoint(payload, checkpoint_path)
    return int((rows >= 0).sum())
