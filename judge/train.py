"""`judge train`: mined records -> a judge. Split by problem (a problem's mismatches are all in train or all
in validation), standardise, fit logistic regression for several L2 strengths, keep the one with the best
validation ROC-AUC, then refit on everything with it. Thresholds are quantiles of the validation
probabilities, so "accept the 40% least important mismatches" is one table row."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from .classifier import Judge, fit_logistic, roc_auc

L2_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
ACCEPT_SHARES = (0.05, 0.1, 0.2, 0.4)     # `judge eval` runs each row: keep the table short
VALIDATION_SHARE = 0.2


def read_mined(paths: list[Path], on_skip=None) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(features [N, H], labels [N], problem id per record) from mined JSONL files."""
    features, labels, problems = [], [], []
    lines = [(path, number, line) for path in paths
             for number, line in enumerate(path.read_text().splitlines(), start=1)]
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
    names = sorted(set(problems))
    random.Random(seed).shuffle(names)
    held = set(names[:max(1, int(len(names) * VALIDATION_SHARE))])
    is_val = torch.tensor([p in held for p in problems])
    mean, scale = features.mean(0), features.std(0).clamp(min=1e-6)
    standard = (features - mean) / scale
    scores = {}
    for l2 in L2_GRID:
        weight, bias = fit_logistic(standard[~is_val], labels[~is_val], l2)
        scores[l2] = roc_auc(torch.sigmoid(standard[is_val] @ weight + bias), labels[is_val])
    best = max(scores, key=lambda l2: (scores[l2] if scores[l2] == scores[l2] else -1, -l2))
    weight, bias = fit_logistic(standard[~is_val], labels[~is_val], best)
    validation = torch.sigmoid(standard[is_val] @ weight + bias)
    thresholds = torch.tensor([[share, float(validation.quantile(share))] for share in ACCEPT_SHARES])
    weight, bias = fit_logistic(standard, labels, best)
    judge = Judge(mean, scale, weight, bias, thresholds, target_fingerprint, scores[best])
    report = {"records": len(labels), "important_share": round(float(labels.float().mean()), 4),
              "problems": len(names), "validation_problems": len(held), "l2": best,
              "roc_auc_by_l2": {str(k): round(v, 4) for k, v in scores.items()}, "roc_auc": round(scores[best], 4),
              "thresholds": [[round(a, 2), round(b, 4)] for a, b in thresholds.tolist()]}
    return judge, report
