"""Predicted seconds for one target pass over n tokens (a verified tree of n nodes), streamed or resident.

Per streamed decoder layer the prefetch ring overlaps the copy of the next layers with this layer's
compute, so a streamed layer costs max(transfer, compute); a resident layer costs its compute:

    t(n) = sum_streamed max(transfer_l, compute_l(n)) + num_device_layers * compute_l(n) + head(n)
    transfer_l = layer_bytes / link          (RAM layer)
               = layer_bytes / disk + layer_bytes / link   (disk layer: read, then copied; as the planner)
    compute_l(n) = 2 * layer_params * n / (tflops * efficiency) + layer_bytes / decode_gbps
                   (resident layers decoded once at load, `resident_decoded`: without the decode term)

Not modelled: attention over the context (~10% of a 70B layer's FLOPs at n=1024 with 4K context),
launch overheads, and the slack a ring of 2-3 layers gives resident layers' compute to hide copies.
A measured curve (`MeasuredPassCurve`) replaces all of this where a GPU has been probed.
"""
from __future__ import annotations

import json
import math
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offload.byte_units import GIB

from .result_formats import read_device_check

GB = 1e9


@dataclass(slots=True, frozen=True)
class GpuPreset:
    name: str
    tflops: float          # dense fp16/bf16 tensor-core TFLOP/s with fp32 accumulate (what torch matmuls use)
    memory_bytes: int
    link_gbps: float       # pinned host->device GB/s, measured or assumed (see each entry)
    memory_gbps: float | None = None   # device memory bandwidth, GB/s (datasheet): bounds decode and the draft


GPU_PRESETS: dict[str, GpuPreset] = {p.name: p for p in (
    # Ada whitepaper: 165.2 dense fp16/bf16 tensor with fp32 accumulate (330.3 with fp16 accumulate;
    # 82.6 is the non-tensor shader rate). Link: 23.9-26.4 GB/s measured pinned on PCIe 4.0 x16 (ANCHORS).
    GpuPreset("rtx4090", 165.2, 24 * GIB, 25.0, 1008.0),   # 21 Gbps GDDR6X x 384 bit
    # GA102 whitepaper: 142 dense fp16 tensor with fp16 accumulate, half (71) with fp32 accumulate on
    # GeForce; 35.6 is the shader fp32 rate. Link: assumed as the 4090's (same PCIe 4.0 x16).
    GpuPreset("rtx3090", 71.0, 24 * GIB, 25.0, 936.0),     # 19.5 Gbps GDDR6X x 384 bit
    # AD106, 34 SMs at 2.535 GHz: 34 * 4 tensor cores * 128 dense fp16 FMA (fp32 acc) * 2 * 2.535e9
    # = 44.1 TFLOP/s (NVIDIA lists 353 sparse FP8 TOPS = 8x this). Link: PCIe 4.0 x8, 15.75 GB/s
    # nominal, assumed 12.5 GB/s real (the x16 ratio, 25 / 31.5).
    GpuPreset("rtx4060ti-16g", 44.1, 16 * GIB, 12.5, 288.0),   # 18 Gbps GDDR6 x 128 bit
    # A100 datasheet: 312 dense bf16/fp16 tensor TFLOP/s. Link: PCIe 4.0 x16, assumed 25 GB/s as above.
    GpuPreset("a100-40g", 312.0, 40 * GIB, 25.0, 1555.0),   # HBM2, datasheet
)}


def gpu_preset(name: str) -> GpuPreset:
    """The preset called `name` (case-insensitive); ValueError naming the known ones otherwise."""
    preset = GPU_PRESETS.get(name.strip().lower())
    if preset is None:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(sorted(GPU_PRESETS))}")
    return preset


