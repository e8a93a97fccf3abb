"""distill: train a draft model that shares the target's tokenizer (resumable)."""
from __future__ import annotations

import json
from pathlib import Path

from .flags import add_device, add_dtype, add_target


def add_parsers(commands) -> None:
    distill = commands.add_parser("distill", help="train a draft model that shares the target's tokenizer")
    add_target(distill, "target model (default: embedded model)")
    distill.add_argument("--out", type=Path, required=True, help="draft folder to write (training state inside)")
    distill.add_argument("--kind", default="small", choices=["small", "early-exit"],
                         help="small: new layers only; early-exit: the target's first layers frozen + new ones")
    distill.add_argument("--layers", type=int, default=3, help="draft decoder layers (default: 3)")
    distill.add_argument("--reuse-layers", type=int, default=0,
                         help="early-exit: how many of --layers are frozen target layers (default: 0)")
    distill.add_argument("--vocab-top", type=int, default=4096,
                         help="draft output vocabulary: the K most frequent target tokens (default: 4096)")
    distill.add_argument("--data", type=Path, nargs="*", default=[],
                         help="extra training prompts (JSONL) or text/code files (default: none)")
    distill.add_argument("--template-prompts", type=int, default=8000,
                         help="synthetic chat prompts answered by the target (default: 8000)")
    distill.add_argument("--self-prompts", type=int, default=2480,
                         help="prompts the target writes itself, then answers (default: 2480)")
    distill.add_argument("--gsm8k-prompts", type=int, default=1000, help="GSM8K train questions (default: 1000)")
    distill.add_argument("--sampled-prompts", type=int, default=600,
                         help="prompts also answered with sampling at temperature 0.8 (default: 600)")
    distill.add_argument("--init-draft", type=Path, default=None,
                         help="start from this trained draft: its layers and head rows; new tokens join its "
                              "vocabulary up to --vocab-top (default: start from the target's layers)")
    distill.add_argument("--head-only", action="store_true",
                         help="with --init-draft: train only the head rows and biases (default: off)")
    distill.add_argument("--batch-size", type=int, default=64,
                         help="target answers generated together while collecting; a GPU takes 256+ (default: 64)")
    distill.add_argument("--batch-tokens", type=int, default=4096, help="training tokens per step (default: 4096)")
    distill.add_argument("--steps", type=int, default=3000, help="training steps (default: 3000)")
    distill.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default: 2e-3)")
    distill.add_argument("--resume", action="store_true", help="continue the run in --out (default: off)")
    distill.add_argument("--revocab", action="store_true",
                         help="with --resume: re-choose the output vocabulary on the grown corpus, keeping "
                              "trained rows (default: off)")
    add_device(distill)
    add_dtype(distill, "the target's dtype while collecting answers (default: auto)")


def cmd_distill(args, console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from runtime.models import weight_formats
    from spec.distill import DistillConfig, distill
    from spec.distill.generate import GenerationConfig
    config = DistillConfig(args.target, args.out, args.kind, args.layers, args.reuse_layers, args.vocab_top,
                           list(args.data), num_steps=args.steps, batch_tokens=args.batch_tokens,
                           generation=GenerationConfig(batch_size=args.batch_size), resume=args.resume,
                           revocab=args.revocab,
                           device=args.device, dtype=args.dtype, num_template_prompts=args.template_prompts,
                           num_self_prompts=args.self_prompts, max_gsm8k_prompts=args.gsm8k_prompts,
                           num_sampled_prompts=args.sampled_prompts, init_draft=args.init_draft,
                           head_only=args.head_only, learning_rate=args.lr, formats=weight_formats())
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("distill", total=None)

        def on_progress(event: dict) -> None:
            if event.get("phase") == "train":
                text = f"train loss {event.get('loss', 0):.3f} agreement {event.get('agreement', 0):.3f}"
                progress.update(task, description=text, completed=event["step"], total=event["num_steps"])
            elif "done" in event:
                progress.update(task, description=event["phase"], completed=event["done"], total=event["total"])

        summary = distill(config, on_progress)
    print(json.dumps(summary))
    return 0


COMMANDS = {"distill": cmd_distill}
