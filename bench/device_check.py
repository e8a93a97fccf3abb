"""GPU check: pinned host->device bandwidth and streaming efficiency for Llama-3.1-70B-shaped layers.

    python bench/device_check.py [--dry-run] [--layers 4] [--tokens 1,16,...] > result.json
A random-initialised model with the 70B layer shapes (bf16, every layer streamed from pinned RAM)
runs passes of each size; efficiency = (streamed bytes / raw pinned H2D bandwidth) / pass seconds.
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
            "tier": "ram", "passes": rows}


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
