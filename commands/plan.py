"""plan: where each part of a model would live (device, RAM, disk) and the predicted transfer per pass, from
config.json alone (or a GGUF file's header). A plan may describe a GPU this machine does not have
(`--device cuda` on a CPU-only machine): then the memory limits must be given and the link rate is nominal
PCIe 4.0 x16 unless given. With a GPU described (`--gpu`, `--gpu-tflops`) or measured (`--measured-curve`)
it also projects the pass time by tree size, the tree budget that maximises the rate (tokens per second),
and that rate."""
from __future__ import annotations

import json
import math

from offload.devices import DTYPES
from perf.llama_cpp_offload import DEFAULT_RAM_GBPS
from perf.pass_model import GPU_PRESETS, gpu_preset
from perf.plan_request import WEIGHT_FORMATS
from perf.self_draft_plan import DEFAULT_SELF_CURVES
from spec.self_draft import SELF_DRAFT

from .flags import add_device, add_draft, add_target
from .plan_common import (_as_json, _edge_assumptions, _print_plan, _print_projection, build_plan, build_projection,
                          measured_bandwidth)
from .plan_self_draft import cmd_plan_self


def add_parsers(commands) -> None:
    plan = commands.add_parser("plan", help="show where each part of a model would live (config.json is enough)")
    add_target(plan, "model folder, config.json folder, .gguf or Hub id (default: embedded model)")
    add_draft(plan, "draft model folder (kept on the device), or self: the target's own low-bit substitutes, "
                    "reported at 2, 3 and 4 bits beside llama.cpp's partial offload (default: none)")
    plan.add_argument("--gpu-mem", default=None, help="device memory limit, e.g. 24GiB (default: free memory - margin)")
    plan.add_argument("--ram", default=None, help="host memory limit, e.g. 64GiB (default: available RAM - margin)")
    plan.add_argument("--budget", type=int, default=2048, help="largest speculation tree, tokens (default: 2048)")
    plan.add_argument("--context", type=int, default=4096, help="context length, tokens (default: 4096)")
    plan.add_argument("--dtype", default="bf16", choices=list(DTYPES),
                      help="compute dtype, and the weights' when --weights is not given (default: bf16)")
    add_device(plan)
    plan.add_argument("--ring", type=int, default=2, help="layer buffers in the prefetch ring (default: 2)")
    plan.add_argument("--link-gbps", type=float, default=None,
                      help="host->device GB/s for the prediction (default: the --gpu preset's, else measured now)")
    plan.add_argument("--disk-gbps", type=float, default=None,
                      help="disk GB/s for the prediction (default: measured now, when layers stream from disk)")
    plan.add_argument("--weights", default=None, choices=WEIGHT_FORMATS,
                      help="decoder layers as stored: a dtype; spqr-w3|spqr-w4|spqr-w4-g32 (SpQR at its expected "
                           "bits per parameter; -g32: groups of 32); q4_k_m|q5_k_m|q8_0 (llama.cpp's tensor types "
                           "for that GGUF file type) (default: --dtype; a .gguf target: the file's own types)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    _add_projection_flags(plan)


def _add_projection_flags(plan) -> None:
    group = plan.add_argument_group("projection (with --gpu, --gpu-tflops or --measured-curve)")
    group.add_argument("--gpu", default=None, metavar="NAME",
                       help=f"GPU preset: {', '.join(GPU_PRESETS)}; sets the TFLOP/s and memory bandwidth, and the "
                            "defaults of --gpu-mem (its memory) and --link-gbps (default: none, no projection)")
    group.add_argument("--gpu-tflops", type=float, default=None,
                       help="dense bf16 TFLOP/s of the GPU (default: the --gpu preset's)")
    group.add_argument("--draft-ms", type=float, default=None,
                       help="draft time per tree-growth round, ms (default: from the draft's size and the GPU's "
                            "memory bandwidth and TFLOP/s; no --draft: not counted)")
    group.add_argument("--decode-gbps", type=float, default=None,
                       help="packed GB/s at which the GPU decodes packed layers (default: a fused kernel at 50%% "
                            "of the GPU's memory bandwidth)")
    group.add_argument("--acceptance", default=None, metavar="FILE",
                       help="tokens per pass by budget: an acceptance-curve file, a `bench spec` or tree-simulation "
                            "result (default: the shipped curve of the default pair); --draft self: one per width "
                            f"with {{bits}} in the path (default: {DEFAULT_SELF_CURVES})")
    group.add_argument("--ram-gbps", type=float, default=DEFAULT_RAM_GBPS,
                       help="GB/s at which llama.cpp's CPU layers read RAM, for --draft self's comparison "
                            f"(default: {DEFAULT_RAM_GBPS:g}, dual-channel DDR5)")
    group.add_argument("--measured-curve", default=None, metavar="FILE",
                       help="a GPU device-check result (bench/results/device_check_*.json): its measured pass "
                            "times, rescaled to this plan's bytes and link, replace the pass model (default: none)")


def cmd_plan(args, console) -> int:
    if args.gpu:
        gpu_preset(args.gpu)          # an unknown name is one error line before any work
    if not args.ram_gbps > 0:
        raise ValueError(f"--ram-gbps must be positive (e.g. {DEFAULT_RAM_GBPS:g} for dual-channel DDR5), "
                         f"got {args.ram_gbps:g}")
    if args.draft == SELF_DRAFT:
        return cmd_plan_self(args)
    plan, weights = build_plan(args)
    bandwidth, link_source = measured_bandwidth(args, plan)
    seconds = plan.predicted_transfer_seconds({"ram": bandwidth["ram"], "disk": bandwidth["disk"] or math.inf})
    projection = build_projection(args, plan, bandwidth)
    if projection is not None:
        projection.assumptions[:0] = _edge_assumptions(args, plan, bandwidth, link_source)
    if args.json:
        print(json.dumps(_as_json(plan, weights, bandwidth, seconds, projection)))
        return 0
    from rich.console import Console
    console = Console()   # the plan is the command's output: stdout
    _print_plan(console, plan, weights, bandwidth, seconds)
    if projection is None:
        console.print("projection: give --gpu NAME (or --gpu-tflops X, --measured-curve FILE) for the pass time by "
                      "tree size and the projected tokens per second")
    else:
        _print_projection(console, projection)
    return 0


COMMANDS = {"plan": cmd_plan}
