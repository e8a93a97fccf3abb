"""What `plan` predicts beyond placement, on a described GPU: the pass time by tree size, the tree budget
that maximises the rate (tokens per second), and that rate:

    pass(b)  = perf.pass_model (per layer: max(transfer, compute + decode)), or a measured curve rescaled
    draft(b) = seconds per draft round x rounds(b)            (perf.projection.DraftCost)
    rate(b)  = tokens per pass a(b) / (pass(b) + draft(b))    (perf.projection.project)

Defaults, each stated in the projection's `assumptions`:
    decode       a fused kernel that reads the packed layer and writes it dense, at
                 DECODE_MEMORY_EFFICIENCY of the GPU's memory bandwidth
    draft round  one draft forward over up to MAX_WIDTH tree nodes: the slower of reading its weights at
                 DRAFT_MEMORY_EFFICIENCY of memory bandwidth and its GEMMs at the pass model's efficiency
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from offload.byte_units import format_bytes
from offload.model.config import ModelConfig
from offload.planner import Plan, PlanRequest
from spec.grow import MAX_WIDTH

from .pass_model import GpuPreset, MeasuredPassCurve, PassModelInputs, pass_breakdown
from .projection import AcceptanceCurve, DraftCost, Projection, project
from .tree_size import MAX_BUDGET

GB = 1e9
DECODE_MEMORY_EFFICIENCY = 0.5   # a dequantization kernel's share of peak DRAM bandwidth (assumed)
DRAFT_MEMORY_EFFICIENCY = 0.8    # a batch-1 forward's weight reads (memory-bound GEMV) (assumed)


@dataclass(slots=True)
class ProjectionSettings:
    acceptance: AcceptanceCurve
    link_gbps: float                            # host->device GB/s
    gpu: GpuPreset | None = None                # TFLOP/s and memory bandwidth of the pass model and defaults
    disk_gbps: float | None = None              # needed when the plan streams from disk
    draft: ModelConfig | None = None            # the draft model (resident, compute dtype)
    draft_round_seconds: float | None = None    # None: the roofline default from `draft` on `gpu`
    decode_gbps: float | None = None            # packed GB/s; None: the fused-kernel default
    measured: MeasuredPassCurve | None = None   # replaces the pass model where given
    measured_label: str = ""                    # where `measured` comes from (device, file)
    efficiency: float = 0.7                     # share of peak TFLOP/s the GEMMs reach
    # seconds to grow a tree of b tokens, given whole (a self-draft's, perf/self_draft_plan.py), and its
    # assumption line; replaces the per-round model of `draft`
    draft_seconds: Callable[[int], float] | None = None
    draft_text: str = ""

    def __post_init__(self) -> None:
        if self.gpu is None and self.measured is None:
            raise ValueError("a projection needs a GPU (--gpu NAME or --gpu-tflops X) or a measured pass-time "
                             "curve (--measured-curve FILE)")
        if not self.link_gbps > 0:
            raise ValueError(f"link GB/s must be positive, got {self.link_gbps}")
        for name in ("draft_round_seconds", "decode_gbps"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")


@dataclass(slots=True)
class PlanProjection:
    projection: Projection
    transfer_seconds: dict[str, float]                          # one pass, per streamed tier
    compute_seconds: dict[int, float] = field(default_factory=dict)   # by budget (pass model only)
    assumptions: list[str] = field(default_factory=list)
    gpu: GpuPreset | None = None
    link_gbps: float = 0.0

    def as_dict(self) -> dict:
        out = self.projection.as_dict()
        for row in out["rows"]:
            row["compute_seconds"] = self.compute_seconds.get(row["budget"])
        gpu = None if self.gpu is None else {"name": self.gpu.name, "tflops": self.gpu.tflops,
                                             "memory_gbps": self.gpu.memory_gbps}
        return {**out, "gpu": gpu, "link_gbps": self.link_gbps, "transfer_seconds": self.transfer_seconds,
                "assumptions": self.assumptions}


def project_plan(plan: Plan, settings: ProjectionSettings) -> PlanProjection:
    """Rows for tree budgets 1, 2, 4, ... up to the plan's largest tree (and the measured curve's)."""
    request, assumptions = plan.request, []
    if plan.tier_of.count("disk") and not (settings.disk_gbps or 0) > 0:
        raise ValueError(f"{plan.tier_of.count('disk')} layers stream from disk: give a disk rate (--disk-gbps)")
    decode_gbps = packed_decode_gbps(request, settings, assumptions)
    inputs = None
    if settings.gpu is not None:
        inputs = PassModelInputs.from_plan(plan, settings.gpu, settings.disk_gbps, link_gbps=settings.link_gbps,
                                           decode_gbps=decode_gbps, efficiency=settings.efficiency)
    pass_seconds = _pass_seconds(plan, settings, inputs, assumptions)
    draft_seconds = settings.draft_seconds or DraftCost(_draft_round_seconds(request, settings, assumptions)).seconds
    if settings.draft_seconds:
        assumptions.append(settings.draft_text)
    max_budget = min(request.max_tree, MAX_BUDGET, settings.measured.max_tokens if settings.measured else MAX_BUDGET)
    projection = project(pass_seconds, settings.acceptance, draft_seconds, max_budget)
    assumptions.append(_acceptance_line(settings.acceptance, projection))
    compute = {row.budget: pass_breakdown(inputs, row.budget).compute_seconds
               for row in projection.rows} if inputs and settings.measured is None else {}
    return PlanProjection(projection, _transfer_seconds(plan, settings), compute, assumptions, settings.gpu,
                          settings.link_gbps)


def _transfer_seconds(plan: Plan, settings: ProjectionSettings) -> dict[str, float]:
    out = {"ram": plan.streamed_bytes("ram") / (settings.link_gbps * GB)}
    if plan.tier_of.count("disk"):
        out["disk"] = plan.streamed_bytes("disk") * (1 / (settings.disk_gbps * GB) + 1 / (settings.link_gbps * GB))
    return out


def _pass_seconds(plan: Plan, settings: ProjectionSettings, inputs: PassModelInputs | None,
                  assumptions: list[str]) -> Callable[[int], float]:
    if settings.measured is None:
        gpu = settings.gpu
        decode = " + decode" if inputs.decode_gbps else ""
        assumptions.append(
            f"pass model: {gpu.name} at {gpu.tflops:g} TFLOPS x {settings.efficiency:.0%} for the GEMMs (2 x "
            f"{inputs.layer_params / 1e9:.2f} B params x tokens per layer); a streamed layer costs max(transfer, "
            f"compute{decode}), a resident one its compute; the LM head ({inputs.head_params / 1e9:.2f} B params) "
            "on every token; attention over the context and kernel launches not modelled")
        return lambda num_tokens: pass_breakdown(inputs, num_tokens).seconds
    curve, disk_layers = settings.measured, plan.tier_of.count("disk")
    over_link = plan.streamed_bytes("ram") + plan.streamed_bytes("disk")
    scaled = curve.scaled(over_link, settings.link_gbps, len(plan.tier_of))
    disk_read = plan.streamed_bytes("disk") / (settings.disk_gbps * GB) if disk_layers else 0.0
    assumptions.append(
        f"pass time: measured on {settings.measured_label or 'a GPU'} ({curve.num_layers} layers, "
        f"{curve.bytes_streamed / GB:.2f} GB over {curve.link_gbps:g} GB/s, up to {curve.max_tokens} tokens), "
        f"rescaled to this plan's {over_link / GB:.2f} GB over {settings.link_gbps:g} GB/s and {len(plan.tier_of)} "
        "layers (transfer + the measured residual x layer ratio); decoding packed layers not included"
        + (f"; disk reads {disk_read:.2f} s added" if disk_layers else ""))
    return lambda num_tokens: scaled.seconds(num_tokens) + disk_read


def packed_decode_gbps(request: PlanRequest, settings: ProjectionSettings, assumptions: list[str]) -> float | None:
    """Packed GB/s the GPU decodes layers at (None: nothing packed, or no rate known); its assumption appended."""
    if not (request.ring_decode_bytes or request.decode_workspace_bytes):
        return None
    where = "streamed layers; resident ones decoded once at load" if request.resident_layer_bytes else \
        "every layer, every pass"
    if settings.decode_gbps:
        seconds = request.layer_bytes / (settings.decode_gbps * GB)
        assumptions.append(f"decode: {settings.decode_gbps:g} GB/s of packed bytes (--decode-gbps): "
                           f"{seconds * 1e3:.1f} ms per layer ({where})")
        return settings.decode_gbps
    memory = settings.gpu.memory_gbps if settings.gpu else None
    if memory is None:
        assumptions.append("decode: not counted (no memory bandwidth known: --gpu NAME or --decode-gbps)")
        return None
    dense = request.config.layer_param_count * request.dtype_bytes
    seconds = (request.layer_bytes + dense) / (memory * GB * DECODE_MEMORY_EFFICIENCY)
    assumptions.append(
        f"decode: {seconds * 1e3:.1f} ms per layer ({where}): a fused kernel reading "
        f"{format_bytes(request.layer_bytes)} packed and writing {format_bytes(dense)} dense at {DECODE_MEMORY_EFFICIENCY:.0%} of {memory:g} GB/s "
        "(--decode-gbps sets packed GB/s)")
    return request.layer_bytes / seconds / GB


def default_draft_round_seconds(draft: ModelConfig, dtype_bytes: int, gpu: GpuPreset, efficiency: float,
                                width: int = MAX_WIDTH) -> float:
    """One draft forward over `width` tree nodes: max(weights read once, GEMMs over width tokens). The
    embedding lookup reads a row per token; every other weight (layers, LM head) is read in full."""
    params = draft.num_layers * draft.layer_param_count + draft.vocab_size * draft.hidden_size
    compute = 2 * params * width / (gpu.tflops * 1e12 * efficiency)
    memory = params * dtype_bytes / (gpu.memory_gbps * GB * DRAFT_MEMORY_EFFICIENCY) if gpu.memory_gbps else 0.0
    return max(compute, memory)


def _draft_round_seconds(request: PlanRequest, settings: ProjectionSettings, assumptions: list[str]) -> float:
    rounds = DraftCost(0.0)
    rounds_text = (f"rounds per tree of b tokens: max(min({rounds.max_depth + 1}, log2 b), b / {rounds.width}) "
                   "(perf.projection.DraftCost)")
    if settings.draft_round_seconds is not None:
        assumptions.append(f"draft: {settings.draft_round_seconds * 1e3:.1f} ms per round (--draft-ms); {rounds_text}")
        return settings.draft_round_seconds
    if settings.draft is None or settings.gpu is None:
        why = "no draft given (--draft CONFIG or --draft-ms)" if settings.draft is None else \
            "no GPU described to derive it from (--gpu NAME or --draft-ms)"
        assumptions.append(f"draft: time not counted: {why}")
        return 0.0
    gpu, draft = settings.gpu, settings.draft
    seconds = default_draft_round_seconds(draft, request.dtype_bytes, gpu, settings.efficiency)
    params = draft.num_layers * draft.layer_param_count + draft.vocab_size * draft.hidden_size
    memory = f"{DRAFT_MEMORY_EFFICIENCY:.0%} of {gpu.memory_gbps:g} GB/s" if gpu.memory_gbps else "memory not known"
    assumptions.append(
        f"draft: {seconds * 1e3:.1f} ms per round: the slower of reading its {params / 1e9:.2f} B params "
        f"({request.dtype_bytes} bytes each) at {memory} and GEMMs over {MAX_WIDTH} nodes at "
        f"{settings.efficiency:.0%} of {gpu.tflops:g} TFLOPS (--draft-ms to set); {rounds_text}")
    return seconds


def _acceptance_line(curve: AcceptanceCurve, projection: Projection) -> str:
    largest = projection.rows[-1].budget
    line = (f"acceptance: {curve.source or 'given curve'}: {curve.tokens_per_pass(largest):.2f} tokens per pass at "
            f"budget {largest}")
    if largest > curve.max_budget:
        line += f" (held at its largest measured budget, {curve.max_budget})"
    if curve.source.startswith("perf/data"):
        line += "; measured on the default SmolLM2-135M pair, not this one (--acceptance FILE for yours)"
    return line
