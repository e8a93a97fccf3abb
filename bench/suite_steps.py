"""The benchmarks `bench all` runs, each a call of a `bench` command's own function (or, for the peers
that live in other environments, its script): our engine resident, streamed from RAM and from a cold
disk, speculative by budget and at the auto budget, SpQR w4 and the in-place GGUF from a cold disk, the
draft, batched decoding, the server under concurrent clients; transformers generate and assisted generation,
accelerate disk offload, AirLLM and llama.cpp (also on 1B- and 8B-shaped GGUF files: bench/suite_shapes.py).
Every engine decodes the same prompts greedily with the same thread count."""
from __future__ import annotations

import gc
import json
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.suite_config import ROOT, SuiteConfig
from bench.suite_batch import run_batch
from bench.suite_serve import run_serve
from bench.suite_shapes import run_cpu_shapes

PEERS_PYTHON = ROOT / ".venv-peers/bin/python"
GPU_REFERENCE = ROOT / "bench/results/device_check_h200.json"


class SuiteContext:
    """What the benchmarks share: the settings, the model (the peers' private copy of the default model's
    fp32 folder, which no other process maps, so cold runs are cold), the prompts, earlier results."""

    def __init__(self, config: SuiteConfig, out: Path, status: Callable[[str], None]) -> None:
        self.config, self.out, self.status = config, out, status
        self.results: dict[str, dict] = {}
        self._folder: Path | None = None

    @property
    def model_folder(self) -> Path:
        if self._folder is None:
            from bench.peers import model_folder
            self._folder = model_folder(private_copy=True)
        return self._folder

    @property
    def gguf_file(self) -> Path:
        from offload.weights.resolve import default_model_gguf
        return default_model_gguf()

    @property
    def prompts(self) -> list[list[dict[str, str]]]:
        import textdata
        from spec.distill.prompts import prompt_turns
        return prompt_turns([textdata.path(textdata.CHAT_PROMPTS)], self.config.prompts)

    @property
    def prompt_text(self) -> str:
        """The first prompt: the single-prompt benchmarks (peers, llama.cpp, quant-disk) decode this one."""
        return self.prompts[0][-1]["content"]


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    run: Callable[[SuiteContext], dict]
    estimate: Callable[[SuiteConfig], float]     # seconds, for the progress display's time left


def run_spec(ctx: SuiteContext) -> dict:
    """bench spec: autoregressive, every budget and auto, resident and disk-cold; transformers generate and
    assisted generation with the same draft."""
    from bench.spec_bench import SpecBenchConfig, run_spec_bench
    from bench.spec_report import summarize
    from spec import SamplingConfig
    from spec.draft import default_draft_for
    c = ctx.config
    reports = []
    # one call per mode, the peer in the first only: transformers memory-maps the checkpoint, and the kernel
    # keeps a mapped file's pages, so a disk-cold mode run beside a live peer would read from the page cache
    for index, mode in enumerate(c.spec_modes):
        config = SpecBenchConfig(str(ctx.model_folder), str(default_draft_for(None)), c.max_new_tokens,
                                 list(c.budgets), [mode], dtype="fp32", run_peer=index == 0)
        reports.append(run_spec_bench(config, SamplingConfig(), ctx.prompts, on_status=ctx.status))
        gc.collect()          # the peer's models, and their file mappings, go before the next mode
    merged = {**reports[0], "modes": {m: r for report in reports for m, r in report["modes"].items()}}
    merged["summary"] = summarize(merged)
    return merged


