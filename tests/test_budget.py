"""Tree-budget choice: limits and flag parsing, the pass-time curve, its probe and cache, and the
chooser on synthetic hardware (flat GPU-like and steep CPU-like curves) and synthetic drafts."""
from __future__ import annotations

import json
import math
import random

import pytest

from perf.pass_curve import PassTimeCurve, curve_path, load_curve, save_curve
from perf.probe import probe_pass_times
from perf.tree_size import BudgetChooser, budget_grid, check_budget, parse_budget

CPU_POINTS = [(1, 0.070), (16, 0.125), (64, 0.305), (256, 0.729), (1024, 2.79)]   # measured, 2 cores
FLAT = PassTimeCurve([(n, 1.0) for n in budget_grid(4096)])
STEEP = PassTimeCurve(CPU_POINTS)
GAIN = 1.2               # synthetic draft: A(b) = GAIN * log2(b)
DRAFT_PER_TOKEN = 1e-5   # seconds of draft work per tree token
NUM_STEPS = 200


def draw_path_ranks(rng: random.Random, tree_size: int, gain: float) -> list[int]:
    """Ranks on an accepted path with E[#ranks < b] = gain * log2(b) for every b at once: points of a
    Poisson process of rate `gain` in log2(rank) space, floored, made strictly increasing (a child
    ranks below its parent in a best-first tree) and cut at the tree size."""
    ranks: list[int] = []
    if gain <= 0:
        return ranks
    log_rank = rng.expovariate(gain)
    while (rank := max(int(2 ** log_rank), ranks[-1] + 1 if ranks else 1)) < tree_size:
        ranks.append(rank)
        log_rank += rng.expovariate(gain)
    return ranks


def simulate(chooser: BudgetChooser, gain: float, num_steps: int = NUM_STEPS, seed: int = 0) -> list[int]:
    """choose -> draw the path a tree of that size accepts -> observe; returns the chosen budgets."""
    rng, chosen = random.Random(seed), []
    for _ in range(num_steps):
        budget = chooser.split(1, chooser.max_budget)
        chooser.observe(budget, draw_path_ranks(rng, budget, gain), DRAFT_PER_TOKEN * (budget - 1),
                        0.002 + 1e-7 * budget)
        chosen.append(budget)
    return chosen


def settled_after(chosen: list[int], allowed: set[int]) -> int:
    """Steps before the choices stay in `allowed` for good."""
    return max((i + 1 for i, b in enumerate(chosen) if b not in allowed), default=0)


def test_path_ranks_follow_the_synthetic_acceptance():
    rng = random.Random(0)
    paths = [draw_path_ranks(rng, 4096, GAIN) for _ in range(4000)]
    def mean_accepted(b: int) -> float:
        return sum(sum(r < b for r in p) for p in paths) / len(paths)
    assert 0.6 < mean_accepted(2) <= 1.0                       # one rank-1 node: A(2) <= 1 < GAIN
    for b in (16, 256, 4096):
        assert mean_accepted(b) == pytest.approx(GAIN * math.log2(b), rel=0.05)
    assert all(p == sorted(set(p)) for p in paths)


def test_flat_curve_settles_on_a_large_tree():
    chosen = simulate(BudgetChooser(FLAT, 4096), GAIN)
    assert chosen[0] == 4096                                   # prior: the whole flat curve
    assert all(b >= 1024 for b in chosen[-100:])
    assert settled_after(chosen, {1024, 2048, 4096}) <= 10


def test_flat_curve_explores_up_from_small_observed_trees():
    chooser, rng = BudgetChooser(FLAT, 4096), random.Random(1)
    for _ in range(5):                                         # e.g. the context window forced small trees
        chooser.observe(4, draw_path_ranks(rng, 4, GAIN), DRAFT_PER_TOKEN * 3, 0.002)
    assert chooser.split(1, chooser.max_budget) >= 1024                            # extrapolated gain makes a big tree pay
    assert all(b >= 1024 for b in simulate(chooser, GAIN)[-100:])


def test_steep_curve_settles_on_a_small_tree():
    chooser = BudgetChooser(STEEP, 4096)
    chosen = simulate(chooser, GAIN)
    assert chosen[0] == 16                                     # prior: t(16) <= 2 t(1) < t(32)
    assert all(1 < b <= 64 for b in chosen[-100:])
    assert max(set(chosen[-100:]), key=chosen[-100:].count) in (8, 16)
    assert settled_after(chosen, {2, 4, 8, 16, 32, 64}) <= 10


