"""`bench quant-disk`: greedy decoding with every decoder layer streamed from disk and the page cache
dropped before each pass, the reference weights (fp32 and bf16) against packed SpQR checkpoints and (`--gguf`)
the model's own GGUF run in place, in one run.

Per model: decoding tokens per second (the passes after the prefill), bytes streamed per pass, and
where a pass's time goes per layer: waiting for the loader (transfer not hidden), dequantization
(packed layers decoded into dense matrices, timed alone; 0 for dense weights), the decoder thread's
time in the `-ahead` rows (a decoder thread dequantizes each layer between its read and its compute)
and the rest (the layer's compute). A packed model's pass gains as far as its dequantization plus
compute stays under the dense model's transfer.
"""
from __future__ import annotations

import json
import shutil
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from offload import LoadedModel, LoadOptions

from runtime.models import load_model, weight_formats
from offload.weights.gguf_import import cache_root
from offload.weights.resolve import resolve_model
from offload.loader import streaming_device_budget
from offload.pass_stats import PassStats
from spec import DecodeConfig, Decoder, SamplingConfig
from bench.quant_bench import SpqrRow, dequantize_seconds
from bench.start_bench import run_start_bench

PROMPT = "Explain how a hash table handles collisions, with a short example in Python."
MAX_CONTEXT, MAX_PASS_TOKENS = 512, 128


@dataclass(slots=True)
class DiskBenchConfig:
    target: str | None = None                        # the reference (default: the embedded model)
    packed: list[Path] = field(default_factory=list)  # SpQR checkpoints of that model
    new_tokens: int = 24
    rounds: int = 1                                  # every model once per round, in turn; medians reported
    reference_dtypes: tuple[str, ...] = ("fp32", "bf16")
    prompt: str = PROMPT
    gguf_in_place: bool = False                      # the model's own GGUF run in place, beside its imports

    def __post_init__(self) -> None:
        if not self.packed and not self.gguf_in_place:
            raise ValueError("give at least one SpQR checkpoint with --packed (see `quantize`), or --gguf")
        for folder in self.packed:
            if not (Path(folder) / "config.json").is_file():
                raise FileNotFoundError(f"--packed {folder}: no config.json there (not a checkpoint folder)")
        if self.new_tokens < 2:
            raise ValueError(f"new tokens must be >= 2, got {self.new_tokens}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")


def run_disk_bench(config: DiskBenchConfig, on_status: Callable[[str], None] = lambda message: None) -> dict:
    """Every model once per round, in turn, so that a shared machine's slow phases fall on all of them;
    each row holds the medians over the rounds."""
    reference = resolve_model(config.target, gguf_import=True)   # dense reference weights
    runs = [_Run(str(reference if dtype == "fp32" else stored_copy(reference, dtype, on_status)), dtype,
                 f"reference-{dtype}", f"reference-{dtype}") for dtype in config.reference_dtypes]
    if config.gguf_in_place:        # the GGUF's blocks decoded at use, and ahead by a decoder thread
        in_place = str(resolve_model(config.target))
        runs += _with_ahead(_Run(in_place, "fp32", "gguf-in-place", "GGUF in place"))
        # the CLI's CPU default: its matrices multiplied as stored (packed_linear), streamed layers read from the
        # kernel layer cache (offload/weights/kernel_cache.py) where the file's every matrix suits the kernel
        runs.append(_Run(in_place, "fp32", "gguf-in-place-packed", "GGUF in place, packed kernel", cpu_kernel="packed"))
    for folder in config.packed:    # dequantized at use (the default) and ahead by a decoder thread, side by side
        runs += _with_ahead(_Run(str(folder), "fp32", Path(folder).name, checkpoint_label(Path(folder))))
    measured: dict[str, list[dict]] = {}
    for round_index in range(config.rounds):
        for run in runs:
            if config.rounds > 1:
                on_status(f"round {round_index + 1}/{config.rounds}")
            measured.setdefault(run.name, []).append(_measure(run, config, on_status))
    rows = [_median_row(rows) for rows in measured.values()]
    _add_ratios(rows)
    result = {"bench": "quant-disk", "new_tokens": config.new_tokens, "rounds": config.rounds,
              "prompt": config.prompt, "rows": rows}
    if config.gguf_in_place:
        on_status("start: load + first forward, in place vs the import")
        result["start"] = run_start_bench(config.target, config.rounds)
    return result


def _median_row(rows: list[dict]) -> dict:
    """One model's rounds -> its row with tok/s and the per-layer times as medians (and every round's tok/s)."""
    row = dict(rows[0])
    row["tokens_per_second"] = round(statistics.median(r["tokens_per_second"] for r in rows), 3)
    row["pass_seconds"] = round(statistics.median(r["pass_seconds"] for r in rows), 4)
    row["per_layer_ms"] = {key: round(statistics.median(r["per_layer_ms"][key] for r in rows), 3)
                           for key in rows[0]["per_layer_ms"]}
    row["tokens_per_second_by_round"] = [r["tokens_per_second"] for r in rows]
    return row


def stored_copy(folder: Path, dtype: str, on_status) -> Path:
    """The checkpoint with its floating tensors stored in `dtype` (made once, in the cache), so that the
    row reads that dtype's bytes from disk rather than casting the reference's on the way."""
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    out = cache_root() / "bench_quant" / f"{folder.name}-{dtype}"
    if (out / "config.json").exists():
        return out
    on_status(f"writing a {dtype} copy of {folder.name} for the {dtype} row")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for path in folder.iterdir():
        if path.suffix == ".safetensors":
            tensors = load_file(str(path))
            save_file({k: t.to(torch_dtype) if t.is_floating_point() else t for k, t in tensors.items()},
                      str(tmp / path.name), metadata={"format": "pt"})
        elif path.is_file():
            shutil.copyfile(path, tmp / path.name)
    tmp.rename(out)
    return out


