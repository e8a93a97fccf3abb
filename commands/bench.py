"""bench: benchmarks that print JSON (draft, spec, stream, quant, quant-disk), the whole suite with its report
(all) and the generated record (record); their code lives in bench/."""
from __future__ import annotations

import json
from pathlib import Path

from .flags import add_device, add_draft, add_dtype, add_target


def add_parsers(commands) -> None:
    benches = commands.add_parser("bench", help="benchmarks (print JSON)").add_subparsers(dest="bench", required=True)
    _add_quant_parsers(benches)
    draft = benches.add_parser("draft", help="draft vs target: top-1 agreement, rank acceptance, cost per token")
    add_target(draft, "target (default: embedded model)")
    add_draft(draft, "draft folder (default: the target's shipped draft)")
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
    add_target(stream, "model (default: embedded model)")
    stream.add_argument("--gpu-mem", default=None,
                        help="device budget that forces streaming, e.g. 450MiB (default: every layer streams)")
    stream.add_argument("--synthetic-gguf", default=None, choices=["q4_k", "q8_0"],
                        help="stream a multi-GB GGUF of random valid blocks of this type (the default model "
                             "scaled up; written once to the cache) instead of --model")
    stream.add_argument("--scale", type=int, default=8,
                        help="--synthetic-gguf: hidden/intermediate/heads times this (default: 8)")
    stream.add_argument("--size-gb", type=float, default=2.5,
                        help="--synthetic-gguf: decoder-layer GB to aim at (default: 2.5)")
    stream.add_argument("--tier", default="ram", choices=["ram", "disk"], help="tier to stream from (default: ram)")
    stream.add_argument("--tokens", default="1,16,64,256,1024", help="pass sizes (default: 1,16,64,256,1024)")
    stream.add_argument("--disk-reads", default="direct", choices=["direct", "buffered"],
                        help="disk tier reads: O_DIRECT where the file system allows it, or through the page "
                             "cache (default: direct)")
    add_device(stream)
    add_dtype(stream)
    stream.add_argument("--repeats", type=int, default=3, help="measured passes per size, best kept (default: 3)")
    stream.add_argument("--json", action="store_true", help="print only JSON")
    _add_bench_spec_parser(benches)
    _add_bench_batch_parser(benches)
    _add_suite_parsers(benches)


def _add_bench_batch_parser(benches) -> None:
    batch = benches.add_parser("batch", help="batched decoding: tok/s and latency by batch size, RAM- and "
                                             "cold-disk-streamed, with and without speculation")
    add_target(batch, "target (default: embedded model)")
    add_draft(batch, "draft (default: the target's shipped draft)")
    batch.add_argument("--prompts", type=Path, nargs="+", required=True,
                       help='JSONL files: lines with "prompt", MT-Bench "turns" (first turn) or "question"')
    batch.add_argument("--limit", type=int, default=None, help="use only the first N prompts (default: all)")
    batch.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="batch sizes (default: 1,2,4,8,16,32)")
    batch.add_argument("--max-new-tokens", type=int, default=32, help="tokens per answer (default: 32)")
    batch.add_argument("--tiers", default="ram,disk",
                       help="ram (every layer streams from RAM) and/or disk (cold, 3 layers resident) "
                            "(default: ram,disk)")
    batch.add_argument("--no-draft", action="store_true", help="autoregressive rows only (default: off)")
    batch.add_argument("--budget", default="auto",
                       help="tree tokens per sequence, or auto: the budget chooser splits each pass "
                            "(default: auto)")
    batch.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_device(batch)
    add_dtype(batch)
    batch.add_argument("--json", action="store_true", help="print only JSON")


def _add_suite_parsers(benches) -> None:
    suite = benches.add_parser("all", help="every benchmark and peer in one run: one JSON each and report.md "
                                           "with plots in --out")
    suite.add_argument("--out", type=Path, required=True, help="folder for the JSON files, report.md and PNGs")
    suite.add_argument("--quick", action="store_true",
                       help="fewer prompts, tokens, budgets and rounds: under 10 minutes on 2 cores (default: off)")
    suite.add_argument("--only", default=None, metavar="LIST",
                       help="comma-separated benchmarks: spec,stream,quant,quant_disk,draft,peers,llama_cpp,batch "
                            "(default: all)")
    suite.add_argument("--threads", type=int, default=None,
                       help="threads for every engine, ours and the peers' (default: torch's, 2 here)")
    suite.add_argument("--record", action="store_true",
                       help="then rewrite the generated blocks of README.md and docs/performance.md (default: off)")
    suite.add_argument("--report-only", action="store_true",
                       help="rewrite report.md and its plots from the JSON already in --out, measuring nothing")
    record = benches.add_parser("record", help="rewrite the generated blocks of README.md and docs/performance.md "
                                               "from a `bench all` folder")
    record.add_argument("--from", dest="source", type=Path, required=True, help="the `bench all --out` folder")
    record.add_argument("--files", type=Path, nargs="+", default=None,
                        help="documents to rewrite (default: README.md docs/performance.md)")


