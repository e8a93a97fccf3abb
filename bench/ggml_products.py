"""ggml's own CPU matrix products, timed through the libggml that llama-cpp-python ships (ctypes, no build).

Run by the llama.cpp peer's Python (`bench.cpu_kernel_bench --parts ggml` starts it), never imported by the
product: it needs numpy and llama_cpp's shared libraries, and nothing from this repository.

    PYTHON bench/ggml_products.py --spec '[{"type": "q4_0", "n": 8192, "k": 2048, "m": 1}]' --threads 2

Each product y = W x runs as a one-node ggml graph on the CPU backend, W in ggml's plain CPU buffer and, for Q4_0
and Q4_K, again in its repack buffer (the interleaved 8x8 tiles llama.cpp builds at load on AVX2/AVX512),
x in fp32 as llama.cpp keeps activations (ggml quantizes x to 8 bits inside the product). Weights are random
blocks with small fp16 scales: speed only. Prints one JSON line: per product, milliseconds per call, plain and
repacked, and the weight bytes.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import time
from pathlib import Path

import numpy as np

# ggml_type id, block bytes, weights per block, byte offsets of the block's fp16 scales
TYPES = {"q4_0": (2, 18, 32, (0,)), "q4_1": (3, 20, 32, (0, 2)), "q8_0": (8, 34, 32, (0,)),
         "q4_k": (12, 144, 256, (0, 2)), "q6_k": (14, 210, 256, (208,))}
F32 = 0
REPACK_BUFT = "_Z35ggml_backend_cpu_repack_buffer_typev"   # ggml_backend_cpu_repack_buffer_type(), C++ linkage
REPACKED = ("q4_0", "q4_k")   # the types ggml repacks on x86; the repack buffer crashes on the others
P = ctypes.c_void_p


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", P), ("no_alloc", ctypes.c_bool)]


class Ggml:
    """The few libggml entry points a one-product graph needs."""

    def __init__(self, threads: int):
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("llama_cpp is not installed in this Python")
        lib = Path(list(spec.submodule_search_locations)[0]) / "lib"
        base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        fn = self._fn
        self.init = fn(base, "ggml_init", P, _InitParams)
        self.free = fn(base, "ggml_free", None, P)
        self.new_2d = fn(base, "ggml_new_tensor_2d", P, P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        self.mul_mat = fn(base, "ggml_mul_mat", P, P, P, P)
        self.new_graph = fn(base, "ggml_new_graph", P, P)
        self.expand = fn(base, "ggml_build_forward_expand", None, P, P)
        self.tensor_overhead = fn(base, "ggml_tensor_overhead", ctypes.c_size_t)
        self.graph_overhead = fn(base, "ggml_graph_overhead", ctypes.c_size_t)
        self.alloc = fn(base, "ggml_backend_alloc_ctx_tensors_from_buft", P, P, P)
        self.buffer_free = fn(base, "ggml_backend_buffer_free", None, P)
        self.tensor_set = fn(base, "ggml_backend_tensor_set", None, P, P, ctypes.c_size_t, ctypes.c_size_t)
        self.nbytes = fn(base, "ggml_nbytes", ctypes.c_size_t, P)
        self.compute = fn(base, "ggml_backend_graph_compute", ctypes.c_int, P, P)
        fn(cpu, "ggml_cpu_init", None)()
        self.backend = fn(cpu, "ggml_backend_cpu_init", P)()
        fn(cpu, "ggml_backend_cpu_set_n_threads", None, P, ctypes.c_int)(self.backend, threads)
        self.cpu_buft = fn(cpu, "ggml_backend_cpu_buffer_type", P)()
        self.repack_buft = fn(cpu, REPACK_BUFT, P)() if hasattr(cpu, REPACK_BUFT) else None

    @staticmethod
    def _fn(lib, name: str, restype, *argtypes):
        f = getattr(lib, name)
        f.restype, f.argtypes = restype, list(argtypes)
        return f

    def context(self, tensors: int, graph: bool = False):
        size = self.tensor_overhead() * tensors + (self.graph_overhead() if graph else 0)
        return self.init(_InitParams(size, None, True))


def random_blocks(qtype: str, n: int, k: int, rng) -> np.ndarray:
    _, block_bytes, per_block, scales = TYPES[qtype]
    blocks = rng.integers(0, 256, size=(n * k // per_block, block_bytes), dtype=np.uint8)
    small = np.full(len(blocks), 0.01, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    for offset in scales:
        blocks[:, offset:offset + 2] = small
    return blocks


def time_product(g: Ggml, qtype: str, n: int, k: int, m: int, buft, seconds: float, copies: int) -> float:
    """Milliseconds per call of y = W x, W [n, k] of qtype in buffer type buft, x [m, k] fp32, taken in turn over
    `copies` copies of W (so that they outgrow the CPU's last-level cache, as a model's layers do)."""
    contexts, buffers, graphs = [], [], []
    try:
        rng = np.random.default_rng(0)
        blocks = random_blocks(qtype, n, k, rng)
        values = rng.standard_normal((m, k)).astype(np.float32)
        for _ in range(copies):
            weights_ctx, graph_ctx = g.context(1), g.context(3, graph=True)
            contexts += [weights_ctx, graph_ctx]
            w = g.new_2d(weights_ctx, TYPES[qtype][0], k, n)           # ggml: ne0 = k (the row), ne1 = n
            buffers.append(g.alloc(weights_ctx, buft))
            assert g.nbytes(w) == blocks.nbytes, (g.nbytes(w), blocks.nbytes)
            g.tensor_set(w, blocks.ctypes.data, 0, blocks.nbytes)      # the repack buffer repacks here
            x = g.new_2d(graph_ctx, F32, k, m)
            graph = g.new_graph(graph_ctx)
            g.expand(graph, g.mul_mat(graph_ctx, w, x))
            buffers.append(g.alloc(graph_ctx, g.cpu_buft))
            g.tensor_set(x, values.ctypes.data, 0, values.nbytes)
            graphs.append(graph)
        for graph in graphs:
            g.compute(g.backend, graph)
        calls, start = 0, time.perf_counter()
        while calls < 2 * copies or time.perf_counter() - start < seconds:
            g.compute(g.backend, graphs[calls % copies])
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
    g = Ggml(args.threads)
    out = []
    for item in json.loads(args.spec):
        qtype, n, k, m = item["type"], item["n"], item["k"], item["m"]
        weight_bytes = n * k // TYPES[qtype][2] * TYPES[qtype][1]
        copies = max(1, -(-args.cold_bytes // weight_bytes))
        row = {**item, "weight_bytes": weight_bytes, "copies": copies,
               "plain_ms": round(time_product(g, qtype, n, k, m, g.cpu_buft, args.seconds, copies), 4)}
        if g.repack_buft and qtype in REPACKED:
            row["repacked_ms"] = round(time_product(g, qtype, n, k, m, g.repack_buft, args.seconds, copies), 4)
        out.append(row)
    print(json.dumps({"products": out, "repack_buffer": bool(g.repack_buft)}))


if __name__ == "__main__":
    main()
