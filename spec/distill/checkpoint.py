"""The distillation training checkpoint on disk: one safetensors file, tensors plus JSON, never pickle.

    checkpoint.safetensors
        model.<name>            every tensor of the draft's state_dict (float32)
        optimizer.<i>.<key>     AdamW's tensors of trainable parameter i (step, exp_avg, exp_avg_sq)
        vocab_map               [K] int64 target id of each head row (written by --revocab)
        metadata                format "specstream-distill-checkpoint", version "1", and JSON strings:
                                state (step, tokens_seen, seconds, history), config (TrainConfig),
                                trainable (parameter names), param_groups (AdamW's settings), scalars
                                (AdamW's non-tensor per-parameter state), target (embedding fingerprint)
    vocab_map.safetensors
        vocab_map               [K] int64, the vocabulary the first run chose; metadata format
                                "specstream-distill-vocab", version "1"

Written atomically (temp file, fsync, rename): a stop mid-write leaves the previous checkpoint in place.
The pickled `checkpoint.pt` / `vocab_map.pt` of older versions are refused, never loaded.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from offload.weights.safetensors_io import SafetensorsFile, write_safetensors

CHECKPOINT_FORMAT, CHECKPOINT_VERSION = "specstream-distill-checkpoint", "1"
JSON_KEYS = ("state", "config", "trainable", "param_groups", "scalars", "target")
VOCAB_FORMAT = {"format": "specstream-distill-vocab", "version": "1"}
PICKLED_FILES = {"checkpoint.pt": "training checkpoint", "vocab_map.pt": "vocabulary map"}


class CheckpointError(ValueError):
    """A training checkpoint is malformed, pickled, or does not fit the run resuming from it."""


def write_checkpoint(payload: dict, path: Path) -> None:
    """payload: {"model": state_dict, "optimizer": optimizer state_dict, "state", "config", "trainable",
    "target", optional "vocab_map"}, as Trainer.save_checkpoint builds it."""
    tensors = {f"model.{name}": t for name, t in payload["model"].items()}
    scalars: dict[str, dict] = {}
    for index, state in payload["optimizer"]["state"].items():
        for key, value in state.items():
            if isinstance(value, Tensor):
                tensors[f"optimizer.{index}.{key}"] = value
            else:
                scalars.setdefault(str(index), {})[key] = value
    if payload.get("vocab_map") is not None:
        tensors["vocab_map"] = payload["vocab_map"].long()
    meta = {"state": payload["state"], "config": payload["config"], "trainable": payload["trainable"],
            "param_groups": payload["optimizer"]["param_groups"], "scalars": scalars, "target": payload.get("target")}
    metadata = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
                **{key: json.dumps(value) for key, value in meta.items()}}
    write_safetensors(path, {k: t.detach().cpu().contiguous() for k, t in tensors.items()}, metadata)


def read_checkpoint(path: Path) -> dict:
    """The payload write_checkpoint took (tensors on the CPU); a malformed file raises CheckpointError."""
    opened = SafetensorsFile(path)
    try:
        meta = _metadata(opened, path)
        payload = {key: meta[key] for key in ("state", "config", "trainable", "target")}
        payload["model"] = {k.removeprefix("model."): opened.tensor(k).clone() for k in opened.entries
                            if k.startswith("model.")}
        payload["optimizer"] = {"state": _optimizer_state(opened, meta["scalars"], path),
                                "param_groups": [_group(group) for group in meta["param_groups"]]}
        if "vocab_map" in opened.entries:
            payload["vocab_map"] = opened.tensor("vocab_map").clone()
    finally:
        opened.close()
    return payload


def _metadata(opened: SafetensorsFile, path: Path) -> dict:
    found = opened.metadata
    if found.get("format") != CHECKPOINT_FORMAT or found.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path} is format {found.get('format')!r} version {found.get('version')!r}; "
                              f"this build reads {CHECKPOINT_FORMAT} version {CHECKPOINT_VERSION}")
    missing = [key for key in JSON_KEYS if key not in found]
    if missing:
        raise CheckpointError(f"{path} lacks metadata {', '.join(missing)} (not a complete training checkpoint)")
    try:
        meta = {key: json.loads(found[key]) for key in JSON_KEYS}
    except ValueError as err:
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({err})") from None
    if not isinstance(meta["state"], dict) or not isinstance(meta["param_groups"], list):
        raise CheckpointError(f"{path}: checkpoint metadata state/param_groups malformed")
    return meta


def _optimizer_state(opened: SafetensorsFile, scalars: dict, path: Path) -> dict[int, dict]:
    state: dict[int, dict] = {int(i): dict(values) for i, values in scalars.items()}
    for key in opened.entries:
        if key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            if not index.isdigit():
                raise CheckpointError(f"{path}: tensor {key!r} names no parameter index")
            state.setdefault(int(index), {})[name] = opened.tensor(key).clone()
    return state


def _group(group: dict) -> dict:
    """JSON turned AdamW's tuples (betas) into lists; `params` stays a list."""
    return {k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in group.items()}


