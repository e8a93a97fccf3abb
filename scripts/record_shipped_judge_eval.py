"""One-off: store the measured `judge eval` of the shipped judge (bench/results/judge_eval_gsm8k.json) in
the judge file's metadata (format version 2), without retraining; the tensors stay byte-identical.

    .venv/bin/python scripts/record_shipped_judge_eval.py [RESULT_JSON]

Equivalent to rerunning `judge eval --task gsm8k --judge default --limit 30 --budget 8 --record` (18 minutes)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from judge.classifier import JUDGE_TENSORS, record_evaluation  # noqa: E402
from judge.held_out import HeldOutEvaluation  # noqa: E402
from judge.policy import DEFAULT_JUDGE  # noqa: E402
from offload.weights.safetensors_io import SafetensorsFile  # noqa: E402


def tensor_bytes(path: Path) -> dict[str, bytes]:
    opened = SafetensorsFile(path)
    return {name: opened.tensor(name).contiguous().view(-1).view(torch.uint8).numpy().tobytes() for name in JUDGE_TENSORS}


def main(result_path: Path) -> int:
    evaluation = HeldOutEvaluation.from_eval_result(json.loads(result_path.read_text()))
    before = tensor_bytes(DEFAULT_JUDGE)
    record_evaluation(DEFAULT_JUDGE, evaluation)
    if tensor_bytes(DEFAULT_JUDGE) != before:
        raise SystemExit(f"{DEFAULT_JUDGE}: the tensors changed while recording the evaluation")
    print(json.dumps({"judge": str(DEFAULT_JUDGE.relative_to(ROOT)), "metadata": SafetensorsFile(DEFAULT_JUDGE).metadata}))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "bench" / "results" / "judge_eval_gsm8k.json"))
