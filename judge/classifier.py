"""The judge: standardised target hidden states -> logistic regression -> p(important), saved as a small
safetensors file tied to the target it was mined with.

    judge.safetensors   mean [H], scale [H], weight [H], bias [1], thresholds [T, 2] (quantile of the
                        validation probabilities, threshold); metadata: format, version, the target's
                        embedding fingerprint, hidden size, validation ROC-AUC, and (version 2) "evaluation":
                        the held-out evaluation as JSON (judge/held_out.py). Version 1 files still load,
                        with no evaluation.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from offload.weights.safetensors_io import SafetensorsFile, write_safetensors
from .held_out import HeldOutEvaluation

JUDGE_FORMAT, JUDGE_VERSION = "specstream-judge", 2
READABLE_VERSIONS = ("1", "2")     # version 1: no held-out evaluation
JUDGE_TENSORS = ("mean", "scale", "weight", "bias", "thresholds")


class JudgeFormatError(ValueError):
    """A judge file is malformed, of another version, or for another target."""


@dataclass(slots=True)
class Judge:
    mean: Tensor          # [H]
    scale: Tensor         # [H]
    weight: Tensor        # [H]
    bias: Tensor          # [1]
    thresholds: Tensor    # [T, 2] (share of validation mismatches accepted, threshold on p(important))
    target_fingerprint: str
    roc_auc: float
    evaluation: HeldOutEvaluation | None = None

    def __post_init__(self) -> None:
        size = self.mean.shape[0]
        if self.mean.dim() != 1 or any(t.shape != (size,) for t in (self.scale, self.weight)) or \
                self.bias.shape != (1,) or self.thresholds.dim() != 2 or self.thresholds.shape[1] != 2:
            shapes = ", ".join(f"{n} {list(getattr(self, n).shape)}" for n in JUDGE_TENSORS)
            raise JudgeFormatError(f"judge tensors have inconsistent shapes ({shapes}; need [H], [H], [H], [1], "
                                   "[T, 2])")

    @property
    def hidden_size(self) -> int:
        return self.mean.shape[0]

    def to(self, device: torch.device) -> "Judge":
        return replace(self, mean=self.mean.to(device), scale=self.scale.to(device), weight=self.weight.to(device),
                       bias=self.bias.to(device))

    def important_probability(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] (on the judge's device) -> p(important) [...]."""
        h = (hidden.float() - self.mean) / self.scale
        return torch.sigmoid(h @ self.weight + self.bias)

    def save(self, path: Path) -> None:
        tensors = {"mean": self.mean, "scale": self.scale, "weight": self.weight, "bias": self.bias,
                   "thresholds": self.thresholds}
        metadata = {"format": JUDGE_FORMAT, "version": str(JUDGE_VERSION), "target": self.target_fingerprint,
                    "roc_auc": json.dumps(self.roc_auc)}
        if self.evaluation is not None:
            metadata["evaluation"] = self.evaluation.to_json()
        write_safetensors(path, {k: v.float().contiguous() for k, v in tensors.items()}, metadata)

    @classmethod
    def load(cls, path: Path) -> "Judge":
        opened = SafetensorsFile(path)
        meta = opened.metadata
        if meta.get("format") != JUDGE_FORMAT or meta.get("version") not in READABLE_VERSIONS:
            raise JudgeFormatError(f"{path} is format {meta.get('format')!r} version {meta.get('version')!r}; "
                                   f"this build reads {JUDGE_FORMAT} versions {', '.join(READABLE_VERSIONS)}")
        missing = [n for n in JUDGE_TENSORS if n not in opened.entries] + [k for k in ("target", "roc_auc")
                                                                          if k not in meta]
        if missing:
            raise JudgeFormatError(f"{path} lacks {', '.join(missing)}: not a complete judge file (`judge train` "
                                   "writes one)")
        try:
            tensors = {name: opened.tensor(name).clone().float() for name in JUDGE_TENSORS}
            evaluation = HeldOutEvaluation.from_json(meta["evaluation"]) if "evaluation" in meta else None
            return cls(**tensors, target_fingerprint=meta["target"], roc_auc=float(json.loads(meta["roc_auc"])),
                       evaluation=evaluation)
        except (ValueError, TypeError) as err:
            raise JudgeFormatError(f"{path}: {err}") from None


def record_evaluation(path: Path, evaluation: HeldOutEvaluation) -> None:
    """Stores `evaluation` in the judge file at `path` (now version 2); its tensors are written unchanged."""
    replace(Judge.load(path), evaluation=evaluation).save(path)


def roc_auc(scores: Tensor, labels: Tensor) -> float:
    """Probability that a random positive scores above a random negative (ties count half)."""
    positives, negatives = scores[labels == 1], scores[labels == 0]
    if not len(positives) or not len(negatives):
        return float("nan")
    greater = (positives[:, None] > negatives[None, :]).float().mean()
    ties = (positives[:, None] == negatives[None, :]).float().mean()
    return float(greater + 0.5 * ties)


def fit_logistic(features: Tensor, labels: Tensor, l2: float, steps: int = 200) -> tuple[Tensor, Tensor]:
    """Standardised features [N, H], labels [N] -> (weight [H], bias [1]) minimising the mean log loss
    + l2 * ||w||^2 / 2 (full-batch L-BFGS; the problem is convex)."""
    weight = torch.zeros(features.shape[1], requires_grad=True)
    bias = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=steps, line_search_fn="strong_wolfe")
    targets = labels.float()

    def closure():
        optimizer.zero_grad()
        logits = features @ weight + bias
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets) + 0.5 * l2 * weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return weight.detach(), bias.detach()