@dataclass(frozen=True, slots=True)
class _Run:
    model: str            # the folder (or file) loaded
    dtype: str
    name: str             # the row's key in the JSON
    label: str            # the row as tables name it
    ahead: bool = False   # packed layers decoded by a decoder thread between their read and their compute
    cpu_kernel: str = "dense"


def _with_ahead(run: _Run) -> list[_Run]:
    return [run, replace(run, name=f"{run.name}-ahead", label=f"{run.label}, decoder thread", ahead=True)]


def checkpoint_label(folder: Path) -> str:
    """A SpQR checkpoint named by its settings, as the tables name it (e.g. "SpQR w4-g32-s8-noact")."""
    settings = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    try:
        row = SpqrRow(settings["bits"], settings.get("outlier_threshold", 0.0), settings["groupsize"],
                      settings["stats_bits"], settings.get("act_order", True))
    except KeyError:
        return folder.name
    return "SpQR " + row.name.removeprefix("spqr-")


def _measure(run: _Run, config: DiskBenchConfig, on_status) -> dict:
    name = run.name
    options = LoadOptions(run.model, dtype=run.dtype, ram=1, disk_cold=True, max_context=MAX_CONTEXT,
                          max_pass_tokens=MAX_PASS_TOKENS, decode_ahead=run.ahead, formats=weight_formats(),
                          cpu_kernel=run.cpu_kernel)
    options.gpu_mem = streaming_device_budget(options)
    loaded = load_model(options)
    try:
        on_status(f"{name}: decoding {config.new_tokens} tokens, {loaded.plan.tier_of.count('disk')} of "
                  f"{len(loaded.plan.tier_of)} layers from disk (cold)")
        passes = _decode(loaded, config)
        packed = loaded.source.packed_bytes() if hasattr(loaded.source, "packed_bytes") else None
        dequantize = dequantize_seconds(loaded, kernel=run.cpu_kernel == "packed") if packed is not None else 0.0
    finally:
        loaded.layers.close()
    return {"label": run.label, **_row(name, loaded, passes, dequantize)}


def _decode(loaded: LoadedModel, config: DiskBenchConfig) -> list[PassStats]:
    """The decoding passes (prefill passes dropped) of one greedy answer."""
    passes: list[PassStats] = []
    end_pass = loaded.layers.end_pass

    def record() -> None:
        end_pass()
        passes.append(loaded.layers.last_pass)

    loaded.layers.end_pass = record
    decoder = Decoder(loaded.model, loaded.stop_ids, DecodeConfig(config.new_tokens, MAX_CONTEXT, MAX_PASS_TOKENS))
    prompt_ids = loaded.tokenizer.encode_prompt(config.prompt)
    result = decoder.generate(prompt_ids, SamplingConfig())
    loaded.layers.end_pass = end_pass
    steps = passes[len(passes) - result.stats.num_steps:]
    if len(steps) < 1:
        raise RuntimeError("the answer ended at its first token: no decoding pass to measure")
    return steps


def _row(name: str, loaded: LoadedModel, passes: list[PassStats], dequantize: float) -> dict:
    num_layers = len(loaded.plan.tier_of)
    seconds = statistics.median(p.seconds for p in passes)
    wait = statistics.median(p.wait_seconds for p in passes)
    # decoding per pass: the decoder thread's (ahead) or one layer's timed decode times the layers streamed
    decode = statistics.median(p.decode_seconds for p in passes) or dequantize * loaded.plan.tier_of.count("disk")
    return {"model": name, "dtype": str(loaded.model.dtype).removeprefix("torch."),
            "layers_from_disk": loaded.plan.tier_of.count("disk"), "decode_passes": len(passes),
            "tokens_per_second": round(len(passes) / sum(p.seconds for p in passes), 3),
            "pass_seconds": round(seconds, 4), "bytes_per_pass": passes[0].bytes_streamed,
            "decode_share": round(decode / seconds, 4),
            "per_layer_ms": {"pass": round(1e3 * seconds / num_layers, 3),
                             "wait": round(1e3 * wait / num_layers, 3),
                             "transfer": round(1e3 * statistics.median(p.transfer_seconds for p in passes)
                                               / num_layers, 3),
                             "dequantize": round(1e3 * dequantize, 3),
                             "decoded_ahead": round(1e3 * statistics.median(p.decode_seconds for p in passes)
                                                        / num_layers, 3)}}


def _add_ratios(rows: list[dict]) -> None:
    """Bytes per pass and tokens per second against each reference row: the ratio of the medians, and the
    median of each round's own ratio (rows of one round run back to back, so a shared machine's slow phase
    falls on both sides of that ratio)."""
    for reference in (r for r in rows if r["model"].startswith("reference-")):
        key = reference["model"].removeprefix("reference-")
        for row in rows:
            row[f"bytes_ratio_vs_{key}"] = round(reference["bytes_per_pass"] / row["bytes_per_pass"], 3)
            row[f"speedup_vs_{key}"] = round(row["tokens_per_second"] / reference["tokens_per_second"], 3)
            paired = [ours / theirs for ours, theirs in zip(row["tokens_per_second_by_round"],
                                                            reference["tokens_per_second_by_round"])]
            row[f"paired_speedup_vs_{key}"] = round(statistics.median(paired), 3)
