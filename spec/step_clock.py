"""What a self-draft's tree growth may spend (spec/self_speculator.py): each draft round and each tree token the
target verifies costs seconds, each emitted token is worth the seconds a whole step spends per token. A node stays
in the tree where its path probability (what it can add at most) pays for its target row, and is expanded where it
pays for its draft row and its child's target row too; a round runs where its nodes pay for the round's fixed cost
as well."""
from __future__ import annotations

from dataclasses import dataclass, field


def _mean(old: float | None, new: float, smoothing: float) -> float:
    return new if old is None else old + smoothing * (new - old)


@dataclass(slots=True)
class CostLine:
    """seconds ~ fixed + per_row * rows, a least-squares line over recent (rows, seconds) samples (exponential
    means of rows, seconds, rows^2 and rows * seconds). Until the rows spread enough to tell a row's cost from the
    fixed part (a rising line), the slope is 0, or (`pessimistic`) every second is the rows'."""
    pessimistic: bool = False
    smoothing: float = 0.05
    fixed: float | None = None
    per_row: float = 0.0
    _moments: list[float] | None = field(default=None, repr=False)

    def add(self, rows: int, seconds: float) -> None:
        sample = [rows, seconds, rows * rows, rows * seconds]
        self._moments = sample if self._moments is None else \
            [_mean(old, new, self.smoothing) for old, new in zip(self._moments, sample)]
        mean_n, mean_t, mean_nn, mean_nt = self._moments
        variance = mean_nn - mean_n * mean_n
        slope = (mean_nt - mean_n * mean_t) / variance if variance > 0.25 else 0.0
        if slope > 0:                 # a falling line is noise (a cold first pass): the last slope stands
            self.per_row, self.pessimistic = slope, False
        elif self.pessimistic:
            self.per_row = mean_t / max(mean_n, 1)
        self.fixed = max(0.0, mean_t - self.per_row * mean_n)


class StepClock:
    """The draft's round line, the target's pass line, and seconds per emitted token of a whole step (from its
    draft to the end of its target pass); before a step is measured, a token is worth one target pass (what
    one-token decoding pays for it)."""
    SMOOTHING = 0.2            # the token's worth follows the current answer

    def __init__(self) -> None:
        # rounds start cheap per row (wide first rounds spread the widths), passes dear (a tree no larger than the
        # first pass's price can buy: a prompt's pass and a tree's soon spread the sizes)
        self.rounds, self.passes = CostLine(), CostLine(pessimistic=True)
        self.token_seconds: float | None = None
        self._is_prior = False
        self._step_started: float | None = None
        self._step_ended: float | None = None
        self._tokens = 0

    def step_started(self, now: float) -> None:
        """A step's draft begins: the last step is priced per token it emitted (time between steps, such as a new
        request's prefill, is no step's)."""
        if self._step_started is not None and self._step_ended is not None and self._tokens:
            measured = (self._step_ended - self._step_started) / self._tokens
            self.token_seconds = _mean(None if self._is_prior else self.token_seconds, measured, self.SMOOTHING)
            self._is_prior = False
        self._step_started, self._step_ended, self._tokens = now, None, 0

    def drafted(self, width: int, seconds: float) -> None:
        """One draft forward over `width` rows took `seconds`."""
        self.rounds.add(width, seconds)

    def passed(self, num_tokens: int, seconds: float, now: float) -> None:
        """A target pass over `num_tokens` took `seconds`, ending at `now` (the open step's end)."""
        self.passes.add(num_tokens, seconds)
        if self._step_started is not None and self._step_ended is None:
            self._step_ended = now
        if self.token_seconds is None:
            self.token_seconds, self._is_prior = seconds, True

    def emitted(self, num_tokens: int) -> None:
        self._tokens += num_tokens

    def min_gain(self) -> float:
        """Expected tokens a round must add to pay for its fixed cost (0 until it is measured)."""
        if self.rounds.fixed is None or not self.token_seconds:
            return 0.0
        return self.rounds.fixed / self.token_seconds

    def min_child_gain(self) -> float:
        """Expected tokens a tree node must be able to add to pay for its target row."""
        return self.passes.per_row / self.token_seconds if self.token_seconds else 0.0

    def min_node_gain(self) -> float:
        """Expected tokens a node must be able to add to pay for its draft row and its child's target row."""
        if not self.token_seconds:
            return 0.0
        return (self.rounds.per_row + self.passes.per_row) / self.token_seconds
