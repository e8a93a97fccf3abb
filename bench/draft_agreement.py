"""Draft quality and cost against its target (what `cli.py bench draft` runs), as a script.

    .venv/bin/python bench/draft_agreement.py [--target T] [--draft D] \
        --prompts textdata/chat/prompts.jsonl --prompts textdata/mt_bench/question.jsonl
Prompt files: JSONL with `prompt`, `question`, `instruction` or `turns` (the first turn is used).
Prints one summary line, then the JSON report (top1_agreement, rank_acceptance k=1..8, cost_ratio).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from offload import LoadOptions  # noqa: E402
from runtime.models import load_model  # noqa: E402
from offload.devices import DEVICE_NAMES, DTYPE_CHOICES  # noqa: E402
from bench.draft_bench import DraftBenchConfig, bench_draft  # noqa: E402
from spec.draft import default_draft_for, load_draft  # noqa: E402
from spec.distill.prompts import prompts_from_jsonl  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default=None, help="target model (default: the embedded default)")
    parser.add_argument("--draft", default=None, help="draft folder (default: the shipped draft of the target)")
    parser.add_argument("--prompts", type=Path, action="append", required=True, help="prompt JSONL (repeatable)")
    parser.add_argument("--max-prompts", type=int, default=None, help="first N prompts of each file")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--device", default="auto", choices=DEVICE_NAMES)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    draft_folder = args.draft or default_draft_for(args.target)
    if draft_folder is None:
        parser.error("no --draft given and no shipped draft for this target")
    target = load_model(LoadOptions(args.target, args.device, args.dtype))
    draft = load_draft(LoadOptions(str(draft_folder), args.device, args.dtype), embed=target.model.embed)
    prompts = [p.messages for path in args.prompts
               for p in prompts_from_jsonl(path, is_evaluation=True)[:args.max_prompts]]
    report = bench_draft(target, draft, prompts, DraftBenchConfig(args.max_new_tokens, args.batch_size),
                         on_progress=lambda e: print(f"{e['done']}/{e['total']} agreement {e['top1_agreement']:.3f}",
                                                     file=sys.stderr, flush=True))
    report.update(target=str(target.path), draft=str(draft_folder), dtype=str(target.model.dtype),
                  threads=torch.get_num_threads())
    print(f"draft top-1 agreement {report['top1_agreement']:.3f} over {report['num_answer_tokens']} answer tokens; "
          f"cost ratio {report['cost_ratio']:.3f}; estimated speed-up {report['estimated_speedup']:.2f}x "
          f"(chain {report['best_chain_length']})")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