def _add_bench_spec_parser(benches) -> None:
    spec = benches.add_parser("spec", help="speculation by budget vs autoregressive vs transformers assisted generation")
    add_target(spec, "target (default: embedded model)")
    add_draft(spec, "draft (default: the target's shipped draft)")
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
    add_dtype(spec, "target and draft dtype (default: auto = bf16 on CUDA, fp32 on CPU)")
    spec.add_argument("--no-peer", action="store_true", help="skip transformers assisted generation (default: off)")
    spec.add_argument("--resume", action="store_true",
                      help="take the rows a killed run with the same settings finished (default: start afresh)")
    spec.add_argument("--partial", action="store_true",
                      help="report on the prompts a (killed or running) run with the same settings finished, "
                           "decoding nothing (default: off)")
    spec.add_argument("--json", action="store_true", help="print only JSON")


def _add_quant_parsers(benches) -> None:
    bench = benches.add_parser("quant", help="SpQR vs reference, round-to-nearest, GPTQ and NF4 on held-out text")
    add_target(bench, "model (default: embedded model)")
    bench.add_argument("--tokens", type=int, default=4096, help="held-out tokens per domain (default: 4096)")
    bench.add_argument("--nsamples", type=int, default=128, help="calibration sequences (default: 128)")
    bench.add_argument("--seqlen", type=int, default=512, help="calibration sequence length (default: 512)")
    bench.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                       help="rows besides the reference: spqr rtn gptq nf4 (default: all)")
    bench.add_argument("--json", action="store_true", help="print only JSON")
    disk = benches.add_parser("quant-disk", help="decoding with layers streamed from a cold disk: reference "
                                                 "fp32/bf16 vs SpQR checkpoints, in one run")
    add_target(disk, "reference model (default: embedded model)")
    disk.add_argument("--packed", type=Path, nargs="+", default=[], help="SpQR checkpoints of that model")
    disk.add_argument("--gguf", action="store_true",
                      help="add the model's GGUF run in place (decoded at use, and ahead by a thread) beside "
                           "its fp32 and bf16 imports")
    disk.add_argument("--new-tokens", type=int, default=24, help="tokens decoded per model (default: 24)")
    disk.add_argument("--rounds", type=int, default=3, help="every model once per round, in turn; medians "
                                                            "(default: 3)")
    disk.add_argument("--json", action="store_true", help="print only JSON")


def _bench_draft(args, console) -> dict:
    from offload import LoadOptions
    from runtime.models import load_model
    from bench.draft_bench import DraftBenchConfig, bench_draft, load_pair
    from spec.distill import AnswerCache
    from spec.distill.prompts import prompt_turns
    prompts = prompt_turns(args.prompts, args.limit)
    target, draft, same_dtype = load_pair(args.target, args.draft)
    answers_by = load_model(LoadOptions(args.answers_by)) if args.answers_by else None
    config = DraftBenchConfig(max_new_tokens=args.max_new_tokens)
    cache = AnswerCache(args.answers_cache, (answers_by or target).path, config.max_new_tokens)
    return bench_draft(target, draft, prompts, config, cache=cache, draft_at_target_dtype=same_dtype,
                       answers_by=answers_by,
                       on_progress=lambda e: console.print(f"[dim]answers: {e['done']}/{e['total']}[/dim]"))


def _bench_spec(args, console) -> dict:
    from offload.planner import parse_bytes
    from bench.spec_bench import SpecBenchConfig, run_spec_bench
    from bench.spec_report import print_tables
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


def _bench_all(args, console) -> int:
    from bench.report import write_report
    from bench.suite import command_line, preset, run_suite
    if args.report_only:
        if not (args.out / "suite.json").is_file():
            raise FileNotFoundError(f"--report-only: {args.out} holds no suite.json (run `bench all --out` first)")
        console.print(f"wrote {write_report(args.out)}")
    else:
        overrides = {"threads": args.threads} if args.threads else {}
        if args.only:
            overrides["only"] = tuple(x.strip() for x in args.only.split(",") if x.strip())
        config = preset(args.quick, **overrides)
        manifest = run_suite(config, args.out, command_line(config, args.out), console)
        console.print(f"bench all: {manifest['wall_seconds'] / 60:.1f} min; report: {args.out / 'report.md'}")
    return _bench_record(args.out, None, console) if args.record else 0


def _bench_record(source: Path, files: list[Path] | None, console) -> int:
    from bench.record import rewrite
    from bench.suite import ROOT
    for document in files or [ROOT / "README.md", ROOT / "docs/performance.md"]:
        console.print(f"{document.name}: {rewrite(document, source)} generated block(s) rewritten from {source}")
    return 0


