"""Raw tier bandwidths, measured on this machine: host->device copy and cold sequential disk read."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from offload.disk_reads import DIRECT_ALIGN, DirectReader, aligned_buffer, aligned_up, read_full
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
    """Sequential reads of (file, start, length) ranges, cold: with O_DIRECT where the file system allows it
    (the disk's own rate, as the disk tier reads on a CPU), else buffered after evicting them from the page
    cache."""
    buffer = aligned_buffer(buffer_bytes)
    direct = {path: DirectReader.supported(path) for path, _, _ in paths_and_ranges}
    for path in [path for path, is_direct in direct.items() if not is_direct]:
        drop_page_cache(path)
    start_time = time.perf_counter()
    total = sum(read_range_cold(path, start, length, buffer, direct[path]) for path, start, length in paths_and_ranges)
    return total / (time.perf_counter() - start_time) / 1e9


def read_range_cold(path: Path, start: int, length: int, buffer: np.ndarray, direct: bool) -> int:
    """Reads bytes [start, start + length) of `path` through `buffer` (aligned, whole DIRECT_ALIGN blocks),
    with O_DIRECT when `direct` (else through the page cache, which the caller evicted); the bytes of the
    range read (short at the file's end)."""
    offset, end, done = (start - start % DIRECT_ALIGN if direct else start), start + length, 0
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        while offset < end:
            wanted = min(len(buffer), aligned_up(end - offset))
            count = read_full(fd, [memoryview(buffer[:wanted])], offset, path)
            done += max(0, min(offset + count, end) - max(offset, start))
            if count < wanted:
                break
            offset += count
    finally:
        os.close(fd)
    return done


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
