"""`quantize`: a model in, a SpQR checkpoint out, one decoder layer at a time, resumable.

The source streams one layer at a time from its memory-mapped files, so a 70B model is quantized
within the RAM its calibration activations take. After each layer the checkpoint folder holds the
finished layer files and the activations entering the next layer (`.state/`), so a killed run resumes
at the next unfinished layer.
"""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from offload.config import ModelConfig
from offload.sources import resolve_model
from offload.tokenizer import Tokenizer
from offload.weights import CheckpointSource
from .calibrate import LayerRunner
from .calibration_data import calibration_windows
from .checkpoint import MATRICES, matrix_shapes, write_config, write_globals, write_layer
from .source_grid import aligned_settings_hint
from .spqr import FULL_PRECISION_STATS, SpqrConfig, quantize_matrix

SUPPORTED_BITS = (3, 4)
STATE = ".state"


@dataclass(slots=True)
class QuantizeConfig:
    target: str | None
    out: Path
    bits: int = 4
    groupsize: int = 16
    stats_bits: int = 3
    outlier_threshold: float = 0.2
    calib: list[Path] = field(default_factory=list)     # extra calibration text files
    nsamples: int = 128
    seqlen: int = 512
    resume: bool = False
    seed: int = 0
    act_order: bool = True      # off: groups keep the input order (aligned with a GGUF source's blocks)

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"--bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, got {self.bits}")
        if self.nsamples < 1 or self.seqlen < 16:
            raise ValueError(f"need --nsamples >= 1 and --seqlen >= 16, got {self.nsamples}, {self.seqlen}")
        self.spqr()   # validates groupsize, stats bits and threshold

    def spqr(self) -> SpqrConfig:
        return SpqrConfig(self.bits, self.groupsize, self.stats_bits, self.outlier_threshold,
                          act_order=self.act_order)


Progress = Callable[[dict], None]


def quantize(config: QuantizeConfig, on_progress: Progress | None = None,
             on_hint: Callable[[str], None] | None = None) -> dict:
    """`on_hint` gets one line suggesting better settings for this source (judged from its first layer)."""
    source_folder = resolve_model(config.target)
    model_config = ModelConfig.from_file(source_folder)
    _check_supported(model_config, config)
    source = CheckpointSource(source_folder, model_config)
    out, state = config.out, config.out / STATE
    first, hidden = _start(config, source, source_folder, state)
    if on_hint and first == 0:
        matrices = {name: tensor for name, tensor in source.layer(0).items() if name in MATRICES}
        hint = aligned_settings_hint(matrices, config.bits, config.groupsize, config.stats_bits, config.act_order)
        if hint:
            on_hint(hint)
    runner = LayerRunner(model_config, config.seqlen)
    reports = _read_reports(state)
    for index in range(first, model_config.num_layers):
        started = time.perf_counter()
        hidden, report = _quantize_layer(source, runner, hidden, index, config)
        report["seconds"] = round(time.perf_counter() - started, 2)
        reports.append(report)
        _save_state(state, index + 1, hidden, reports)
        if on_progress:
            on_progress({"layer": index, "num_layers": model_config.num_layers, **report})
    return _finish(config, source, source_folder, reports)


def _check_supported(model_config: ModelConfig, config: QuantizeConfig) -> None:
    for name, (rows, cols) in matrix_shapes(model_config).items():
        if cols % config.groupsize:
            raise ValueError(f"{name} matrices have {cols} input columns, not a multiple of --groupsize "
                             f"{config.groupsize}: this layer type cannot be quantized so")


def _start(config: QuantizeConfig, source: CheckpointSource, source_folder: Path, state: Path):
    """(first layer to do, the hidden states entering it [S, T, H])."""
    progress = state / "progress.json"
    if config.resume and progress.exists():
        saved = json.loads(progress.read_text())
        if saved["config"] != _config_key(config):
            raise ValueError(f"{config.out} was started with other settings ({saved['config']}); "
                             "rerun without --resume into a new folder")
        if saved["next_layer"] >= source.config.num_layers:
            return saved["next_layer"], None          # every layer is done: only the finish is left
        return saved["next_layer"], torch.load(state / "hidden.pt")
    if config.out.exists() and any(config.out.iterdir()) and not config.resume:
        raise ValueError(f"{config.out} is not empty (use --resume to continue a run, or a new folder)")
    state.mkdir(parents=True, exist_ok=True)
    tokens = calibration_windows(Tokenizer(source_folder), config.calib, config.nsamples, config.seqlen, config.seed)
    embed = source.global_tensors()["embed"]
    hidden = torch.nn.functional.embedding(tokens, embed).float()                  # [S, T, H]
    (state / "progress.json").write_text(json.dumps({"config": _config_key(config), "next_layer": 0}))
    return 0, hidden


