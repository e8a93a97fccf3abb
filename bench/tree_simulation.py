"""`bench tree-simulation`: tokens per pass of greedy tree speculation at any budget, from draft work alone.

Greedy verification accepts exactly the longest root path of the tree that follows the target's own
greedy continuation, then adds the target's next token. So once the target's greedy answers are known
(decoded once, one token per pass), every budget's tokens per pass follows from growing the same trees
with the real growth code and matching them against those answers: no target pass over the tree. On 2
CPU cores a target pass over 4,096 tree tokens takes ~30 s, so this is how budgets of the GPU regime
are measured here on many prompts. tests/test_speculative.py checks it against real speculative decoding,
tests/test_simulation_vs_live.py against a recorded live `bench spec` run.

    specstream bench tree-simulation --budgets 1024,2048,4096 --limit 4 --max-new-tokens 128
    specstream bench tree-simulation --draft self --draft-bits 3 --budgets 16,64,256,1024
Prompt files (default: the 44 chat prompts and the MT-Bench first turns; `--limit` takes the first N of
each). The JSON report is an acceptance source `plan --acceptance` reads (perf/result_formats.py).

`--draft self`: the target's self-draft, substitutes for every layer past the first `--resident-layers` (as a plan
that keeps those resident streams the rest); the target writes each step's accepted keys into the shared cache.
A run checkpoints each (budget, prompt) in the model cache and resumes there when run again with the same flags;
`--checkpoint-dir` keeps the checkpoints in another folder (one copied from another machine resumes there: a file's
name is a hash of the flags that decide its results). `--shard K/N` simulates only every N-th prompt from the K-th,
into the same checkpoint: N processes (one a core) share a run, and the same command without `--shard` then
reports every prompt from their items.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import textdata
from offload import LoadOptions
from offload.loader import DEFAULT_CPU_KERNEL
from perf.result_formats import TREE_SIMULATION
from runtime.models import load_model
from spec import DecodeConfig, Decoder, default_draft_for, load_any_draft
from offload.weights.gguf_import import cache_root
from runtime.self_drafting import SELF_DRAFT_MAX_DEPTH
from spec.self_draft import SELF_DRAFT, SubstituteConfig, load_self_draft
from spec.simulation import SIMULATION_VERSION, greedy_answers, simulate, simulate_self
from spec.distill.prompts import prompts_from_jsonl

def default_prompt_files() -> list[Path]:
    return [textdata.path(textdata.CHAT_PROMPTS), textdata.path(textdata.MT_BENCH)]


@dataclass(slots=True)
class TreeSimulationConfig:
    target: str | None = None                 # None: the embedded default model
    draft: str | None = None                  # None: the target's shipped draft; "self": the self-draft
    prompt_files: list[Path] | None = None    # None: default_prompt_files()
    limit: int | None = None                  # the first N prompts of each file
    max_new_tokens: int = 128
    budgets: list[int] = field(default_factory=lambda: [64, 256, 1024, 4096])
    draft_bits: int = 4                       # a self-draft's substitutes
    resident_layers: int = 3                  # a self-draft's layers kept as they are (the rest substituted)
    cpu_kernel: str = DEFAULT_CPU_KERNEL       # a GGUF target's products (packed: the int4 kernel)
    growth_temperature: float | None = None   # a self-draft's trees (None: self_draft.growth_temperature's pick)
    checkpoint_dir: Path | None = None        # None: the model cache's tree_simulation folder
    shard: tuple[int, int] | None = None      # (k, n): only the prompts i with i % n == k (one of n processes)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 2 or not self.budgets or min(self.budgets) < 1:
            raise ValueError(f"--max-new-tokens must be >= 2 and --budgets positive, got {self.max_new_tokens} "
                             f"and {self.budgets}")
        if self.resident_layers < 0:
            raise ValueError(f"--resident-layers must be >= 0, got {self.resident_layers}")
        if self.shard is not None and not 0 <= self.shard[0] < self.shard[1]:
            raise ValueError(f"--shard takes K/N with 0 <= K < N, got {self.shard[0]}/{self.shard[1]}")
        SubstituteConfig(self.draft_bits)
        if self.growth_temperature is not None and (not self.growth_temperature > 0 or not self.is_self):
            raise ValueError(f"--growth-temperature takes a positive number, with --draft self; got "
                             f"{self.growth_temperature}")

    @property
    def is_self(self) -> bool:
        return self.draft == SELF_DRAFT

    def key(self, *parts) -> str:
        files = [p.name for p in self.prompt_files or default_prompt_files()]
        text = json.dumps([self.target, self.cpu_kernel, files, self.limit, self.max_new_tokens, *parts])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class Checkpoint:
    """Finished work of a run, one JSON line each, in the model cache: a rerun with the same flags resumes."""

    def __init__(self, name: str, folder: Path | None = None) -> None:
        self.path = (folder or cache_root() / "tree_simulation") / f"{name}.jsonl"
        self.done: dict[str, object] = {}
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                    self.done[entry["key"]] = entry["value"]
                except (ValueError, KeyError, TypeError):
                    continue            # a line cut short by a crash: that item runs again

    def get(self, key: str):
        return self.done.get(key)

    def put(self, key: str, value) -> None:
        self.done[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as out:
            out.write(json.dumps({"key": key, "value": value}) + "\n")


def run_tree_simulation(config: TreeSimulationConfig, on_status: Callable[[str], None] = lambda m: None) -> dict:
    torch.manual_seed(0)
    target = load_model(LoadOptions(config.target, device="cpu", dtype="fp32", cpu_kernel=config.cpu_kernel))
    sources = [(Path(path).name, p) for path in config.prompt_files or default_prompt_files()
               for p in prompts_from_jsonl(path, is_evaluation=True)[:config.limit]]
    prompts = [target.tokenizer.encode_chat(p.messages) for _, p in sources]
    answers = _answers(config, target, prompts, on_status)
    draft, run_one = _drafting(config, target, on_status)
    growth = [] if draft.growth_temperature == 1.0 else [f"growth temperature {draft.growth_temperature}"]
    checkpoint = Checkpoint(config.key(config.draft, config.draft_bits, config.resident_layers, "passes", *growth,
                                       SIMULATION_VERSION), config.checkpoint_dir)
    chosen = [i for i in range(len(prompts)) if config.shard is None or i % config.shard[1] == config.shard[0]]
    files, chosen_answers = [sources[i][0] for i in chosen], [answers[i] for i in chosen]
    rows = []
    for budget in config.budgets:
        done = [_simulated(checkpoint, budget, index, lambda: run_one(prompts[index], answers[index], budget))
                for index in chosen]
        rows.append(_budget_row(budget, files, chosen_answers, done))
        on_status(f"budget {budget}: {rows[-1]['tokens_per_pass']} tokens per pass")
    return {"bench": TREE_SIMULATION, "target": target.path.name, "draft": _draft_name(config, draft),
            "draft_dtype": str(draft.model.dtype).removeprefix("torch."), "cpu_kernel": config.cpu_kernel,
            "growth_temperature": draft.growth_temperature, "simulation_version": SIMULATION_VERSION,
            **({"shard": f"{config.shard[0]}/{config.shard[1]}"} if config.shard else {}),
            "num_prompts": len(chosen),
            "max_new_tokens": config.max_new_tokens, "answer_tokens": sum(len(a) for a in chosen_answers), "rows": rows}


def _simulated(checkpoint: Checkpoint, budget: int, index: int, run: Callable[[], int]) -> dict:
    """{"passes", "seconds"} of one (budget, prompt): from the checkpoint, else simulated and checkpointed."""
    key = f"{budget}/{index}"
    done = checkpoint.get(key)
    if done is None:
        start = time.perf_counter()
        done = {"passes": run(), "seconds": time.perf_counter() - start}
        checkpoint.put(key, done)
    return done


def _budget_row(budget: int, files: list[str], answers: list[list[int]], done: list[dict]) -> dict:
    passes = [item["passes"] for item in done]
    tokens = sum(len(a) - 1 for a in answers)
    return {"budget": budget, "tokens_per_pass": round(tokens / max(sum(passes), 1), 4),
            "tokens_per_pass_by_file": _by_file(files, answers, passes),
            "tokens_per_pass_by_prompt": [round((len(a) - 1) / max(n, 1), 3) for a, n in zip(answers, passes)],
            "draft_seconds": round(sum(item["seconds"] for item in done), 1)}


def _answers(config: TreeSimulationConfig, target, prompts: list[list[int]], on_status) -> list[list[int]]:
    """The target's greedy answers, decoded once per target and prompt set (and kept in the checkpoint)."""
    checkpoint = Checkpoint(config.key("answers"), config.checkpoint_dir)
    answers = checkpoint.get("answers")
    if answers is None or len(answers) != len(prompts):
        on_status(f"greedy answers to {len(prompts)} prompts")
        answers = greedy_answers(Decoder(target.model, target.stop_ids, DecodeConfig(config.max_new_tokens)), prompts)
        checkpoint.put("answers", answers)
    return answers


