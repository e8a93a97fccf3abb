"""`bench quant`: perplexity on held-out text, bits per parameter, dequantization time per layer and bytes
per pass for the reference weights, SpQR w4/w3, round-to-nearest, plain GPTQ and NF4, in one run.

Held-out text, kept apart from calibration (quant/calibration_data.py): GSM8K test problems (math
prose), standard-library modules not used for calibration (code), the even-numbered documentation
topics (prose), and the reference model's own greedy answers to MT-Bench first turns (chat answers).
"""
from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


from offload import LoadedModel, LoadOptions


from runtime.models import load_model
from offload.weights.disk_errors import write_text_atomic, writing
from offload.weights.gguf_import import cache_root
from offload.weights.resolve import is_default_model
from offload.loader import build_engine
from spec import DecodeConfig, Decoder, SamplingConfig
from quant.baselines import (NF4_BITS, InMemorySource, gptq_layers, nf4, round_to_nearest, rtn_bits,
                        transformed_layers)
from quant.bits import bits_per_param
from quant.calibration_data import EVALUATION_MODULES, calibration_windows, documentation_prose, stdlib_code
from quant.perplexity import PerplexityConfig, perplexity
from quant.quantize import QuantizeConfig, quantize
from quant.spqr import ALGORITHM
import textdata
from textdata import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class SpqrRow:
    """One SpQR configuration of the table."""
    bits: int
    outlier_threshold: float
    groupsize: int = 16
    stats_bits: int = 3
    act_order: bool = True

    @property
    def name(self) -> str:
        return (f"spqr-w{self.bits}" + ("" if self.groupsize == 16 else f"-g{self.groupsize}")
                + ("" if self.stats_bits == 3 else f"-s{self.stats_bits}") + ("" if self.act_order else "-noact"))


# w4 at groups of 32 is the row under 4.57 bits (7x fewer bytes than fp32), which groups of 16 cannot reach
# (their statistics alone cost 0.625 bits); groups of 32 in input order with 8-bit statistics cost what
# groups of 16 with 3-bit ones do, and align with a GGUF Q4_1 source's blocks of 32 (the default model's)
SPQR_ROWS = (SpqrRow(4, 8.0), SpqrRow(3, 3.0), SpqrRow(4, 8.0, 32), SpqrRow(4, 8.0, 32, 8, act_order=False))
METHODS = ("spqr", "rtn", "gptq", "nf4")