@pytest.mark.parametrize("curve", [FLAT, STEEP], ids=["flat", "steep"])
def test_useless_draft_falls_back_to_budget_one_exploring_rarely(curve: PassTimeCurve):
    chooser = BudgetChooser(curve, 4096)
    chosen = simulate(chooser, gain=0.0)
    assert chosen[0] > 1 and chosen[1:chooser.window + 1] == [1] * chooser.window
    explored = [i for i, b in enumerate(chosen) if b > 1]
    assert len(explored) <= NUM_STEPS // chooser.window + 1   # one tree per window of budget-1 steps
    assert all(b - a > chooser.window for a, b in zip(explored, explored[1:]))


def test_a_draft_that_turns_useful_is_noticed_after_budget_one():
    chooser = BudgetChooser(STEEP, 4096)
    simulate(chooser, gain=0.0, num_steps=50)
    assert chooser.split(1, chooser.max_budget) == 1 or chooser.last_choice > 1
    later = simulate(chooser, GAIN, num_steps=100, seed=3)
    assert all(1 < b <= 64 for b in later[-50:])


def test_observed_pass_times_replace_a_disturbed_probe():
    disturbed = PassTimeCurve([(1, 0.07), (2, 0.34), (4, 0.34), (8, 0.41), (16, 0.45), (64, 0.86)])
    chooser, rng = BudgetChooser(disturbed, 64), random.Random(0)
    assert chooser.pass_seconds(16) == pytest.approx(0.45)
    for _ in range(40):
        budget = chooser.split(1, chooser.max_budget)
        seconds = STEEP.seconds(budget)                      # what passes really take
        chooser.observe(budget, draw_path_ranks(rng, budget, GAIN), DRAFT_PER_TOKEN * (budget - 1), 0.002, seconds)
    assert chooser.pass_seconds(chooser.last_choice) == pytest.approx(STEEP.seconds(chooser.last_choice), rel=1e-6)


def test_extrapolation_adds_the_last_gain_per_doubling_capped_by_tree_size():
    chooser = BudgetChooser(FLAT, 64)
    for _ in range(3):
        chooser.observe(4, [1, 3], 0.0, 0.0)                   # A(1)=0, A(2)=1, A(4)=2
    assert chooser.expected_accepted() == pytest.approx([0, 1, 2, 3, 4, 5, 6])
    chooser = BudgetChooser(FLAT, 16, window=2)
    chooser.observe(16, list(range(1, 11)), 0.0, 0.0)          # A(4)=3, A(8)=7, A(16)=10, stale in 3 steps
    for _ in range(3):
        chooser.observe(2, [1], 0.0, 0.0)                      # recent: A(2)=1, gain 1 per doubling
    assert chooser.expected_accepted() == pytest.approx([0, 1, 3, 7, 10])   # stale beats 2, 3, 4


def test_estimates_price_draft_and_overhead():
    chooser = BudgetChooser(STEEP, 64)
    chooser.observe(16, [1, 2], draft_seconds=0.015, overhead_seconds=0.004)
    rows = {row["budget"]: row for row in chooser.estimates()}
    assert rows[1]["draft_seconds"] == 0.0
    assert rows[16]["draft_seconds"] == pytest.approx(0.015)
    assert rows[32]["draft_seconds"] == pytest.approx(0.031)   # 1 ms per tree token beyond the root
    assert rows[64]["overhead_seconds"] == pytest.approx(0.004)
    assert rows[16]["rate"] == pytest.approx((2 + 1) / (0.125 + 0.015 + 0.004))
    assert chooser.split(1, chooser.max_budget) == chooser.last_choice


