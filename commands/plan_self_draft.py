"""plan --draft self: the self-draft's substitutes at each width against the device memory they take from resident
target layers, the projected rate at each, the width it would pick, and llama.cpp's partial offload on the same
card and RAM beside it (perf/self_draft_plan.py)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from offload.byte_units import format_bytes
from offload.planner import Plan, make_plan
from offload.weights.sizes import WeightBytes
from perf.llama_cpp_offload import LLAMA_CPP_BUFFER_BYTES, llama_cpp_weights, project_llama_cpp
from perf.self_draft_plan import (CURVE_LABEL, DEFAULT_SELF_CURVES, SelfDraftReport, SubstituteOption, self_curves,
                                  substitute_options)

from .plan_common import (_as_json, _edge_assumptions, _gpu, _print_plan, build_request, is_cpu_plan, measured_bandwidth,
                   projection_settings, target_gguf)


@dataclass(slots=True)
class SelfDraftPlan:
    report: SelfDraftReport
    plan: Plan                               # the picked width's; the target alone where none fits
    weights: WeightBytes
    bandwidth: dict[str, float | None]       # bytes/s, as measured_bandwidth

    @property
    def transfer_seconds(self) -> float:
        return self.plan.predicted_transfer_seconds({"ram": self.bandwidth["ram"],
                                                     "disk": self.bandwidth["disk"] or math.inf})

    def as_json(self) -> dict:
        chosen = self.report.chosen
        out = _as_json(self.plan, self.weights, self.bandwidth, self.transfer_seconds,
                       chosen.projection if chosen else None)
        return {**out, "self_draft": self.report.as_dict()}


def build_report(args) -> SelfDraftPlan:
    request, weights = build_request(args)
    bare = make_plan(request)
    bandwidth, link_source = measured_bandwidth(args, bare)
    curves = self_curves(args.acceptance)
    any_curve = next((c for c in curves.values() if not isinstance(c, str)), None)
    settings = projection_settings(args, bandwidth, any_curve) if any_curve else None
    is_cpu = is_cpu_plan(args)
    all_resident = all(t == "device" for t in bare.tier_of)
    report = SelfDraftReport([] if all_resident else substitute_options(request, is_cpu, curves, settings),
                             all_resident)
    report.assumptions = _edge_assumptions(args, bare, bandwidth, link_source) + _substitute_lines(curves, is_cpu)
    gpu = _gpu(args)
    if gpu is not None and gpu.memory_gbps and not is_cpu:
        peer = llama_cpp_weights(request.config, weights, target_gguf(args))
        report.llama_cpp = project_llama_cpp(request.config, peer, request.device_budget, request.host_budget,
                                             args.context, gpu.memory_gbps, args.ram_gbps)
        report.assumptions += _llama_cpp_lines(report, args.context)
    chosen = report.chosen
    return SelfDraftPlan(report, chosen.plan if chosen else bare, weights, bandwidth)


def _substitute_lines(curves: dict, is_cpu: bool) -> list[str]:
    codes = "4-bit codes whatever the width (the CPU's int4 kernel)" if is_cpu else "codes at the width"
    sources = ", ".join(f"{bits} bits: {'none' if isinstance(c, str) else c.source}" for bits, c in curves.items())
    lines = [f"substitutes: every matrix of a streamed layer in {codes} + an fp16 scale and offset per group of 32, "
             "norms fp32 (spec/self_draft.substitute_layer_bytes); resident layers shared, not copied",
             f"acceptance: {CURVE_LABEL}: {sources}"]
    missing = [bits for bits, c in curves.items() if isinstance(c, str)]
    if missing:
        lines.append(f"no acceptance curve for {', '.join(map(str, missing))} bits ({DEFAULT_SELF_CURVES} not "
                     "found): --acceptance FILE, with {bits} in the path for one per width")
    return lines


def _llama_cpp_lines(report: SelfDraftReport, context: int) -> list[str]:
    peer = report.llama_cpp
    lines = [f"llama.cpp: device memory - {format_bytes(LLAMA_CPP_BUFFER_BYTES)} (CUDA context and compute "
             f"buffers, assumed) - each GPU layer's fp16 KV cache at {context} context; one token per pass; weights "
             f"read once per token (attention over the context not modelled, as ours); --ram-gbps "
             f"{peer.ram_gbps:g} for its CPU layers"]
    if peer.weights.note:
        lines.append(f"llama.cpp weights: {peer.weights.note}")
    return lines


def cmd_plan_self(args) -> int:
    result = build_report(args)
    if args.json:
        print(json.dumps(result.as_json()))
        return 0
    from rich.console import Console
    console = Console()   # the plan is the command's output: stdout
    _print_plan(console, result.plan, result.weights, result.bandwidth, result.transfer_seconds)
    _print_report(console, result.report)
    return 0


def _print_report(console, report: SelfDraftReport) -> None:
    if report.options:
        _print_options(console, report.options)
    if report.llama_cpp is not None:
        console.print(report.llama_cpp.describe(), highlight=False, soft_wrap=True)
    console.print(report.verdict(), highlight=False, soft_wrap=True)
    chosen = report.chosen
    console.print("assumptions:")
    lines = report.assumptions + (chosen.projection.assumptions if chosen and chosen.projection else [])
    lines += [f"{o.bits} bits not projected: {o.why_not_projected}" for o in report.options
              if o.plan is not None and o.projection is None]
    for line in dict.fromkeys(lines):
        console.print(f"  - {line}", highlight=False, soft_wrap=True)


def _print_options(console, options: list[SubstituteOption]) -> None:
    from rich import box
    from rich.table import Table
    room = options[0].room_bytes
    table = Table(title=f"self-draft: substitutes of the streamed layers beside the resident ones, in "
                        f"{format_bytes(max(room, 0))} beside what never streams", box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False)
    for column in ("bits", "fits", "resident", "subs GiB", "budget", "pass s", "draft s", "tok/pass", "tok/s"):
        table.add_column(column, justify="right")
    for option in options:
        table.add_row(*_row(option))
    console.print(table, soft_wrap=True)


def _row(option: SubstituteOption) -> list[str]:
    head = [str(option.bits), "yes" if option.plan else "no", str(option.num_resident),
            f"{option.substitutes_bytes / 1024 ** 3:.2f}"]
    if option.projection is None:
        return head + ["-"] * 5
    best = option.projection.projection.best
    return head + [str(best.budget), f"{best.pass_seconds:.3f}", f"{best.draft_seconds:.3f}",
                   f"{best.tokens_per_pass:.2f}", f"{best.tokens_per_second:.2f}"]