@dataclass(slots=True)
class PassModelInputs:
    layer_bytes: int                  # one decoder layer as stored and streamed (packed if quantized)
    layer_params: int                 # weights one token multiplies through in one layer
    link_gbps: float                  # host->device GB/s
    gpu_tflops: float                 # peak dense TFLOP/s of the pass's matmul dtype
    num_device_layers: int = 0
    num_ram_layers: int = 0
    num_disk_layers: int = 0
    disk_gbps: float | None = None    # needed when layers stream from disk
    efficiency: float = 0.7           # share of peak large GEMMs reach (cuBLAS on big fp16 GEMMs: ~0.6-0.9)
    decode_gbps: float | None = None  # packed bytes dequantized per second on the GPU; None: not packed
    head_params: int = 0              # LM head weights, resident, applied to every token of the pass
    resident_decoded: bool = False    # device layers kept dense (decoded once at load): no decode per pass

    def __post_init__(self) -> None:
        for name in ("layer_bytes", "layer_params", "link_gbps", "gpu_tflops"):
            if not getattr(self, name) > 0:
                raise ValueError(f"pass model {name} must be positive, got {getattr(self, name)!r}")
        for name in ("num_device_layers", "num_ram_layers", "num_disk_layers", "head_params"):
            if getattr(self, name) < 0:
                raise ValueError(f"pass model {name} must be >= 0, got {getattr(self, name)!r}")
        if self.num_layers == 0:
            raise ValueError("pass model needs at least one decoder layer on some tier")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must lie in (0, 1], got {self.efficiency!r}")
        if self.num_disk_layers and not (self.disk_gbps or 0) > 0:
            raise ValueError(f"{self.num_disk_layers} layers stream from disk: give disk_gbps > 0, "
                             f"got {self.disk_gbps!r}")
        if self.decode_gbps is not None and not self.decode_gbps > 0:
            raise ValueError(f"decode_gbps must be positive or None, got {self.decode_gbps!r}")

    @property
    def num_layers(self) -> int:
        return self.num_device_layers + self.num_ram_layers + self.num_disk_layers

    @classmethod
    def from_plan(cls, plan: Any, gpu: GpuPreset, disk_gbps: float | None = None, **overrides: Any) -> PassModelInputs:
        """From an offload planner Plan (read by attribute: tier_of, request.layer_bytes,
        request.config.layer_param_count, request.resident_layer_bytes: resident layers stored dense) and
        a GPU preset; keyword overrides win (link_gbps, ...)."""
        tiers, config = plan.tier_of, plan.request.config
        fields = dict(layer_bytes=plan.request.layer_bytes, layer_params=config.layer_param_count,
                      link_gbps=gpu.link_gbps, gpu_tflops=gpu.tflops, num_device_layers=tiers.count("device"),
                      num_ram_layers=tiers.count("ram"), num_disk_layers=tiers.count("disk"), disk_gbps=disk_gbps,
                      head_params=config.vocab_size * config.hidden_size,
                      resident_decoded=bool(getattr(plan.request, "resident_layer_bytes", 0)))
        return cls(**{**fields, **overrides})


@dataclass(slots=True, frozen=True)
class PassBreakdown:
    """One pass over n tokens, seconds: transfer and compute are sums over layers before overlap."""
    tokens: int
    transfer_seconds: float
    compute_seconds: float
    seconds: float


def _flops_seconds(inputs: PassModelInputs, params: int, num_tokens: int) -> float:
    return 2 * params * num_tokens / (inputs.gpu_tflops * 1e12 * inputs.efficiency)


def layer_compute_seconds(inputs: PassModelInputs, num_tokens: int) -> float:
    """One decoder layer's GPU time over num_tokens: the GEMMs plus dequantizing its packed bytes."""
    decode = inputs.layer_bytes / (inputs.decode_gbps * GB) if inputs.decode_gbps else 0.0
    return _flops_seconds(inputs, inputs.layer_params, num_tokens) + decode


def layer_transfer_seconds(inputs: PassModelInputs, tier: str) -> float:
    """Seconds to bring one layer from `tier` ('ram' or 'disk') into a GPU ring slot."""
    link = inputs.layer_bytes / (inputs.link_gbps * GB)
    if tier == "ram":
        return link
    if tier == "disk":
        return inputs.layer_bytes / (inputs.disk_gbps * GB) + link
    raise ValueError(f"streamed tier must be 'ram' or 'disk', got {tier!r}")


