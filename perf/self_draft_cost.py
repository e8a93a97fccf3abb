"""A self-draft's step on a GPU (spec/self_draft.py): every draft round is a forward of the whole model that
streams nothing: the resident layers as the target holds them, a substitute for every streamed layer, the LM head.

    round(memory)  = (resident layers' bytes + substitutes' bytes + LM head bytes) / (memory GB/s x DRAFT_MEMORY_EFFICIENCY)
                     + resident packed layers' decode (SpQR, GGUF kept packed: decoded at each use)
    compute(b)     = 2 x (all layers' params + LM head params) x b / (TFLOP/s x efficiency): every node once
    rounds(b)      = max(a(b), b / MAX_WIDTH): one round per tree level, and a confident draft's tree is about as
                     deep as the path it gets accepted (a(b) = tokens per pass, the accepted path + the target's
                     token); no catch-up round (the draft attends to the target's own keys)
    draft(b)       = rounds(b) x decode + max(rounds(b) x reads, compute(b))

Substitutes are read as packed bits, i.e. by a fused low-bit kernel (quant/lowbit.LowBitWeight today unpacks to a
dense matrix at each use, which costs more on a GPU than this).
"""
from __future__ import annotations

from dataclasses import dataclass

from offload.planner import Plan
from spec.grow import MAX_WIDTH

from .pass_model import GpuPreset
from .plan_projection import DRAFT_MEMORY_EFFICIENCY
from .projection import AcceptanceCurve

GB = 1e9


@dataclass(frozen=True, slots=True)
class SelfDraftCost:
    read_bytes: int              # one round: resident layers + substitutes + LM head
    decode_seconds: float        # one round: resident layers decoded at their use
    params: int                  # weights one token multiplies through: every layer and the LM head
    gpu: GpuPreset
    efficiency: float
    acceptance: AcceptanceCurve

    def __post_init__(self) -> None:
        if not self.gpu.memory_gbps:
            raise ValueError(f"a self-draft's step needs the GPU's memory bandwidth; {self.gpu.name} has none "
                             "(use --gpu NAME)")

    @property
    def read_seconds(self) -> float:
        return self.read_bytes / (self.gpu.memory_gbps * GB * DRAFT_MEMORY_EFFICIENCY)

    def rounds(self, budget: int) -> float:
        return max(self.acceptance.tokens_per_pass(budget), budget / MAX_WIDTH)

    def seconds(self, budget: int) -> float:
        rounds = self.rounds(budget)
        compute = 2 * self.params * budget / (self.gpu.tflops * 1e12 * self.efficiency)
        return rounds * self.decode_seconds + max(rounds * self.read_seconds, compute)

    def describe(self) -> str:
        decode = f" + {self.decode_seconds * 1e3:.1f} ms decoding resident packed layers" if self.decode_seconds else ""
        return (f"self-draft step: rounds(b) = max(tokens per pass a(b), b / {MAX_WIDTH}) (one round per tree "
                f"level, assumed as deep as the accepted path; no catch-up); a round reads {self.read_bytes / GB:.2f} "
                f"GB (resident layers + substitutes + LM head) at {DRAFT_MEMORY_EFFICIENCY:.0%} of "
                f"{self.gpu.memory_gbps:g} GB/s = {self.read_seconds * 1e3:.1f} ms{decode}; the tree's GEMMs "
                f"(2 x {self.params / 1e9:.2f} B params x b) at {self.efficiency:.0%} of {self.gpu.tflops:g} TFLOPS "
                "when slower; substitutes read by a fused low-bit kernel (assumed)")


def self_draft_cost(plan: Plan, gpu: GpuPreset, decode_gbps: float | None, efficiency: float,
                    acceptance: AcceptanceCurve) -> SelfDraftCost:
    """The step of the self-draft of `plan` (a plan made with request.substitute_layer_bytes)."""
    request, config = plan.request, plan.request.config
    num_resident = plan.tier_of.count("device")
    head_params = config.vocab_size * config.hidden_size
    read = (num_resident * request.device_layer_bytes + (config.num_layers - num_resident)
            * request.substitute_layer_bytes + head_params * request.dtype_bytes)
    decoded_at_use = not request.resident_layer_bytes and decode_gbps
    decode = num_resident * request.layer_bytes / (decode_gbps * GB) if decoded_at_use else 0.0
    return SelfDraftCost(read, decode, config.num_layers * config.layer_param_count + head_params, gpu, efficiency,
                         acceptance)
