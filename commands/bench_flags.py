"""The flags of each `bench` subcommand (commands/bench.py pairs each with its handler in one table)."""
from __future__ import annotations

from pathlib import Path

from bench.peer_engines import ENGINES

from .flags import add_cpu_kernel, add_device, add_draft, add_dtype, add_target

PROMPTS_HELP = 'JSONL files: lines with "prompt", MT-Bench "turns" (first turn) or "question"'


def _pair(parser) -> None:
    add_target(parser, "target (default: embedded model)")
    add_draft(parser, "draft (default: the target's shipped draft)")


def draft_flags(draft) -> None:
    add_target(draft, "target (default: embedded model)")
    add_draft(draft, "draft folder (default: the target's shipped draft)")
    draft.add_argument("--prompts", type=Path, nargs="+", required=True, help=PROMPTS_HELP)
    draft.add_argument("--max-new-tokens", type=int, default=256, help="target answer length (default: 256)")
    draft.add_argument("--limit", type=int, default=None, help="use only the first N prompts (default: all)")
    draft.add_argument("--answers-cache", type=Path, default=None,
                       help="JSONL file keeping the answers, reused by later runs (default: none)")
    draft.add_argument("--answers-by", default=None, metavar="MODEL",
                       help="read MODEL's greedy answers instead of the target's own, the target's argmax "
                            "there as its tokens: compares targets (e.g. SpQR vs reference) on the same text")


def stream_flags(stream) -> None:
    add_target(stream, "model (default: embedded model)")
    stream.add_argument("--gpu-mem", default=None,
                        help="device budget that forces streaming, e.g. 450MiB (default: every layer streams)")
    stream.add_argument("--synthetic-gguf", default=None, choices=["q4_0", "q4_1", "q4_k", "q8_0"],
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
    stream.add_argument("--ring-size", type=int, default=None,
                        help="streamed layers in flight (default: the engine's, LoadOptions.ring_size)")
    stream.add_argument("--loaders", type=int, default=None,
                        help="threads loading streamed layers at once on a CPU (default: the engine's, "
                             "LoadOptions.loaders)")
    stream.add_argument("--beside-compute", action="store_true",
                        help="also measure the tier's raw rate while a thread multiplies as a pass does, and the "
                             "efficiency against that rate")
    add_device(stream)
    add_dtype(stream)
    stream.add_argument("--repeats", type=int, default=3, help="measured passes per size, best kept (default: 3)")


def batch_flags(batch) -> None:
    _pair(batch)
    batch.add_argument("--prompts", type=Path, nargs="+", required=True, help=PROMPTS_HELP)
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


def serve_flags(serve) -> None:
    _pair(serve)
    serve.add_argument("--no-draft", action="store_true", help="no speculation (default: off)")
    serve.add_argument("--prompts", type=Path, nargs="+", default=None,
                       help=f"{PROMPTS_HELP} (default: the shipped chat prompts)")
    serve.add_argument("--clients", default="1,4,8,16", help="concurrent clients per row (default: 1,4,8,16)")
    serve.add_argument("--tiers", default="ram,disk",
                       help="ram (every layer streams from RAM) and/or disk (cold, 3 layers resident) "
                            "(default: ram,disk)")
    serve.add_argument("--max-new-tokens", type=int, default=32, help="tokens per answer (default: 32)")
    serve.add_argument("--budget", default="auto", help="tree tokens per pass, or auto (default: auto)")
    add_device(serve)
    add_dtype(serve)


def suite_flags(suite) -> None:
    suite.add_argument("--out", type=Path, required=True, help="folder for the JSON files, report.md and PNGs")
    suite.add_argument("--quick", action="store_true",
                       help="fewer prompts, tokens, budgets and rounds: under 10 minutes on 2 cores (default: off)")
    suite.add_argument("--only", default=None, metavar="LIST",
                       help="comma-separated benchmarks: spec,stream,quant,quant_disk,draft,peers,llama_cpp,cpu_shapes,"
                            "batch,serve (default: all)")
    suite.add_argument("--threads", type=int, default=None,
                       help="threads for every engine, ours and the peers' (default: torch's, 2 here)")
    suite.add_argument("--record", action="store_true",
                       help="then rewrite the generated blocks of docs/performance.md (default: off)")
    suite.add_argument("--report-only", action="store_true",
                       help="rewrite report.md and its plots from the JSON already in --out, measuring nothing")


def record_flags(record) -> None:
    record.add_argument("--from", dest="source", type=Path, required=True, help="the `bench all --out` folder")
    record.add_argument("--files", type=Path, nargs="+", default=None,
                        help="documents to rewrite (default: docs/performance.md)")


def spec_flags(spec) -> None:
    _pair(spec)
    spec.add_argument("--prompts", type=Path, nargs="+", required=True, help=PROMPTS_HELP)
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
    spec.add_argument("--min-p", type=float, default=0.0,
                      help="drop tokens below min-p x top prob (default: 0 = off)")
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


def tree_simulation_flags(simulation) -> None:
    _pair(simulation)
    simulation.add_argument("--prompts", type=Path, nargs="+", default=None,
                            help=PROMPTS_HELP + " (default: the chat prompts and the MT-Bench first turns)")
    simulation.add_argument("--limit", type=int, default=None,
                            help="use only the first N prompts of each file (default: all)")
    simulation.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer (default: 128)")
    simulation.add_argument("--budgets", default="64,256,1024,4096",
                            help="tree budgets to simulate (default: 64,256,1024,4096)")
    simulation.add_argument("--draft-bits", type=int, default=4, choices=(2, 3, 4),
                            help="--draft self: bits per substitute weight (default: 4)")
    simulation.add_argument("--resident-layers", type=int, default=3,
                            help="--draft self: layers kept as they are, the rest substituted (default: 3)")
    simulation.add_argument("--growth-temperature", type=float, default=None,
                            help="--draft self: the temperature its trees grow at for the greedy target (default: "
                                 "by the substitutes' weight error)")
    simulation.add_argument("--checkpoint-dir", type=Path, default=None,
                            help="where the run's finished (budget, prompt) items are kept and resumed from; a copy "
                                 "from another machine resumes there (default: the model cache)")
    simulation.add_argument("--shard", default=None, metavar="K/N",
                            help="only the prompts i with i %% N == K, into the same checkpoint: N processes share a "
                                 "run, then the command without --shard reports every prompt (default: all)")
    add_cpu_kernel(simulation)


def self_draft_flags(bench) -> None:
    bench.add_argument("--tier", default="disk", choices=("ram", "disk"),
                       help="where the streamed layers come from (disk: cold, page cache dropped) (default: disk)")
    bench.add_argument("--prompts", type=int, default=2, help="chat prompts, the first N (default: 2)")
    bench.add_argument("--max-new-tokens", type=int, default=48, help="tokens per answer (default: 48)")
    bench.add_argument("--resident-layers", type=int, default=3,
                       help="decoder layers each plan keeps on the device; the rest stream (default: 3)")
    bench.add_argument("--draft-bits", type=int, default=4, choices=(2, 3, 4),
                       help="the self-draft's bits per substitute weight (default: 4)")
    bench.add_argument("--budget", default="auto",
                       help="tree tokens per pass for both drafts, or auto (the session's chooser) (default: auto)")
    add_device(bench)
    bench.add_argument("--in-place", action="store_true",
                       help="run the default GGUF in place instead of its fp32 import (default: off)")


def quant_flags(bench) -> None:
    add_target(bench, "model (default: embedded model)")
    bench.add_argument("--natural-weights", action="store_true",
                       help="instead of --target, the shipped draft's trained layers as a standalone model (written "
                            "to the cache): weights on no quantization grid, unlike the default model's Q4_1 "
                            "import (default: off)")
    bench.add_argument("--tokens", type=int, default=4096, help="held-out tokens per domain (default: 4096)")
    bench.add_argument("--nsamples", type=int, default=128, help="calibration sequences (default: 128)")
    bench.add_argument("--seqlen", type=int, default=512, help="calibration sequence length (default: 512)")
    bench.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                       help="rows besides the reference: spqr rtn gptq nf4 (default: all)")


