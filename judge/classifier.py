"""The judge: standardised target hidden states -> logistic regression -> p(important), saved as a small
safetensors file tied to the target it was mined with.

    judge.safetensors   mean [H], scale [H], weight [H], bias [1], thresholds [T, 2] (quantile of the
                        validation probabilities, threshold); metadata: format, version, the target's
                        embedding fingerprint, hidden size, validation ROC-AUC
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from offload.safetensors_io import SafetensorsFile, write_safetensors

JUDGE_FORMAT, JUDGE_VERSION = "specstream-judge", 1


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

    def __post_init__(self) -> None:
        size = self.mean.shape[0]
        if self.mean.dim() != 1 or any(t.shape != (size,) for t in (self.scale, self.weight)) or \
                self.bias.shape != (1,) or self.thresholds.dim() != 2 or self.thresholds.shape[1] != 2:
            raise JudgeFormatError("judge tensors have inconsistent shapes")

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
        write_safetensors(path, {k: v.float().contiguous() for k, v in tensors.items()}, metadata)

    @classmethod
    def load(cls, path: Path) -> "Judge":
        opened = SafetensorsFile(path)
        meta = opened.metadata
        if meta.get("format") != JUDGE_FORMAT or meta.get("version") != str(JUDGE_VERSION):
            raise JudgeFormatError(f"{path} is format {meta.get('format')!r} version {meta.get('version')!r}; "
                                   f"this build reads {JUDGE_FORMAT} version {JUDGE_VERSION}")
        try:
            tensors = {name: opened.tensor(name).clone() for name in ("mean", "scale", "weight", "bias", "thresholds")}
            return cls(**tensors, target_fingerprint=meta["target"], roc_auc=float(json.loads(meta["roc_auc"])))
        except (KeyError, ValueError) as err:
            raise JudgeFormatError(f"{path}: {err}") from None


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
