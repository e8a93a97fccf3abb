"""Generated code never runs in our process: each program runs in a fresh Python interpreter with a time
limit, an address-space limit, no network (sockets refused before the program starts), in an empty
temporary folder. A program that hangs, crashes or exhausts memory fails; it never takes us down."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

MEMORY_LIMIT_BYTES = 1 << 30

_PRELUDE = f"""
import resource, socket, sys
resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT_BYTES}, {MEMORY_LIMIT_BYTES}))
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the sandbox")
socket.socket = _no_network
socket.create_connection = _no_network
sys.setrecursionlimit(10000)
"""


@dataclass(slots=True)
class RunResult:
    passed: bool
    reason: str          # "passed", "failed", "timeout"


def run_program(program: str, timeout_seconds: float) -> RunResult:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "program.py")
        with open(path, "w") as handle:
            handle.write(_PRELUDE + "\n" + program)
        try:
            done = subprocess.run([sys.executable, "-I", path], cwd=folder, capture_output=True,
                                  timeout=timeout_seconds, env={"PATH": os.environ.get("PATH", "")},
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return RunResult(False, "timeout")
    return RunResult(done.returncode == 0, "passed" if done.returncode == 0 else "failed")
