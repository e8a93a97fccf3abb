"""The host allocator setting: a block of a few MB comes from glibc's heap, whose freed blocks stay mapped
for reuse, instead of a fresh mapping that every use page-faults in again."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Allocates 16 MiB and prints whether it lies in the heap (below the program break) rather than in a
# mapping of its own. glibc maps blocks above its mmap threshold (128 KiB until a mapped block is freed).
PROBE = """
import ctypes, sys, torch
sys.path.insert(0, {root!r})
if {tune}:
    from offload.allocator import keep_freed_host_memory
    assert keep_freed_host_memory()
libc = ctypes.CDLL("libc.so.6")
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, (ctypes.c_long,)
block = torch.empty(4 << 20)
block.fill_(1.0)
print(block.data_ptr() < libc.sbrk(0))
"""


def _in_heap(tune: bool) -> bool:
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT), tune=tune)], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return out.strip().splitlines()[-1] == "True"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_dense_layer_sized_block_comes_from_the_heap_once_set():
    assert not _in_heap(tune=False)     # glibc's default: a mapping of its own, unmapped when freed
    assert _in_heap(tune=True)


def test_user_malloc_settings_win(monkeypatch):
    from offload import allocator as host_memory
    host_memory.keep_freed_host_memory.cache_clear()
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    try:
        assert host_memory.keep_freed_host_memory() is False
    finally:
        host_memory.keep_freed_host_memory.cache_clear()
