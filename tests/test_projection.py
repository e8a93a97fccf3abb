"""The pass-time model (perf/pass_model.py) and the rate projection (perf/projection.py),
on cases worked out by hand in the comments."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from perf.pass_model import (GPU_PRESETS, MeasuredPassCurve, PassModelInputs, gpu_preset, load_device_check,
                             pass_breakdown, predicted_pass_seconds)
from perf.projection import (AcceptanceCurve, DraftCost, default_acceptance_curve, load_acceptance_curve,
                             project)

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def ram_only(**overrides) -> PassModelInputs:
    # 80 layers of 0.5 GB streamed from RAM at 25 GB/s; 0.25e9 params per layer; 100 TFLOP/s at 50%.
    fields = dict(layer_bytes=500_000_000, layer_params=250_000_000, link_gbps=25.0, gpu_tflops=100.0,
                  num_ram_layers=80, efficiency=0.5)
    return PassModelInputs(**{**fields, **overrides})


def test_transfer_bound_pass():
    # transfer: 0.5e9 / 25e9 = 0.02 s per layer, x 80 = 1.6 s.
    # compute at n = 1024: 2 * 0.25e9 * 1024 / (100e12 * 0.5) = 5.12e11 / 5e13 = 0.01024 s per layer.
    # max(0.02, 0.01024) = 0.02 per layer -> 1.6 s: the copy hides the compute.
    breakdown = pass_breakdown(ram_only(), 1024)
    assert breakdown.transfer_seconds == pytest.approx(1.6)
    assert breakdown.compute_seconds == pytest.approx(80 * 0.01024)
    assert breakdown.seconds == pytest.approx(1.6)


def test_compute_bound_pass():
    # n = 4096: 2 * 0.25e9 * 4096 / 5e13 = 0.04096 s per layer > 0.02 -> 80 * 0.04096 = 3.2768 s.
    assert predicted_pass_seconds(ram_only(), 4096) == pytest.approx(3.2768)
    # Crossover where compute = transfer: 0.02 = 1e-5 * n -> n = 2000; just past it the pass grows.
    assert predicted_pass_seconds(ram_only(), 2000) == pytest.approx(1.6)
    assert predicted_pass_seconds(ram_only(), 2100) == pytest.approx(80 * 1e-5 * 2100)


def test_mixed_tiers_and_resident_compute():
    # 10 device, 60 RAM, 10 disk layers; disk 5 GB/s read, then the 25 GB/s copy (as the planner):
    # disk layer 0.5/5 + 0.5/25 = 0.1 + 0.02 = 0.12 s; compute at n = 1: 2 * 0.25e9 / 5e13 = 1e-5 s.
    # pass = 10 * 1e-5 (resident) + 60 * 0.02 + 10 * 0.12 = 0.0001 + 1.2 + 1.2 = 2.4001 s.
    inputs = ram_only(num_device_layers=10, num_ram_layers=60, num_disk_layers=10, disk_gbps=5.0)
    assert predicted_pass_seconds(inputs, 1) == pytest.approx(2.4001)
    assert pass_breakdown(inputs, 1).transfer_seconds == pytest.approx(2.4)


def test_decode_and_head_add_to_compute():
    # decode at 50 GB/s: 0.5e9 / 50e9 = 0.01 s per layer on the compute side: at n = 1024 compute is
    # 0.01024 + 0.01 = 0.02024 > 0.02 -> 80 * 0.02024 = 1.6192 s.
    assert predicted_pass_seconds(ram_only(decode_gbps=50.0), 1024) == pytest.approx(1.6192)
    # LM head 8192 x 32000 = 262,144,000 params at n = 1024: 2 * 262144000 * 1024 / 5e13 = 0.0107374 s.
    head = predicted_pass_seconds(ram_only(head_params=8192 * 32000), 1024) - 1.6
    assert head == pytest.approx(2 * 262_144_000 * 1024 / 5e13)


def test_from_plan_reads_tiers_and_preset():
    config = SimpleNamespace(layer_param_count=250_000_000, vocab_size=32000, hidden_size=8192)
    plan = SimpleNamespace(tier_of=["device"] * 2 + ["ram"] * 78, request=SimpleNamespace(
        layer_bytes=500_000_000, config=config))
    inputs = PassModelInputs.from_plan(plan, gpu_preset("rtx4090"), efficiency=0.5)
    assert (inputs.num_device_layers, inputs.num_ram_layers, inputs.num_disk_layers) == (2, 78, 0)
    assert (inputs.link_gbps, inputs.gpu_tflops, inputs.head_params) == (25.0, 165.2, 262_144_000)


def test_unknown_gpu_lists_the_known_ones():
    with pytest.raises(ValueError) as error:
        gpu_preset("rtx9090")
    assert "rtx9090" in str(error.value)
    for name in ("rtx4090", "rtx3090", "rtx4060ti-16g", "a100-40g"):
        assert name in str(error.value) and name in GPU_PRESETS
    assert gpu_preset(" RTX4090 ").tflops == 165.2


@pytest.mark.parametrize("overrides", [dict(layer_bytes=0), dict(link_gbps=-1.0), dict(efficiency=1.5),
                                       dict(efficiency=0.0), dict(num_ram_layers=0),
                                       dict(num_disk_layers=4), dict(decode_gbps=0.0), dict(head_params=-1)])
def test_invalid_pass_inputs_are_rejected(overrides):
    with pytest.raises(ValueError):
        ram_only(**overrides)


def test_measured_curve_interpolates_in_log_tokens():
    curve = MeasuredPassCurve([(256, 2.0), (1, 1.0), (16, 1.0)], bytes_streamed=10**9, link_gbps=10.0, num_layers=1)
    # n = 64 between 16 and 256: log(64/16) / log(256/16) = 2 / 4 = 0.5 -> 1 + 0.5 * (2 - 1) = 1.5.
    assert curve.seconds(64) == pytest.approx(1.5)
    assert curve.seconds(16) == pytest.approx(1.0) and curve.seconds(256) == pytest.approx(2.0)
    assert curve.seconds(1) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="256"):
        curve.seconds(512)


def test_measured_curve_scales_its_transfer_part():
    # Measured: 10 GB over 50 GB/s = 0.2 s of transfer; residuals 0.25 - 0.2 = 0.05 and 0.3 - 0.2 = 0.1.
    # Scaled to 20 GB at 25 GB/s = 0.8 s: 0.85 and 0.9; with twice the layers the residuals double: 0.9, 1.0.
    curve = MeasuredPassCurve([(1, 0.25), (1024, 0.3)], bytes_streamed=10 * 10**9, link_gbps=50.0, num_layers=4)
    same_layers = curve.scaled(20 * 10**9, 25.0)
    assert [s for _, s in same_layers.points] == pytest.approx([0.85, 0.9])
    assert [s for _, s in curve.scaled(20 * 10**9, 25.0, num_layers=8).points] == pytest.approx([0.9, 1.0])


def test_device_check_file_loads():
    curve = load_device_check(RESULTS / "device_check_h200.json")
    assert (curve.num_layers, curve.bytes_streamed, curve.link_gbps, curve.max_tokens) == (4, 6845235200, 55.132, 2048)
    # n = 32 between 16 (0.12946 s) and 64 (0.12779 s): halfway in log n -> 0.129625 s.
    assert curve.seconds(32) == pytest.approx((0.12946 + 0.12779) / 2)


def test_best_budget_by_hand():
    # a(b): 1 -> 1, 4 -> 2, 16 -> 3, 64 -> 3.5; at 2 and 8, halfway in log b: 1.5 and 2.5; at 32: 3.25.
    # t(n) = 1 s up to 16 tokens, 2 s above; draft 0.1 s x log2(b) rounds: 0.1 / 0.2 / 0.3 / 0.4 / 0.5 / 0.6.
    # tok/s: b=1 1/1 = 1; 2: 1.5/1.1 = 1.364; 4: 2/1.2 = 1.667; 8: 2.5/1.3 = 1.923; 16: 3/1.4 = 2.143;
    # 32: 3.25/2.5 = 1.3; 64: 3.5/2.6 = 1.346 -> best 16 at 2.142857, 2.142857x autoregressive.
    curve = AcceptanceCurve([(4, 2.0), (16, 3.0), (64, 3.5)])
    result = project(lambda n: 1.0 if n <= 16 else 2.0, curve, DraftCost(0.1).seconds)
    assert [row.budget for row in result.rows] == [1, 2, 4, 8, 16, 32, 64]
    assert [row.tokens_per_second for row in result.rows] == pytest.approx(
        [1.0, 1.5 / 1.1, 2 / 1.2, 2.5 / 1.3, 3 / 1.4, 3.25 / 2.5, 3.5 / 2.6])
    assert result.best_budget == 16
    assert result.tokens_per_second == pytest.approx(3 / 1.4)
    assert result.autoregressive_tokens_per_second == pytest.approx(1.0)
    assert result.speedup == pytest.approx(3 / 1.4)
    assert result.as_dict()["best_budget"] == 16


def test_acceptance_clamps_above_the_largest_budget():
    curve = AcceptanceCurve([(4, 2.0), (64, 3.5)])
    assert curve.tokens_per_pass(8192) == pytest.approx(3.5)
    # Candidates stop at the curve's largest budget (and at max_budget when smaller, which is included).
    rows = project(lambda n: 1.0, curve, DraftCost(0.0).seconds, max_budget=8192).rows
    assert rows[-1].budget == 64
    assert [r.budget for r in project(lambda n: 1.0, curve, DraftCost(0.0).seconds, max_budget=48).rows][-1] == 48


@pytest.mark.parametrize("points", [[(4, 5.0)], [(4, 0.5)], [(1, 2.0)], [(0, 1.0)], [(4, 2.0), (4, 3.0)]])
def test_invalid_acceptance_curves_are_rejected(points):
    with pytest.raises(ValueError):
        AcceptanceCurve(points)


def test_draft_cost_rounds():
    cost = DraftCost(0.025)
    # 1024: max(min(33, log2 1024 = 10), 1024 / 128 = 8) = 10 rounds x 25 ms = 0.25 s.
    # 4096: max(12, 4096 / 128 = 32) = 32 rounds = 0.8 s (the width bound); budget 1: no draft.
    assert cost.seconds(1024) == pytest.approx(0.25)
    assert cost.seconds(4096) == pytest.approx(0.8)
    assert cost.seconds(1) == 0.0
    # Depth term capped at max_depth + 1: 3 x log2(1024) = 30 -> min(5, 30) = 5 vs 1024 / 512 = 2 -> 5.
    assert DraftCost(1.0, rounds_per_doubling=3.0, max_depth=4, width=512).rounds(1024) == pytest.approx(5.0)
    with pytest.raises(ValueError):
        DraftCost(-1.0)


def test_reads_spec_and_tree_simulation_results(tmp_path):
    spec = {"bench": "spec", "modes": {"resident": {"autoregressive": {"tokens_per_pass": 1.0},
                                                    "budgets": [{"budget": 4, "tokens_per_pass": 1.8}]}}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert load_acceptance_curve(tmp_path / "spec.json").points == [(1, 1.0), (4, 1.8)]
    with pytest.raises(ValueError, match="resident"):
        load_acceptance_curve(tmp_path / "spec.json", mode="disk-cold")
    # Parts merged by passes: 10 tokens at 2.0 per pass = 5 passes, 30 at 3.0 = 10: 40 / 15 = 2.6667.
    parts = [{"answer_tokens": 11, "num_prompts": 1, "rows": [{"budget": 64, "tokens_per_pass": 2.0}]},
             {"answer_tokens": 32, "num_prompts": 2, "rows": [{"budget": 64, "tokens_per_pass": 3.0}]}]
    (tmp_path / "all.json").write_text(json.dumps({"bench": "tree-simulation-all-prompts", "parts": parts}))
    assert load_acceptance_curve(tmp_path / "all.json").tokens_per_pass(64) == pytest.approx(40 / 15)
    (tmp_path / "other.json").write_text(json.dumps({"bench": "quant"}))
    with pytest.raises(ValueError, match="tree-simulation"):
        load_acceptance_curve(tmp_path / "other.json")


def test_repo_results_and_the_shipped_default_agree():
    # The shipped curve is the measured one: spec_resident (1-256), spec_1024 (512), tree_simulation (>= 1024).
    default = dict(default_acceptance_curve().points)
    for name in ("spec_resident.json", "spec_1024.json", "tree_simulation.json"):
        for budget, tokens in load_acceptance_curve(RESULTS / name).points:
            assert default[budget] == pytest.approx(tokens)
    everything = load_acceptance_curve(RESULTS / "tree_simulation_all_prompts.json")
    assert everything.tokens_per_pass(1024) == pytest.approx(4.5958, abs=1e-4)
    assert default_acceptance_curve("all-124-prompts").tokens_per_pass(1024) == pytest.approx(4.5958)
    with pytest.raises(ValueError, match="readme-8-prompts"):
        default_acceptance_curve("mt-bench")
