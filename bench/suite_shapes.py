"""`bench all`'s CPU shapes row: bench/shapes_bench.py's own function on the default model's GGUF and the 1B- and
8B-shaped synthetic files of the suite's types, ours (on the int4 kernel, and on ggml's through the same
environment's libggml: what `--cpu-kernel auto` takes there) and llama.cpp in turn with the suite's threads."""
from __future__ import annotations


def run_cpu_shapes(ctx) -> dict:
    from bench.shapes_bench import ShapesBenchConfig, llama_python, run_shapes_bench
    c = ctx.config
    if llama_python() is None:
        return {"skipped": "no environment with llama-cpp-python (.venv-peers: scripts/setup_peers.sh --llama-cpp)"}
    config = ShapesBenchConfig(c.cpu_shapes, c.cpu_shape_types, threads=c.threads, resident_kernels=("packed", "ggml"),
                               stream_kernels=("dense", "packed", "ggml"))
    return run_shapes_bench(config, ctx.status)
