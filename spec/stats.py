"""What a generation did: tokens, passes, and for speculation what each step drafted and accepted."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class DecodeStats:
    num_prompt_tokens: int = 0
    num_new_tokens: int = 0
    num_target_passes: int = 0       # every pass: prefill chunks and steps
    num_reused_tokens: int = 0
    seconds: float = 0.0
    first_token_seconds: float | None = None
    stop_reason: str = ""
    speculative: bool = False
    num_steps: int = 0               # passes after the prefill, one per tree
    tree_tokens: int = 0
    last_budget: int = 0
    policy_accepted: int = 0         # tokens a lossy acceptance policy (the judge) took against the target
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    overhead_seconds: float = 0.0    # growth bookkeeping, masks, sampling, acceptance, commits
    budgets: Counter = field(default_factory=Counter)          # chosen budget -> steps
    yields: Counter = field(default_factory=Counter)           # tokens a step yielded -> steps
    depth_reached: list[int] = field(default_factory=list)     # [d - 1]: steps accepting >= d draft tokens

    @property
    def tokens_per_pass(self) -> float:
        """Tokens per step pass: all but the first token (which the prefill yields) over the steps
        (1.0 for autoregressive decoding; the figure SpecExec and Sequoia report per step)."""
        if not self.num_steps:
            return float(self.num_new_tokens > 0)
        return (self.num_new_tokens - 1) / self.num_steps

    @property
    def tokens_per_second(self) -> float:
        return self.num_new_tokens / self.seconds if self.seconds > 0 else 0.0

    def record_step(self, budget: int, tree_size: int, num_yielded: int, draft_seconds: float,
                    target_seconds: float, overhead_seconds: float) -> None:
        self.num_target_passes += 1
        self.num_steps += 1
        self.tree_tokens += tree_size
        self.draft_seconds += draft_seconds
        self.target_seconds += target_seconds
        self.overhead_seconds += overhead_seconds
        self.budgets[budget] += 1
        self.last_budget = budget
        self.yields[num_yielded] += 1
        accepted = num_yielded - 1
        self.depth_reached.extend([0] * (accepted - len(self.depth_reached)))
        for depth in range(accepted):
            self.depth_reached[depth] += 1

    def speculation_report(self) -> dict:
        steps = max(self.num_steps, 1)
        return {
            "num_steps": self.num_steps,
            "budget": {"last": self.last_budget,
                       "mean": round(sum(b * n for b, n in self.budgets.items()) / steps, 2),
                       "histogram": {str(b): n for b, n in sorted(self.budgets.items())}},
            "mean_tree_tokens": round(self.tree_tokens / steps, 2),
            "tokens_per_pass_histogram": {str(k): n for k, n in sorted(self.yields.items())},
            "acceptance_by_depth": [round(n / steps, 4) for n in self.depth_reached],
            "seconds_per_step": {"draft": round(self.draft_seconds / steps, 5),
                                 "target": round(self.target_seconds / steps, 5),
                                 "overhead": round(self.overhead_seconds / steps, 5)},
            "overhead_share": round(self.overhead_seconds / max(self._step_seconds, 1e-12), 4),
        }

    @property
    def _step_seconds(self) -> float:
        return self.draft_seconds + self.target_seconds + self.overhead_seconds