def pass_breakdown(inputs: PassModelInputs, num_tokens: int) -> PassBreakdown:
    if num_tokens < 1:
        raise ValueError(f"a pass holds at least 1 token, got {num_tokens}")
    compute = layer_compute_seconds(inputs, num_tokens)
    resident = _flops_seconds(inputs, inputs.layer_params, num_tokens) if inputs.resident_decoded else compute
    streamed = {"ram": inputs.num_ram_layers, "disk": inputs.num_disk_layers}
    transfer = {tier: layer_transfer_seconds(inputs, tier) for tier, count in streamed.items() if count}
    overlapped = sum(streamed[tier] * max(seconds, compute) for tier, seconds in transfer.items())
    head = _flops_seconds(inputs, inputs.head_params, num_tokens)
    total = overlapped + inputs.num_device_layers * resident + head
    return PassBreakdown(num_tokens, sum(streamed[t] * s for t, s in transfer.items()),
                         sum(streamed.values()) * compute + inputs.num_device_layers * resident + head, total)


def predicted_pass_seconds(inputs: PassModelInputs, num_tokens: int) -> float:
    return pass_breakdown(inputs, num_tokens).seconds


@dataclass(slots=True)
class MeasuredPassCurve:
    """Measured (tokens, seconds) pass times of `num_layers` streamed layers moving `bytes_streamed`
    bytes per pass over a `link_gbps` link. seconds(n) interpolates linearly in log(n) between points,
    holds the first value below the first point and refuses n above the last (no extrapolation)."""
    points: list[tuple[int, float]]
    bytes_streamed: int
    link_gbps: float
    num_layers: int

    def __post_init__(self) -> None:
        self.points = sorted((int(n), float(s)) for n, s in self.points)
        sizes = [n for n, _ in self.points]
        if not sizes or sizes[0] < 1 or len(set(sizes)) != len(sizes):
            raise ValueError(f"measured pass sizes must be distinct and >= 1, got {sizes}")
        if any(not math.isfinite(s) or s <= 0 for _, s in self.points):
            raise ValueError(f"measured pass seconds must be finite and > 0, got {self.points}")
        if self.bytes_streamed < 0 or not self.link_gbps > 0 or self.num_layers < 1:
            raise ValueError(f"need bytes_streamed >= 0, link_gbps > 0, num_layers >= 1, got "
                             f"{self.bytes_streamed}, {self.link_gbps}, {self.num_layers}")

    @property
    def max_tokens(self) -> int:
        return self.points[-1][0]

    @property
    def transfer_seconds(self) -> float:
        return self.bytes_streamed / (self.link_gbps * GB)

    def seconds(self, num_tokens: float) -> float:
        if num_tokens > self.max_tokens:
            raise ValueError(f"pass time measured up to {self.max_tokens} tokens only, asked for {num_tokens}; "
                             f"measure larger passes or use the pass model")
        sizes = [n for n, _ in self.points]
        if num_tokens <= sizes[0]:
            return self.points[0][1]
        upper = bisect_left(sizes, num_tokens)        # sizes[upper - 1] < num_tokens <= sizes[upper]
        (n0, s0), (n1, s1) = self.points[upper - 1], self.points[upper]
        return s0 + (s1 - s0) * math.log(num_tokens / n0) / math.log(n1 / n0)

    def scaled(self, bytes_streamed: int, link_gbps: float, num_layers: int | None = None) -> MeasuredPassCurve:
        """The same GPU and layer shapes moving other bytes over another link. Assumes each measured pass
        = transfer (bytes / link, the measured pinned rate) + a residual (compute not hidden under the
        copy, launches), and that only the transfer changes; the residual scales with the layer count.
        Not valid where the new transfer falls below the compute (the pass turns compute-bound)."""
        layer_ratio = (num_layers or self.num_layers) / self.num_layers
        transfer = bytes_streamed / (link_gbps * GB)
        points = [(n, transfer + max(s - self.transfer_seconds, 0.0) * layer_ratio) for n, s in self.points]
        return MeasuredPassCurve(points, bytes_streamed, link_gbps, num_layers or self.num_layers)


def load_device_check(path: str | Path) -> MeasuredPassCurve:
    """The pass-time curve of a device-check result (perf/result_formats.py; tests/gpu/device_check.py)."""
    check = read_device_check(json.loads(Path(path).read_text()), str(path))
    return MeasuredPassCurve(check.points, check.bytes_streamed, check.pinned_h2d_gbps, check.num_layers)
