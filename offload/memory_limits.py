"""Default memory limits: what the device and the host report free, minus a safety margin."""
from __future__ import annotations

import psutil
import torch

from offload.byte_units import GIB


def default_device_memory(device: torch.device) -> int:
    """Bytes the plan may place on `device`: free device memory less max(0.5 GiB, 5%); on a CPU the host's."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free - max(GIB // 2, free * 0.05))
    return default_host_memory()


def default_host_memory() -> int:
    """Bytes the plan may place in host RAM: available memory less max(2 GiB, 10%)."""
    available = psutil.virtual_memory().available
    return int(available - max(2 * GIB, available * 0.1))
