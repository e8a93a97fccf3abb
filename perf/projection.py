"""The projected rate (tokens per second) of tree speculation from a pass time, a draft cost and an
acceptance curve, per tree budget b:

    rate(b) = a(b) / (t(b) + draft(b))        a(b): tokens per target pass (accepted path + the target's token)

Budget 1 is autoregressive decoding: a(1) = 1 and no draft work. The same rate `BudgetChooser`
maximises online (perf/tree_size.py, with A(b) + 1 = a(b)); here every term comes from a curve, so the
`plan` command can say what to expect before any weight is loaded.
"""
from __future__ import annotations

import json
import math
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from spec.grow import MAX_DEPTH, MAX_WIDTH

from .result_formats import acceptance_points, curve_points
from .tree_size import MAX_BUDGET, budget_grid

DEFAULT_VARIANTS = {"readme-8-prompts": "points", "all-124-prompts": "all_prompts_points"}


@dataclass(slots=True)
class AcceptanceCurve:
    """Tokens per pass at measured budgets. Between points: linear in log(budget); above the largest
    measured budget: that budget's value (clamped, never extrapolated). (1, 1.0) is added when absent:
    a one-token tree is autoregressive decoding."""
    points: list[tuple[int, float]]
    source: str = ""

    def __post_init__(self) -> None:
        points = {int(b): float(a) for b, a in self.points}
        if len(points) != len(self.points):
            raise ValueError(f"acceptance budgets must be distinct, got {[b for b, _ in self.points]}")
        points.setdefault(1, 1.0)
        for budget, tokens in points.items():
            if budget < 1 or not 1.0 <= tokens <= budget:
                raise ValueError(f"tokens per pass at budget {budget} must lie in [1, {budget}], got {tokens}")
        self.points = sorted(points.items())

    @property
    def max_budget(self) -> int:
        return self.points[-1][0]

    def tokens_per_pass(self, budget: float) -> float:
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        if budget >= self.max_budget:
            return self.points[-1][1]
        budgets = [b for b, _ in self.points]
        upper = bisect_left(budgets, budget)          # budgets[upper - 1] < budget <= budgets[upper]
        if budgets[upper] == budget:
            return self.points[upper][1]
        (b0, a0), (b1, a1) = self.points[upper - 1], self.points[upper]
        return a0 + (a1 - a0) * math.log(budget / b0) / math.log(b1 / b0)


@dataclass(slots=True, frozen=True)
class DraftCost:
    """Draft seconds per step = seconds_per_round * rounds(b), one draft forward per round (a round over
    up to `width` nodes costs about one over a single node for a memory-bound draft on a GPU).

    rounds(b) = max(min(max_depth + 1, rounds_per_doubling * log2(b)), b / width), 0 at b = 1: growth needs
    about one round per tree level (best-first trees deepen with log b; +1 for the catch-up forward), and
    a tree of b nodes needs about b / width rounds to expand them. Measured with this repo's grower on the
    default pair (draft forwards per step, catch-up included; 4 prompts x 64 tokens): b = 4 / 16 / 64 /
    256 / 1024 / 4096 / 8192 -> 2.4 / 4.4 / 6.5 / 8.1 / 12.0 / 33.0 / 61.8; this model: 2 / 4 / 6 / 8 /
    10 / 32 / 64.
    A sharper draft grows deeper, narrower trees: raise rounds_per_doubling for it."""
    seconds_per_round: float
    rounds_per_doubling: float = 1.0
    max_depth: int = MAX_DEPTH
    width: int = MAX_WIDTH

    def __post_init__(self) -> None:
        if self.seconds_per_round < 0 or self.rounds_per_doubling <= 0 or self.max_depth < 1 or self.width < 1:
            raise ValueError(f"need seconds_per_round >= 0, rounds_per_doubling > 0, max_depth >= 1, width >= 1; "
                             f"got {self.seconds_per_round}, {self.rounds_per_doubling}, {self.max_depth}, {self.width}")

    def rounds(self, budget: int) -> float:
        if budget <= 1:
            return 0.0
        by_depth = min(self.max_depth + 1, self.rounds_per_doubling * math.log2(budget))
        return max(by_depth, budget / self.width)

    def seconds(self, budget: int) -> float:
        return self.seconds_per_round * self.rounds(budget)


