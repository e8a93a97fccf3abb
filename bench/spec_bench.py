"""`bench spec`: speculative decoding against our own autoregressive decoding and transformers' assisted
generation, on the same prompts and settings, in one run.

Per mode (resident: every layer on the device; disk-cold: layers streamed from disk with the page cache
dropped before each pass) each prompt runs autoregressively, then at every fixed budget, then under the
auto chooser, back to back (prompt-major), so slow drift of a shared machine hits every row alike.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from offload import LoadedModel, LoadOptions, Tokenizer

from runtime.models import load_model
from offload.model.config import ModelConfig
from offload.devices import choose_device, choose_dtype, dtype_name
from offload.host_sync import count_steps
from offload.loader import stop_token_ids, streaming_device_budget
from offload.weights.resolve import DEFAULT_MODEL_NAME, is_default_model, resolve_model
from spec import DecodeConfig, Decoder, DecodeResult, FixedBudget, SamplingConfig, Speculator
from perf.pass_curve import PassTimeCurve
from perf.probe import auto_budget, measure_pass_seconds as _pass_seconds, probe_pass_times
from perf.result_formats import SPEC
from perf.tree_size import BudgetChooser, check_budget
from spec.draft import load_any_draft, require_draft
from bench.journal import BenchJournal, changed_fields, fingerprint, result_from_dict, result_to_dict
from bench.hf_draft import Peer, PeerRun, open_peer
from runtime.speculation import estimated_draft_footprint
from bench.spec_report import mode_report, progress_line, summarize

MODES = ("resident", "disk-cold")
DISK_COLD_RESIDENT_LAYERS = 3             # default disk-cold budget: these stay on the device, the rest stream
MIN_PASS_TOKENS = 512                     # the prefill chunk, as a session plans it
WARMUP_TOKENS = 4
COUNTED_TOKENS = 16                       # per row, the first prompt's answer decoded again, counting syncs


Status = Callable[[str], None]
SYNC_MEANING = {"cuda": "device syncs: reads of CUDA tensors, blocking host<->device copies, data-dependent shapes",
                "cpu": "every read of a tensor's values and every blocking move naming a device, host bookkeeping "
                       "included: an upper bound of the device syncs a GPU would make"}


@dataclass(slots=True)
class SpecBenchConfig:
    target: str | None = None          # None: the embedded default model
    draft: str | None = None           # None: the target's shipped draft
    max_new_tokens: int = 256
    budgets: list[int] = field(default_factory=lambda: [1, 4, 16, 64, 256, 1024, 4096])
    modes: list[str] = field(default_factory=lambda: list(MODES))
    gpu_mem: int | None = None         # disk-cold device budget; None: disk_cold_gpu_mem()
    max_context: int = 4096
    run_peer: bool = True              # transformers' assisted generation
    dtype: str = "auto"                # target and draft (auto: bf16 on CUDA, fp32 on CPU)
    count_syncs: bool = True           # host reads and torch ops per step, per row (see count_row_syncs)

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"--max-new-tokens must be positive, got {self.max_new_tokens}")
        if not self.budgets:
            raise ValueError("--budgets needs at least one budget, e.g. 1,4,16")
        for budget in self.budgets:
            check_budget(budget)
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"--modes takes {', '.join(MODES)}; got {','.join(self.modes) or 'nothing'}")
        if self.gpu_mem is not None and self.gpu_mem <= 0:
            raise ValueError(f"--gpu-mem must be positive, got {self.gpu_mem}")

    @property
    def max_budget(self) -> int:
        return max(self.budgets)

    @property
    def max_pass_tokens(self) -> int:
        return max(MIN_PASS_TOKENS, self.max_budget)

    @property
    def draft_spec(self) -> str:
        return require_draft(self.target, self.draft)


def load_options(config: SpecBenchConfig, mode: str) -> LoadOptions:
    """The target planned for the largest budget; disk-cold: a small device budget, no RAM tier."""
    draft = estimated_draft_footprint(config.draft_spec, _dtype_bytes(config.dtype))
    options = LoadOptions(config.target, dtype=config.dtype, max_context=config.max_context,
                          max_pass_tokens=config.max_pass_tokens, draft_bytes=draft.weight_bytes,
                          draft_kv_token_bytes=draft.kv_token_bytes)
    if mode == "disk-cold":
        options.gpu_mem, options.ram = config.gpu_mem or disk_cold_gpu_mem(config), 1
        options.disk_cold = True
    return options


def disk_cold_gpu_mem(config: SpecBenchConfig) -> int:
    """A device budget holding what never streams (globals, draft, KV cache, workspace), the ring,
    DISK_COLD_RESIDENT_LAYERS layers and half a layer of slack, in the layer bytes as stored (a packed
    checkpoint's are packed; from config.json they would leave every packed layer resident): most
    layers stream from disk."""
    return streaming_device_budget(load_options(config, "resident"), DISK_COLD_RESIDENT_LAYERS)


def _dtype_bytes(dtype: str) -> int:
    return choose_dtype(dtype, choose_device()).itemsize


@dataclass(slots=True)
class ModeRun:
    """One mode's loaded models and decoders: `plain` never drafts; `speculative` takes each row's policy."""
    target: LoadedModel
    plain: Decoder
    speculative: Decoder
    chooser: BudgetChooser          # the auto row's policy, learning across the mode's prompts as in a session

    def decode(self, row: str | int, prompt_ids: list[int], sampling: SamplingConfig,
               max_new_tokens: int) -> DecodeResult:
        decoder = self.plain if row == "autoregressive" else self.speculative
        decoder.budget = self.chooser if row == "auto" else FixedBudget(1 if row == "autoregressive" else row)
        decoder.config = replace(decoder.config, max_new_tokens=max_new_tokens)
        decoder.reset()   # every prompt from an empty cache: no prefix reuse between prompts
        return decoder.generate(prompt_ids, sampling)

    def close(self) -> None:
        self.target.layers.close()
        self.speculative.speculator.draft.close()


def open_mode(config: SpecBenchConfig, mode: str, on_status: Status) -> ModeRun:
    target = load_model(load_options(config, mode))
    draft_options = LoadOptions(dtype=config.dtype, max_context=config.max_context,
                                max_pass_tokens=config.max_pass_tokens)
    draft = load_any_draft(config.draft_spec, target, draft_options, on_status)
    decode = DecodeConfig(config.max_new_tokens, config.max_context, config.max_pass_tokens)
    speculator = Speculator(draft, config.max_context, config.max_budget, config.max_pass_tokens)
    chooser = auto_budget(target, config.max_budget, on_status)
    return ModeRun(target, Decoder(target.model, target.stop_ids, decode),
                   Decoder(target.model, target.stop_ids, decode, speculator), chooser)


@dataclass(slots=True)
class BenchPrompt:
    """A prompt's token ids and its seed (the sampling seed + its index in the whole prompt list); `key`
    names its rows in the journal."""
    ids: list[int]
    seed: int

    @property
    def key(self) -> str:
        return f"{fingerprint(self.ids)}-{self.seed}"


PEER_ROWS = ("transformers", "assisted")


def bench_mode(config: SpecBenchConfig, mode: str, prompts: list[BenchPrompt], sampling: SamplingConfig,
               on_status: Status, journal: BenchJournal, peer: Peer | None) -> tuple[dict, list[list[int]], dict]:
    """-> (the mode's report, its autoregressive tokens per prompt, the peer's runs by row). Rows in
    `journal` are not run again (the auto row's chooser then goes on without what it learnt on them).
    The peer (`peer`: transformers, plain and assisted) runs after each prompt's rows, so a run cut short
    still compares both on the same prompts."""
    run = open_mode(config, mode, on_status)
    rows = ["autoregressive", *config.budgets, "auto"]
    for row in ("autoregressive", config.max_budget):
        run.decode(row, prompts[0].ids, sampling, WARMUP_TOKENS)
    if peer:
        peer.warm_up(prompts[0].ids)
    results: dict = {row: [] for row in rows}
    peer_runs: dict = {row: [] for row in PEER_ROWS}
    for index, prompt in enumerate(prompts):
        seeded = replace(sampling, seed=prompt.seed)
        for row in rows:
            done = journal.get(mode, prompt.key, row)
            result = result_from_dict(done) if done else run.decode(row, prompt.ids, seeded, config.max_new_tokens)
            if not done:
                journal.put(result_to_dict(result), mode, prompt.key, row)
            results[row].append(result)
            on_status(progress_line(mode, index, len(prompts), row, result, results["autoregressive"][index]))
        for row in PEER_ROWS if peer else ():
            done = journal.get("peer", prompt.key, row)
            peer_runs[row].append(PeerRun(**done) if done else peer.run(prompt.ids, prompt.seed, row == "assisted"))
            if not done:
                journal.put(asdict(peer_runs[row][-1]), "peer", prompt.key, row)
        if peer:
            on_status(f"assisted generation: prompt {index + 1}/{len(prompts)}: "
                      f"{len(peer_runs['assisted'][-1].token_ids)} tokens in "
                      f"{peer_runs['assisted'][-1].num_target_forwards} target forwards")
    syncs = {row: count_row_syncs(run, row, prompts[0], sampling) for row in rows} if config.count_syncs else {}
    curve = measure_pass_times(run.target, config.max_budget)
    run.close()
    reference = [r.token_ids for r in results["autoregressive"]]
    return mode_report(run.target.plan, results, reference, sampling, curve, syncs), reference, peer_runs


def count_row_syncs(run: ModeRun, row: str | int, prompt: BenchPrompt, sampling: SamplingConfig) -> dict:
    """What one step of `row` makes the host wait for, counted, not timed (counting slows every op): host
    reads (device syncs on a GPU; on a CPU every read counts, see offload/host_sync.py) and torch ops per
    step of a COUNTED_TOKENS-token answer to `prompt`, less its prefill (a one-token answer, counted alike)."""
    seeded = replace(sampling, seed=prompt.seed)
    counts, steps = count_steps(lambda tokens: run.decode(row, prompt.ids, seeded, tokens).stats.num_steps,
                                COUNTED_TOKENS, run.target.model.device)
    return counts.report(steps)


def journaled(journal: BenchJournal, config: SpecBenchConfig, prompt: BenchPrompt) -> bool:
    """Whether every row of `prompt` is in the journal."""
    rows = [(mode, row) for mode in config.modes for row in ("autoregressive", *config.budgets, "auto")]
    rows += [("peer", row) for row in PEER_ROWS] if config.run_peer else []
    return all((mode, prompt.key, row) in journal.rows for mode, row in rows)


def measure_pass_times(target: LoadedModel, max_budget: int) -> PassTimeCurve:
    """t(n) measured now, in this run (the auto row's chooser keeps the runtime's cached curve)."""
    scratch = target.model.new_cache(max_budget)
    return probe_pass_times(lambda n: _pass_seconds(target, scratch, n), max_budget)


def run_spec_bench(config: SpecBenchConfig, sampling: SamplingConfig, prompts: list[list[dict[str, str]]],
                   on_status: Status = lambda message: None, resume: bool = False, partial: bool = False) -> dict:
    """Every mode, and transformers' assisted generation, on `prompts` (chat messages) -> the JSON report.
    Each finished row goes to a journal in the cache folder; `resume` takes the rows a killed run of the
    same benchmark finished (their seconds were measured then: `resumed_rows` in the report counts them);
    `partial` reports on the prompts whose rows are all journaled, decoding nothing."""
    if not prompts:
        raise ValueError("no prompts to benchmark (check --prompts and --limit)")
    target_folder = resolve_model(config.target, on_status=on_status, gguf_import=True)  # transformers' peer reads it
    tokenizer = Tokenizer(target_folder)
    stop_ids = stop_token_ids(target_folder, ModelConfig.from_file(target_folder), tokenizer)
    bench_prompts = [BenchPrompt(tokenizer.encode_chat(messages), (sampling.seed or 0) + index)
                     for index, messages in enumerate(prompts)]
    device, dtype = choose_device(), dtype_name(choose_dtype(config.dtype, choose_device()))
    # models as the user named them (a new machine resolves the same names to other paths)
    settings = {**changed_fields(config), "sampling": changed_fields(sampling), "device": str(device), "dtype": dtype}
    journal = BenchJournal("spec", settings, resume, read_only=partial)
    on_status(f"journal: {journal.path.name} ({len(journal.rows)} finished rows taken; a killed run resumes "
              f"with the same command and --resume)")
    if partial:
        config = replace(config, count_syncs=False)         # decodes nothing
        bench_prompts = [p for p in bench_prompts if journaled(journal, config, p)]
        if not bench_prompts:
            raise ValueError("--partial: no prompt has all its rows in the journal of a run with these settings")
    report = {"bench": SPEC, "target": DEFAULT_MODEL_NAME if is_default_model(config.target)
              else target_folder.name, "draft": Path(config.draft_spec).name, "prompts": len(bench_prompts),
              "max_new_tokens": config.max_new_tokens, "sampling": asdict(sampling), "device": str(device),
              "dtype": dtype, "threads": torch.get_num_threads(), "modes": {}}
    if config.count_syncs:
        report["host_syncs"] = {"counted_on": device.type, "answer_tokens": COUNTED_TOKENS,
                                "meaning": SYNC_MEANING.get(device.type, SYNC_MEANING["cpu"])}
    if partial:
        report["partial"] = {"prompts_finished": len(bench_prompts), "prompts_given": len(prompts)}
    peer = open_peer(target_folder, config.draft_spec, stop_ids, config.max_new_tokens, sampling, on_status) \
        if config.run_peer else "--no-peer"
    references, peer_runs = {}, {}
    for mode in config.modes:
        on_status(f"{mode}: loading, then {len(bench_prompts)} prompts x {len(config.budgets) + 2} rows")
        first = mode == config.modes[0] and isinstance(peer, Peer)
        report["modes"][mode], references[mode], runs = bench_mode(config, mode, bench_prompts, sampling, on_status,
                                                                   journal, peer if first else None)
        peer_runs = runs if first else peer_runs
    reference = references[config.modes[0]] if sampling.is_greedy else None
    report["assisted_generation"] = peer.report(peer_runs["transformers"], peer_runs["assisted"], reference) \
        if isinstance(peer, Peer) else {"skipped": peer}
    report["resumed_rows"] = journal.resumed
    report["summary"] = summarize(report)
    return report
