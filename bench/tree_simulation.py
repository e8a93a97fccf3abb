"""`bench tree-simulation`: tokens per pass of greedy tree speculation at any budget, from draft work alone.

Greedy verification accepts exactly the longest root path of the tree that follows the target's own
greedy continuation, then adds the target's next token. So once the target's greedy answers are known
(decoded once, one token per pass), every budget's tokens per pass follows from growing the same trees
with the real growth code and matching them against those answers: no target pass over the tree. On 2
CPU cores a target pass over 4,096 tree tokens takes ~30 s, so this is how budgets of the GPU regime
are measured here on many prompts. tests/test_speculative.py checks it against real speculative decoding,
tests/test_simulation_vs_live.py against a recorded live `bench spec` run.

    specstream bench tree-simulation --budgets 1024,2048,4096 --limit 4 --max-new-tokens 128
Prompt files (default: the 44 chat prompts and the MT-Bench first turns; `--limit` takes the first N of
each). The JSON report is an acceptance source `plan --acceptance` reads (perf/result_formats.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import textdata
from offload import LoadOptions
from perf.result_formats import TREE_SIMULATION
from runtime.models import load_model
from spec import DecodeConfig, Decoder, default_draft_for, load_any_draft
from spec.simulation import greedy_answers, simulate
from spec.distill.prompts import prompts_from_jsonl

def default_prompt_files() -> list[Path]:
    return [textdata.path(textdata.CHAT_PROMPTS), textdata.path(textdata.MT_BENCH)]


@dataclass(slots=True)
class TreeSimulationConfig:
    target: str | None = None                 # None: the embedded default model
    draft: str | None = None                  # None: the target's shipped draft
    prompt_files: list[Path] | None = None    # None: default_prompt_files()
    limit: int | None = None                  # the first N prompts of each file
    max_new_tokens: int = 128
    budgets: list[int] = field(default_factory=lambda: [64, 256, 1024, 4096])

    def __post_init__(self) -> None:
        if self.max_new_tokens < 2 or not self.budgets or min(self.budgets) < 1:
            raise ValueError(f"--max-new-tokens must be >= 2 and --budgets positive, got {self.max_new_tokens} "
                             f"and {self.budgets}")


def run_tree_simulation(config: TreeSimulationConfig, on_status: Callable[[str], None] = lambda m: None) -> dict:
    torch.manual_seed(0)
    target = load_model(LoadOptions(config.target, device="cpu", dtype="fp32"))
    draft = load_any_draft(config.draft or str(default_draft_for(config.target)), target, LoadOptions(device="cpu"))
    prompts = [target.tokenizer.encode_chat(p.messages) for path in config.prompt_files or default_prompt_files()
               for p in prompts_from_jsonl(path, is_evaluation=True)[:config.limit]]
    on_status(f"greedy answers to {len(prompts)} prompts")
    answers = greedy_answers(Decoder(target.model, target.stop_ids, DecodeConfig(config.max_new_tokens)), prompts)
    rows = []
    for budget in config.budgets:
        start = time.perf_counter()
        passes = [simulate(draft, p, a, budget, config.max_new_tokens) for p, a in zip(prompts, answers)]
        tokens = sum(len(a) - 1 for a in answers)
        rows.append({"budget": budget, "tokens_per_pass": round(tokens / max(sum(passes), 1), 4),
                     "tokens_per_pass_by_prompt": [round((len(a) - 1) / max(n, 1), 3) for a, n in zip(answers, passes)],
                     "draft_seconds": round(time.perf_counter() - start, 1)})
        on_status(f"budget {budget}: {rows[-1]['tokens_per_pass']} tokens per pass")
    return {"bench": TREE_SIMULATION, "target": target.path.name, "draft": Path(draft.path).name,
            "draft_dtype": str(draft.model.dtype).removeprefix("torch."), "num_prompts": len(prompts),
            "max_new_tokens": config.max_new_tokens, "answer_tokens": sum(len(a) for a in answers), "rows": rows}
