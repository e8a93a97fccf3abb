"""The CLI's tool commands: plan (where a model would live), distill (train a draft), bench (JSON
benchmarks). Parsers and handlers; cli.py wires them next to run/chat/batch."""
from __future__ import annotations

import json
from pathlib import Path

from offload.devices import DEVICE_NAMES, DTYPE_CHOICES, DTYPES


def add_tool_parsers(commands) -> None:
    from runtime.judge_cli import add_judge_parsers
    from runtime.quant_cli import add_quant_parsers
    _add_plan_parser(commands)
    _add_distill_parser(commands)
    add_quant_parsers(commands)
    add_judge_parsers(commands)
    _add_bench_parsers(commands.add_parser("bench", help="benchmarks (print JSON)").add_subparsers(
        dest="bench", required=True))


def _add_plan_parser(commands) -> None:
    plan = commands.add_parser("plan", help="show where each part of a model would live (config.json is enough)")
    plan.add_argument("--target", default=None, help="model folder, config.json folder, .gguf or Hub id "
                                                     "(default: embedded model)")
    plan.add_argument("--draft", default=None, help="draft model folder (kept on the device) (default: none)")
    plan.add_argument("--gpu-mem", default=None, help="device budget, e.g. 24GiB (default: free memory - margin)")
    plan.add_argument("--ram", default=None, help="host budget, e.g. 64GiB (default: available RAM - margin)")
    plan.add_argument("--budget", type=int, default=2048, help="largest speculation tree, tokens (default: 2048)")
    plan.add_argument("--context", type=int, default=4096, help="context length, tokens (default: 4096)")
    plan.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="weight dtype (default: bf16)")
    plan.add_argument("--device", default="auto", choices=DEVICE_NAMES, help="device (default: auto)")
    plan.add_argument("--ring", type=int, default=2, help="layer buffers in the prefetch ring (default: 2)")
    plan.add_argument("--link-gbps", type=float, default=None,
                      help="host->device GB/s for the prediction (default: measured now)")
    plan.add_argument("--disk-gbps", type=float, default=None, help="disk GB/s for the prediction (default: measured now)")
    plan.add_argument("--weights", default=None, choices=["spqr-w3", "spqr-w4", "spqr-w4-g32"],
                      help="plan packed SpQR decoder layers (expected bits per parameter; -g32: groups of 32) "
                           "(default: --dtype)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")


def _add_distill_parser(commands) -> None:
    distill = commands.add_parser("distill", help="train a draft model that shares the target's tokenizer")
    distill.add_argument("--target", default=None, help="target model (default: embedded model)")
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
    distill.add_argument("--device", default="auto", choices=DEVICE_NAMES, help="device (default: auto)")
    distill.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                         help="the target's dtype while collecting answers (default: auto)")


def _add_bench_parsers(benches) -> None:
    from runtime.quant_cli import add_bench_quant_parser
    add_bench_quant_parser(benches)
    draft = benches.add_parser("draft", help="draft vs target: top-1 agreement, rank acceptance, cost per token")
    draft.add_argument("--target", default=None, help="target (default: embedded model)")
    draft.add_argument("--draft", default=None, help="draft folder (default: the target's shipped draft)")
    draft.add_argument("--prompts", type=Path, nargs="+", required=True,
                       help='JSONL files: lines with "prompt", MT-Bench "turns" (first turn) or "question"')
    draft.add_argument("--max-new-tokens", type=int, default=256, help="target answer length (default: 256)")
    draft.add_argument("--limit", type=int, default=None, help="use only the first N prompts (default: all)")
    draft.add_argument("--answers-cache", type=Path, default=None,
                       help="JSONL file keeping the answers, reused by later runs (default: none)")
    draft.add_argument("--answers-by", default=None, metavar="MODEL",
                       help="read MODEL's greedy answers instead of the target's own, the target's argmax "
                            "there as its tokens: compares targets (e.g. SpQR vs reference) on the same text")
    draft.add_argument("--json", action="store_true", help="print only JSON")
    stream = benches.add_parser("stream", help="pass time vs raw tier bandwidth for several pass sizes")
    stream.add_argument("--target", default=None, help="model (default: embedded model)")
    stream.add_argument("--gpu-mem", required=True, help="device budget that forces streaming, e.g. 450MiB")
    stream.add_argument("--tier", default="ram", choices=["ram", "disk"], help="tier to stream from (default: ram)")
    stream.add_argument("--tokens", default="1,16,64,256,1024", help="pass sizes (default: 1,16,64,256,1024)")
    stream.add_argument("--device", default="auto", choices=DEVICE_NAMES, help="device (default: auto)")
    stream.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="(default: auto)")
    stream.add_argument("--repeats", type=int, default=3, help="measured passes per size, best kept (default: 3)")
    stream.add_argument("--json", action="store_true", help="print only JSON")
    _add_bench_spec_parser(benches)


