"""The recorded tree simulation against the recorded live `bench spec` run, prompt by prompt (was
bench/simulation_vs_live.py). Greedy verification accepts exactly the tree path that follows the target's
greedy answer, so the simulation's passes must equal the live run's for every prompt both cover: here all
124 chat and MT-Bench prompts at budget 1,024 (bench/results/tree_simulation_all_prompts.json against the
live run's journal, bench/results/spec_all_prompts.journal.jsonl)."""
import json
from pathlib import Path

import textdata
from bench.journal import JOURNAL_FORMAT, read_journal
from bench.spec_bench import BenchPrompt
from offload import Tokenizer
from offload.weights.resolve import resolve_model
from spec.distill.prompts import prompt_turns

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
BUDGET, MODE = 1024, "resident"


def simulated(path: Path, budget: int) -> list[float]:
    """Tokens per pass by prompt at `budget`, in file order (a report, or {"parts": [reports]})."""
    report = json.loads(path.read_text())
    by_prompt = []
    for part in report.get("parts", [report]):
        by_prompt += next(r for r in part["rows"] if r["budget"] == budget)["tokens_per_pass_by_prompt"]
    return by_prompt


def test_the_simulation_counts_the_live_runs_passes_on_every_prompt():
    header, rows = read_journal(RESULTS / "spec_all_prompts.journal.jsonl")
    assert header.get("format") == JOURNAL_FORMAT
    expected = simulated(RESULTS / "tree_simulation_all_prompts.json", BUDGET)
    tokenizer = Tokenizer(resolve_model(None))
    files = [textdata.path(textdata.CHAT_PROMPTS), textdata.path(textdata.MT_BENCH)]
    keys = [BenchPrompt(tokenizer.encode_chat(m), i).key for i, m in enumerate(prompt_turns(files, None))]
    live = {}
    for index, key in enumerate(keys):
        row = rows.get((MODE, key, BUDGET))
        if row is not None:
            stats = row["stats"]
            live[index] = round((stats["num_new_tokens"] - 1) / max(stats["num_steps"], 1), 3)
    assert len(keys) == len(expected) == len(live) == 124
    assert {i: tpp for i, tpp in live.items() if tpp != expected[i]} == {}