def _quantize_layer(source: CheckpointSource, runner: LayerRunner, hidden, index: int, config: QuantizeConfig):
    weights = {name: t.float() for name, t in source.layer(index).items()}
    quantized, stored, report = quantize_layer(weights, runner.hessians(hidden, weights, index), config.spqr())
    write_layer(config.out, index, stored)
    return runner.run(hidden, quantized, index), report


def quantize_layer(weights: dict[str, torch.Tensor], hessians: dict[str, torch.Tensor], spqr: SpqrConfig):
    """One layer's matrices -> (weights with the matrices dequantized, the stored tensors (None for fp16
    statistics), the layer report)."""
    stored, quantized, errors, stored_bits = {}, dict(weights), {}, 0.0
    outliers = 0.0
    for name in MATRICES:
        result = quantize_matrix(weights[name], hessians[name], spqr)
        quantized[name] = result.dequantized
        if result.packed is not None:
            stored.update(result.packed.tensors(name))
        errors[name] = round(result.relative_error, 6)
        stored_bits += result.bits_per_param * weights[name].numel()
        outliers += result.outlier_share * weights[name].numel()
    stored.update({name: t for name, t in weights.items() if name not in MATRICES})
    params = sum(weights[name].numel() for name in MATRICES)
    report = {"error": round(sum(errors.values()) / len(errors), 6), "errors": errors,
              "bits_per_param": round(stored_bits / params, 4), "outlier_share": round(outliers / params, 5),
              "packed_bytes": int(round(stored_bits / 8)), "params": params}
    return quantized, (stored if spqr.stats_bits != FULL_PRECISION_STATS else None), report


def _save_state(state: Path, next_layer: int, hidden, reports: list[dict]) -> None:
    tmp = state / "hidden.pt.tmp"
    torch.save(hidden, tmp)
    os.replace(tmp, state / "hidden.pt")
    (state / "reports.json").write_text(json.dumps(reports))
    progress = json.loads((state / "progress.json").read_text())
    progress["next_layer"] = next_layer
    (state / "progress.json.tmp").write_text(json.dumps(progress))
    os.replace(state / "progress.json.tmp", state / "progress.json")


def _read_reports(state: Path) -> list[dict]:
    path = state / "reports.json"
    return json.loads(path.read_text()) if path.exists() else []


def _config_key(config: QuantizeConfig) -> dict:
    key = asdict(config)
    key.update(out=None, resume=None, calib=[str(p) for p in config.calib], target=config.target)
    return key


def _finish(config: QuantizeConfig, source: CheckpointSource, source_folder: Path, reports: list[dict]) -> dict:
    (config.out / STATE / "hidden.pt").unlink(missing_ok=True)
    write_globals(config.out, source.global_tensors())
    quantization = {"bits": config.bits, "groupsize": config.groupsize, "stats_bits": config.stats_bits,
                    "outlier_threshold": config.outlier_threshold if math.isfinite(config.outlier_threshold) else None,
                    "act_order": config.act_order, "nsamples": config.nsamples, "seqlen": config.seqlen}
    write_config(config.out, source_folder, quantization, "default" if config.target in (None, "default") else None)
    packed = sum(r["packed_bytes"] for r in reports)
    params = sum(r["params"] for r in reports)
    summary = {"out": config.out.name, "layers": len(reports), "bits_per_param": round(8 * packed / params, 4),
               "outlier_share": round(sum(r["outlier_share"] * r["params"] for r in reports) / params, 5),
               "mean_error": round(sum(r["error"] for r in reports) / len(reports), 6),
               "seconds": round(sum(r["seconds"] for r in reports), 1), "layer_reports": reports}
    (config.out / "quantize_report.json").write_text(json.dumps(summary, indent=1))
    return summary
