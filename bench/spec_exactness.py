"""Greedy speculation vs target-only greedy decoding, token for token, on every chat prompt and every
MT-Bench first turn (the default pair unless --target / --draft say otherwise).

    .venv/bin/python bench/spec_exactness.py [--max-new-tokens 128] [--budgets 16,auto]
Prints one JSON line per prompt and budget, then a summary line; exits 1 on any mismatch.
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
from perf.probe import auto_budget  # noqa: E402
from spec import (DecodeConfig, Decoder, FixedBudget, SamplingConfig, Speculator, default_draft_for,  # noqa: E402
                  load_any_draft)
from perf.tree_size import parse_budget  # noqa: E402

PROMPT_FILES = [ROOT / "textdata/chat/prompts.jsonl", ROOT / "textdata/mt_bench/question.jsonl"]


def prompts() -> list[tuple[str, str]]:
    out = []
    for path in PROMPT_FILES:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out.append((str(row.get("id", row.get("question_id"))), row.get("prompt") or row["turns"][0]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budgets", default="16,auto")
    parser.add_argument("--target", default=None)
    parser.add_argument("--draft", default=None)
    args = parser.parse_args()
    budgets = [parse_budget(b) for b in args.budgets.split(",")]
    max_budget = max([b for b in budgets if b] + [1024])
    target = load_model(LoadOptions(args.target, device="cpu", dtype="fp32", max_context=2048,
                                    max_pass_tokens=max(512, max_budget)))
    draft = load_any_draft(args.draft or str(default_draft_for(args.target)), target,
                           LoadOptions(device="cpu", max_context=2048))
    config = DecodeConfig(args.max_new_tokens, 2048, max_pass_tokens=max(512, max_budget))
    reference = Decoder(target.model, target.stop_ids, config)
    decoders = {b: Decoder(target.model, target.stop_ids, config, Speculator(draft, 2048, b or max_budget),
                           FixedBudget(b) if b else auto_budget(target, max_budget)) for b in budgets}
    identical = {b: 0 for b in budgets}
    all_prompts = prompts()
    for prompt_id, text in all_prompts:
        ids = target.tokenizer.encode_chat([{"role": "user", "content": text}])
        expected = reference.generate(ids, SamplingConfig()).token_ids
        for budget, decoder in decoders.items():
            result = decoder.generate(ids, SamplingConfig())
            same = result.token_ids == expected
            identical[budget] += same
            print(json.dumps({"id": prompt_id, "budget": budget or "auto", "identical": same,
                              "num_tokens": len(expected), "tokens_per_pass": round(result.stats.tokens_per_pass, 3)}),
                  flush=True)
    print(json.dumps({"prompts": len(all_prompts), "max_new_tokens": args.max_new_tokens,
                      "identical": {str(b or "auto"): n for b, n in identical.items()}}))
    return 0 if all(n == len(all_prompts) for n in identical.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