def quant_disk_flags(disk) -> None:
    add_target(disk, "reference model (default: embedded model)")
    disk.add_argument("--packed", type=Path, nargs="+", default=[], help="SpQR checkpoints of that model")
    disk.add_argument("--gguf", action="store_true",
                      help="add the model's GGUF run in place (decoded at use, and ahead by a thread) beside "
                           "its fp32 and bf16 imports")
    disk.add_argument("--new-tokens", type=int, default=24, help="tokens decoded per model (default: 24)")
    disk.add_argument("--rounds", type=int, default=3, help="every model once per round, in turn; medians "
                                                            "(default: 3)")


def startup_flags(startup) -> None:
    startup.add_argument("--rounds", type=int, default=5,
                         help="later starts per path, taken in turn; medians (default: 5)")


def peers_flags(peers) -> None:
    peers.add_argument("--max-new-tokens", type=int, default=32, help="timed greedy tokens (default: 32)")
    peers.add_argument("--gpu-mem", default="450MiB",
                       help="device budget: our planner's, and the peers' split from it (default: 450MiB)")
    peers.add_argument("--max-context", type=int, default=512, help="(default: 512)")
    peers.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for every engine (default: 2)")
    peers.add_argument("--rounds", type=int, default=3, help="the in-venv engines in turn; medians (default: 3)")
    peers.add_argument("--airllm-tokens", type=int, default=8,
                       help="AirLLM is slow on a CPU: it decodes this many tokens, compared as a prefix of ours "
                            "(default: 8)")
    peers.add_argument("--warmup-tokens", type=int, default=4, help="untimed decode before the timed one (default: 4)")
    peers.add_argument("--omp-wait-policy", default="PASSIVE", choices=("default", "PASSIVE", "ACTIVE"),
                       help="OMP_WAIT_POLICY of every engine's process ('default': the environment's). PASSIVE: on a "
                            "shared, oversubscribed machine spinning OpenMP barriers slow some engines 10-25x "
                            "(default: PASSIVE)")
    peers.add_argument("--engines", default=None,
                       help=f"comma-separated subset of {', '.join(ENGINES)} (default: all)")
    peers.add_argument("--prompt", default=None, help="(default: a short-story request)")
    peers.add_argument("--no-private-copy", action="store_true",
                       help="run on the default model folder itself, not a copy under .cache/peers/model (cold runs "
                            "are then not cold while other processes map the file)")
    peers.add_argument("--timeout", type=int, default=420, help="seconds per child process (default: 420)")
    peers.add_argument("--out", type=Path, default=None, help="also write the JSON here, indented (default: none)")