@dataclass(slots=True)
class QuantBenchConfig:
    target: str | None = None
    tokens_per_domain: int = 4096
    nsamples: int = 128
    seqlen: int = 512
    chat_prompts: Path | None = textdata.path(textdata.MT_BENCH)
    gsm8k_test: Path | None = textdata.path(textdata.GSM8K_TEST)
    spqr: tuple[SpqrRow, ...] = SPQR_ROWS
    methods: tuple[str, ...] = METHODS       # the reference row always runs

    def __post_init__(self) -> None:
        if self.tokens_per_domain < 64:
            raise ValueError(f"tokens per domain must be >= 64, got {self.tokens_per_domain}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"unknown methods {unknown}: choose from {', '.join(METHODS)}")


def run_quant_bench(config: QuantBenchConfig, on_status: Callable[[str], None] = lambda message: None) -> dict:
    reference = load_model(LoadOptions(config.target, device="cpu", dtype="fp32"))
    texts = heldout_texts(reference, config, on_status)
    ppl_config = PerplexityConfig(max_tokens=config.tokens_per_domain)

    def evaluate(name: str, model: LoadedModel, bits: float, extra: dict | None = None) -> dict:
        on_status(f"{name}: perplexity on {', '.join(texts)}")
        scores = {domain: round(perplexity(model, text, ppl_config)["perplexity"], 4) for domain, text in texts.items()}
        return {"method": name, "bits_per_param": round(bits, 4), "perplexity": scores, **(extra or {})}

    rows = [evaluate("reference", reference, bits_per_param(reference))]
    if "spqr" in config.methods:
        rows += [_spqr_row(config, row, evaluate, on_status) for row in config.spqr]
    source = reference.source
    if "rtn" in config.methods:
        for bits in (4, 3):
            for groupsize in (16, 64):
                layers = transformed_layers(source, lambda w, b=bits, g=groupsize: round_to_nearest(w, b, g))
                rows.append(evaluate(f"rtn-w{bits}-g{groupsize}", _in_memory(reference, layers),
                                     rtn_bits(bits, groupsize)))
    if "gptq" in config.methods:
        calibration = calibration_windows(reference.tokenizer, [], config.nsamples, config.seqlen, seed=0)
        for bits in (4, 3):
            on_status(f"gptq-w{bits}-g16: calibrating")
            layers, bits_used = gptq_layers(source, calibration, bits)
            rows.append(evaluate(f"gptq-w{bits}-g16", _in_memory(reference, layers), bits_used))
    if "nf4" in config.methods:
        rows.append(evaluate("nf4", _in_memory(reference, transformed_layers(source, nf4)), NF4_BITS))
    _add_increases(rows)
    return {"bench": "quant", "model": reference.path.name, "window": ppl_config.window, "stride": ppl_config.stride,
            "tokens_per_domain": config.tokens_per_domain, "calibration": {"nsamples": config.nsamples,
                                                                            "seqlen": config.seqlen},
            "rows": rows}


def spqr_checkpoint(config: QuantBenchConfig, row: SpqrRow, on_status=lambda message: None,
                    create: bool = True) -> Path | None:
    """The row's SpQR checkpoint of config.target, quantized once into the cache (`bench quant-disk` and
    `bench all` stream the same folder); with `create` False, None unless it is already there."""
    name = row.name
    key = f"{_model_key(config)}-{name}-t{row.outlier_threshold:g}-n{config.nsamples}-s{config.seqlen}-a{ALGORITHM}"
    folder = cache_root() / "bench_quant" / key
    if not (folder / "config.json").exists() and not create:
        return None
    if not (folder / "config.json").exists():
        on_status(f"{name}: quantizing into {folder} (resumable)")
        quantize(QuantizeConfig(config.target, folder, row.bits, row.groupsize, row.stats_bits, row.outlier_threshold,
                                nsamples=config.nsamples, seqlen=config.seqlen, resume=folder.exists(),
                                act_order=row.act_order),
                 lambda e: on_status(f"{name}: layer {e['layer']} error {e['error']:.2e}"))
    return folder


def _spqr_row(config: QuantBenchConfig, row: SpqrRow, evaluate, on_status) -> dict:
    name = row.name
    folder = spqr_checkpoint(config, row, on_status)
    model = load_model(LoadOptions(str(folder), device="cpu", dtype="fp32"))
    report = json.loads((folder / "quantize_report.json").read_text())
    extra = {"outlier_threshold": row.outlier_threshold, "groupsize": row.groupsize, "stats_bits": row.stats_bits,
             "act_order": row.act_order, "outlier_share": report["outlier_share"],
             "dequantize_seconds_per_layer": round(dequantize_seconds(model), 5),
             "bytes_per_pass": model.source.packed_bytes()}
    return evaluate(name, model, bits_per_param(model), extra)


def dequantize_seconds(model: LoadedModel, repeats: int = 5, kernel: bool = False) -> float:
    """Median time to decode one packed layer into dense matrices on the compute device, as a pass pays it:
    the layer's statistics, then each matrix in turn, released before the next (a decoder thread, which
    holds a layer's matrices until its compute, pays more on a CPU: the buffers leave the cache). `kernel`: what
    a streamed layer on the CPU's int4 kernel pays instead (its repack, or nothing from the kernel layer cache)."""
    source, times = model.source, []
    stored = {name: t.to(model.model.device) for name, t in source.layer(0).items()}
    decode = source.kernel_layer if kernel else source.decode_layer
    for _ in range(repeats + 1):
        start = time.perf_counter()
        decoded = decode(0, stored, model.model.dtype)
        for linear in decoded.values():
            if hasattr(linear, "matrix"):     # SpQR decodes each matrix here; a GGUF layer is dense already
                linear.matrix.dequantize(linear.dtype, permuted=True, statistics=linear.statistics)
        model.model.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _in_memory(reference: LoadedModel, layers) -> LoadedModel:
    source = InMemorySource(reference.source, layers)
    engine = build_engine(source, LoadOptions(device="cpu", dtype="fp32"))
    return LoadedModel(reference.path, reference.config, reference.tokenizer, engine.model, engine.layers, engine.plan,
                       reference.stop_ids, engine.global_bytes, source)


def _add_increases(rows: list[dict]) -> None:
    base = rows[0]["perplexity"]
    for row in rows:
        row["increase"] = {d: round(row["perplexity"][d] / base[d] - 1, 4) for d in base}
        row["mean_increase"] = round(statistics.mean(row["increase"].values()), 4)
    bytes_fp32 = rows[0]["bits_per_param"] / 8
    for row in rows:
        row["bytes_ratio_vs_fp32"] = round(bytes_fp32 * 8 / row["bits_per_param"], 3)
        row["bytes_ratio_vs_bf16"] = round(16 / row["bits_per_param"], 3)


def _model_key(config: QuantBenchConfig) -> str:
    return "default" if is_default_model(config.target) else Path(config.target).name


def heldout_texts(reference: LoadedModel, config: QuantBenchConfig, on_status) -> dict[str, str]:
    texts = {"code": stdlib_code(EVALUATION_MODULES), "prose": documentation_prose(0)}
    if config.gsm8k_test:
        rows = read_jsonl(config.gsm8k_test)[:400]
        texts["math"] = "\n\n".join(f"{row['question']}\n{row['answer']}" for row in rows)
    if config.chat_prompts:
        texts["chat"] = _chat_answers(reference, config, on_status)
    return texts


def _chat_answers(reference: LoadedModel, config: QuantBenchConfig, on_status) -> str:
    """The reference model's greedy answers to MT-Bench first turns (generated once per model and length,
    cached: a cache made for a shorter text must not stand in for a longer one)."""
    cache = cache_root() / "bench_quant" / f"{_model_key(config)}-chat-answers-{config.tokens_per_domain}.json"
    if cache.exists():
        return json.loads(cache.read_text())["text"]
    decoder = Decoder(reference.model, reference.stop_ids, DecodeConfig(192, 1024))
    answers, total = [], 0
    for row in read_jsonl(config.chat_prompts):
        prompt = row["turns"][0]
        ids = decoder.generate(reference.tokenizer.encode_prompt(prompt), SamplingConfig()).token_ids
        answers.append(reference.tokenizer.decode(ids))
        total += len(ids)
        on_status(f"chat answers for held-out text: {total} / {config.tokens_per_domain} tokens")
        if total >= config.tokens_per_domain:
            break
    text = "\n\n".join(answers)
    with writing(cache, "nothing (these answers are generated again)",
                 "rerun the same `specstream bench quant` command"):
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(cache, json.dumps({"text": text}))
    return text
