"""Generated code never runs in our process, nor loose on the machine: each program runs in a fresh
Python interpreter that the operating system confines (judge/isolation.py, judge/seccomp.py): no
network, no files outside its own size-limited folder (the host's home folders, /tmp and /proc are
not even visible), no new processes, no signals to other processes, and limits on CPU time, memory,
file size and open files, in its own session. A program that hangs, crashes or exhausts memory fails;
it never takes us down. Where the kernel cannot confine it, run_program refuses unless told otherwise."""
from __future__ import annotations

import functools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

MEMORY_LIMIT_BYTES = 1 << 30
MAX_OUTPUT_BYTES = 64 << 10
MECHANISMS = ("user, mount, network, IPC and UTS namespaces", "a read-only root of system folders only",
              "a size-limited private tmpfs", "no capabilities", "a seccomp-BPF filter",
              "CPU, memory, file-size and open-file limits", "its own session, killed as a group")
_LAUNCH = "import sys; sys.path.insert(0, {folder!r}); import isolation; isolation.main(sys.argv[1])"
# Run confined: each attempt that the kernel lets through prints the guarantee it breaks.
_PROBE = """
import os, socket
attempts = {"network": socket.socket, "processes": lambda: os.fork() or os._exit(0),
            "filesystem": lambda: open("/usr/.sandbox-probe", "w")}
for name, attempt in attempts.items():
    try:
        attempt()
        print(name)
    except OSError:
        pass
"""


class SandboxUnavailable(RuntimeError):
    """The kernel cannot confine generated code here; `run_program(..., unconfined=True)` accepts the risk."""


@dataclass(slots=True)
class SandboxConfig:
    max_memory_bytes: int = MEMORY_LIMIT_BYTES   # RLIMIT_AS
    max_file_bytes: int = 16 << 20               # RLIMIT_FSIZE: any one file, the captured output included
    max_open_files: int = 64                     # RLIMIT_NOFILE
    folder_bytes: int = 32 << 20                 # the program's private tmpfs, its working folder /tmp

    def __post_init__(self) -> None:
        for name in ("max_memory_bytes", "max_file_bytes", "max_open_files", "folder_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be positive, got {getattr(self, name)}")


@dataclass(slots=True)
class IsolationReport:
    mechanisms: tuple[str, ...]   # what confines a program here
    missing: str                  # "" when confinement is complete, else one human line

    @property
    def is_available(self) -> bool:
        return not self.missing


@dataclass(slots=True)
class RunResult:
    passed: bool
    reason: str          # "passed", "failed", "timeout"
    output: str = ""     # the program's stdout and stderr, their last MAX_OUTPUT_BYTES


def run_program(program: str, timeout_seconds: float, config: SandboxConfig | None = None,
                unconfined: bool = False) -> RunResult:
    """Runs `program` confined; raises SandboxUnavailable where this machine cannot confine it, unless
    `unconfined` (then only the resource limits, the session and a fresh folder apply)."""
    if not unconfined:
        report = available_isolation()
        if not report.is_available:
            raise SandboxUnavailable(f"cannot sandbox generated code here: {report.missing} "
                                     "(pass unconfined=True to run it with resource limits only)")
    return _run(program, timeout_seconds, config or SandboxConfig(), confine=not unconfined)


@functools.cache
def available_isolation() -> IsolationReport:
    """Confines a probe program once per process and asks it which guarantees the kernel enforced."""
    result = _run(_PROBE, 10.0, SandboxConfig(), confine=True)
    last_line = (result.output.strip().splitlines() or [result.reason])[-1]
    if result.reason == "timeout":
        missing = "the confined probe program did not finish in 10 s"
    elif last_line.startswith("sandbox: "):
        missing = last_line.removeprefix("sandbox: ")
    elif not result.passed:
        missing = f"the confined probe program failed: {last_line}"
    else:
        missing = f"not enforced: {', '.join(result.output.split())}" if result.output.strip() else ""
    return IsolationReport(() if missing else MECHANISMS, missing)


def _run(program: str, timeout_seconds: float, config: SandboxConfig, confine: bool) -> RunResult:
    limits = asdict(config) | {"confine": confine, "max_cpu_seconds": math.ceil(timeout_seconds) + 1}
    launch = _LAUNCH.format(folder=os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryFile(dir=folder) as output:
        with subprocess.Popen([sys.executable, "-I", "-c", launch, json.dumps(limits)], cwd=folder,
                              stdin=subprocess.PIPE, stdout=output, stderr=subprocess.STDOUT,
                              env={"PATH": "/usr/bin:/bin"}, start_new_session=True) as process:
            timed_out = _wait(process, program, timeout_seconds)
        output.seek(max(0, output.seek(0, os.SEEK_END) - MAX_OUTPUT_BYTES))
        text = output.read().decode(errors="replace")
    if timed_out or process.returncode == -signal.SIGXCPU:
        return RunResult(False, "timeout", text)
    return RunResult(process.returncode == 0, "passed" if process.returncode == 0 else "failed", text)


def _wait(process: subprocess.Popen, program: str, timeout_seconds: float) -> bool:
    """True on timeout, after killing the program's whole process group (before it is reaped, so the
    group id cannot have been reused)."""
    try:
        process.communicate(program.encode(), timeout=timeout_seconds)
        return False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return True
