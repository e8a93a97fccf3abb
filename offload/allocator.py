"""The host allocator keeps freed blocks for reuse instead of handing them back to the OS.

Every pass allocates the same tensors again: a streamed layer's dense weights when it is dequantized, a
tree pass's activations. glibc serves large blocks with fresh mappings and returns a freed heap top to
the OS, so each such allocation page-faults on first touch. Dequantizing one SpQR w4 layer of the
default model on the CPU took 10.8 ms, 4.8 ms of it those faults (measured in one process, 2026-12-04).
Raising the mmap threshold to glibc's maximum and the trim threshold keeps such blocks in the heap:
at most TRIM_THRESHOLD of free memory stays mapped.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3       # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20                          # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD = 512 << 20
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


@functools.cache
def keep_freed_host_memory() -> bool:
    """Sets the thresholds once per process -> whether they were set (False off glibc, or where the user
    set glibc's MALLOC_* variables: theirs win)."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):     # musl or another C library: nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
