"""Tree size: the tree budget a user may ask for (`--budget`, tokens per tree) and the chooser that
picks each step's tree size to maximise the expected rate (tokens per second):

    rate(b) = (A(b) + 1) / (t(b) + draft(b) + overhead(b))

A(b) is the expected accepted path length (root excluded) of a best-first tree of b tokens, t(b) the
target's pass time over b tokens (perf/pass_curve.py, probed by perf/probe.py), draft(b) and overhead(b)
the learned growth and bookkeeping costs.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field

from .pass_curve import PassTimeCurve

MIN_BUDGET = 1
MAX_BUDGET = 8192


def check_budget(value: int) -> int:
    """Returns `value` if it is an int in [MIN_BUDGET, MAX_BUDGET], else raises ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_BUDGET <= value <= MAX_BUDGET:
        raise ValueError(f"budget must lie in [{MIN_BUDGET}, {MAX_BUDGET}], got {value!r}")
    return value


def parse_budget(text: str) -> int | None:
    """Parses the --budget flag: "auto" -> None (the chooser decides), else a checked int."""
    if text.strip().lower() == "auto":
        return None
    try:
        return check_budget(int(text))
    except ValueError:
        raise ValueError(f"--budget must be 'auto' or an integer in [{MIN_BUDGET}, {MAX_BUDGET}], "
                         f"got {text!r}") from None


def budget_grid(max_budget: int) -> list[int]:
    """Candidate tree budgets (and the probed pass sizes): 1, 2, 4, ... below max_budget, then max_budget."""
    check_budget(max_budget)
    return [1 << k for k in range(max_budget.bit_length()) if 1 << k < max_budget] + [max_budget]


@dataclass(slots=True)
class _Mean:
    """Plain mean of the first `window` samples, then an EMA with weight 1/window."""
    window: int
    value: float = 0.0
    count: int = 0
    last_step: int = -1

    def add(self, sample: float, step: int) -> None:
        self.count += 1
        self.value += (sample - self.value) / min(self.count, self.window)
        self.last_step = step


@dataclass(slots=True)
class _CostModel:
    """Seconds per step as a function of tree size: one (mean size, mean seconds) point per grid
    bucket, joined piecewise-linearly (PassTimeCurve), optionally through a fixed anchor point."""
    grid: list[int]
    window: int
    anchor: tuple[float, float] | None = None
    sizes: dict[int, _Mean] = field(default_factory=dict)
    costs: dict[int, _Mean] = field(default_factory=dict)

    def add(self, tree_size: int, seconds: float, step: int) -> None:
        bucket = self.grid[bisect_left(self.grid, tree_size + 1) - 1]
        self.sizes.setdefault(bucket, _Mean(self.window)).add(tree_size, step)
        self.costs.setdefault(bucket, _Mean(self.window)).add(seconds, step)

    def curve(self) -> PassTimeCurve | None:
        points = [(self.sizes[b].value, self.costs[b].value) for b in self.sizes]
        points += [self.anchor] if self.anchor and all(n != self.anchor[0] for n, _ in points) else []
        return PassTimeCurve(points) if points else None


