"""Checks tree_simulation.py's tokens per pass against a live `bench spec` run, prompt by prompt.

Greedy verification accepts exactly the tree path that follows the target's greedy answer, so the
simulation's count of passes must equal the live run's for every prompt both cover. Reads the live
run's journal (`~/.cache/specstream/bench_journal/spec-*.jsonl`, or a copy in bench/results) and the
simulation's JSON reports, in the order of the prompt files the live run was given:

    python bench/simulation_vs_live.py --journal bench/results/spec_all_prompts.journal.jsonl \
        --simulation bench/results/tree_simulation_all_prompts.json --budget 1024 \
        --prompts textdata/chat/prompts.jsonl textdata/mt_bench/question.jsonl
Prints one JSON object: prompts compared, how many agree, and each that does not.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from offload import Tokenizer  # noqa: E402
from offload.weights.resolve import resolve_model  # noqa: E402
from bench.journal import JOURNAL_FORMAT, read_journal  # noqa: E402
from bench.spec_bench import BenchPrompt  # noqa: E402
from spec.distill.prompts import prompt_turns  # noqa: E402


def journal_rows(path: Path) -> dict[tuple, dict]:
    header, rows = read_journal(path)
    if header.get("format") != JOURNAL_FORMAT:
        raise SystemExit(f"error: {path} is not a bench journal ({JOURNAL_FORMAT})")
    return rows


def simulated(paths: list[Path], budget: int) -> list[float]:
    """Tokens per pass by prompt at `budget`, in file order (a report, or {"parts": [reports]})."""
    by_prompt = []
    for path in paths:
        report = json.loads(path.read_text())
        for part in report.get("parts", [report]):
            row = next((r for r in part["rows"] if r["budget"] == budget), None)
            if row is None:
                raise SystemExit(f"error: {path} has no row at budget {budget}")
            by_prompt += row["tokens_per_pass_by_prompt"]
    return by_prompt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--journal", type=Path, required=True)
    parser.add_argument("--simulation", type=Path, nargs="+", required=True)
    parser.add_argument("--prompts", type=Path, nargs="+", required=True, help="the live run's prompt files, in order")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--mode", default="resident")
    args = parser.parse_args()
    rows, expected = journal_rows(args.journal), simulated(args.simulation, args.budget)
    tokenizer = Tokenizer(resolve_model(None))
    keys = [BenchPrompt(tokenizer.encode_chat(m), i).key for i, m in enumerate(prompt_turns(args.prompts, None))]
    compared, differing = 0, []
    for index, (key, simulated_tpp) in enumerate(zip(keys, expected)):
        live = rows.get((args.mode, key, args.budget))
        if live is None:
            continue
        stats = live["stats"]
        live_tpp = round((stats["num_new_tokens"] - 1) / max(stats["num_steps"], 1), 3)
        compared += 1
        if live_tpp != simulated_tpp:
            differing.append({"prompt": index, "live": live_tpp, "simulated": simulated_tpp})
    print(json.dumps({"budget": args.budget, "prompts_given": len(keys), "prompts_compared": compared,
                      "equal": compared - len(differing), "differing": differing}))
    return 0 if compared and not differing else 1


if __name__ == "__main__":
    sys.exit(main())
