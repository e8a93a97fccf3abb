"""What a judge costs, measured on problems it was not fitted on: the evaluation a judge file carries
(metadata key "evaluation", judge format version 2) and what `--judge` reports at start.

`judge train` records the out-of-fold ROC-AUC over the mined problems; `judge eval --record` adds, per
threshold, the share of test problems whose final answer stays the target's own and the tokens per pass.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

MIN_USEFUL_ROC_AUC = 0.6    # below it the judge barely tells answer-changing mismatches from harmless ones
THRESHOLD_DECIMALS = 4      # `judge eval` runs (and records) thresholds rounded to this many decimals


@dataclass(slots=True, frozen=True)
class ThresholdCost:
    threshold: float             # accept a mismatch when p(important) < threshold
    answer_agreement: float      # share of problems whose final answer is the target's own greedy one
    tokens_per_pass: float


@dataclass(slots=True)
class HeldOutEvaluation:
    task: str | None             # "gsm8k", "humaneval"; None: judge train's mined problems (task not known)
    num_problems: int            # problems behind the agreement figures (judge train: the mined problems)
    roc_auc: float               # out-of-fold ROC-AUC of p(important) over the mined mismatches
    source: str                  # "judge train" (ROC-AUC only) or "judge eval"
    budget: int | None = None    # tree budget of the judge eval runs
    lossless_tokens_per_pass: float | None = None
    rows: list[ThresholdCost] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_problems < 1:
            raise ValueError(f"an evaluation needs at least one problem, got {self.num_problems}")
        if not (math.isnan(self.roc_auc) or 0 <= self.roc_auc <= 1):
            raise ValueError(f"ROC-AUC must lie in [0, 1], got {self.roc_auc}")

    @property
    def predicts_importance(self) -> bool:
        return self.roc_auc >= MIN_USEFUL_ROC_AUC

    def at(self, threshold: float) -> ThresholdCost | None:
        """The row measured at `threshold` (to THRESHOLD_DECIMALS decimals), or None when none was."""
        wanted = round(threshold, THRESHOLD_DECIMALS)
        return next((row for row in self.rows if round(row.threshold, THRESHOLD_DECIMALS) == wanted), None)

    def as_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.as_dict())

    @classmethod
    def from_json(cls, text: str) -> "HeldOutEvaluation":
        fields = json.loads(text)
        return cls(**{**fields, "rows": [ThresholdCost(**row) for row in fields.get("rows", [])]})

    @classmethod
    def from_eval_result(cls, result: dict) -> "HeldOutEvaluation":
        """`judge eval`'s result (also as saved in bench/results/judge_eval_*.json) -> its evaluation."""
        rows = [ThresholdCost(r["threshold"], r["answer_agreement"], r["tokens_per_pass"]) for r in result["thresholds"]]
        return cls(result["task"], result["problems"], result["roc_auc"], "judge eval", result["budget"],
                   result["lossless"]["tokens_per_pass"], rows)


def judge_cost(evaluation: HeldOutEvaluation | None, threshold: float) -> dict:
    """What `--judge` at `threshold` is known to cost: the session reports it, commands/ prints it."""
    if evaluation is None:
        return {"threshold": threshold, "evaluation": None, "at_threshold": None, "predicts_importance": None}
    row = evaluation.at(threshold)
    return {"threshold": threshold, "evaluation": evaluation.as_dict(), "at_threshold": asdict(row) if row else None,
            "predicts_importance": evaluation.predicts_importance}
