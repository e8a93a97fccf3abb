"""The `plan` command's library side: a plan from config.json alone, and the bandwidths to predict with.

A plan may describe a GPU this machine does not have (`--device cuda` on a CPU-only machine): then
the budgets must be given and the link rate is nominal PCIe 4.0 x16 unless given."""
from __future__ import annotations

import torch

from .budgets import default_device_budget, default_host_budget
from .config import ModelConfig
from .devices import DTYPES, choose_device
from .gguf_import import cache_root
from .planner import Plan, make_plan, parse_bytes, request_from_config
from .sources import resolve_model

NOMINAL_PCIE4_GBPS = 25.0


def build_plan(args, weight_bits: float | None = None) -> Plan:
    """args: target, draft, gpu_mem, ram, budget, context, dtype, device, ring (strings as typed);
    weight_bits: packed decoder layers' bits per parameter (None: the dtype's)."""
    device = choose_device(args.device, require_available=False)
    config = ModelConfig.from_file(resolve_model(args.target))
    draft = ModelConfig.from_file(resolve_model(args.draft)) if args.draft else None
    if args.gpu_mem:
        device_budget = parse_bytes(args.gpu_mem)
    elif device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("no GPU here to read free memory from: give --gpu-mem for a CUDA plan")
    else:
        device_budget = default_device_budget(device)
    host_budget = parse_bytes(args.ram) if args.ram else default_host_budget()
    request = request_from_config(config, DTYPES[args.dtype].itemsize, device_budget, host_budget, draft,
                                  args.context, args.budget, args.ring, device.type == "cpu", weight_bits)
    return make_plan(request)


def measured_bandwidth(args) -> dict[str, float]:
    """Bytes/s for the host->device link and the disk: given on the command line, else measured now."""
    from .bandwidth import disk_probe_gbps, host_to_device_gbps
    device = choose_device(args.device, require_available=False)
    link = args.link_gbps
    if link is None:
        can_measure = device.type == "cpu" or torch.cuda.is_available()
        link = host_to_device_gbps(256 << 20, device) if can_measure else NOMINAL_PCIE4_GBPS
    disk = args.disk_gbps or disk_probe_gbps(cache_root() / "probe")
    return {"ram": link * 1e9, "disk": disk * 1e9}