def test_prior_and_validation():
    assert BudgetChooser(STEEP, 4096).prior_budget() == 16
    assert BudgetChooser(PassTimeCurve([(1, 1.0), (2, 5.0)]), 4096).prior_budget() == 2
    assert BudgetChooser(FLAT, 1).split(1, 1) == 1
    assert budget_grid(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    with pytest.raises(ValueError, match=r"\[1, 4\)"):
        BudgetChooser(FLAT, 64).observe(4, [1, 4], 0.0, 0.0)
    with pytest.raises(ValueError, match="8192"):
        BudgetChooser(FLAT, 10_000)


def test_curve_interpolates_and_extrapolates():
    curve = PassTimeCurve([(5, 6.0), (1, 1.0), (3, 2.0)])
    assert [curve.seconds(n) for n in (0.5, 1, 2, 3, 4, 5, 7)] == pytest.approx([1, 1, 1.5, 2, 4, 6, 10])
    falling = PassTimeCurve([(1, 1.0), (2, 3.0), (4, 2.0)])
    assert falling.seconds(3) == pytest.approx(2.5)
    assert falling.seconds(8) == pytest.approx(2.0)            # never below the last value
    assert PassTimeCurve([(4, 0.3)]).seconds(1000) == pytest.approx(0.3)
    assert PassTimeCurve.from_dict(json.loads(json.dumps(curve.to_dict()))).points == curve.points


@pytest.mark.parametrize("points", [[], [(1, 1.0), (1, 2.0)], [(0, 1.0)], [(1, -1.0)], [(1, math.nan)]])
def test_curve_rejects_bad_points(points):
    with pytest.raises(ValueError):
        PassTimeCurve(points)


def test_curve_rejects_other_formats():
    with pytest.raises(ValueError, match="pass-time-curve"):
        PassTimeCurve.from_dict({"format": "something-else", "version": 1, "points": [[1, 1.0]]})


def counting(seconds_of):
    calls: list[int] = []

    def measure(n: int) -> float:
        calls.append(n)
        return seconds_of(n)
    return measure, calls


def test_probe_stops_on_a_steep_curve():
    measure, calls = counting(lambda n: 0.07 + 0.0027 * n)     # 12 t(1) = 0.87 s: first above is n = 512
    curve = probe_pass_times(measure, 4096)
    assert [n for n, _ in curve.points] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert calls == [1] + [n for n in sizes for _ in range(3)] + [512, 1]   # warm-up; slow sizes once; 1 again
    assert curve.seconds(512) == pytest.approx(0.07 + 0.0027 * 512)


def test_probe_reaches_max_on_a_flat_curve_and_keeps_the_best():
    timings = iter([9.0] + [0.6, 0.5, 0.7] * 8 + [0.8])       # warm-up is slow; repeats vary
    measure, calls = counting(lambda n: next(timings))
    curve = probe_pass_times(measure, 100)
    assert [n for n, _ in curve.points] == [1, 2, 4, 8, 16, 32, 64, 100]
    assert calls == [1] + [n for n in (1, 2, 4, 8, 16, 32, 64, 100) for _ in range(3)] + [1]
    assert all(s == 0.5 for _, s in curve.points)


def test_a_disturbed_point_is_measured_again_and_a_busy_first_point_too():
    """A 2-token pass measured at 6x the 1-token pass (a busy moment: the curve of a cache found here had
    t(2) = 0.667 s against t(1) = 0.106 s) is measured again until it is within 1.5 x 2 x t(1); the
    1-token pass is measured once more at the end."""
    timings = {1: iter([0.1, 0.1, 0.1, 0.1, 0.1]), 2: iter([0.6, 0.6, 0.6, 0.5, 0.12]), 4: iter([0.13] * 3)}
    measure, calls = counting(lambda n: next(timings[n]))
    curve = probe_pass_times(measure, 4)
    assert curve.points == [(1, 0.1), (2, 0.12), (4, 0.13)]
    assert calls == [1, 1, 1, 1, 2, 2, 2, 2, 2, 4, 4, 4, 1]
    stuck = {1: iter([0.1] * 5), 2: iter([0.6] * 6)}                 # never settles: kept after 3 retries
    measure, calls = counting(lambda n: next(stuck[n]))
    assert probe_pass_times(measure, 2).points == [(1, 0.1), (2, 0.6)] and calls.count(2) == 6


def test_probe_rejects_bad_measurements():
    with pytest.raises(ValueError, match="over 1 tokens"):
        probe_pass_times(lambda n: -1.0, 8)


KEY = {"model": "abc123", "tiers": {"gpu": 10, "cpu": 22}, "device": "cuda", "dtype": "float16", "threads": 8}


def test_curve_cache_round_trip(tmp_path):
    folder = tmp_path / "cache"
    assert load_curve(KEY, folder) is None
    save_curve(KEY, STEEP, folder)
    assert load_curve(dict(reversed(KEY.items())), folder).points == STEEP.points   # key order is irrelevant
    assert load_curve({**KEY, "tiers": {"gpu": 11, "cpu": 21}}, folder) is None
    assert [p.name for p in folder.iterdir()] == [curve_path(KEY, folder).name]    # no temporary left


def test_corrupt_cache_counts_as_missing(tmp_path):
    save_curve(KEY, STEEP, tmp_path)
    curve_path(KEY, tmp_path).write_text('{"key": ')
    with pytest.warns(RuntimeWarning, match="unreadable pass-time cache"):
        assert load_curve(KEY, tmp_path) is None
    curve_path(KEY, tmp_path).write_text(json.dumps({"key": KEY, "curve": {"format": "x"}}))
    with pytest.warns(RuntimeWarning):
        assert load_curve(KEY, tmp_path) is None


@pytest.mark.parametrize("value", [0, -3, 8193, True, 2.0])
def test_check_budget_names_the_range(value):
    with pytest.raises(ValueError, match=r"budget must lie in \[1, 8192\]"):
        check_budget(value)


def test_parse_budget():
    assert parse_budget("auto") is None and parse_budget(" AUTO ") is None
    assert parse_budget("1") == 1 and parse_budget("8192") == 8192
    for text in ("0", "9000", "lots", "1.5", ""):
        with pytest.raises(ValueError, match=r"--budget must be 'auto' or an integer in \[1, 8192\]"):
            parse_budget(text)
