"""`bench all`'s progress display (rich): which benchmark, which engine or row it is on (the benchmark's
own status lines), elapsed time, and the time left: the estimates of the benchmarks still to run, scaled
by how far the finished ones ran over or under their own estimates."""
from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text


class RemainingColumn(ProgressColumn):
    def render(self, task) -> Text:
        left = task.fields.get("left")
        return Text("left --:--" if left is None else f"left ~{_clock(left)}", style="progress.remaining")


def _clock(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    return f"{seconds // 60}:{seconds % 60:02d}"


class SuiteProgress:
    """One bar over the whole suite, in estimated seconds; status lines also go to the console above it."""

    def __init__(self, console: Console | None, estimates: list[tuple[str, float]]) -> None:
        self.console = console or Console(stderr=True)
        self.estimates = dict(estimates)
        self.order = [name for name, _ in estimates]
        self.done: dict[str, float] = {}          # name -> seconds it took
        self.current: str | None = None
        self.step_started = 0.0
        self.progress = Progress(SpinnerColumn(), TextColumn("[bold]{task.fields[step]}[/bold]"),
                                 TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                                 RemainingColumn(), console=self.console, transient=False)
        self.task = self.progress.add_task("", total=sum(self.estimates.values()) or 1, step="bench all",
                                           left=None)

    def __enter__(self) -> SuiteProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def start(self, name: str) -> None:
        self.current, self.step_started = name, time.perf_counter()
        index = self.order.index(name) + 1
        self.progress.update(self.task, step=f"[{index}/{len(self.order)}] {name}", description="starting")
        self._refresh()

    def status(self, message: str) -> None:
        """A benchmark's status line: shown on the bar (its engine, prompt, row) and printed above it."""
        self.progress.update(self.task, description=message[:90])
        self.progress.console.print(f"[dim]{self.current}: {message}[/dim]", highlight=False, soft_wrap=True)
        self._refresh()

    def finish(self, name: str, status: str, reason: str | None) -> None:
        self.done[name] = time.perf_counter() - self.step_started
        note = f" ({reason})" if reason else ""
        colour = {"ok": "green", "skipped": "yellow"}.get(status, "red")
        self.progress.console.print(f"[{colour}]{name}: {status}[/{colour}] in {self.done[name]:.0f} s{note}",
                                    highlight=False, soft_wrap=True)
        self.current = None
        self._refresh()

    def _refresh(self) -> None:
        finished_estimate = sum(self.estimates[n] for n in self.done)
        scale = min(max(sum(self.done.values()) / finished_estimate, 0.5), 3.0) if finished_estimate else 1.0
        in_step = time.perf_counter() - self.step_started if self.current else 0.0
        pending = [n for n in self.order if n not in self.done]
        left = sum(self.estimates[n] for n in pending) * scale - in_step
        completed = finished_estimate + (min(in_step / scale, 0.95 * self.estimates[self.current])
                                         if self.current else 0.0)
        self.progress.update(self.task, completed=completed, left=max(left, 0.0))
