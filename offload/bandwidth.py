"""Raw tier bandwidths, measured on this machine: host->device copy and cold sequential disk read."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from offload.host_io import allocate_host, drop_page_cache


def host_to_device_gbps(num_bytes: int, device: torch.device, repeats: int = 3) -> float:
    """Best of `repeats` copies of a pinned host buffer to the device (a memcpy when the device is the CPU)."""
    host = allocate_host(num_bytes, pin=device.type == "cuda")
    host.fill_(1)
    target = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    return num_bytes / min(timed_seconds(lambda: target.copy_(host, non_blocking=True), device) for _ in range(repeats)) / 1e9


def copy_gbps(sources: list[torch.Tensor], target: torch.Tensor) -> float:
    """The link's rate on given buffers: each source copied into `target` in turn, once."""
    device = target.device
    total = sum(s.numel() for s in sources)

    def run() -> None:
        for source in sources:
            target[:source.numel()].copy_(source, non_blocking=True)
    return total / timed_seconds(run, device) / 1e9


def cold_read_gbps(paths_and_ranges: list[tuple[Path, int, int]], buffer_bytes: int = 64 << 20) -> float:
    """Sequential reads of (file, start, length) ranges after evicting them from the page cache."""
    for path, _, _ in paths_and_ranges:
        drop_page_cache(path)
    buffer = bytearray(buffer_bytes)
    view = memoryview(buffer)
    total, start_time = 0, time.perf_counter()
    for path, start, length in paths_and_ranges:
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < length:
                count = os.preadv(fd, [view[:min(buffer_bytes, length - done)]], start + done)
                if count <= 0:
                    break
                done += count
            total += done
        finally:
            os.close(fd)
    return total / (time.perf_counter() - start_time) / 1e9


def disk_probe_gbps(folder: Path, num_bytes: int = 256 << 20) -> float:
    """Writes a scratch file in `folder`, evicts it, and reads it back cold."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, delete=False) as handle:
        chunk = os.urandom(1 << 20)
        for _ in range(num_bytes >> 20):
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())
        path = Path(handle.name)
    try:
        return cold_read_gbps([(path, 0, num_bytes)])
    finally:
        path.unlink()



def timed_seconds(fn, device: torch.device) -> float:
    """Seconds fn() takes on `device`, queued device work included (CUDA is synchronised around it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