def run_stream(ctx: SuiteContext) -> dict:
    """bench stream from RAM and from a cold disk (3 layers resident, the rest streamed), beside the GPU's
    measured curve."""
    from bench.stream_bench import run_stream_bench
    from offload import LoadOptions
    from offload.loader import streaming_device_budget
    c, sizes = ctx.config, list(ctx.config.stream_sizes)
    options = LoadOptions(str(ctx.model_folder), device="cpu", dtype="fp32", max_context=max(sizes) + 1,
                          max_pass_tokens=max(sizes))
    from offload.model.config import ModelConfig
    resident = 3 if ModelConfig.from_file(ctx.model_folder).num_layers >= 8 else 0   # the rest stream
    gpu_mem = streaming_device_budget(options, resident)
    tiers = {tier: run_stream_bench(str(ctx.model_folder), gpu_mem, tier, sizes, "cpu", "fp32", c.stream_repeats,
                                    on_status=ctx.status) for tier in ("ram", "disk")}
    return {"bench": "stream", "gpu_mem_bytes": gpu_mem, "tiers": tiers, "gpu_reference": gpu_reference()}


def gpu_reference() -> dict | None:
    """The H200's pass time per pass size (bench/results/device_check_h200.json, measured on a lent GPU;
    not re-run here), or None where the repository's results are not beside the package."""
    if not GPU_REFERENCE.is_file():
        return None
    check = json.loads(GPU_REFERENCE.read_text())
    return {"source": str(GPU_REFERENCE.relative_to(ROOT)), "device": check["device"], "date": check.get("date"),
            "dtype": check["dtype"], "pinned_h2d_gbps": check["pinned_h2d_gbps"], "passes": check["passes"]}


def quant_config(ctx: SuiteContext, spqr_rows: tuple | None = None):
    from bench.quant_bench import SPQR_ROWS, QuantBenchConfig
    c = ctx.config
    extra = {} if c.quant_chat_domain else {"chat_prompts": None}
    rows = spqr_rows if spqr_rows is not None else SPQR_ROWS if c.quant_all_spqr_rows else (w4_row(),)
    methods = tuple(m for m in c.quant_methods if m != "spqr" or rows)
    return QuantBenchConfig(str(ctx.model_folder), c.quant_tokens, c.quant_nsamples, c.quant_seqlen, spqr=rows,
                            methods=methods, **extra)


SPQR_NOT_CACHED = ("no SpQR w4 checkpoint of this model in the cache yet, and --quick does not quantize (about 20 "
                   "minutes on 2 cores): a full `bench all` run makes it, and later quick runs reuse it")


def cached_spqr(ctx: SuiteContext) -> Path | None:
    """The w4 checkpoint the suite streams: made now (full run) or taken from the cache (quick)."""
    from bench.quant_bench import spqr_checkpoint
    return spqr_checkpoint(quant_config(ctx), w4_row(), ctx.status, create=ctx.config.spqr_quantize)


def w4_row():
    """The SpQR w4 row the suite streams: groups of 32 in input order with 8-bit statistics (4.68 bits)."""
    from bench.quant_bench import SpqrRow
    return SpqrRow(4, 8.0, 32, 8, act_order=False)


def run_quant(ctx: SuiteContext) -> dict:
    """bench quant: perplexity and bits per parameter per method."""
    from bench.quant_bench import run_quant_bench
    c = ctx.config
    if c.spqr_quantize or "spqr" not in c.quant_methods:
        return run_quant_bench(quant_config(ctx), on_status=ctx.status)
    if cached_spqr(ctx) is None:          # quick: no quantizing; the other methods still run
        return {**run_quant_bench(quant_config(ctx, spqr_rows=()), on_status=ctx.status),
                "spqr_skipped": SPQR_NOT_CACHED}
    return run_quant_bench(quant_config(ctx, spqr_rows=(w4_row(),)), on_status=ctx.status)


def run_quant_disk(ctx: SuiteContext) -> dict:
    """bench quant-disk: fp32 and bf16 against SpQR w4 from a cold disk; then the in-place GGUF against
    fp32 in its own call (its ratio measured within that call)."""
    from bench.quant_disk_bench import DiskBenchConfig, run_disk_bench
    c = ctx.config
    packed = cached_spqr(ctx)
    if packed is None:
        report = {"bench": "quant-disk", "new_tokens": c.disk_tokens, "rounds": c.disk_rounds, "rows": [],
                  "spqr_skipped": SPQR_NOT_CACHED}
    else:
        report = run_disk_bench(DiskBenchConfig(str(ctx.model_folder), [packed], c.disk_tokens, c.disk_rounds,
                                                prompt=ctx.prompt_text), on_status=ctx.status)
    report["gguf_in_place"] = _gguf_in_place(ctx, DiskBenchConfig, run_disk_bench)
    return report