def check_fits(payload: dict, path: Path, state_dict: dict[str, Tensor], params: list[Tensor],
               fingerprint: str) -> None:
    """Refuses a checkpoint whose tensors, optimizer state or target do not match the draft resuming."""
    stored = payload["model"]
    missing = [name for name in state_dict if name not in stored]
    extra = [name for name in stored if name not in state_dict]
    if missing or extra:
        raise CheckpointError(f"{path} lacks {len(missing)} and has {len(extra)} unexpected draft tensors "
                              f"(first {(missing or extra)[0]!r}): it is not a checkpoint of this draft")
    for name, tensor in stored.items():
        _check_shape(path, f"tensor {name!r}", tensor, state_dict[name])
    for index, state in payload["optimizer"]["state"].items():
        if not 0 <= index < len(params):
            raise CheckpointError(f"{path}: optimizer state for parameter {index}, but the draft trains {len(params)}")
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                _check_shape(path, f"optimizer {key} of parameter {index}", state[key], params[index])
    if payload["target"] not in (None, fingerprint):
        raise CheckpointError(f"{path} was trained against another target (fingerprint {payload['target']}, this "
                              f"target {fingerprint}): resume with the --target the run started with")


def _check_shape(path: Path, what: str, stored: Tensor, expected: Tensor) -> None:
    if stored.shape != expected.shape:
        raise CheckpointError(f"{path}: {what} has shape {tuple(stored.shape)}, this draft's is "
                              f"{tuple(expected.shape)}")


def refuse_pickled(work_dir: Path, out_dir: Path) -> None:
    """Names an older version's pickled file where its safetensors successor is absent, and how to go on."""
    for name, what in PICKLED_FILES.items():
        old = Path(work_dir) / name
        if old.exists() and not old.with_suffix(".safetensors").exists():
            raise CheckpointError(
                f"{old} is a pickled {what} from an older specstream, and pickle is never loaded: delete "
                f"{Path(work_dir) / '*.pt'} and rerun `specstream distill --out {out_dir} --resume` with the same "
                f"flags to retrain from step 0 (the collected corpus is kept)")


def write_vocab_map(path: Path, vocab_map: Tensor) -> None:
    write_safetensors(path, {"vocab_map": vocab_map.long().cpu().contiguous()}, VOCAB_FORMAT)


def read_vocab_map(path: Path) -> Tensor:
    """[K] int64 target id of each head row."""
    opened = SafetensorsFile(path)
    try:
        entry = opened.entries.get("vocab_map")
        if opened.metadata != VOCAB_FORMAT or entry is None or len(entry.shape) != 1 or entry.dtype != torch.int64:
            raise CheckpointError(f"{path} is not a {VOCAB_FORMAT['format']} version {VOCAB_FORMAT['version']} file "
                                  f"holding one int64 vector 'vocab_map'")
        return opened.tensor("vocab_map").clone()
    finally:
        opened.close()
