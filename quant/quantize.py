"""`quantize`: a model in, a SpQR checkpoint out, one decoder layer at a time, resumable.

The source streams one layer at a time from its memory-mapped files, so a 70B model is quantized
within the RAM its calibration activations take. After each layer the checkpoint folder holds the
finished layer files and the activations entering the next layer (`.state/`), so a killed run resumes
at the next unfinished layer:

    .state/progress.json        {"config": the settings, "next_layer": N}
    .state/reports.json         the finished layers' reports
    .state/hidden.safetensors   "hidden" [S, T, H] float32, the activations entering layer N; metadata
                                format "specstream-quantize-state", version "1", next_layer N

Written in that order after each layer: reports, hidden, progress. A stop between two writes (a kill, a
full disk) resumes at the layer hidden.safetensors names, whose layer file is already complete.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

from offload.model.config import ModelConfig
from offload.weights.resolve import is_default_model, resolve_model
from offload.weights.disk_errors import write_text_atomic, writing
from offload.weights.safetensors_io import SafetensorsFile, write_safetensors
from offload.weights.tokenizer import Tokenizer
from offload.weights.formats import dense_source
from offload.weights.source import WeightSource
from .calibrate import LayerRunner
from .calibration_data import calibration_windows
from .checkpoint import MATRICES, matrix_shapes, write_config, write_globals, write_layer
from .source_grid import Q4_1_BLOCK, aligned_settings_hint, on_block_grid
from .spqr import FULL_PRECISION_STATS, SpqrConfig, quantize_matrix

SUPPORTED_BITS = (3, 4)
STATE = ".state"
HIDDEN_FILE = "hidden.safetensors"
STATE_FORMAT = {"format": "specstream-quantize-state", "version": "1"}


@dataclass(slots=True)
class QuantizeConfig:
    target: str | None
    out: Path
    bits: int = 4
    groupsize: int | None = None     # None: chosen by resolve_settings (16, or 32 on a GGUF Q4_1 grid)
    stats_bits: int | None = None    # None: 3, or 8 on such a grid
    outlier_threshold: float | None = None   # None: default_outlier_threshold(bits)
    calib: list[Path] = field(default_factory=list)     # extra calibration text files
    nsamples: int = 128
    seqlen: int = 512
    resume: bool = False
    seed: int = 0
    act_order: bool | None = None    # None: on, or off on such a grid (groups keep the input order)
    gguf_import: bool = False   # a GGUF target is read from its dequantized import rather than in place

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"--bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, got {self.bits}")
        if self.outlier_threshold is None:
            self.outlier_threshold = default_outlier_threshold(self.bits)
        if self.nsamples < 1 or self.seqlen < 16:
            raise ValueError(f"need --nsamples >= 1 and --seqlen >= 16, got {self.nsamples}, {self.seqlen}")
        self.settled(DEFAULT_SETTINGS).spqr()   # validates groupsize, stats bits and threshold

    @property
    def unset_settings(self) -> tuple[str, ...]:
        return tuple(name for name in SETTING_NAMES if getattr(self, name) is None)

    def settled(self, defaults: dict) -> "QuantizeConfig":
        """This config with every setting the user left unset taken from `defaults`."""
        if not self.unset_settings:
            return self
        return replace(self, **{name: defaults[name] for name in self.unset_settings})

    def spqr(self) -> SpqrConfig:
        if self.unset_settings:
            raise ValueError(f"settings not chosen yet: {', '.join(self.unset_settings)} (resolve_settings)")
        return SpqrConfig(self.bits, self.groupsize, self.stats_bits, self.outlier_threshold,
                          act_order=self.act_order)


SETTING_NAMES = ("groupsize", "stats_bits", "act_order")
DEFAULT_SETTINGS = {"groupsize": 16, "stats_bits": 3, "act_order": True}
# A source on a GGUF Q4_1 grid (blocks of 32 inputs): groups on the blocks, in input order, 8-bit statistics
# find the file's grid again at the default w4's 4.68 bits (+0.5% perplexity vs +7.0% on the default model).
ALIGNED_SETTINGS = {"groupsize": Q4_1_BLOCK, "stats_bits": 8, "act_order": False}


def resolve_settings(config: QuantizeConfig, matrices: dict[str, Tensor]) -> tuple[QuantizeConfig, str | None]:
    """(the config with its unset settings chosen, one line saying why when it matters). matrices: the
    source's first layer (name -> [out, in]). At 4 bits a source on a Q4_1 grid gets the aligned settings
    unless the user set any of them; otherwise the defaults, with a hint when the grid is there."""
    on_grid = config.bits == 4 and bool(matrices) and all(on_block_grid(w) for w in matrices.values())
    if on_grid and len(config.unset_settings) == len(SETTING_NAMES):
        return config.settled(ALIGNED_SETTINGS), (
            "the source's weights lie on a GGUF Q4_1 grid: quantizing with the aligned settings --groupsize 32 "
            "--stats-bits 8 --no-act-order (set any of --groupsize/--stats-bits/--act-order to choose yourself)")
    resolved = config.settled(DEFAULT_SETTINGS)
    hint = aligned_settings_hint(matrices, resolved.bits, resolved.groupsize, resolved.stats_bits, resolved.act_order)
    return resolved, hint


def default_outlier_threshold(bits: int) -> float:
    """Measured on the default model: tau 0.2 (SpQR's paper recipe) kept 4.5-5% of its weights as outliers
    (6.2 bits per parameter at w4); these keep ~0.1-0.3%, inside the 4.7 / 3.8-bit budgets."""
    return 8.0 if bits >= 4 else 3.0


Progress = Callable[[dict], None]


def quantize(config: QuantizeConfig, on_progress: Progress | None = None,
             on_hint: Callable[[str], None] | None = None) -> dict:
    """`on_hint` gets one line suggesting better settings for this source (judged from its first layer)."""
    source_folder = resolve_model(config.target, gguf_import=config.gguf_import)
    model_config = ModelConfig.from_file(source_folder)
    source = dense_source(source_folder, model_config)
    config, hint = resolve_settings(config, {name: tensor for name, tensor in source.layer(0).items()
                                             if name in MATRICES})
    _check_supported(model_config, config)
    state = config.out / STATE
    first, hidden = _start(config, source, source_folder, state)
    if on_hint and hint and first == 0:
        on_hint(hint)
    runner = LayerRunner(model_config, config.seqlen)
    reports = _read_reports(state)[:first]          # a report written past the saved state is redone
    for index in range(first, model_config.num_layers):
        started = time.perf_counter()
        with _writing(config, f"{index} of {model_config.num_layers} layers"):
            hidden, report = _quantize_layer(source, runner, hidden, index, config)
            report["seconds"] = round(time.perf_counter() - started, 2)
            reports.append(report)
            _save_state(state, index + 1, hidden, reports)
        if on_progress:
            on_progress({"layer": index, "num_layers": model_config.num_layers, **report})
    with _writing(config, f"all {model_config.num_layers} layers"):
        return _finish(config, source, source_folder, reports)


def _writing(config: QuantizeConfig, layers_done: str):
    """A full disk while writing the checkpoint: one line naming the file and how to continue."""
    return writing(config.out, f"{layers_done} in {config.out}",
                   f"rerun `specstream quantize --out {config.out} --resume` with the same flags")


def _check_supported(model_config: ModelConfig, config: QuantizeConfig) -> None:
    for name, (rows, cols) in matrix_shapes(model_config).items():
        if cols % config.groupsize:
            raise ValueError(f"{name} matrices have {cols} input columns, not a multiple of --groupsize "
                             f"{config.groupsize}: this layer type cannot be quantized so")


def _start(config: QuantizeConfig, source: WeightSource, source_folder: Path, state: Path):
    """(first layer to do, the hidden states entering it [S, T, H])."""
    progress = state / "progress.json"
    if config.resume and progress.exists():
        saved = json.loads(progress.read_text())
        if saved["config"] != _config_key(config):
            raise ValueError(f"{config.out} was started with other settings ({saved['config']}); "
                             "rerun without --resume into a new folder")
        if saved["next_layer"] >= source.config.num_layers:
            return saved["next_layer"], None          # every layer is done: only the finish is left
        if (state / HIDDEN_FILE).exists() or (state / "hidden.pt").exists():
            return _read_hidden(state, config.out)
        # no layer's state was saved: start again from the embedding
    elif config.out.exists() and any(config.out.iterdir()) and not config.resume:
        raise ValueError(f"{config.out} is not empty (use --resume to continue a run, or a new folder)")
    tokens = calibration_windows(Tokenizer(source_folder), config.calib, config.nsamples, config.seqlen, config.seed)
    embed = source.global_tensors()["embed"]
    hidden = torch.nn.functional.embedding(tokens, embed).float()                  # [S, T, H]
    with _writing(config, f"0 of {source.config.num_layers} layers"):
        state.mkdir(parents=True, exist_ok=True)
        write_text_atomic(state / "progress.json", json.dumps({"config": _config_key(config), "next_layer": 0}))
    return 0, hidden


def _read_hidden(state: Path, out: Path) -> tuple[int, torch.Tensor]:
    """(next layer, [S, T, H] the activations entering it); an older version's pickled file is refused."""
    path = state / HIDDEN_FILE
    if not path.exists() and (state / "hidden.pt").exists():
        raise ValueError(f"{state / 'hidden.pt'} is pickled resume state from an older specstream, and pickle is "
                         f"never loaded: delete {out} and rerun the same `specstream quantize --out {out}` command "
                         "without --resume to start over")
    opened = SafetensorsFile(path)
    entry, meta = opened.entries.get("hidden"), opened.metadata
    if any(meta.get(k) != v for k, v in STATE_FORMAT.items()) or not meta.get("next_layer", "").isdigit() or \
            entry is None or len(entry.shape) != 3 or entry.dtype != torch.float32:
        raise ValueError(f"{path} is not {STATE_FORMAT['format']} version {STATE_FORMAT['version']} resume state "
                         f"(one float32 [S, T, H] tensor 'hidden'): delete {out} and rerun without --resume")
    hidden = opened.tensor("hidden").clone()
    opened.close()
    return int(meta["next_layer"]), hidden


def _quantize_layer(source: WeightSource, runner: LayerRunner, hidden, index: int, config: QuantizeConfig):
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
    write_text_atomic(state / "reports.json", json.dumps(reports))
    write_safetensors(state / HIDDEN_FILE, {"hidden": hidden.float().contiguous()},
                      {**STATE_FORMAT, "next_layer": str(next_layer)})
    progress = json.loads((state / "progress.json").read_text())
    progress["next_layer"] = next_layer
    write_text_atomic(state / "progress.json", json.dumps(progress))


def _read_reports(state: Path) -> list[dict]:
    path = state / "reports.json"
    return json.loads(path.read_text()) if path.exists() else []


def _config_key(config: QuantizeConfig) -> dict:
    key = asdict(config)
    key.update(out=None, resume=None, calib=[str(p) for p in config.calib], target=config.target)
    return key


def _finish(config: QuantizeConfig, source: WeightSource, source_folder: Path, reports: list[dict]) -> dict:
    (config.out / STATE / HIDDEN_FILE).unlink(missing_ok=True)
    write_globals(config.out, source.global_tensors())
    quantization = {"bits": config.bits, "groupsize": config.groupsize, "stats_bits": config.stats_bits,
                    "outlier_threshold": config.outlier_threshold if math.isfinite(config.outlier_threshold) else None,
                    "act_order": config.act_order, "nsamples": config.nsamples, "seqlen": config.seqlen}
    write_config(config.out, source_folder, quantization, "default" if is_default_model(config.target) else None)
    packed = sum(r["packed_bytes"] for r in reports)
    params = sum(r["params"] for r in reports)
    summary = {"out": config.out.name, "layers": len(reports), "bits_per_param": round(8 * packed / params, 4),
               "outlier_share": round(sum(r["outlier_share"] * r["params"] for r in reports) / params, 5),
               "mean_error": round(sum(r["error"] for r in reports) / len(reports), 6),
               "seconds": round(sum(r["seconds"] for r in reports), 1), "layer_reports": reports}
    write_text_atomic(config.out / "quantize_report.json", json.dumps(summary, indent=1))
    return summary