def _drafting(config: TreeSimulationConfig, target, on_status):
    """(the draft, a function (prompt, answer, budget) -> target passes)."""
    if config.is_self:
        layers = list(range(min(config.resident_layers, target.config.num_layers), target.config.num_layers))
        draft = load_self_draft(target, SubstituteConfig(config.draft_bits), on_status, layers=layers)
        draft.growth_temperature = config.growth_temperature or draft.growth_temperature
        return draft, lambda p, a, budget: simulate_self(draft, target.model, p, a, budget, config.max_new_tokens,
                                                         SELF_DRAFT_MAX_DEPTH, draft.growth_temperature)
    draft = load_any_draft(config.draft or str(default_draft_for(config.target)), target, LoadOptions(device="cpu"))
    return draft, lambda p, a, budget: simulate(draft, p, a, budget, config.max_new_tokens)


def _by_file(files: list[str], answers: list[list[int]], passes: list[int]) -> dict[str, float]:
    """Tokens per pass over each prompt file's prompts (the goal set's chat prompts apart from MT-Bench's)."""
    out = {}
    for name in dict.fromkeys(files):
        chosen = [i for i, file in enumerate(files) if file == name]
        out[name] = round(sum(len(answers[i]) - 1 for i in chosen) / max(sum(passes[i] for i in chosen), 1), 4)
    return out


def _draft_name(config: TreeSimulationConfig, draft) -> str:
    if config.is_self:
        return f"self-{config.draft_bits}bit ({draft.model.layers.num_substitutes} substituted layers)"
    return Path(draft.path).name
