"""Tokens per pass of greedy tree speculation at any budget, from draft work alone.

Greedy verification accepts exactly the longest root path of the tree that follows the target's own
greedy continuation, then adds the target's next token. So once the target's greedy answers are known
(decoded once, one token per pass), every budget's tokens per pass follows from growing the same trees
with the real growth code and matching them against those answers: no target pass over the tree. On 2
CPU cores a target pass over 4,096 tree tokens takes ~30 s, so this is how budgets of the GPU regime
are measured here on many prompts. A test checks it against real speculative decoding.

    .venv/bin/python bench/tree_simulation.py --budgets 1024,2048,4096 --limit 4 --max-new-tokens 128
Prompt files (default: the 44 chat prompts and the MT-Bench first turns; `--limit` takes the first N of
each). Prints one JSON line per budget, then the JSON report.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from offload import LoadOptions  # noqa: E402
from runtime.models import load_model  # noqa: E402
from spec import DecodeConfig, Decoder, default_draft_for, load_any_draft  # noqa: E402
from spec.simulation import greedy_answers, simulate  # noqa: E402
from spec.distill.prompts import prompts_from_jsonl  # noqa: E402

PROMPT_FILES = [ROOT / "textdata/chat/prompts.jsonl", ROOT / "textdata/mt_bench/question.jsonl"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default=None, help="target (default: the embedded model)")
    parser.add_argument("--draft", default=None, help="draft (default: the target's shipped draft)")
    parser.add_argument("--prompts", type=Path, nargs="+", default=PROMPT_FILES, help="prompt JSONL files")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of each file (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budgets", default="64,256,1024,4096")
    args = parser.parse_args()
    torch.manual_seed(0)
    budgets = [int(b) for b in args.budgets.split(",")]
    target = load_model(LoadOptions(args.target, device="cpu", dtype="fp32"))
    draft = load_any_draft(args.draft or str(default_draft_for(args.target)), target, LoadOptions(device="cpu"))
    prompts = [target.tokenizer.encode_chat(p.messages) for path in args.prompts
               for p in prompts_from_jsonl(path, is_evaluation=True)[:args.limit]]
    answers = greedy_answers(Decoder(target.model, target.stop_ids, DecodeConfig(args.max_new_tokens)), prompts)
    rows = []
    for budget in budgets:
        start = time.perf_counter()
        passes = [simulate(draft, p, a, budget, args.max_new_tokens) for p, a in zip(prompts, answers)]
        tokens = sum(len(a) - 1 for a in answers)
        rows.append({"budget": budget, "tokens_per_pass": round(tokens / max(sum(passes), 1), 4),
                     "tokens_per_pass_by_prompt": [round((len(a) - 1) / max(n, 1), 3) for a, n in zip(answers, passes)],
                     "draft_seconds": round(time.perf_counter() - start, 1)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"bench": "tree-simulation", "target": target.path.name, "draft": Path(draft.path).name,
                      "draft_dtype": str(draft.model.dtype).removeprefix("torch."), "num_prompts": len(prompts),
                      "max_new_tokens": args.max_new_tokens, "answer_tokens": sum(len(a) for a in answers),
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
