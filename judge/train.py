"""`judge train`: mined records -> a judge. Standardise, fit logistic regression for several L2 strengths
with 5-fold cross-validation split by problem (a problem's mismatches all sit in one fold), keep the
strength with the best out-of-fold ROC-AUC, then refit on everything with it. Thresholds are quantiles
of the out-of-fold probabilities, so "accept the 10% least important mismatches" is one table row."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from textdata import jsonl_lines

from .classifier import Judge, fit_logistic, roc_auc
from .held_out import HeldOutEvaluation

L2_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
ACCEPT_SHARES = (0.05, 0.1, 0.2, 0.4)     # `judge eval` runs each row: keep the table short
FOLDS = 5                                  # cross-validation folds, split by problem


def read_mined(paths: list[Path], on_skip=None) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(features [N, H], labels [N], problem id per record) from mined JSONL files."""
    features, labels, problems = [], [], []
    lines = [(path, number, line) for path in paths
             for number, line in jsonl_lines(path)]
    for path, number, line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            if on_skip:
                on_skip(f"{path.name} line {number}: not JSON")
            continue
        if "label" not in row:
            continue
        features.append(row["features"])
        labels.append(row["label"])
        problems.append(row["problem"])
    if not labels:
        raise ValueError(f"{', '.join(map(str, paths))} hold no labelled mismatches (run `judge mine` first)")
    if len(set(labels)) < 2:
        raise ValueError("the mined records hold only one label; mine more problems")
    return torch.tensor(features), torch.tensor(labels), problems


def train_judge(paths: list[Path], target_fingerprint: str, seed: int = 0) -> tuple[Judge, dict]:
    features, labels, problems = read_mined(paths)
    fold = _folds_by_problem(problems, seed)
    mean, scale = features.mean(0), features.std(0).clamp(min=1e-6)
    standard = (features - mean) / scale
    held_out = {l2: _out_of_fold(standard, labels, fold, l2) for l2 in L2_GRID}
    scores = {l2: roc_auc(p, labels) for l2, p in held_out.items()}
    best = max(scores, key=lambda l2: (scores[l2] if scores[l2] == scores[l2] else -1, -l2))
    thresholds = torch.tensor([[share, float(held_out[best].quantile(share))] for share in ACCEPT_SHARES])
    weight, bias = fit_logistic(standard, labels, best)
    evaluation = HeldOutEvaluation(None, len(set(problems)), scores[best], "judge train")   # out-of-fold
    judge = Judge(mean, scale, weight, bias, thresholds, target_fingerprint, scores[best], evaluation)
    report = {"records": len(labels), "important_share": round(float(labels.float().mean()), 4),
              "problems": len(set(problems)), "folds": int(fold.max()) + 1, "l2": best,
              "roc_auc_by_l2": {str(k): round(v, 4) for k, v in scores.items()}, "roc_auc": round(scores[best], 4),
              "thresholds": [[round(a, 2), round(b, 4)] for a, b in thresholds.tolist()]}
    return judge, report


def _folds_by_problem(problems: list[str], seed: int) -> torch.Tensor:
    """[N] fold of each record: problems shuffled and dealt into FOLDS folds (a problem's records share one)."""
    names = sorted(set(problems))
    random.Random(seed).shuffle(names)
    folds = min(FOLDS, len(names))
    of = {name: i % folds for i, name in enumerate(names)}
    return torch.tensor([of[p] for p in problems])


def _out_of_fold(standard: torch.Tensor, labels: torch.Tensor, fold: torch.Tensor, l2: float) -> torch.Tensor:
    """[N] each record's p(important) from the model fitted without its fold."""
    out = torch.empty(len(labels))
    for k in range(int(fold.max()) + 1):
        held = fold == k
        weight, bias = fit_logistic(standard[~held], labels[~held], l2)
        out[held] = torch.sigmoid(standard[held] @ weight + bias)
    return out
