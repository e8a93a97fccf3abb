"""Batched vs alone, token for token: every shared chat prompt answered greedily by the default pair (or
--target / --draft) one at a time (Decoder), then all together in a packed batch (BatchDecoder), with and
without speculation; each answer must be identical.

    .venv/bin/python bench/batch_exactness.py [--limit 8] [--batch-size 4] [--max-new-tokens 64] [--budget 16]
Prints one JSON line per prompt and mode, then a summary line; exits 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from offload import LoadOptions  # noqa: E402
from runtime.models import load_model  # noqa: E402
from spec import (DecodeConfig, Decoder, FixedBudget, SamplingConfig, Speculator, default_draft_for,  # noqa: E402
                  load_any_draft)
from spec.batch_speculator import BatchSpeculator  # noqa: E402
from spec.batched import BatchConfig, BatchDecoder, BatchRequest, FixedShare  # noqa: E402

PROMPTS = ROOT / "textdata/chat/prompts.jsonl"
CONTEXT, PASS = 2048, 512


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts (default: all)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budget", type=int, default=16, help="tree tokens per pass, shared by the batch")
    parser.add_argument("--target", default=None)
    parser.add_argument("--draft", default=None)
    args = parser.parse_args()
    target = load_model(LoadOptions(args.target, device="cpu", dtype="fp32", max_context=CONTEXT,
                                    max_pass_tokens=PASS, num_sequences=args.batch_size))
    draft = load_any_draft(args.draft or str(default_draft_for(args.target)), target,
                           LoadOptions(device="cpu", max_context=CONTEXT))
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()][:args.limit]
    prompts = [target.tokenizer.encode_chat([{"role": "user", "content": row["prompt"]}]) for row in rows]
    summary = {"prompts": len(prompts), "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens}
    for name, budget in (("autoregressive", 1), ("speculative", args.budget)):
        expected, alone_seconds = _alone(target, draft, prompts, budget, args.max_new_tokens)
        got, batch_seconds = _batched(target, draft, prompts, budget, args)
        for row, want, have in zip(rows, expected, got):
            print(json.dumps({"id": row["id"], "mode": name, "identical": want == have, "num_tokens": len(want)}),
                  flush=True)
        summary[name] = {"identical": sum(w == h for w, h in zip(expected, got)),
                         "alone_seconds": round(alone_seconds, 2), "batched_seconds": round(batch_seconds, 2)}
    print(json.dumps(summary))
    return 0 if all(summary[m]["identical"] == len(prompts) for m in ("autoregressive", "speculative")) else 1


def _alone(target, draft, prompts, budget, max_new_tokens) -> tuple[list[list[int]], float]:
    speculator = Speculator(draft, CONTEXT, budget, PASS) if budget > 1 else None
    decoder = Decoder(target.model, target.stop_ids, DecodeConfig(max_new_tokens, CONTEXT, PASS), speculator,
                      FixedBudget(budget))
    start, answers = time.perf_counter(), []
    for ids in prompts:
        decoder.reset()
        answers.append(decoder.generate(ids, SamplingConfig()).token_ids)
    return answers, time.perf_counter() - start


def _batched(target, draft, prompts, budget, args) -> tuple[list[list[int]], float]:
    speculator = BatchSpeculator(draft, args.batch_size, CONTEXT, PASS, PASS) if budget > 1 else None
    decoder = BatchDecoder(target.model, target.stop_ids, BatchConfig(args.batch_size, CONTEXT, PASS), speculator,
                           FixedShare(budget * args.batch_size))
    answers: dict[int, list[int]] = {}
    requests = [BatchRequest(ids, SamplingConfig(), args.max_new_tokens, tag=i) for i, ids in enumerate(prompts)]
    start = time.perf_counter()
    decoder.run(requests, lambda request, result, error: answers.__setitem__(request.tag, result.token_ids))
    return [answers[i] for i in range(len(prompts))], time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
