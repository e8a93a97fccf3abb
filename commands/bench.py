"""bench: benchmarks that print JSON (draft, spec, stream, batch, serve, quant, quant-disk, tree-simulation,
self-draft, startup, peers, and the CPU kernels': cpu-kernel, spqr-kernel, step-profile, products, shapes), the
whole suite with its report (all) and the generated record (record); their code lives in bench/. One table
(BENCHES) names each subcommand with its help, its flags and its handler: a subcommand cannot exist without a
handler, nor a handler be reached by a name the parser does not know."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import bench_cpu_flags as cpu_flags
from . import bench_flags as flags


@dataclass(frozen=True, slots=True)
class Bench:
    help: str
    add_flags: Callable[[object], None]
    run: Callable[[object, object], dict]      # (args, console) -> the JSON result
    prints_json: bool = True                   # False: the handler prints its own lines and returns {}


def _on_status(console) -> Callable[[str], None]:
    return lambda message: console.print(f"[dim]{message}[/dim]", highlight=False)


def _integers(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, e.g. 1,4,16; got {text!r}") from None
    if not values or min(values) <= 0:
        raise ValueError(f"{flag} takes positive integers, e.g. 1,4,16; got {text!r}")
    return values


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
    from offload.byte_units import parse_bytes
    from bench.spec_bench import SpecBenchConfig, run_spec_bench
    from bench.spec_report import print_tables
    from spec.distill.prompts import prompt_turns
    from spec import SamplingConfig
    config = SpecBenchConfig(args.target, args.draft, args.max_new_tokens, _integers(args.budgets, "--budgets"),
                             [m.strip() for m in args.modes.split(",") if m.strip()],
                             parse_bytes(args.gpu_mem) if args.gpu_mem else None, run_peer=not args.no_peer,
                             dtype=args.dtype)
    sampling = SamplingConfig(args.temperature, args.top_p, min_p=args.min_p, seed=args.seed,
                              repetition_penalty=args.repetition_penalty)
    result = run_spec_bench(config, sampling, prompt_turns(args.prompts, args.limit, per_file=True),
                            on_status=_on_status(console), resume=args.resume, partial=args.partial)
    if not args.json:
        print_tables(result, console)
    return result


def _bench_stream(args, console) -> dict:
    from offload.byte_units import parse_bytes
    from bench.stream_bench import run_stream_bench
    sizes = _integers(args.tokens, "--tokens")
    on_status = lambda m: console.print(f"[dim]{m}[/dim]")
    target, synthetic = args.target, None
    if args.synthetic_gguf:
        from bench.synthetic_gguf import synthetic_target
        path, synthetic = synthetic_target(args.synthetic_gguf, args.scale, args.size_gb, on_status)
        target = str(path)
    result = run_stream_bench(target, parse_bytes(args.gpu_mem) if args.gpu_mem else None, args.tier, sizes,
                              args.device, args.dtype, args.repeats, on_status=on_status,
                              direct_reads=args.disk_reads == "direct", ring_size=args.ring_size,
                              beside_compute=args.beside_compute, loaders=args.loaders)
    if synthetic:
        result["synthetic_gguf"] = synthetic
    if not args.json:
        for row in result["passes"]:
            console.print(f"{row['tokens']:>5} tokens: {row['pass_seconds']:.4f} s/pass, "
                          f"efficiency {row['efficiency']:.2f}")
    return result


def _bench_batch(args, console) -> dict:
    import torch
    from bench.batch_bench import BatchBenchConfig
    from bench.batch_summary import batch_report, summary_line
    from spec.distill.prompts import prompt_turns
    if args.budget != "auto" and not args.budget.isdigit():
        raise ValueError(f"--budget takes auto or a positive integer; got {args.budget!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = BatchBenchConfig(args.target, args.draft, _integers(args.batch_sizes, "--batch-sizes"),
                              [t.strip() for t in args.tiers.split(",") if t.strip()], args.max_new_tokens,
                              not args.no_draft, None if args.budget == "auto" else int(args.budget),
                              device=args.device, dtype=args.dtype)
    result = batch_report(config, prompt_turns(args.prompts, args.limit), _on_status(console))
    result["prompt_files"] = [p.name for p in args.prompts]
    console.print(summary_line(result), highlight=False)
    return result


def _bench_serve(args, console) -> dict:
    import textdata
    from bench.serve_bench import ServeBenchConfig, run_serve_bench, summary_line
    from perf.tree_size import parse_budget
    from spec.distill.prompts import prompt_turns
    clients = _integers(args.clients, "--clients")
    config = ServeBenchConfig(args.target, args.draft, args.no_draft, clients,
                              [t.strip() for t in args.tiers.split(",") if t.strip()], args.max_new_tokens,
                              parse_budget(args.budget), args.device, args.dtype)
    prompts = prompt_turns(args.prompts or [textdata.path(textdata.CHAT_PROMPTS)], max(clients))
    result = run_serve_bench(config, prompts, _on_status(console))
    console.print(summary_line(result), highlight=False)
    return result


def _bench_quant(args, console) -> dict:
    from bench.quant_bench import METHODS, QuantBenchConfig, run_quant_bench
    target = args.target
    if args.natural_weights:
        from bench.draft_as_model import natural_weights_model
        if target:
            raise ValueError("--natural-weights builds its own model: give it or --target, not both")
        target = str(natural_weights_model())
    config = QuantBenchConfig(target, args.tokens, args.nsamples, args.seqlen,
                              methods=tuple(args.methods) if args.methods else METHODS)
    result = run_quant_bench(config, on_status=_on_status(console))
    if not args.json:
        for row in result["rows"]:
            console.print(f"{row['method']:>16}  {row['bits_per_param']:6.3f} bits  "
                          + "  ".join(f"{d} {v:.3f}" for d, v in row["perplexity"].items())
                          + f"  mean increase {row['mean_increase']:+.1%}")
    return result


def _bench_quant_disk(args, console) -> dict:
    from bench.quant_disk_bench import DiskBenchConfig, run_disk_bench
    config = DiskBenchConfig(args.target, list(args.packed), args.new_tokens, args.rounds, gguf_in_place=args.gguf)
    result = run_disk_bench(config, on_status=_on_status(console))
    if not args.json:
        for row in result["rows"]:
            ms = row["per_layer_ms"]
            console.print(f"{row['model']:>32}  {row['tokens_per_second']:7.3f} tok/s  "
                          f"{row['bytes_per_pass'] / 2**20:8.1f} MiB/pass  per layer: wait {ms['wait']:.2f} ms, "
                          f"dequantize {ms['dequantize']:.2f} ms, pass {ms['pass']:.2f} ms  "
                          f"x{row['speedup_vs_fp32']:.2f} vs fp32", highlight=False)
    return result


def _shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    parts = text.split("/")
    if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
        raise ValueError(f"--shard takes K/N (e.g. 0/2), got {text!r}")
    return int(parts[0]), int(parts[1])


def _bench_tree_simulation(args, console) -> dict:
    from bench.tree_simulation import TreeSimulationConfig, run_tree_simulation
    config = TreeSimulationConfig(args.target, args.draft, args.prompts, args.limit, args.max_new_tokens,
                                  _integers(args.budgets, "--budgets"), args.draft_bits, args.resident_layers,
                                  args.cpu_kernel, args.growth_temperature, args.checkpoint_dir,
                                  _shard(args.shard))
    return run_tree_simulation(config, on_status=_on_status(console))


def _bench_self_draft(args, console) -> dict:
    from bench.self_draft_bench import SelfDraftBenchConfig, run_self_draft_bench
    from perf.tree_size import parse_budget
    config = SelfDraftBenchConfig(args.tier, args.prompts, args.max_new_tokens, args.resident_layers, args.draft_bits,
                                  gguf_import=not args.in_place, budget=parse_budget(args.budget), device=args.device)
    return run_self_draft_bench(config, on_status=_on_status(console))


def _bench_startup(args, console) -> dict:
    from bench.startup import run_startup_bench
    return run_startup_bench(args.rounds, on_status=_on_status(console))


def _bench_all(args, console) -> dict:
    from bench.report import write_report
    from bench.suite import command_line, run_suite
    from bench.suite_config import preset
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
    if args.record:
        _record(args.out, None, console)
    return {}


def _module_bench(module_name: str) -> Callable[[object, object], dict]:
    """A bench whose bench/ module measures from the flags (from_args) and sums the result up (headline); the
    result carries its command line, and goes to --out too."""
    def run(args, console) -> dict:
        import importlib
        import shlex
        from bench.suite_steps import scrub
        from offload.weights.disk_errors import write_text_atomic
        if args.out and not args.out.resolve().parent.is_dir():     # refused before minutes of measuring
            raise FileNotFoundError(f"--out {args.out}: its folder does not exist")
        module = importlib.import_module(f"bench.{module_name}")
        result = scrub({"command": shlex.join(["specstream", *args.argv]), **module.from_args(args)})
        if not args.json:
            console.print(module.headline(result), highlight=False)
        if args.out:
            try:
                write_text_atomic(args.out, json.dumps(result, indent=1) + "\n")
            except OSError:
                print(json.dumps(result))            # minutes of measurements: printed rather than lost
                raise
        return result
    return run


def _bench_record(args, console) -> dict:
    _record(args.source, args.files, console)
    return {}


def _record(source: Path, files: list[Path] | None, console) -> None:
    from bench.record import rewrite
    from bench.suite_config import ROOT
    for document in files or [ROOT / "docs/performance.md"]:
        console.print(f"{document.name}: {rewrite(document, source)} generated block(s) rewritten from {source}")


BENCHES: dict[str, Bench] = {
    "quant": Bench("SpQR vs reference, round-to-nearest, GPTQ and NF4 on held-out text", flags.quant_flags,
                   _bench_quant),
    "quant-disk": Bench("decoding with layers streamed from a cold disk: reference fp32/bf16 vs SpQR checkpoints, "
                        "in one run", flags.quant_disk_flags, _bench_quant_disk),
    "draft": Bench("draft vs target: top-1 agreement, rank acceptance, cost per token", flags.draft_flags,
                   _bench_draft),
    "stream": Bench("pass time vs raw tier bandwidth for several pass sizes", flags.stream_flags, _bench_stream),
    "spec": Bench("speculation by budget vs autoregressive vs transformers assisted generation", flags.spec_flags,
                  _bench_spec),
    "batch": Bench("batched decoding: tok/s and latency by batch size, RAM- and cold-disk-streamed, with and "
                   "without speculation", flags.batch_flags, _bench_batch),
    "serve": Bench("the OpenAI-compatible server under 1-16 concurrent streamed clients, from RAM and a cold disk: "
                   "total tok/s, time to first token and chunk gaps, against the same requests one after another",
                   flags.serve_flags, _bench_serve),
    "tree-simulation": Bench("tokens per pass by tree budget from draft work alone, against the target's greedy "
                             "answers (an acceptance curve `plan --acceptance` reads)", flags.tree_simulation_flags,
                             _bench_tree_simulation),
    "self-draft": Bench("end-to-end tok/s with the self-draft vs the shipped draft vs autoregressive decoding, layers "
                        "streamed from RAM or a cold disk, in one run", flags.self_draft_flags, _bench_self_draft),
    "startup": Bench("seconds from a fresh process to its first token: first start, then the GGUF in place vs "
                     "its import", flags.startup_flags, _bench_startup),
    "cpu-kernel": Bench("the CPU's packed kernel (int4 or ggml) vs dense fp32 on one GGUF: pass-size crossover, "
                        "prefill, decode (and llama.cpp), context, streaming, quality", cpu_flags.cpu_kernel_flags,
                        _module_bench("cpu_kernel_bench")),
    "spqr-kernel": Bench("a SpQR checkpoint on the CPU's int4 kernel vs dequantized fp32 products: outliers, decode, "
                         "streaming, perplexity, quality", cpu_flags.spqr_kernel_flags,
                         _module_bench("spqr_kernel_bench")),
    "step-profile": Bench("where a one-token CPU decode step spends its time, part by part (optionally against "
                          "another checkout)", cpu_flags.step_profile_flags, _module_bench("cpu_step_profile")),
    "products": Bench("one token's matrix products, ours vs ggml's own, at Llama-3.2-1B and 3.1-8B shapes",
                      cpu_flags.products_flags, _module_bench("products_bench")),
    "shapes": Bench("our CPU engine vs llama.cpp on the same GGUF files and threads: the default model and "
                    "Llama-3.2-1B / 3.1-8B shapes, resident and streamed", cpu_flags.shapes_flags,
                    _module_bench("shapes_bench")),
    "peers": Bench("per-token latency of our streamed decoding vs transformers + accelerate offload and AirLLM at the "
                   "same device budget, each engine in its own process", flags.peers_flags, _module_bench("peers")),
    "all": Bench("every benchmark and peer in one run: one JSON each and report.md with plots in --out",
                 flags.suite_flags, _bench_all, prints_json=False),
    "record": Bench("rewrite the generated blocks of docs/performance.md from a `bench all` folder",
                    flags.record_flags, _bench_record, prints_json=False),
}


def add_parsers(commands) -> None:
    benches = commands.add_parser("bench", help="benchmarks (print JSON)").add_subparsers(dest="bench", required=True)
    for name, bench in BENCHES.items():
        parser = benches.add_parser(name, help=bench.help)
        bench.add_flags(parser)
        if bench.prints_json:
            parser.add_argument("--json", action="store_true", help="print only JSON")


def cmd_bench(args, console) -> int:
    bench = BENCHES.get(args.bench)
    if bench is None:
        raise ValueError(f"unknown bench {args.bench!r}; choose from {', '.join(BENCHES)}")
    result = bench.run(args, console)
    if bench.prints_json:
        print(json.dumps(result))
    return 0


COMMANDS = {"bench": cmd_bench}
