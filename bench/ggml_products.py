"""ggml's own CPU matrix products, timed through offload/weights/ggml_linear.py's binding of an installed libggml.

Started by bench/products_bench.py in a process of its own (ggml's threads never beside torch's products):

    SPECSTREAM_GGML_LIB=FOLDER python -m bench.ggml_products --spec '[{"type": "q4_0", "n": 8192, "k": 2048, "m": 1}]' --threads 2

Each product y = W x runs as a one-node ggml graph on the CPU backend, W in ggml's plain CPU buffer and, for Q4_0
and Q4_K, again in its repack buffer (the interleaved 8x8 tiles llama.cpp builds at load on AVX2/AVX512),
x in fp32 as llama.cpp keeps activations (ggml quantizes x to 8 bits inside the product). Weights are random
valid blocks: speed only. Prints one JSON line: per product, milliseconds per call, plain and repacked, and the
weight bytes.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from offload.weights.ggml_lib import F32, ggml
from offload.weights.ggml_types import GGMLType as T
from offload.weights.gguf_blocks import packed_nbytes, random_blocks

TYPES = {"q4_0": T.Q4_0, "q4_1": T.Q4_1, "q8_0": T.Q8_0, "q4_k": T.Q4_K, "q6_k": T.Q6_K}
REPACKED = ("q4_0", "q4_k")   # the types ggml repacks on x86; its repack buffer crashes on the others


def time_product(qtype: T, n: int, k: int, m: int, buffer_type: int, seconds: float, copies: int) -> float:
    """Milliseconds per call of y = W x, W [n, k] of qtype in `buffer_type`, x [m, k] fp32, taken in turn over
    `copies` copies of W (so that they outgrow the CPU's last-level cache, as a model's layers do)."""
    g = ggml()
    contexts, buffers, graphs = [], [], []
    try:
        rng = np.random.default_rng(0)
        blocks = random_blocks(qtype, (n, k), rng)
        values = rng.standard_normal((m, k)).astype(np.float32)
        for _ in range(copies):
            weights_ctx, graph_ctx = g.context(g.weight_context_bytes), g.context(g.product_context_bytes)
            contexts += [weights_ctx, graph_ctx]
            w = g.new_2d(weights_ctx, int(qtype), k, n)                 # ggml: ne0 = k (the row), ne1 = n
            buffers.append(g.alloc_in(weights_ctx, buffer_type))
            g.tensor_set(w, blocks.ctypes.data, 0, blocks.nbytes)      # the repack buffer repacks here
            x = g.new_2d(graph_ctx, F32, k, m)
            graph = g.new_graph(graph_ctx, 4, False)
            g.expand(graph, g.mul_mat(graph_ctx, w, x))
            buffers.append(g.alloc_in(graph_ctx, g.cpu_type))
            g.tensor_set(x, values.ctypes.data, 0, values.nbytes)
            graphs.append(graph)
        for graph in graphs:
            g.compute_graph(graph)
        calls, start = 0, time.perf_counter()
        while calls < 2 * copies or time.perf_counter() - start < seconds:
            g.compute_graph(graphs[calls % copies])
            calls += 1
        return (time.perf_counter() - start) / calls * 1e3
    finally:
        for buffer in buffers:
            g.buffer_free(buffer)
        for context in contexts:
            g.free(context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True, help='JSON list of {"type", "n", "k", "m"}')
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=0.3, help="timing window per product")
    parser.add_argument("--cold-bytes", type=int, default=96 << 20,
                        help="copies of each matrix taken in turn, at least this many bytes in all (beyond the CPU's "
                             "last-level cache: a layer's weights come from RAM); 0: one copy, cache-hot")
    args = parser.parse_args()
    import torch
    torch.set_num_threads(args.threads)          # ggml's backend takes torch's thread count
    g, out = ggml(), []
    for item in json.loads(args.spec):
        qtype, n, k, m = TYPES[item["type"]], item["n"], item["k"], item["m"]
        weight_bytes = packed_nbytes(qtype, (n, k))
        copies = max(1, -(-args.cold_bytes // weight_bytes))
        row = {**item, "weight_bytes": weight_bytes, "copies": copies,
               "plain_ms": round(time_product(qtype, n, k, m, g.cpu_type, args.seconds, copies), 4)}
        if g.repack_type and item["type"] in REPACKED:
            row["repacked_ms"] = round(time_product(qtype, n, k, m, g.repack_type, args.seconds, copies), 4)
        out.append(row)
    print(json.dumps({"products": out, "repack_buffer": bool(g.repack_type)}))


if __name__ == "__main__":
    main()