def _gguf_in_place(ctx: SuiteContext, config_type, run) -> dict:
    from offload.weights.resolve import resolve_model
    folder = resolve_model(str(ctx.gguf_file))
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return {"skipped": "this build converts GGUF files to safetensors at load: no in-place GGUF path yet"}
    c = ctx.config
    try:
        return run(config_type(str(ctx.model_folder), [folder], c.disk_tokens, c.disk_rounds,
                               reference_dtypes=("fp32",), prompt=ctx.prompt_text), on_status=ctx.status)
    except Exception as err:   # the rows above stand; the report shows this row as failed, with the error
        return {"error": f"bench quant-disk on the in-place GGUF: {type(err).__name__}: {err}"}


def run_draft(ctx: SuiteContext) -> dict:
    """bench draft: top-1 agreement, rank acceptance and cost of the shipped draft on the target's answers."""
    from bench.draft_bench import DraftBenchConfig, bench_draft, load_pair
    from spec.draft import default_draft_for
    target, draft, same_dtype = load_pair(str(ctx.model_folder), str(default_draft_for(None)))
    config = DraftBenchConfig(max_new_tokens=ctx.config.max_new_tokens,
                              num_cost_repeats=2 if ctx.config.quick else 5)
    try:
        return bench_draft(target, draft, ctx.prompts, config, draft_at_target_dtype=same_dtype,
                           on_progress=lambda e: ctx.status(f"target answers {e['done']}/{e['total']}"))
    finally:
        target.layers.close()


def run_peers(ctx: SuiteContext) -> dict:
    """`bench peers` (each engine in its own process, AirLLM in .venv-peers) on the suite's first prompt."""
    c, out = ctx.config, ctx.out / "peers.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "cli", "bench", "peers", "--max-new-tokens", str(c.peer_tokens), "--rounds",
           str(c.peer_rounds), "--airllm-tokens", str(c.airllm_tokens), "--threads", str(c.threads),
           "--engines", ",".join(c.peer_engines), "--prompt", ctx.prompt_text, "--out", str(out), "--json"]
    code, tail = stream_process(cmd, ctx.status)
    if not out.is_file():
        return {"error": f"bench peers exited {code} without a report: {tail}"}
    return json.loads(out.read_text())


def stream_process(cmd: list[str], status: Callable[[str], None]) -> tuple[int, str]:
    """Runs `cmd`, passing each stderr line to `status` -> (exit code, the last stderr lines)."""
    lines: list[str] = []
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
        for line in proc.stderr:
            if line.strip():
                lines.append(line.rstrip())
                status(line.strip())
    return proc.returncode, " | ".join(lines[-5:])


