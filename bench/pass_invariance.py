"""Does a pass over many tokens compute what one-token passes compute? Greedy speculation is token-identical
to one-token greedy decoding only if the target's choice at a tree node is the one a one-token pass would
make. In fp32 the two differ by ~1e-5 in the logits and never change a choice; in bf16 every matmul and
attention output is rounded to 8 bits of mantissa, a different accumulation order (another kernel or
blocking for another number of tokens) rounds differently, and the choice flips wherever the top two
logits are that close. This measures how often.

Per prompt: decode `--tokens` tokens greedily one token per pass, recording each pass's logits; then
recompute the same positions in one block pass (the work of a chain-shaped tree) and compare row by row.

    .venv/bin/python bench/pass_invariance.py --dtype bf16 --limit 4
Prints the JSON report: the largest logit difference, choices that flip, and the one-token pass's margin
between its top two logits at each flip.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from offload import LoadOptions  # noqa: E402
from runtime.models import load_model  # noqa: E402
from offload.devices import DTYPE_CHOICES, dtype_name  # noqa: E402
from spec.distill.prompts import prompts_from_jsonl  # noqa: E402
from offload.model.pass_check import compare_passes  # noqa: E402

PROMPT_FILES = [ROOT / "textdata/chat/prompts.jsonl", ROOT / "textdata/mt_bench/question.jsonl"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default=None, help="target (default: the embedded model)")
    parser.add_argument("--prompts", type=Path, nargs="+", default=PROMPT_FILES, help="prompt JSONL files")
    parser.add_argument("--limit", type=int, default=4, help="first N prompts of each file (default: 4)")
    parser.add_argument("--tokens", type=int, default=64, help="positions compared per prompt (default: 64)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="bf16")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    target = load_model(LoadOptions(args.target, device=args.device, dtype=args.dtype,
                                    max_pass_tokens=max(512, args.tokens)))
    prompts = [target.tokenizer.encode_chat(p.messages) for path in args.prompts
               for p in prompts_from_jsonl(path, is_evaluation=True)[:args.limit]]
    rows = [compare_passes(target.model, ids, args.tokens) for ids in prompts]
    margins = sorted(m for row in rows for m in row["margins_at_flips"])
    print(json.dumps({"bench": "pass-invariance", "target": target.path.name, "device": str(target.model.device),
                      "dtype": dtype_name(target.model.dtype), "prompts": len(rows), "tokens_per_prompt": args.tokens,
                      "positions": sum(r["positions"] for r in rows), "flips": sum(r["flips"] for r in rows),
                      "max_logit_difference": round(max(r["max_logit_difference"] for r in rows), 5),
                      "largest_margin_at_a_flip": margins[-1] if margins else None, "margins_at_flips": margins}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
