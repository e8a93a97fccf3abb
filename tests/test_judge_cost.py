"""Lossy modes say what they cost: a judge file carries its held-out evaluation (format version 2; version 1
still loads, with none), `judge train` and `judge eval --record` write it, and `--judge` reports it at start,
with a warning when the judge's ROC-AUC says it does not predict importance for its target."""
import io
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rich.console import Console

from commands.generate import _print_judge_cost
from judge.classifier import Judge, record_evaluation
from judge.held_out import HeldOutEvaluation, ThresholdCost, judge_cost
from judge.policy import DEFAULT_JUDGE, default_threshold
from judge.train import train_judge
from offload.weights.safetensors_io import SafetensorsFile, write_safetensors
from test_judge import constant_judge, synthetic_records, write_mined

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_EVAL = ROOT / "bench" / "results" / "judge_eval_gsm8k.json"
WARNING = "does not predict importance for this target"


def evaluation(roc_auc: float = 0.45) -> HeldOutEvaluation:
    rows = [ThresholdCost(0.0003, 0.3333, 3.5606), ThresholdCost(0.5618, 0.1333, 3.9168)]
    return HeldOutEvaluation("gsm8k", 30, roc_auc, "judge eval", 8, 3.5056, rows)


def start_lines(cost: dict) -> list[str]:
    out = io.StringIO()
    _print_judge_cost(cost, Console(file=out, width=80, no_color=True))
    return out.getvalue().splitlines()


def test_the_evaluation_round_trips_through_the_judge_file(tmp_path):
    path = tmp_path / "j.safetensors"
    replace(constant_judge(0.3), evaluation=evaluation()).save(path)
    loaded = Judge.load(path)
    assert loaded.evaluation == evaluation() and SafetensorsFile(path).metadata["version"] == "2"
    assert loaded.evaluation.at(0.000331) == ThresholdCost(0.0003, 0.3333, 3.5606)     # judge eval's 4 decimals
    assert loaded.evaluation.at(1.0) is None


def test_a_version_1_file_still_loads_and_reports_no_evaluation(tmp_path):
    judge, path = constant_judge(0.3), tmp_path / "v1.safetensors"
    tensors = {"mean": judge.mean, "scale": judge.scale, "weight": judge.weight, "bias": judge.bias,
               "thresholds": judge.thresholds}
    write_safetensors(path, tensors, {"format": "specstream-judge", "version": "1", "target": "fp", "roc_auc": "0.5"})
    loaded = Judge.load(path)
    assert loaded.evaluation is None and loaded.roc_auc == 0.5
    lines = start_lines(judge_cost(loaded.evaluation, 0.3))
    assert len(lines) == 1 and lines[0].endswith("no held-out evaluation recorded")
    record_evaluation(path, evaluation(0.8))          # what `judge eval --record` does to an old file
    assert Judge.load(path).evaluation == evaluation(0.8)
    torch.testing.assert_close(Judge.load(path).weight, judge.weight, rtol=0, atol=0)


def test_judge_train_records_its_out_of_fold_roc_auc(tmp_path):
    features, labels = synthetic_records(200, 1)
    write_mined(tmp_path / "mined.jsonl", features, labels, lambda i: f"p{i // 10}")
    judge, report = train_judge([tmp_path / "mined.jsonl"], "fp")
    judge.save(tmp_path / "j.safetensors")
    recorded = Judge.load(tmp_path / "j.safetensors").evaluation
    assert recorded.source == "judge train" and recorded.num_problems == report["problems"] == 20
    assert recorded.roc_auc == pytest.approx(report["roc_auc"], abs=1e-4) and recorded.rows == []
    lines = start_lines(judge_cost(recorded, 0.5))
    assert "over 20 mined problems" in lines[0] and "judge eval --record" in lines[0]


def test_the_shipped_judge_carries_its_measured_gsm8k_evaluation():
    measured = json.loads(SHIPPED_EVAL.read_text())
    judge = Judge.load(DEFAULT_JUDGE)
    assert judge.evaluation == HeldOutEvaluation.from_eval_result(measured)
    assert judge.evaluation.task == "gsm8k" and judge.evaluation.num_problems == 30
    row = judge.evaluation.at(default_threshold(judge))               # the 5% row, run by default
    assert row == ThresholdCost(0.0003, 0.3333, 3.5606) and not judge.evaluation.predicts_importance


@pytest.mark.parametrize("roc_auc, warned", [(0.45, True), (0.59, True), (0.6, False), (0.9, False)])
def test_one_start_line_with_the_figures_and_a_warning_below_0_6(roc_auc, warned):
    lines = start_lines(judge_cost(evaluation(roc_auc), 0.000331))
    assert len(lines) == 1 + warned
    assert f"held out on gsm8k (30 problems): ROC-AUC {roc_auc:.2f}, answer agreement 33% at 3.56 tokens/pass" \
           in lines[0] and lines[0].startswith("lossy decoding:")
    assert (WARNING in lines[-1]) == warned


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


@pytest.mark.e2e
def test_run_with_the_shipped_judge_reports_its_cost_and_warns():
    result = cli("run", "What is 2+2?", "--judge", "default", "--json", "--max-new-tokens", "4")
    assert result.returncode == 0, result.stderr
    cost = json.loads(result.stdout)["judge"]
    assert cost["evaluation"]["roc_auc"] == pytest.approx(0.4502, abs=1e-4) and cost["evaluation"]["task"] == "gsm8k"
    assert cost["at_threshold"] == {"threshold": 0.0003, "answer_agreement": 0.3333, "tokens_per_pass": 3.5606}
    assert 0 < cost["threshold"] < 1 and cost["predicts_importance"] is False
    stderr = result.stderr.splitlines()
    assert len([line for line in stderr if line.startswith("lossy decoding:")]) == 1
    assert any(WARNING in line and "0.45" in line for line in stderr)


@pytest.mark.e2e
def test_judge_eval_record_stores_the_evaluation_in_the_judge_file(tmp_path):
    judge_file = shutil.copy(DEFAULT_JUDGE, tmp_path / "judge.safetensors")
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps({"question": "What is 2+2?", "answer": "#### 4"}) + "\n")
    result = cli("judge", "eval", "--task", "gsm8k", "--judge", str(judge_file), "--data", str(problems),
                 "--limit", "1", "--budget", "4", "--max-new-tokens", "8", "--thresholds", "0.5", "--json",
                 "--record")
    assert result.returncode == 0, result.stderr
    recorded = Judge.load(judge_file).evaluation
    assert recorded == HeldOutEvaluation.from_eval_result(json.loads(result.stdout.splitlines()[-1]))
    assert recorded.source == "judge eval" and recorded.num_problems == 1 and [r.threshold for r in recorded.rows] == [0.5]
    shipped = Judge.load(DEFAULT_JUDGE)
    assert torch.equal(Judge.load(judge_file).weight, shipped.weight) and shipped.evaluation.num_problems == 30
