"""`bench serve`'s arithmetic and settings (its measurement runs in bench/results/serve.json, not here): the
figures of a set of timed streams, and the settings it refuses."""
import pytest

from bench.serve_bench import ServeBenchConfig, _row, summary_line
from bench.serve_clients import Timed, figures, percentiles


def timed(sent: float, chunks: list[float], tokens: int, text: str = "a") -> Timed:
    return Timed(sent, chunks, text, tokens, chunks[-1])


def test_figures_time_first_tokens_gaps_and_tokens_per_second():
    answers = [timed(0.0, [1.0, 1.5, 2.5], 5), timed(0.5, [1.0, 2.0], 3)]
    result = figures(answers, wall=4.0)
    assert result["tokens"] == 8 and result["tokens_per_second"] == 2.0
    assert result["first_token_seconds"] == {"p50": 0.75, "p90": 1.0, "max": 1.0}
    assert result["chunk_gap_seconds"]["max"] == 1.0 and result["chunk_gap_seconds"]["p50"] == 1.0
    assert result["seconds_per_token"]["p50"] == pytest.approx(0.4375)     # 1.5 / 4 and 1.0 / 2
    assert percentiles([]) == {"p50": None, "p90": None, "max": None}


def test_a_row_compares_with_one_after_another_and_checks_each_answer():
    alone = [timed(0.0, [1.0, 2.0], 2, "x"), timed(2.0, [3.0, 4.0], 2, "y")]
    row = _row("disk", 2, [timed(0.0, [1.0, 2.0], 2, "x"), timed(0.0, [1.0, 2.0], 2, "y")], 2.0, alone)
    assert row["speedup"] == 2.0 and row["identical"]
    assert not _row("disk", 2, [timed(0.0, [1.0], 1, "z"), alone[1]], 2.0, alone)["identical"]
    result = {"rows": [row], "summary": {"all_identical": True}}
    assert summary_line(result) == "bench serve: disk x2: 2.0 tok/s (2.00x); answers identical to each alone"


@pytest.mark.parametrize("settings, fragment", [
    ({"clients": [0, 4]}, "--clients"), ({"tiers": ["ssd"]}, "--tiers"), ({"max_new_tokens": 0}, "--max-new-tokens"),
])
def test_bad_settings_are_refused(settings, fragment):
    with pytest.raises(ValueError, match=fragment):
        ServeBenchConfig(**settings)
