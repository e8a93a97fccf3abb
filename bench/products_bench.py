"""One token's matrix products, ours against ggml's own, side by side in one run: the 1B and 8B shapes of
bench.shapes_bench (Llama-3.2-1B, Llama-3.1-8B decoder layers and the synthetic files' 49,152-row Q4_0 head).

    python cli.py bench products --shapes 1b,8b --types q4_0,q4_k,q4_k_m --rounds 3 --out FILE.json

Ours: every product as the engine runs it (offload/weights/packed_linear: q/k/v and gate/up stacked, torch's
`_weight_int4pack_mm_for_cpu` on bf16 activations). ggml's: the same matrices as llama.cpp runs them (q, k,
v, gate, up apart; x in fp32, quantized to 8 bits inside the product), timed by bench/ggml_products.py in a
process of its own through the libggml of the llama.cpp peer's environment, in ggml's plain CPU buffer and
in its repack buffer (llama.cpp's choice at load for Q4_0 and Q4_K). The two engines run in turn, --rounds
times, each product's median kept; a token's figure is the sum over its layers and the head. Each product is
timed over copies of its matrix taken in turn, --cold-bytes in all, beyond the CPU's last-level cache (one
copy called again and again is served from a 32 MiB L3 and flatters a memory-bound kernel: ggml's plain Q4_K
product ran 0.30 ms hot and 0.56 ms cold, torch's int4 kernel 0.52 and 0.55). This answers
whether a faster product exists for the same bytes on this CPU (issue 36: torch's kernel is most of our
step on these shapes), not how fast a whole step is: bench.shapes_bench measures steps.
`specstream bench products` runs it (flags: commands/bench_cpu_flags.py): one summary line, then the JSON (also
written to --out, indented, with the command that made it)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from bench.shapes_bench import ggml_library, llama_python
from bench.suite_config import ROOT
from bench.synthetic_gguf import MORE_BITS, NAMED_SHAPES, SYNTHETIC_TYPES, SyntheticShape
from offload.weights.gguf_blocks import random_blocks
from offload.weights.ggml_types import GGMLType as T
from offload.weights.packed_linear import from_gguf
from offload.weights.sizes import use_more_bits

COLD_BYTES = 96 << 20                   # each product over copies of this many bytes: 3x this CPU's 32 MiB L3
HEAD_ROWS = 49_152                      # the synthetic files' tied Q4_0 head (the default model's vocabulary)
GGML_NAMES = {T.Q4_0: "q4_0", T.Q4_1: "q4_1", T.Q8_0: "q8_0", T.Q4_K: "q4_k", T.Q6_K: "q6_k"}
Product = tuple[T, int, int]            # GGUF type, rows (N), columns (K)


def token_products(shape: SyntheticShape, file_type: str, stacked: bool) -> Counter:
    """Product -> how many a one-token step runs: per layer q, k, v, o, gate, up, down (q/k/v and gate/up as
    one each where `stacked` and their types agree, as our engine runs them), then the head."""
    kv = shape.num_kv_heads * shape.head_dim
    hidden, inter = shape.hidden_size, shape.intermediate_size
    raised, names = MORE_BITS.get(file_type, (None, ()))
    base = SYNTHETIC_TYPES[file_type]
    count: Counter = Counter()
    for layer in range(shape.num_layers):
        more = use_more_bits(layer, shape.num_layers)
        v_type = raised if more and "attn_v.weight" in names else base
        down_type = raised if more and "ffn_down.weight" in names else base
        if stacked and v_type == base:
            count[(base, hidden + 2 * kv, hidden)] += 1
        else:
            count[(base, hidden, hidden)] += 1
            count[(base, kv, hidden)] += 1
            count[(v_type, kv, hidden)] += 1
        count[(base, hidden, hidden)] += 1
        if stacked:
            count[(base, 2 * inter, hidden)] += 1
        else:
            count[(base, inter, hidden)] += 2
        count[(down_type, hidden, inter)] += 1
    count[(T.Q4_0, HEAD_ROWS, hidden)] += 1
    return count


def time_ours(product: Product, seconds: float, cold_bytes: int) -> float:
    """Milliseconds per one-row product on the engine's Int4Weight of these blocks, taken in turn over copies of
    at least `cold_bytes` in all (a model's weights come from RAM, not the last-level cache)."""
    qtype, rows, cols = product
    blocks = torch.from_numpy(random_blocks(qtype, (rows, cols), np.random.default_rng(0)))
    weights = [from_gguf(blocks, qtype, (rows, cols)) for _ in range(max(1, -(-cold_bytes // blocks.numel())))]
    x = torch.randn(1, cols)
    for weight in weights:
        weight.matmul(x)
    calls, start = 0, time.perf_counter()
    while calls < 2 * len(weights) or time.perf_counter() - start < seconds:
        weights[calls % len(weights)].matmul(x)
        calls += 1
    return (time.perf_counter() - start) / calls * 1e3


def time_ggml(python: Path, products: list[Product], threads: int, seconds: float,
              cold_bytes: int) -> dict[Product, dict]:
    """ggml's products (bench/ggml_products.py in a process of its own) through the libggml of `python`'s
    llama.cpp environment."""
    spec = [{"type": GGML_NAMES[q], "n": n, "k": k, "m": 1} for q, n, k in products]
    env = {**os.environ, "SPECSTREAM_GGML_LIB": os.environ.get("SPECSTREAM_GGML_LIB") or ggml_library(python) or ""}
    proc = subprocess.run([sys.executable, "-m", "bench.ggml_products", "--spec", json.dumps(spec),
                           "--threads", str(threads), "--seconds", str(seconds), "--cold-bytes", str(cold_bytes)],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("{")), None)
    if line is None:
        raise RuntimeError(f"ggml_products exit {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return {p: row for p, row in zip(products, json.loads(line)["products"])}


def per_token(count: Counter, ms: dict[Product, float]) -> float:
    return round(sum(n * ms[p] for p, n in count.items()), 3)


def run(shapes: list[str], types: list[str], rounds: int, seconds: float, python: Path | None,
        cold_bytes: int = COLD_BYTES) -> dict:
    threads = torch.get_num_threads()
    files = {f"{s}/{t}": (token_products(NAMED_SHAPES[s], t, True), token_products(NAMED_SHAPES[s], t, False))
             for s in shapes for t in types}
    ours_set = sorted({p for mine, _ in files.values() for p in mine})
    ggml_set = sorted({p for _, theirs in files.values() for p in theirs})
    ours_runs: dict[Product, list[float]] = {p: [] for p in ours_set}
    ggml_runs: dict[Product, list[dict]] = {p: [] for p in ggml_set}
    for _ in range(rounds):
        for p in ours_set:
            ours_runs[p].append(time_ours(p, seconds, cold_bytes))
        if python:
            for p, row in time_ggml(python, ggml_set, threads, seconds, cold_bytes).items():
                ggml_runs[p].append(row)
    ours_ms = {p: statistics.median(v) for p, v in ours_runs.items()}
    result = {"files": {}}
    for name, (mine, theirs) in files.items():
        row = {"ours_int4_kernel_ms_per_token": per_token(mine, ours_ms),
               "ours_products": len(mine), "ggml_products": len(theirs)}
        if python:
            plain = {p: statistics.median(r["plain_ms"] for r in ggml_runs[p]) for p in theirs}
            best = {p: min(plain[p], statistics.median(r.get("repacked_ms", plain[p]) for r in ggml_runs[p]))
                    for p in theirs}
            row["ggml_plain_ms_per_token"] = per_token(theirs, plain)
            row["ggml_as_llama_cpp_ms_per_token"] = per_token(theirs, {
                p: statistics.median(r.get("repacked_ms", r["plain_ms"]) for r in ggml_runs[p]) for p in theirs})
            row["ggml_best_ms_per_token"] = per_token(theirs, best)
            row["ours_over_ggml_as_llama_cpp"] = round(row["ggml_as_llama_cpp_ms_per_token"]
                                                       / row["ours_int4_kernel_ms_per_token"], 3)
        result["files"][name] = row
    result["products"] = [{"type": GGML_NAMES[p[0]], "rows": p[1], "cols": p[2], "ours_ms": round(ours_ms[p], 4)}
                          for p in ours_set]
    if python:
        result["ggml_products"] = [{"type": GGML_NAMES[p[0]], "rows": p[1], "cols": p[2],
                                    **{key: round(statistics.median(r[key] for r in ggml_runs[p]), 4)
                                       for key in ("plain_ms", "repacked_ms") if key in ggml_runs[p][0]}}
                                   for p in ggml_set]
    else:
        result["ggml_skipped"] = "no environment with llama-cpp-python (.venv-peers or .venv-llama)"
    return result


def from_args(args) -> dict:
    """Both engines' products in turn (flags: commands/bench_cpu_flags.py)."""
    shapes, types = args.shapes.split(","), args.types.split(",")
    bad = [s for s in shapes if s not in NAMED_SHAPES] + [t for t in types if t not in SYNTHETIC_TYPES]
    if bad:
        raise ValueError(f"unknown shapes or types {bad} (shapes: {', '.join(NAMED_SHAPES)}; types: "
                         f"{', '.join(SYNTHETIC_TYPES)})")
    if args.rounds < 1 or args.seconds <= 0:
        raise ValueError("--rounds must be at least 1 and --seconds above 0")
    cold_bytes = COLD_BYTES if args.cold_bytes is None else args.cold_bytes
    return {"bench": "products", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "cold_bytes": cold_bytes,
            **run(shapes, types, args.rounds, args.seconds, llama_python(), cold_bytes)}


def headline(report: dict) -> str:
    return "products: " + "; ".join(f"{name} ours {row['ours_int4_kernel_ms_per_token']} ms"
                                    + (f", ggml {row['ggml_as_llama_cpp_ms_per_token']} ms"
                                       if "ggml_as_llama_cpp_ms_per_token" in row else "")
                                    for name, row in report["files"].items())
