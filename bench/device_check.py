"""GPU check: pinned host->device bandwidth and streaming efficiency for Llama-3.1-70B-shaped layers.

    python bench/device_check.py [--dry-run] [--layers 4] [--tokens 1,16,...] > result.json
A random-initialised model with the 70B layer shapes (bf16, every layer streamed from pinned RAM)
runs passes of each size; efficiency = (streamed bytes / raw pinned H2D bandwidth) / pass seconds.
Then SpQR w4 dequantization of one such layer (random packed codes): the fused Triton kernel (where
Triton runs) and the torch path, against the time the pinned link takes to bring the packed bytes.
--dry-run shrinks the shapes and runs on the CPU, so the test suite exercises the same code.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from offload.bandwidth import copy_gbps, host_to_device_gbps  # noqa: E402
from offload.config import ModelConfig, RopeConfig  # noqa: E402
from offload.loader import LoadOptions, build_engine  # noqa: E402
from offload.packing import LayerLayout  # noqa: E402
from offload.weights import layer_tensor_names  # noqa: E402
from quant.checkpoint import matrix_shapes  # noqa: E402
from quant.packbits import packed_bytes  # noqa: E402
from quant.spqr_format import STATS_RUN, SpqrMatrix, _fused_kernel  # noqa: E402

LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_heads=64, num_kv_heads=8, head_dim=128)
DRY_RUN = dict(hidden_size=256, intermediate_size=896, num_heads=8, num_kv_heads=2, head_dim=32)


class RandomSource:
    """A WeightSource of random tensors with the given shapes (nothing read from disk)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        self.config, self.dtype = config, dtype

    def _rand(self, *shape: int) -> torch.Tensor:
        return (torch.randn(shape, dtype=torch.float32) * 0.02).to(self.dtype)

    def global_tensors(self) -> dict[str, torch.Tensor]:
        c = self.config
        return {"embed": self._rand(c.vocab_size, c.hidden_size), "norm": torch.ones(c.hidden_size, dtype=self.dtype),
                "lm_head": self._rand(c.vocab_size, c.hidden_size)}

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes = {"input_norm": (c.hidden_size,), "post_norm": (c.hidden_size,), "q": (q, c.hidden_size),
                  "k": (kv, c.hidden_size), "v": (kv, c.hidden_size), "o": (c.hidden_size, q),
                  "gate": (c.intermediate_size, c.hidden_size), "up": (c.intermediate_size, c.hidden_size),
                  "down": (c.hidden_size, c.intermediate_size)}
        return {name: self._rand(*shapes[name]) for name in layer_tensor_names(c)}

    def layout(self, dtype: torch.dtype) -> LayerLayout:
        return LayerLayout.from_tensors(self.layer(0), dtype)

    def decode_layer(self, index: int, stored: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
        return stored


def run(dry_run: bool, num_layers: int, pass_tokens: list[int]) -> dict:
    device = torch.device("cpu" if dry_run or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    shapes = DRY_RUN if dry_run else LLAMA_70B
    config = ModelConfig(family="llama", vocab_size=1024, num_layers=num_layers, rms_norm_eps=1e-5,
                         max_position=131072, rope=RopeConfig(theta=500000.0), **shapes)
    source = RandomSource(config, dtype)
    max_tokens = max(pass_tokens)
    probe = LoadOptions(device=device.type, dtype={torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype],
                        max_context=max_tokens + 1, max_pass_tokens=max_tokens, gpu_mem=1 << 50, ram=1 << 50)
    fixed = _fixed_bytes(build_engine(source, probe))
    layer_bytes = config.layer_param_count * dtype.itemsize
    probe.gpu_mem = fixed + 2 * layer_bytes + layer_bytes // 2     # every layer streams through a ring of 2
    engine = build_engine(source, probe)
    try:
        raw = host_to_device_gbps(min(layer_bytes * 2, 2 << 30), device)
        rows = [_measure(engine, config, n) for n in pass_tokens]
    finally:
        engine.layers.close()
    return {"check": "device", "date": date.today().isoformat(), "device": _device_name(device),
            "dry_run": dry_run, "dtype": str(dtype).removeprefix("torch."), "layers": num_layers,
            "layer_bytes": engine.layers.layout.num_bytes, "pinned_h2d_gbps": round(raw, 3),
            "tier": "ram", "passes": rows, "spqr_w4_dequantize": _dequantize_check(config, device, raw)}


def _random_spqr(shape: tuple[int, int], bits: int, device: torch.device) -> SpqrMatrix:
    """A packed matrix of random codes (any byte is valid) and statistics, no outliers."""
    out, inp = shape
    groups, runs, stats_bits = inp // 16, -(-out // STATS_RUN), 3
    index = torch.int16 if max(out, inp) <= torch.iinfo(torch.int16).max else torch.int32

    def random_bytes(count: int) -> torch.Tensor:
        return torch.randint(0, 256, (count,), dtype=torch.uint8, device=device)

    params = (torch.rand(runs, groups, 4, device=device) * torch.tensor([1e-3, 4.0, 0.5, 2.0], device=device)).half()
    return SpqrMatrix(shape, bits, 16, stats_bits, random_bytes(packed_bytes(out * inp, bits)),
                      random_bytes(packed_bytes(out * groups, stats_bits)),
                      random_bytes(packed_bytes(out * groups, stats_bits)), params,
                      torch.randperm(inp, device=device).to(index), torch.zeros(out + 1, dtype=index, device=device),
                      torch.zeros(0, dtype=index, device=device), torch.zeros(0, dtype=torch.float16, device=device))


def _dequantize_check(config: ModelConfig, device: torch.device, link_gbps: float) -> dict:
    """One layer's matrices at w4: ms to dequantize with each path vs ms to transfer the packed bytes."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    matrices = [_random_spqr(shape, 4, device) for shape in matrix_shapes(config).values()]
    paths = {"torch": False}
    if device.type == "cuda" and _fused_kernel() is not None:
        paths["fused"] = True
    result = {"params": sum(m.shape[0] * m.shape[1] for m in matrices), "packed_bytes": sum(m.num_bytes for m in matrices),
              "fused_available": "fused" in paths}
    result["transfer_ms"] = round(1e3 * result["packed_bytes"] / (link_gbps * 1e9), 3)
    for name, fused in paths.items():
        timings = []
        for _ in range(4):     # the first is a warm-up (and the kernel's compilation)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for matrix in matrices:
                matrix.dequantize(dtype, permuted=True, fused=fused)
            if device.type == "cuda":
                torch.cuda.synchronize()
            timings.append(time.perf_counter() - start)
        result[f"{name}_ms"] = round(1e3 * min(timings[1:]), 3)
    if "fused" in paths:
        first = matrices[0]
        result["fused_equals_torch"] = bool(torch.allclose(first.dequantize(dtype, fused=True).float(),
                                                           first.dequantize(dtype, fused=False).float(),
                                                           rtol=1e-2, atol=1e-3))
    return result


def _fixed_bytes(engine) -> int:
    fixed = sum(i.num_bytes for i in engine.plan.items if "layers" not in i.component)
    engine.layers.close()
    return fixed


def _measure(engine, config: ModelConfig, num_tokens: int) -> dict:
    model, layers = engine.model, engine.layers
    tokens = torch.randint(0, config.vocab_size, (1, num_tokens))
    timings = []
    for _ in range(3):   # the first is a warm-up
        cache = model.new_cache(num_tokens + 1)
        start = time.perf_counter()
        model.forward(tokens, cache, last_only=True)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        timings.append((time.perf_counter() - start, layers.last_pass))
    seconds, stats = min(timings[1:], key=lambda t: t[0])
    sources = [layers.ram.buffers[i] for i in layers.streamed]
    raw = copy_gbps(sources, layers.slots[0].buffer)
    return {"tokens": num_tokens, "pass_seconds": round(seconds, 5), "bytes_streamed": stats.bytes_streamed,
            "wait_seconds": round(stats.wait_seconds, 5), "raw_gbps": round(raw, 3),
            "efficiency": round(stats.bytes_streamed / (raw * 1e9) / seconds, 4)}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or 'unknown'})"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", default="1,16,64,256,1024,2048")
    args = parser.parse_args()
    sizes = [int(x) for x in args.tokens.split(",")]
    print(json.dumps(run(args.dry_run, args.layers, sizes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
