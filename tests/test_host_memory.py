"""The host allocator setting: a freed block of a few MB is reused without page faults."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Allocates and touches 8 MiB, frees it, does it again, and prints the minor page faults of the second round.
PROBE = """
import resource, sys, torch
sys.path.insert(0, {root!r})
if {tune}:
    from offload.host_memory import keep_freed_host_memory
    assert keep_freed_host_memory()
def touch():
    block = torch.empty(2 << 20)
    block.fill_(1.0)
    return float(block[-1])
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _second_round_faults(tune: bool) -> int:
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT), tune=tune)], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return int(out.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_freed_block_is_reused_without_page_faults():
    # 8 MiB is 2,048 pages: glibc maps it afresh each time unless told to keep freed blocks
    assert _second_round_faults(tune=False) > 1000
    assert _second_round_faults(tune=True) < 100


def test_user_malloc_settings_win(monkeypatch):
    from offload import host_memory
    host_memory.keep_freed_host_memory.cache_clear()
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    try:
        assert host_memory.keep_freed_host_memory() is False
    finally:
        host_memory.keep_freed_host_memory.cache_clear()