@dataclass(slots=True)
class BudgetChooser:
    """Picks each step's tree budget from the pass-time curve and what recent steps accepted.

    A(b) per grid budget is a running mean over steps whose tree held >= b tokens (recent: within the
    last `window` steps). Above the largest recently observed budget f, A is extrapolated with the
    gain per doubling of the last grid segment below f (concave in b, capped at b - 1), or the stale
    mean where that is larger: optimism that makes the chooser try a bigger tree when it might pay
    and learn from it. Before any tree of >= 2 tokens is seen, it picks the prior: the largest grid
    budget with t(b) <= prior_time_factor * t(1), at least 2; a chooser settled on budget 1 tries the
    prior again once every `window` steps, so a conversation that turns predictable is noticed.
    Pass times start from the probed curve; each grid bucket the decoder has run since is priced by
    what its passes really took (a probe disturbed by a busy machine heals itself)."""
    curve: PassTimeCurve
    max_budget: int
    window: int = 32
    prior_time_factor: float = 2.0
    last_choice: int | None = field(init=False, default=None)
    grid: list[int] = field(init=False)
    _accepted: list[_Mean] = field(init=False)
    _draft: _CostModel = field(init=False)
    _overhead: _CostModel = field(init=False)
    _passes: _CostModel = field(init=False)
    _step: int = field(init=False, default=0)
    _last_tree_step: int = field(init=False, default=-1)

    def __post_init__(self) -> None:
        check_budget(self.max_budget)
        if self.window < 1 or self.prior_time_factor < 1:
            raise ValueError(f"need window >= 1 and prior_time_factor >= 1, "
                             f"got {self.window}, {self.prior_time_factor}")
        self.grid = budget_grid(self.max_budget)
        self._accepted = [_Mean(self.window) for _ in self.grid]
        self._draft = _CostModel(self.grid, self.window, anchor=(1.0, 0.0))
        self._overhead = _CostModel(self.grid, self.window)
        self._passes = _CostModel(self.grid, self.window)

    def observe(self, tree_size: int, path_ranks: list[int], draft_seconds: float,
                overhead_seconds: float, target_seconds: float | None = None) -> None:
        """Learns from one step: a best-first tree of `tree_size` tokens whose accepted non-root nodes
        had these ranks; every grid budget b <= tree_size would have accepted sum(r < b)."""
        if tree_size < 1 or any(not 1 <= r < tree_size for r in path_ranks):
            raise ValueError(f"path ranks must lie in [1, {tree_size}) for a tree of {tree_size} "
                             f"tokens, got {path_ranks}")
        for b, mean in zip(self.grid, self._accepted):
            if b <= tree_size:
                mean.add(sum(r < b for r in path_ranks), self._step)
        # Times are differences of clock readings; rounding may make them a hair below zero.
        if tree_size > 1:
            self._draft.add(tree_size, max(draft_seconds, 0.0), self._step)
            self._last_tree_step = self._step
        self._overhead.add(tree_size, max(overhead_seconds, 0.0), self._step)
        if target_seconds is not None:
            self._passes.add(tree_size, max(target_seconds, 0.0), self._step)
        self._step += 1

    def prior_budget(self, num_sequences: int = 1, max_pass_tokens: int | None = None) -> int:
        """The largest grid budget b whose pass over num_sequences trees of b tokens costs
        <= prior_time_factor * t(num_sequences), at least 2 (where the pass holds it)."""
        k = num_sequences
        limit = self.prior_time_factor * self.curve.seconds(k)
        fitting = [b for b in self._fitting(k, max_pass_tokens) if self.curve.seconds(k * b) <= limit]
        smallest = 2 if 2 in self._fitting(k, max_pass_tokens) else 1
        return max(fitting + [min(smallest, self.max_budget)])

    def split(self, num_sequences: int, max_pass_tokens: int) -> int:
        """Each tree's budget when `num_sequences` trees share one pass of at most max_pass_tokens tokens:
        the grid budget with the highest rate across the batch (see estimates); the prior until a tree of
        >= 2 tokens has been observed (or again after `window` steps at budget 1)."""
        k = max(num_sequences, 1)
        stale = self._last_tree_step < 0 or self._step - self._last_tree_step > self.window * k
        fitting = set(self._fitting(k, max_pass_tokens))
        if len(fitting) < 2 or stale:
            self.last_choice = self.prior_budget(k, max_pass_tokens)
            return self.last_choice
        rows = [row for row in self.estimates(k) if row["budget"] in fitting]
        self.last_choice = max(rows, key=lambda e: (e["rate"], -e["budget"]))["budget"]
        return self.last_choice

    def observe_pass(self, num_tokens: int, seconds: float) -> None:
        """A packed pass's target time over `num_tokens` tokens (many trees and prompt chunks in one pass);
        what `observe` learns from target_seconds when one tree is the whole pass."""
        self._passes.add(num_tokens, max(seconds, 0.0), self._step)

    def _fitting(self, num_sequences: int, max_pass_tokens: int | None) -> list[int]:
        limit = max_pass_tokens if max_pass_tokens is not None else math.inf
        return [b for b in self.grid if b == 1 or num_sequences * b <= limit]

    def estimates(self, num_sequences: int = 1) -> list[dict]:
        """Per grid budget b: expected accepted length, pass/draft/overhead seconds and tokens/second when
        num_sequences = k trees of b tokens share a pass: k (A(b) + 1) / (t(k b) + k draft(b) + k overhead(b)),
        draft and overhead being each tree's share (for k = 1, the single-sequence rate)."""
        k = num_sequences
        draft, overhead = self._draft.curve(), self._overhead.curve()
        rows = []
        for b, accepted in zip(self.grid, self.expected_accepted()):
            pass_seconds = self.pass_seconds(k * b)
            draft_seconds = k * draft.seconds(b) if draft and b > 1 else 0.0
            overhead_seconds = k * overhead.seconds(b) if overhead else 0.0
            total = pass_seconds + draft_seconds + overhead_seconds
            rows.append({"budget": b, "accepted": accepted, "pass_seconds": pass_seconds,
                         "draft_seconds": draft_seconds, "overhead_seconds": overhead_seconds,
                         "rate": k * (accepted + 1) / total if total > 0 else math.inf})
        return rows

    def pass_seconds(self, budget: int) -> float:
        """t(budget): what passes of that grid bucket took lately, else the probed curve."""
        observed = self._passes.costs.get(budget)
        return observed.value if observed and observed.count else self.curve.seconds(budget)

    def expected_accepted(self) -> list[float]:
        """A(b) per grid budget: observed means up to the frontier, optimistic extrapolation above."""
        known = [i for i, mean in enumerate(self._accepted) if mean.count]
        if not known:
            return [0.0] * len(self.grid)
        recent = [i for i in known if self._step - self._accepted[i].last_step <= self.window]
        frontier = max(recent) if recent and max(recent) >= 1 else max(known)
        values = [mean.value for mean in self._accepted]
        gain = 0.0
        if frontier >= 1:
            lower, upper = self.grid[frontier - 1], self.grid[frontier]
            gain = max(0.0, values[frontier] - values[frontier - 1]) / math.log2(upper / lower)
        estimates = values[:frontier + 1]
        for i in range(frontier + 1, len(self.grid)):
            extrapolated = values[frontier] + gain * math.log2(self.grid[i] / self.grid[frontier])
            stale = values[i] if self._accepted[i].count else 0.0
            estimates.append(min(max(extrapolated, stale), self.grid[i] - 1))
        return estimates