def cmd_bench(args, console) -> int:
    from offload.planner import parse_bytes
    if args.bench == "all":
        return _bench_all(args, console)
    if args.bench == "record":
        return _bench_record(args.source, args.files, console)
    if args.bench == "draft":
        result = _bench_draft(args, console)
    if args.bench == "spec":
        result = _bench_spec(args, console)
    if args.bench == "batch":
        result = _bench_batch(args, console)
    if args.bench == "quant":
        result = _bench_quant(args, console)
    if args.bench == "quant-disk":
        result = _bench_quant_disk(args, console)
    if args.bench == "stream":
        from bench.stream_bench import run_stream_bench
        sizes = [int(x) for x in args.tokens.split(",") if x.strip()]
        if not sizes or min(sizes) <= 0:
            raise ValueError(f"--tokens needs positive pass sizes, got {args.tokens!r}")
        on_status = lambda m: console.print(f"[dim]{m}[/dim]")
        target, synthetic = args.target, None
        if args.synthetic_gguf:
            from bench.synthetic_gguf import synthetic_target
            path, synthetic = synthetic_target(args.synthetic_gguf, args.scale, args.size_gb, on_status)
            target = str(path)
        result = run_stream_bench(target, parse_bytes(args.gpu_mem) if args.gpu_mem else None, args.tier, sizes,
                                  args.device, args.dtype, args.repeats, on_status=on_status,
                                  direct_reads=args.disk_reads == "direct")
        if synthetic:
            result["synthetic_gguf"] = synthetic
    if not args.json:
        for row in result.get("passes", []):
            console.print(f"{row['tokens']:>5} tokens: {row['pass_seconds']:.4f} s/pass, "
                          f"efficiency {row['efficiency']:.2f}")
    print(json.dumps(result))
    return 0


def _bench_batch(args, console) -> dict:
    import torch
    from bench.batch_bench import BatchBenchConfig, run_batch_bench
    from bench.batch_summary import plan_70b, summarize, summary_line
    from spec.distill.prompts import prompt_turns
    try:
        sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
        budget = None if args.budget == "auto" else int(args.budget)
    except ValueError:
        raise ValueError(f"--batch-sizes takes integers like 1,2,4 and --budget auto or an integer; got "
                         f"{args.batch_sizes!r}, {args.budget!r}") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    config = BatchBenchConfig(args.target, args.draft, sizes, [t.strip() for t in args.tiers.split(",") if t.strip()],
                              args.max_new_tokens, not args.no_draft, budget, device=args.device, dtype=args.dtype)
    result = run_batch_bench(config, prompt_turns(args.prompts, args.limit),
                             on_status=lambda m: console.print(f"[dim]{m}[/dim]", highlight=False))
    result["target"] = Path(args.target).name if args.target else "default"
    result["prompt_files"] = [p.name for p in args.prompts]
    result["summary"] = summarize(result)
    result["plan_70b_spqr_w4"] = plan_70b()
    console.print(summary_line(result), highlight=False)
    return result


def _bench_quant_disk(args, console) -> dict:
    from bench.quant_disk_bench import DiskBenchConfig, run_disk_bench
    config = DiskBenchConfig(args.target, list(args.packed), args.new_tokens, args.rounds, gguf_in_place=args.gguf)
    result = run_disk_bench(config, on_status=lambda m: console.print(f"[dim]{m}[/dim]", highlight=False))
    if not args.json:
        for row in result["rows"]:
            ms = row["per_layer_ms"]
            console.print(f"{row['model']:>32}  {row['tokens_per_second']:7.3f} tok/s  "
                          f"{row['bytes_per_pass'] / 2**20:8.1f} MiB/pass  per layer: wait {ms['wait']:.2f} ms, "
                          f"dequantize {ms['dequantize']:.2f} ms, pass {ms['pass']:.2f} ms  "
                          f"x{row['speedup_vs_fp32']:.2f} vs fp32", highlight=False)
    return result


def _bench_quant(args, console) -> dict:
    from bench.quant_bench import METHODS, QuantBenchConfig, run_quant_bench
    config = QuantBenchConfig(args.target, args.tokens, args.nsamples, args.seqlen,
                              methods=tuple(args.methods) if args.methods else METHODS)
    result = run_quant_bench(config, on_status=lambda m: console.print(f"[dim]{m}[/dim]", highlight=False))
    if not args.json:
        for row in result["rows"]:
            console.print(f"{row['method']:>16}  {row['bits_per_param']:6.3f} bits  "
                          + "  ".join(f"{d} {v:.3f}" for d, v in row["perplexity"].items())
                          + f"  mean increase {row['mean_increase']:+.1%}")
    return result


COMMANDS = {"bench": cmd_bench}
