"""Host memory and page-cache helpers shared by the tiers, the bandwidth probes and the benchmarks."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from offload.disk_reads import DIRECT_ALIGN, aligned_buffer


def allocate_host(num_bytes: int, pin: bool) -> Tensor:
    """[num_bytes] uint8 in host memory; pinned (page-locked) when asked and possible."""
    if pin:
        try:
            return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:
            pass  # pinning can fail under memory pressure; pageable memory still works
    return torch.empty(num_bytes, dtype=torch.uint8)


def aligned_host(num_bytes: int, pin: bool) -> Tensor:
    """[num_bytes] uint8 host memory starting at a DIRECT_ALIGN boundary (O_DIRECT reads land in it); pinned
    when asked and possible. Pageable memory comes from numpy, which asks the kernel for huge pages for large
    arrays: O_DIRECT reads into it ran at 2.9-3.0 GB/s here, into torch's 4 KiB pages at 2.0-2.2 GB/s."""
    if not pin:
        return torch.from_numpy(aligned_buffer(num_bytes))
    raw = allocate_host(num_bytes + DIRECT_ALIGN, pin)
    skip = -raw.data_ptr() % DIRECT_ALIGN
    return raw[skip:skip + num_bytes]


def copy_host(target: Tensor, source: Tensor) -> None:
    """Copies host bytes on the calling thread alone (numpy; the GIL is released). A torch copy made from a
    loader thread starts an OpenMP team of its own, whose threads then spin on the cores the compute
    thread's team needs: on two cores that halved a pass streamed from the RAM tier."""
    np.copyto(target.view(-1).view(torch.uint8).numpy(), source.view(-1).view(torch.uint8).numpy())


def process_read_bytes() -> int | None:
    """Bytes this process caused to be fetched from storage (/proc/self/io read_bytes; page-cache hits are
    free); None where the kernel does not report it."""
    try:
        for line in Path("/proc/self/io").read_text().split("\n"):
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def drop_page_cache(path: Path) -> None:
    """Evicts a file from the OS page cache, so the next reads hit the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