def _add_bench_spec_parser(benches) -> None:
    spec = benches.add_parser("spec", help="speculation by budget vs autoregressive vs transformers assisted generation")
    spec.add_argument("--target", default=None, help="target (default: embedded model)")
    spec.add_argument("--draft", default=None, help="draft (default: the target's shipped draft)")
    spec.add_argument("--prompts", type=Path, nargs="+", required=True,
                      help='JSONL files: lines with "prompt", MT-Bench "turns" (first turn) or "question"')
    spec.add_argument("--limit", type=int, default=None,
                      help="use only the first N prompts of each file (default: all)")
    spec.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer (default: 256)")
    spec.add_argument("--budgets", default="1,4,16,64,256,1024,4096",
                      help="fixed tree budgets to measure (default: 1,4,16,64,256,1024,4096)")
    spec.add_argument("--modes", default="resident,disk-cold",
                      help="resident and/or disk-cold (layers streamed from disk, page cache dropped each pass) "
                           "(default: resident,disk-cold)")
    spec.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    spec.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0 = off)")
    spec.add_argument("--seed", type=int, default=0, help="sampling seed; prompt i uses seed + i (default: 0)")
    spec.add_argument("--repetition-penalty", type=float, default=1.0,
                      help="the target's repetition penalty, for every row and the peer (default: 1.0 = off)")
    spec.add_argument("--gpu-mem", default=None,
                      help="disk-cold device budget, e.g. 700MiB (default: what never streams + the ring + "
                           "3 layers)")
    spec.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                      help="target and draft dtype (default: auto = bf16 on CUDA, fp32 on CPU)")
    spec.add_argument("--no-peer", action="store_true", help="skip transformers assisted generation (default: off)")
    spec.add_argument("--resume", action="store_true",
                      help="take the rows a killed run with the same settings finished (default: start afresh)")
    spec.add_argument("--partial", action="store_true",
                      help="report on the prompts a (killed or running) run with the same settings finished, "
                           "decoding nothing (default: off)")
    spec.add_argument("--json", action="store_true", help="print only JSON")


def _planned_bits(weights: str) -> float:
    """"spqr-w4" / "spqr-w4-g32" -> the expected bits per parameter of that SpQR configuration."""
    from quant.spqr_format import expected_bits_per_param
    bits, _, groupsize = weights.removeprefix("spqr-w").partition("-g")
    return expected_bits_per_param(int(bits), int(groupsize or 16))


def cmd_plan(args, console) -> int:
    from offload.plan_report import build_plan, measured_bandwidth
    weight_bits = _planned_bits(args.weights) if args.weights else None
    plan, bandwidth = build_plan(args, weight_bits), measured_bandwidth(args)
    seconds = plan.predicted_transfer_seconds(bandwidth)
    if args.json:
        print(json.dumps({**plan.as_dict(), "bandwidth_gbps": {k: v / 1e9 for k, v in bandwidth.items()},
                          "predicted_transfer_seconds_per_pass": round(seconds, 4)}))
        return 0
    from rich.console import Console
    from rich.table import Table

    from offload.planner import format_bytes
    console = Console()   # the plan is the command's output: stdout
    table = Table(title=f"plan: {plan.request.config.family}, {plan.request.config.num_layers} layers, "
                        f"{format_bytes(plan.request.layer_bytes)} per layer")
    for column in ("component", "tier", "bytes"):
        table.add_column(column)
    for item in plan.items:
        table.add_row(item.component, item.tier, format_bytes(item.num_bytes))
    console.print(table, soft_wrap=True)
    console.print(f"device {format_bytes(plan.bytes_in('device'))} of {format_bytes(plan.request.device_budget)}; "
                  f"predicted transfer per pass {seconds:.3f} s (link {bandwidth['ram'] / 1e9:.1f} GB/s, "
                  f"disk {bandwidth['disk'] / 1e9:.1f} GB/s)")
    return 0


