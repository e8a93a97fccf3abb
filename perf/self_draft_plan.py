"""What `plan --draft self` reports. For each substitute width (spec/self_draft.SUBSTITUTE_BITS): whether the
substitutes fit beside what never streams, how many target layers stay resident (the planner's answer for that
width: n resident layers + (L - n) substitutes), the substitutes' bytes, and on a described GPU the projected pass
time and rate with that width's acceptance curve and the self-draft's own step cost (perf/self_draft_cost.py).
Bits and resident layers are one decision: the pick is the width with the most projected tokens per second (the
most bits that fit where nothing is projected, as runtime/self_drafting.choose_substitutes does). Beside it,
llama.cpp's partial offload on the same card and RAM (perf/llama_cpp_offload.py), and the winner.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from offload.byte_units import format_bytes
from offload.planner import Plan, PlanRequest, beside_layers_bytes, make_plan
from spec.self_draft import SUBSTITUTE_BITS, SubstituteConfig, substitute_layer_bytes

from .llama_cpp_offload import LlamaCppOffload
from .plan_projection import PlanProjection, ProjectionSettings, packed_decode_gbps, project_plan
from .projection import AcceptanceCurve
from .result_formats import acceptance_points
from .self_draft_cost import self_draft_cost

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SELF_CURVES = "bench/results/tree_simulation_self_{bits}bit_all_128.json"   # 124 prompts, 128 tokens
CURVE_LABEL = "measured on the default pair (SmolLM2-135M drafting for itself), not this model"


def self_curves(pattern: str | None) -> dict[int, AcceptanceCurve | str]:
    """bits -> the self-draft's acceptance curve at those bits, or why there is none. `pattern`: one acceptance
    file for every width, or a path with {bits}; None: DEFAULT_SELF_CURVES in this repository, where present."""
    out: dict[int, AcceptanceCurve | str] = {}
    for bits in SUBSTITUTE_BITS:
        name = (pattern or DEFAULT_SELF_CURVES).replace("{bits}", str(bits))
        path = ROOT / name if pattern is None else Path(name)
        if pattern is None and not path.exists():
            out[bits] = f"no acceptance curve ({name} not found; --acceptance FILE, {{bits}} for one per width)"
            continue
        out[bits] = AcceptanceCurve(acceptance_points(json.loads(path.read_text()), name), source=name)
    return out


@dataclass(slots=True)
class SubstituteOption:
    bits: int
    substitute_layer_bytes: int
    num_layers: int
    room_bytes: int                        # device bytes beside what never streams and the ring
    plan: Plan | None                      # None: the substitutes alone (every layer streamed) exceed the room
    projection: PlanProjection | None = None
    why_not_projected: str = ""

    @property
    def num_resident(self) -> int:
        return self.plan.tier_of.count("device") if self.plan else 0

    @property
    def substitutes_bytes(self) -> int:
        """On the device where they fit; where not, the least they would take (every layer streamed)."""
        return (self.num_layers - self.num_resident) * self.substitute_layer_bytes

    @property
    def tokens_per_second(self) -> float | None:
        return self.projection.projection.tokens_per_second if self.projection else None

    def as_dict(self) -> dict:
        out = {"bits": self.bits, "fits": self.plan is not None, "substitute_layer_bytes": self.substitute_layer_bytes,
               "room_bytes": self.room_bytes, "substitutes_bytes": self.substitutes_bytes,
               "resident_layers": self.num_resident}
        if self.plan is None:
            return out
        out["layers"] = self.plan.as_dict()["layers"]
        if self.projection is None:
            return {**out, "projection": None, "why_not_projected": self.why_not_projected}
        best = self.projection.projection.best
        return {**out, "best_budget": best.budget, "pass_seconds": best.pass_seconds,
                "draft_seconds": best.draft_seconds, "tokens_per_pass": best.tokens_per_pass,
                "tokens_per_second": best.tokens_per_second, "projection": self.projection.as_dict()}


def substitute_options(request: PlanRequest, device_is_cpu: bool, curves: dict[int, AcceptanceCurve | str],
                       settings: ProjectionSettings | None) -> list[SubstituteOption]:
    """One option per width, planned (and projected where `settings` describes a GPU and the width has a curve).
    `request`: the target alone (no draft, no substitutes)."""
    num_layers, options = request.config.num_layers, []
    for bits in SUBSTITUTE_BITS:
        substitute = substitute_layer_bytes(request.config, SubstituteConfig(bits), device_is_cpu)
        planned = replace(request, substitute_layer_bytes=substitute)
        room = request.device_budget - beside_layers_bytes(planned)   # the KV cache holds the draft's tree rows too
        plan = make_plan(planned) if num_layers * substitute <= room else None
        option = SubstituteOption(bits, substitute, num_layers, room, plan)
        if plan is not None:
            _project(option, curves[bits], settings)
        options.append(option)
    return options


def _project(option: SubstituteOption, curve: AcceptanceCurve | str, settings: ProjectionSettings | None) -> None:
    if isinstance(curve, str):
        option.why_not_projected = curve
    elif settings is None or settings.gpu is None or not settings.gpu.memory_gbps:
        option.why_not_projected = "no GPU with a memory bandwidth described (--gpu NAME)"
    else:
        decode_gbps = packed_decode_gbps(option.plan.request, settings, [])
        cost = self_draft_cost(option.plan, settings.gpu, decode_gbps, settings.efficiency, curve)
        option.projection = project_plan(option.plan, replace(settings, acceptance=curve, draft_seconds=cost.seconds,
                                                              draft_text=cost.describe()))


@dataclass(slots=True)
class SelfDraftReport:
    options: list[SubstituteOption]
    all_resident: bool                     # the target fits the device whole: no layer streams, no self-draft
    llama_cpp: LlamaCppOffload | None = None
    assumptions: list[str] = field(default_factory=list)

    @property
    def chosen(self) -> SubstituteOption | None:
        """The most projected tokens per second; where nothing is projected, the most bits that fit."""
        if self.all_resident:
            return None
        fitting = [o for o in self.options if o.plan is not None]
        projected = [o for o in fitting if o.projection is not None]
        if projected:
            return max(projected, key=lambda o: (o.tokens_per_second, o.bits))
        return max(fitting, key=lambda o: o.bits, default=None)

    def verdict(self) -> str:
        chosen, peer = self.chosen, self.llama_cpp
        if self.all_resident:
            return "every layer fits the device: nothing streams, a self-draft would cost what the target costs"
        if chosen is None:
            least = min(self.options, key=lambda o: o.substitute_layer_bytes)
            return (f"the self-draft does not fit at any bits: {least.bits}-bit substitutes of all "
                    f"{least.num_layers} layers take {format_bytes(least.substitutes_bytes)}, the device has "
                    f"{format_bytes(max(least.room_bytes, 0))} beside what never streams"
                    + (f"; llama.cpp: {peer.tokens_per_second:.2f} tok/s" if peer else ""))
        if chosen.projection is None or peer is None:
            return f"self-draft at {chosen.bits} bits ({chosen.num_resident} layers resident); no rate to compare"
        ours, theirs = chosen.tokens_per_second, peer.tokens_per_second
        winner = "self-draft" if ours > theirs else "llama.cpp partial offload"
        return (f"winner: {winner}: self-draft at {chosen.bits} bits {ours:.2f} tok/s vs llama.cpp "
                f"{theirs:.2f} tok/s ({max(ours, theirs) / min(ours, theirs):.2f}x)")

    def as_dict(self) -> dict:
        chosen = self.chosen
        return {"options": [o.as_dict() for o in self.options], "all_resident": self.all_resident,
                "chosen_bits": chosen.bits if chosen else None,
                "llama_cpp": self.llama_cpp.as_dict() if self.llama_cpp else None,
                "verdict": self.verdict(), "assumptions": self.assumptions}