def run_llama_cpp(ctx: SuiteContext) -> dict:
    """llama.cpp (llama-cpp-python in .venv-peers) on the default model's own GGUF file, the same prompt
    ids, greedy, the same threads; its decode tok/s over ours resident from the peers run (same definition:
    prefill excluded)."""
    if not PEERS_PYTHON.exists():
        return {"skipped": ".venv-peers is missing: run scripts/setup_peers.sh --llama-cpp"}
    if subprocess.run([str(PEERS_PYTHON), "-c", "import llama_cpp"], capture_output=True).returncode != 0:
        return {"skipped": "llama-cpp-python is not installed in .venv-peers: run scripts/setup_peers.sh --llama-cpp"}
    from offload import Tokenizer
    from offload.loader import stop_token_ids
    from offload.model.config import ModelConfig
    c, folder = ctx.config, ctx.model_folder
    tokenizer = Tokenizer(folder)
    stop_ids = stop_token_ids(folder, ModelConfig.from_file(folder), tokenizer)
    ids = tokenizer.encode_chat([{"role": "user", "content": ctx.prompt_text}])     # as the peers' children do
    cmd = [str(PEERS_PYTHON), str(ROOT / "bench/llama_cpp_runner.py"), "--model", str(ctx.gguf_file), "--ids",
           json.dumps(ids), "--stop-ids", json.dumps(sorted(stop_ids)), "--max-new-tokens", str(c.peer_tokens),
           "--threads", str(c.threads)]
    runs = []
    rounds = max(c.peer_rounds, 3)       # a second each: the median of three even in a quick run
    for index in range(rounds):
        ctx.status(f"llama.cpp round {index + 1}/{rounds}")
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        found = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        runs.append(json.loads(found[-1]) if found else {"error": f"exit {proc.returncode}: {proc.stderr[-500:]}"})
        if "error" in runs[-1]:
            return {"error": f"llama.cpp: {runs[-1]['error']}", "runs": runs}
    return llama_report(ctx, runs, ids)


def llama_report(ctx: SuiteContext, runs: list[dict], ids: list[int]) -> dict:
    per_token = statistics.median(r["seconds_per_token"] for r in runs)
    peers = ctx.results.get("peers", {})
    ours = peers.get("engines", {}).get("ours_resident", {}).get("seconds_per_token")
    reference = peers.get("reference_tokens") or []
    tokens = runs[-1]["token_ids"]
    same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    return {"bench": "llama_cpp", "model": ctx.gguf_file.name, "threads": ctx.config.threads,
            "llama_cpp_python": runs[-1].get("llama_cpp_python_version"), "prompt_tokens": len(ids),
            "max_new_tokens": ctx.config.peer_tokens, "rounds": len(runs),
            "seconds_per_token": round(per_token, 5), "tokens_per_second": round(1 / per_token, 3),
            "first_token_seconds": runs[-1]["first_token_seconds"], "token_ids": tokens,
            "same_tokens_as_ours_prefix": same if reference else None,
            "ours_resident_seconds_per_token": ours,
            "llama_cpp_over_ours_resident_tokens_per_second": round(ours / per_token, 3) if ours else None,
            "notes": "llama.cpp reads the Q4_1 blocks and multiplies them with 8-bit activations; ours decodes the "
                     "same file's weights to fp32 (the peers run's fp32 folder), so tokens may part after a while"}


_ABSOLUTE = re.compile(r"(?<![\w.~])/[\w.+@=-]+(?:/[\w.+@=-]*)+")


def scrub(value):
    """A result as the report may show it: paths inside the repository relative to it, any other absolute
    path cut to its last part (no machine's folders, no user names)."""
    if isinstance(value, dict):
        return {k: scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v) for v in value]
    if isinstance(value, str) and "/" in value:
        root = str(ROOT) + "/"
        return _ABSOLUTE.sub(lambda m: m.group(0)[len(root):] if m.group(0).startswith(root)
                             else Path(m.group(0).rstrip("/")).name, value)
    return value


STEPS = (
    Step("spec", run_spec, lambda c: 140 if c.quick else 2400),
    Step("stream", run_stream, lambda c: 40 if c.quick else 120),
    Step("quant", run_quant, lambda c: 140 if c.quick else 1800),
    Step("quant_disk", run_quant_disk, lambda c: 90 if c.quick else 300),
    Step("draft", run_draft, lambda c: 40 if c.quick else 300),
    Step("peers", run_peers, lambda c: 150 if c.quick else 600),
    Step("llama_cpp", run_llama_cpp, lambda c: 15 if c.quick else 30),
    Step("cpu_shapes", run_cpu_shapes, lambda c: 150 * len(c.cpu_shapes) * len(c.cpu_shape_types)),
    Step("batch", run_batch, lambda c: 60 if c.quick else 300),
    Step("serve", run_serve, lambda c: 90 if c.quick else 600),
)
