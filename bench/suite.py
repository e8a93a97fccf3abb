"""`bench all`: every benchmark of ours and every peer in one run, one JSON per benchmark in the output
folder, then report.md with its tables and plots (bench/report.py).

The benchmarks themselves are the `bench` commands' own functions (bench/suite_steps.py calls them);
this file holds the run: its settings (bench/suite_config.py: full or --quick), the machine it ran on, the
progress display, and the manifest (suite.json) that the report and the record generator read.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from bench.suite_config import ROOT, SuiteConfig


def command_line(config: SuiteConfig, out: Path) -> str:
    """The command as the report shows it (the output folder relative to the working directory, or its name)."""
    try:
        shown = out.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        shown = Path(out.name)
    flags = (" --quick" if config.quick else "") + (f" --only {','.join(config.only)}" if config.only else "")
    flags += f" --threads {config.threads}" if config.threads else ""
    return f"specstream bench all{flags} --out {shown}"


def machine() -> dict:
    """The machine as the report names it: no hostname, no paths."""
    import psutil
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}


def git_commit() -> str | None:
    """HEAD's short hash, '+changes' when the tracked files differ from it (read-only git calls)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return head.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


@dataclass(slots=True)
class StepRecord:
    """One benchmark's line in suite.json."""
    name: str
    status: str = "pending"           # ok | skipped | failed
    seconds: float = 0.0
    reason: str | None = None         # why it was skipped or failed
    file: str | None = None


@dataclass(slots=True)
class SuiteRun:
    config: SuiteConfig
    out: Path
    command: str
    started: str = field(default_factory=lambda: datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    steps: list[StepRecord] = field(default_factory=list)

    def manifest(self, wall_seconds: float) -> dict:
        return {"bench": "all", "command": self.command, "date": self.started, "quick": self.config.quick,
                "wall_seconds": round(wall_seconds, 1), "machine": machine(), "commit": git_commit(),
                "config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.config).items()},
                "quick_reduced": self.config.reductions(), "steps": [asdict(s) for s in self.steps]}


def run_suite(config: SuiteConfig, out: Path, command: str, console=None) -> dict:
    """Runs every step (bench/suite_steps.STEPS, or config.only), writes <out>/<step>.json, suite.json and
    report.md; -> the manifest. A step that cannot run here is recorded as skipped with its reason; one
    that raises, as failed with the error: the others still run."""
    from bench.report import write_report
    from bench.suite_progress import SuiteProgress
    from bench.suite_steps import STEPS, SuiteContext, scrub
    import torch
    unknown = set(config.only) - {s.name for s in STEPS}
    if unknown:
        raise ValueError(f"--only: unknown benchmarks {', '.join(sorted(unknown))}; "
                         f"choose from {', '.join(s.name for s in STEPS)}")
    config = replace(config, threads=config.threads or torch.get_num_threads())
    torch.set_num_threads(config.threads)
    out.mkdir(parents=True, exist_ok=True)
    steps = [s for s in STEPS if not config.only or s.name in config.only]
    run = SuiteRun(config, out, command)
    wall = time.perf_counter()
    with SuiteProgress(console, [(s.name, s.estimate(config)) for s in steps]) as progress:
        context = SuiteContext(config, out, progress.status)
        for step in steps:
            progress.start(step.name)
            record = _run_step(step, context, out, scrub)
            run.steps.append(record)
            progress.finish(step.name, record.status, record.reason)
    manifest = run.manifest(time.perf_counter() - wall)
    (out / "suite.json").write_text(json.dumps(manifest, indent=1) + "\n")
    write_report(out)
    return manifest


def _run_step(step, context, out: Path, scrub) -> StepRecord:
    record, started = StepRecord(step.name), time.perf_counter()
    try:
        result = step.run(context)
    except Exception as err:   # recorded in suite.json and the report; the other benchmarks still run
        result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
    record.seconds = round(time.perf_counter() - started, 1)
    result = scrub(result)
    if "skipped" in result:
        record.status, record.reason = "skipped", result["skipped"]
    elif "error" in result:
        record.status, record.reason = "failed", result["error"]
    else:
        record.status = "ok"
    context.results[step.name] = result
    record.file = f"{step.name}.json"
    (out / record.file).write_text(json.dumps(result, indent=1) + "\n")
    return record
