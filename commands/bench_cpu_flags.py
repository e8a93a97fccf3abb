"""The flags of the CPU kernel benchmarks (`bench cpu-kernel`, `spqr-kernel`, `step-profile`, `products`,
`shapes`): each bench/ module measures from them (from_args) and sums its result up (headline)."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from bench.cpu_kernel_bench import PEERS_PYTHON
from bench.shapes_bench import ShapesBenchConfig

from .flags import add_target


def _out(parser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here, indented (default: none)")


def _quality(parser) -> None:
    parser.add_argument("--repeats", type=int, default=9, help="timings per figure, taken in turn (default: 9)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per greedy answer (default: 64)")
    parser.add_argument("--tokens-per-domain", type=int, default=4096,
                        help="perplexity: held-out tokens per domain (default: 4096)")
    parser.add_argument("--spec-prompts", type=int, default=8,
                        help="quality: chat prompts decoded speculatively (default: 8)")


def cpu_kernel_flags(parser) -> None:
    add_target(parser, "GGUF target (default: embedded model)")
    parser.add_argument("--parts", default=None,
                        help="comma-separated, from crossover, prefill, decode, context, stream, quality "
                             "(default: all)")
    _quality(parser)
    parser.add_argument("--llama-cpp", nargs="?", const=PEERS_PYTHON, default=None, metavar="PYTHON",
                        help="decode: also llama.cpp, from this Python's environment (no value: .venv-peers)")
    parser.add_argument("--stream-synthetic", default=None, metavar="TYPE",
                        help="stream: bench stream's synthetic GGUF of this type (q4_k, q8_0: 8x the default's shapes, "
                             "2.5 GB of layers) instead of --target")
    parser.add_argument("--requantize", default=None, metavar="TYPE",
                        help="the default model with its decoder matrices requantized to TYPE (q5_0, q5_1) as --target")
    parser.add_argument("--kernel", default="packed", choices=("packed", "ggml"),
                        help="the kernel set against dense fp32 in every part but stream (ggml: llama.cpp's libggml)")
    _out(parser)


def spqr_kernel_flags(parser) -> None:
    parser.add_argument("checkpoint", help="a SpQR checkpoint folder (`specstream quant` writes one)")
    parser.add_argument("--parts", default=None,
                        help="comma-separated, from outliers, decode, stream, perplexity, quality (default: all)")
    _quality(parser)
    _out(parser)


def step_profile_flags(parser) -> None:
    add_target(parser, "GGUF target (default: embedded model)")
    parser.add_argument("--cpu-kernel", default="packed", choices=("dense", "packed"),
                        help="the products profiled (default: packed)")
    parser.add_argument("--steps", type=int, default=64, help="one-token steps per profile (default: 64)")
    parser.add_argument("--rounds", type=int, default=3, help="profiles, each in its own process (default: 3)")
    parser.add_argument("--baseline-src", type=Path, default=None, metavar="DIR",
                        help="another checkout to profile in turn with this one (its step time is the ratio's base)")
    _out(parser)


def products_flags(parser) -> None:
    parser.add_argument("--shapes", default="1b,8b",
                        help="Llama-3.2-1B and Llama-3.1-8B layers: 1b, 8b (default: both)")
    parser.add_argument("--types", default="q4_0,q4_k,q4_k_m",
                        help="the synthetic files' types (default: q4_0,q4_k,q4_k_m)")
    parser.add_argument("--rounds", type=int, default=3, help="the engines in turn, this many times (default: 3)")
    parser.add_argument("--seconds", type=float, default=0.3, help="timing window per product and round (default: 0.3)")
    parser.add_argument("--cold-bytes", type=int, default=None,
                        help="copies of each matrix taken in turn, this many bytes in all (0: one copy, cache-hot; "
                             "default: 96 MiB, three times this machine's L3)")
    _out(parser)


def shapes_flags(parser) -> None:
    """One flag per ShapesBenchConfig field (None here: the config's default, which the help states from it);
    a tuple field takes a comma-separated list (bench/shapes_bench.from_args)."""
    defaults = ShapesBenchConfig()
    what = {"shapes": "default, 1b, 8b", "types": "the synthetic files' types",
            "stream_tiers": "ram, disk; '' for none", "stream_kernels": "dense, packed, ggml",
            "resident_kernels": "packed, ggml (ggml: ours through llama.cpp's libggml, --cpu-kernel ggml)",
            "omp_wait_policy": "every engine's OMP_WAIT_POLICY ('default': the environment's, as a user runs them)"}
    for field in fields(ShapesBenchConfig):
        default = getattr(defaults, field.name)
        kind = {"type": int} if isinstance(default, int) else {}
        if field.name == "omp_wait_policy":
            kind = {"choices": ("default", "PASSIVE", "ACTIVE")}
        listed = ",".join(default) if isinstance(default, tuple) else default
        text = f"{what[field.name]} (default: {listed})" if field.name in what else f"(default: {listed})"
        parser.add_argument("--" + field.name.replace("_", "-"), default=None, help=text, **kind)
    _out(parser)
