"""The CLI's AutoJudge commands: `judge mine`, `judge train`, `judge eval` (parsers and handlers)."""
from __future__ import annotations

import json
from pathlib import Path

from .flags import add_draft, add_target


def add_parsers(commands) -> None:
    judge = commands.add_parser("judge", help="AutoJudge: mine mismatches, train the judge, evaluate it")
    sub = judge.add_subparsers(dest="judge_command", required=True)
    mine = sub.add_parser("mine", help="label which draft/target mismatches change the final answer")
    _model_flags(mine)
    mine.add_argument("--task", required=True, choices=["gsm8k", "humaneval"], help="task with a checker")
    _unconfined_flag(mine)
    mine.add_argument("--out", type=Path, required=True, help="JSONL file of mined records (appended)")
    mine.add_argument("--limit", type=int, default=None, help="mine only the first N train problems (default: all)")
    mine.add_argument("--max-new-tokens", type=int, default=256, help="response length (default: 256)")
    mine.add_argument("--batch-size", type=int, default=16, help="problems continued per batch (default: 16)")
    mine.add_argument("--max-mismatches", type=int, default=32,
                      help="mismatches labelled per problem, in order (default: 32)")
    mine.add_argument("--resume", action="store_true", help="skip problems already in --out (default: off)")
    train = sub.add_parser("train", help="fit the judge on mined records")
    train.add_argument("--data", type=Path, nargs="+", required=True, help="mined JSONL files")
    train.add_argument("--out", type=Path, required=True, help="judge file to write (.safetensors)")
    add_target(train, "the target the records were mined with (default: embedded)")
    evaluate = sub.add_parser("eval", help="judge vs lossless speculation: tokens per pass, agreement, accuracy")
    _model_flags(evaluate)
    evaluate.add_argument("--task", required=True, choices=["gsm8k", "humaneval"], help="task with a checker")
    _unconfined_flag(evaluate)
    evaluate.add_argument("--judge", default="default", help="judge file or 'default' (default: default)")
    evaluate.add_argument("--data", type=Path, default=None, help="problems file replacing the test split")
    evaluate.add_argument("--limit", type=int, default=30, help="problems (default: 30)")
    evaluate.add_argument("--budget", type=int, default=16, help="tree budget for every setting (default: 16)")
    evaluate.add_argument("--max-new-tokens", type=int, default=256, help="response length (default: 256)")
    evaluate.add_argument("--thresholds", default=None, help="comma-separated thresholds (default: the judge's table)")
    evaluate.add_argument("--json", action="store_true", help="print only JSON")
    evaluate.add_argument("--record", action="store_true",
                          help="store this evaluation in the judge file, which --judge reports at start (default: off)")


def _unconfined_flag(parser) -> None:
    parser.add_argument("--unconfined-code", action="store_true",
                        help="humaneval: run model-written programs WITHOUT the OS sandbox (resource limits only), "
                             "where this machine cannot sandbox them (default: off: refuse)")


def _model_flags(parser) -> None:
    add_target(parser, "target (default: embedded model)")
    add_draft(parser, "draft (default: the target's shipped draft)")


def _pair(args, console):
    from offload import LoadOptions
    from runtime.models import load_model
    from spec import default_draft_for, load_any_draft
    target = load_model(LoadOptions(args.target, max_context=2048), on_status=lambda m: console.print(f"[dim]{m}[/dim]"))
    draft_spec = args.draft or default_draft_for(args.target)
    if draft_spec is None:
        raise ValueError("this target has no shipped draft: give --draft")
    return target, load_any_draft(str(draft_spec), target, LoadOptions(max_context=2048))


def cmd_judge(args, console) -> int:
    return {"mine": _mine, "train": _train, "eval": _eval}[args.judge_command](args, console)


def _mine(args, console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from judge.mine import MineConfig, mine
    from judge.tasks import get_task
    if args.out.exists() and not args.resume:
        raise ValueError(f"{args.out} exists: pass --resume to continue it, or choose a new file")
    task = get_task(args.task, args.unconfined_code)
    problems = task.problems("train", on_skip=lambda m: console.print(f"[yellow]skipped {m}[/yellow]"))[:args.limit]
    target, draft = _pair(args, console)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("mining", total=len(problems))

        def on_progress(counts: dict) -> None:
            progress.update(bar, completed=counts["problems"], description=f"mining: {counts['important']} important, "
                                                                            f"{counts['unimportant']} unimportant")

        counts = mine(target, draft, task, problems, args.out, MineConfig(args.max_new_tokens, args.batch_size, args.max_mismatches),
                      on_progress)
    print(json.dumps(counts))
    return 0


def _train(args, console) -> int:
    from judge.train import train_judge
    from offload.weights.resolve import resolve_model
    from offload.model.config import ModelConfig
    from offload.weights.formats import dense_source
    from spec.draft_folder import embedding_fingerprint
    for path in args.data:
        if not path.is_file():
            raise FileNotFoundError(f"mined file not found: {path}")
    folder = resolve_model(args.target)
    embed = dense_source(folder, ModelConfig.from_file(folder)).global_tensors()["embed"]
    judge, report = train_judge(args.data, embedding_fingerprint(embed))
    judge.save(args.out)
    console.print(f"judge: out-of-fold ROC-AUC {report['roc_auc']:.3f} ({report['folds']} folds by problem), "
                  f"{report['records']} mismatches ({report['important_share']:.0%} important)")
    print(json.dumps(report))
    return 0


def _eval(args, console) -> int:
    from judge.evaluate import EvalConfig, evaluate_judge
    from judge.policy import check_threshold, judge_path, load_judge_for
    from judge.tasks import get_task
    task = get_task(args.task, args.unconfined_code)
    split_file = args.data
    problems = task.problems("test", split_file, on_skip=lambda m: console.print(f"[yellow]skipped {m}[/yellow]"))
    problems = problems[:args.limit]
    target, draft = _pair(args, console)
    judge = load_judge_for(args.judge, target.model.embed, target.config.hidden_size)
    thresholds = [float(t) for t in args.thresholds.split(",")] if args.thresholds else \
        [round(float(t), 4) for t in judge.thresholds[:, 1]]
    for threshold in thresholds:              # checked before the long lossless run
        check_threshold(threshold)
    result = evaluate_judge(target, draft, judge, task, problems, thresholds,
                            EvalConfig(args.budget, args.max_new_tokens),
                            on_status=lambda m: console.print(f"[dim]{m}[/dim]"))
    if not args.json:
        _print_table(result, console)
    if args.record:
        from judge.classifier import record_evaluation
        from judge.held_out import HeldOutEvaluation
        record_evaluation(judge_path(args.judge), HeldOutEvaluation.from_eval_result(result))
        console.print(f"[dim]evaluation recorded in {judge_path(args.judge)}[/dim]", highlight=False)
    print(json.dumps(result))
    return 0


def _print_table(result: dict, console) -> None:
    from rich.table import Table
    table = Table(title=f"judge eval: {result['task']}, {result['problems']} problems, budget {result['budget']}")
    for column in ("setting", "tokens/pass", "agreement", "accuracy", "tok/s"):
        table.add_column(column)
    rows = [("lossless", result["lossless"])] + [(f"p < {r['threshold']:.3f}", r) for r in result["thresholds"]]
    for name, row in rows:
        table.add_row(name, f"{row['tokens_per_pass']:.2f}", f"{row['answer_agreement']:.1%}", f"{row['accuracy']:.1%}",
                      f"{row['tokens_per_second']:.1f}")
    console.print(table)


COMMANDS = {"judge": cmd_judge}