@dataclass(slots=True, frozen=True)
class BudgetProjection:
    budget: int
    pass_seconds: float
    draft_seconds: float
    tokens_per_pass: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_pass / (self.pass_seconds + self.draft_seconds)


@dataclass(slots=True)
class Projection:
    rows: list[BudgetProjection]

    def __post_init__(self) -> None:
        if not self.rows or self.rows[0].budget != 1:
            raise ValueError("a projection needs its budget-1 (autoregressive) row first")

    @property
    def best(self) -> BudgetProjection:
        """The row with the most tokens per second (the smaller budget on ties)."""
        return max(self.rows, key=lambda row: (row.tokens_per_second, -row.budget))

    @property
    def best_budget(self) -> int:
        return self.best.budget

    @property
    def tokens_per_second(self) -> float:
        return self.best.tokens_per_second

    @property
    def autoregressive_tokens_per_second(self) -> float:
        return self.rows[0].tokens_per_second

    @property
    def speedup(self) -> float:
        return self.tokens_per_second / self.autoregressive_tokens_per_second

    def as_dict(self) -> dict:
        rows = [{"budget": r.budget, "pass_seconds": r.pass_seconds, "draft_seconds": r.draft_seconds,
                 "tokens_per_pass": r.tokens_per_pass, "tokens_per_second": r.tokens_per_second} for r in self.rows]
        return {"rows": rows, "best_budget": self.best_budget, "tokens_per_second": self.tokens_per_second,
                "autoregressive_tokens_per_second": self.autoregressive_tokens_per_second, "speedup": self.speedup}


def project(pass_seconds: Callable[[int], float], acceptance: AcceptanceCurve,
            draft_seconds: Callable[[int], float], max_budget: int = MAX_BUDGET) -> Projection:
    """Rows for budgets 1, 2, 4, ... up to min(max_budget, the curve's largest budget), plus that limit.
    pass_seconds(n): one target pass over n tokens; draft_seconds(b): growing a tree of b tokens."""
    rows = []
    for budget in budget_grid(min(max_budget, acceptance.max_budget)):
        draft = draft_seconds(budget) if budget > 1 else 0.0
        row = BudgetProjection(budget, pass_seconds(budget), draft, acceptance.tokens_per_pass(budget))
        if not row.pass_seconds + row.draft_seconds > 0:
            raise ValueError(f"budget {budget}: pass plus draft time must be positive, got "
                             f"{row.pass_seconds} + {row.draft_seconds}")
        rows.append(row)
    return Projection(rows)


def load_acceptance_curve(path: str | Path, mode: str | None = None) -> AcceptanceCurve:
    """Tokens per pass by budget from an acceptance source (perf/result_formats.py: an acceptance-curve
    file, a `bench spec` result (`mode`: which of its modes; default the first), a `bench tree-simulation`
    result, or a file of its parts, merged by passes: total tokens / total passes per budget)."""
    return AcceptanceCurve(acceptance_points(json.loads(Path(path).read_text()), str(path), mode), source=str(path))


def default_acceptance_curve(variant: str = "readme-8-prompts") -> AcceptanceCurve:
    """The shipped curve of the default draft/target pair (perf/data/acceptance_default.json):
    'readme-8-prompts' (11 budgets, 1-4096) or 'all-124-prompts' (budgets 1, 1024, 4096 only)."""
    if variant not in DEFAULT_VARIANTS:
        raise ValueError(f"unknown acceptance variant {variant!r}; known: {', '.join(DEFAULT_VARIANTS)}")
    text = resources.files("perf").joinpath("data").joinpath("acceptance_default.json").read_text()
    data = json.loads(text)
    return AcceptanceCurve(curve_points(data, DEFAULT_VARIANTS[variant]), source=f"perf/data ({variant})")