def cmd_distill(args, console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from spec.distill import DistillConfig, distill
    from spec.distill.generate import GenerationConfig
    config = DistillConfig(args.target, args.out, args.kind, args.layers, args.reuse_layers, args.vocab_top,
                           list(args.data), num_steps=args.steps, batch_tokens=args.batch_tokens,
                           generation=GenerationConfig(batch_size=args.batch_size), resume=args.resume,
                           revocab=args.revocab,
                           device=args.device, dtype=args.dtype, num_template_prompts=args.template_prompts,
                           num_self_prompts=args.self_prompts, max_gsm8k_prompts=args.gsm8k_prompts,
                           num_sampled_prompts=args.sampled_prompts, init_draft=args.init_draft,
                           head_only=args.head_only, learning_rate=args.lr)
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


def _bench_draft(args, console) -> dict:
    from offload import LoadOptions, load_model
    from offload.devices import dtype_name
    from spec.distill import AnswerCache, DraftBenchConfig, bench_draft
    from spec.distill.prompts import prompt_turns
    from spec.draft import default_draft_for, load_draft
    draft_path = args.draft or default_draft_for(args.target)
    if draft_path is None:
        raise ValueError("this target has no shipped draft: give --draft DIR (see `distill`)")
    prompts = prompt_turns(args.prompts, args.limit)
    target = load_model(LoadOptions(args.target))
    draft = load_draft(LoadOptions(str(draft_path)), embed=target.model.embed)
    same_dtype = None
    if draft.model.dtype != target.model.dtype:
        same_dtype = load_draft(LoadOptions(str(draft_path), dtype=dtype_name(target.model.dtype)),
                                embed=target.model.embed)
    answers_by = load_model(LoadOptions(args.answers_by)) if args.answers_by else None
    config = DraftBenchConfig(max_new_tokens=args.max_new_tokens)
    cache = AnswerCache(args.answers_cache, (answers_by or target).path, config.max_new_tokens)
    return bench_draft(target, draft, prompts, config, cache=cache, draft_at_target_dtype=same_dtype,
                       answers_by=answers_by,
                       on_progress=lambda e: console.print(f"[dim]answers: {e['done']}/{e['total']}[/dim]"))


def _bench_spec(args, console) -> dict:
    from offload.planner import parse_bytes
    from runtime.spec_bench import SpecBenchConfig, run_spec_bench
    from runtime.spec_report import print_tables
    from spec.distill.prompts import prompt_turns
    from spec import SamplingConfig
    try:
        budgets = [int(x) for x in args.budgets.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--budgets takes comma-separated integers, e.g. 1,4,16; got {args.budgets!r}") from None
    config = SpecBenchConfig(args.target, args.draft, args.max_new_tokens, budgets,
                             [m.strip() for m in args.modes.split(",") if m.strip()],
                             parse_bytes(args.gpu_mem) if args.gpu_mem else None, run_peer=not args.no_peer,
                             dtype=args.dtype)
    sampling = SamplingConfig(args.temperature, args.top_p, seed=args.seed, repetition_penalty=args.repetition_penalty)
    result = run_spec_bench(config, sampling, prompt_turns(args.prompts, args.limit, per_file=True),
                            on_status=lambda m: console.print(f"[dim]{m}[/dim]", highlight=False),
                            resume=args.resume, partial=args.partial)
    if not args.json:
        print_tables(result, console)
    return result


def cmd_bench(args, console) -> int:
    from offload.planner import parse_bytes
    if args.bench == "draft":
        result = _bench_draft(args, console)
    if args.bench == "spec":
        result = _bench_spec(args, console)
    if args.bench == "quant":
        from runtime.quant_cli import bench_quant
        result = bench_quant(args, console)
    if args.bench == "quant-disk":
        from runtime.quant_cli import bench_quant_disk
        result = bench_quant_disk(args, console)
    if args.bench == "stream":
        from offload.stream_bench import run_stream_bench
        sizes = [int(x) for x in args.tokens.split(",") if x.strip()]
        if not sizes or min(sizes) <= 0:
            raise ValueError(f"--tokens needs positive pass sizes, got {args.tokens!r}")
        result = run_stream_bench(args.target, parse_bytes(args.gpu_mem), args.tier, sizes, args.device,
                                  args.dtype, args.repeats, on_status=lambda m: console.print(f"[dim]{m}[/dim]"))
    if not args.json:
        for row in result.get("passes", []):
            console.print(f"{row['tokens']:>5} tokens: {row['pass_seconds']:.4f} s/pass, "
                          f"efficiency {row['efficiency']:.2f}")
    print(json.dumps(result))
    return 0


def _tool_commands() -> dict:
    from runtime.judge_cli import JUDGE_COMMANDS
    from runtime.quant_cli import QUANT_COMMANDS
    return {"plan": cmd_plan, "bench": cmd_bench, "distill": cmd_distill, **QUANT_COMMANDS, **JUDGE_COMMANDS}


TOOL_COMMANDS = _tool_commands()
