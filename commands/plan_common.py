"""What `plan` computes and prints, shared by the plan of a model and of its self-draft (commands/plan.py,
commands/plan_self_draft.py): the plan request from flags, the link and disk rates, the projection settings,
the JSON and the tables."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from offload.byte_units import format_bytes, parse_bytes
from offload.devices import DTYPES, choose_device
from offload.memory_limits import default_device_memory, default_host_memory
from offload.model.config import ModelConfig
from offload.planner import Plan, PlanRequest, make_plan
from offload.weights.gguf_import import cache_root
from offload.weights.gguf_model import gguf_file_of
from offload.weights.resolve import resolve_model
from offload.weights.sizes import WeightBytes
from perf.pass_model import GpuPreset, gpu_preset, load_device_check
from perf.plan_projection import PlanProjection, ProjectionSettings, project_plan
from perf.plan_request import request_for_weights, weight_bytes_for
from perf.projection import AcceptanceCurve, default_acceptance_curve, load_acceptance_curve
from spec.self_draft import SELF_DRAFT


NOMINAL_PCIE4_GBPS = 25.0


def build_plan(args) -> tuple[Plan, WeightBytes]:
    """args: target, draft, weights, gpu_mem, ram, budget, context, dtype, device, ring, gpu (as typed)."""
    request, weights = build_request(args)
    return make_plan(request), weights


def build_request(args) -> tuple[PlanRequest, WeightBytes]:
    """The plan request (a self-draft's substitutes not counted) and the decoder layers' bytes."""
    device = choose_device(_device_name(args), require_available=False)
    config = ModelConfig.from_file(resolve_model(args.target))
    weights = weight_bytes_for(config, args.weights, target_gguf(args), args.dtype)
    host_memory = parse_bytes(args.ram) if args.ram else default_host_memory()
    request = request_for_weights(config, weights, DTYPES[args.dtype].itemsize, _device_memory(args, device),
                                  host_memory, _draft_config(args), args.context, args.budget, args.ring,
                                  device.type == "cpu")
    return request, weights


def target_gguf(args) -> Path | None:
    return gguf_file_of(resolve_model(args.target))


def _draft_config(args) -> ModelConfig | None:
    """A draft model's config (None: no draft, or the self-draft, whose substitutes the report plans)."""
    return ModelConfig.from_file(resolve_model(args.draft)) if args.draft and args.draft != SELF_DRAFT else None


def is_cpu_plan(args) -> bool:
    return choose_device(_device_name(args), require_available=False).type == "cpu"


def _device_name(args) -> str:
    """A described GPU plans for CUDA unless --device says otherwise."""
    return "cuda" if args.device == "auto" and (args.gpu or args.gpu_tflops) else args.device


def _device_memory(args, device: torch.device) -> int:
    if args.gpu_mem:
        return parse_bytes(args.gpu_mem)
    if args.gpu:
        return gpu_preset(args.gpu).memory_bytes
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("no GPU here to read free memory from: give --gpu-mem or --gpu for a CUDA plan")
    return default_device_memory(device)


def measured_bandwidth(args, plan: Plan) -> tuple[dict[str, float | None], str]:
    """Bytes/s for the host->device link and the disk (None: no layer on disk and no rate given): given on
    the command line, the --gpu preset's link, else measured now; and where the link rate comes from."""
    from offload.bandwidth import disk_probe_gbps, host_to_device_gbps
    device = choose_device(_device_name(args), require_available=False)
    link, source = args.link_gbps, "--link-gbps"
    if link is None and args.gpu:
        link, source = gpu_preset(args.gpu).link_gbps, f"the {gpu_preset(args.gpu).name} preset"
    if link is None:
        can_measure = device.type == "cpu" or torch.cuda.is_available()
        link = host_to_device_gbps(256 << 20, device) if can_measure else NOMINAL_PCIE4_GBPS
        source = "measured now" if can_measure else "nominal PCIe 4.0 x16"
    disk = args.disk_gbps
    if disk is None and "disk" in plan.tier_of:
        disk = disk_probe_gbps(cache_root() / "probe")
    return {"ram": link * 1e9, "disk": disk * 1e9 if disk else None}, source


def _gpu(args) -> GpuPreset | None:
    if not args.gpu and args.gpu_tflops is None:
        return None
    preset = gpu_preset(args.gpu) if args.gpu else GpuPreset("custom GPU", args.gpu_tflops, 0, NOMINAL_PCIE4_GBPS)
    return replace(preset, tflops=args.gpu_tflops) if args.gpu_tflops is not None else preset


def build_projection(args, plan: Plan, bandwidth: dict[str, float | None]) -> PlanProjection | None:
    """None when no GPU is described or measured."""
    acceptance = load_acceptance_curve(args.acceptance) if args.acceptance else default_acceptance_curve()
    settings = projection_settings(args, bandwidth, acceptance)
    return None if settings is None else project_plan(plan, settings)


def projection_settings(args, bandwidth: dict[str, float | None],
                        acceptance: AcceptanceCurve) -> ProjectionSettings | None:
    """None when no GPU is described or measured."""
    gpu = _gpu(args)
    if gpu is None and not args.measured_curve:
        return None
    measured = load_device_check(args.measured_curve) if args.measured_curve else None
    label = ""
    if measured is not None:
        label = f"{json.loads(Path(args.measured_curve).read_text()).get('device', 'a GPU')} ({args.measured_curve})"
    return ProjectionSettings(
        acceptance=acceptance, link_gbps=bandwidth["ram"] / 1e9, gpu=gpu,
        disk_gbps=bandwidth["disk"] / 1e9 if bandwidth["disk"] else None, draft=_draft_config(args),
        draft_round_seconds=args.draft_ms / 1e3 if args.draft_ms is not None else None,
        decode_gbps=args.decode_gbps, measured=measured, measured_label=label)


def _edge_assumptions(args, plan: Plan, bandwidth: dict[str, float | None], link_source: str) -> list[str]:
    source = "--gpu-mem" if args.gpu_mem else (f"the {args.gpu} preset's memory" if args.gpu else "free memory")
    lines = [f"device memory limit: {format_bytes(plan.request.device_budget)} ({source}); "
             f"link: {bandwidth['ram'] / 1e9:g} GB/s ({link_source})"]
    if "disk" in plan.tier_of:
        lines.append(f"disk: {bandwidth['disk'] / 1e9:g} GB/s, read then copied over the link")
    return lines


def _as_json(plan: Plan, weights: WeightBytes, bandwidth: dict[str, float | None], seconds: float,
             projection: PlanProjection | None) -> dict:
    out = {**plan.as_dict(), "device_budget_bytes": plan.request.device_budget, "weights": weights.as_dict(),
           "bandwidth_gbps": {k: v / 1e9 if v else None for k, v in bandwidth.items()},
           "predicted_transfer_seconds_per_pass": round(seconds, 4)}
    if projection is not None:
        out.update(projection=projection.as_dict(), best_budget=projection.projection.best_budget,
                   tokens_per_second=projection.projection.tokens_per_second)
    return out


def _print_plan(console, plan: Plan, weights: WeightBytes, bandwidth: dict[str, float | None], seconds: float) -> None:
    from rich.table import Table
    table = Table(title=f"plan: {plan.request.config.family}, {plan.request.config.num_layers} layers, "
                        f"{format_bytes(plan.request.layer_bytes)} per layer")
    for column in ("component", "tier", "bytes"):
        table.add_column(column)
    for item in plan.items:
        table.add_row(item.component, item.tier, format_bytes(item.num_bytes))
    console.print(table, soft_wrap=True)
    disk = f"disk {bandwidth['disk'] / 1e9:.1f} GB/s" if bandwidth["disk"] else "no disk tier"
    console.print(f"device {format_bytes(plan.bytes_in('device'))} of {format_bytes(plan.request.device_budget)}; "
                  f"predicted transfer per pass {seconds:.3f} s (link {bandwidth['ram'] / 1e9:.1f} GB/s, {disk})",
                  highlight=False, soft_wrap=True)
    types = ", ".join(f"{name} x{count}" for name, count in weights.type_counts)
    console.print(f"weights {weights.format}: {weights.total_file_bytes / 1e9:.2f} GB as stored (decoder layers "
                  f"{sum(weights.layer_file_bytes) / 1e9:.2f} GB + globals {weights.global_file_bytes / 1e9:.2f} GB; "
                  f"{types})", highlight=False, soft_wrap=True)


def _print_projection(console, projection: PlanProjection) -> None:
    from rich.table import Table
    result = projection.projection
    table = Table(title="projection: one target pass and one draft tree per step")
    for column in ("budget", "pass s", "compute s", "draft s", "tokens/pass", "tokens/s"):
        table.add_column(column, justify="right")
    for row in result.rows:
        compute = projection.compute_seconds.get(row.budget)
        table.add_row(str(row.budget), f"{row.pass_seconds:.3f}", "-" if compute is None else f"{compute:.3f}",
                      f"{row.draft_seconds:.3f}", f"{row.tokens_per_pass:.2f}", f"{row.tokens_per_second:.2f}")
    console.print(table, soft_wrap=True)
    tiers = ", ".join(f"{tier} {seconds:.3f} s" for tier, seconds in projection.transfer_seconds.items())
    best = result.best
    console.print(f"best budget {best.budget}: {best.tokens_per_second:.2f} tokens/s ({best.tokens_per_pass:.2f} "
                  f"tokens per pass / ({best.pass_seconds:.3f} s pass + {best.draft_seconds:.3f} s draft)); "
                  f"autoregressive {result.autoregressive_tokens_per_second:.3f} tokens/s ({result.speedup:.1f}x); "
                  f"transfer per pass: {tiers}", highlight=False, soft_wrap=True)
    console.print("assumptions:")
    for line in projection.assumptions:
        console.print(f"  - {line}", highlight=False, soft_wrap=True)
