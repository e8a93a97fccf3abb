"""Default memory budgets: what the device and the host report free, minus a safety margin."""
from __future__ import annotations

import psutil
import torch

GIB = 1024 ** 3


def default_device_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free - max(GIB // 2, free * 0.05))
    return default_host_budget()


def default_host_budget() -> int:
    available = psutil.virtual_memory().available
    return int(available - max(2 * GIB, available * 0.1))
