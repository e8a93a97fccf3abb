"""`bench`'s table (commands/bench.py): each subcommand has help, flags and a handler, a name outside the table
is refused in one line; `bench tree-simulation` writes what `plan --acceptance` reads (perf/result_formats.py)."""
import json

import pytest

import cli
import textdata
from commands.bench import BENCHES, cmd_bench
from perf.projection import load_acceptance_curve
from spec.simulation import SIMULATION_VERSION


def bench_choices() -> dict:
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    return next(a for a in commands["bench"]._actions if a.dest == "bench").choices


def test_the_parser_offers_exactly_the_table():
    choices = bench_choices()
    assert list(choices) == list(BENCHES) and {"tree-simulation", "startup", "batch", "all"} <= set(choices)
    for name, bench in BENCHES.items():
        assert bench.help and ("--json" in choices[name].format_help()) == bench.prints_json, name


def test_a_name_outside_the_table_is_one_error_line(capsys):
    class Args:
        bench = "no-such-bench"
    with pytest.raises(ValueError, match="unknown bench 'no-such-bench'; choose from quant, quant-disk"):
        cmd_bench(Args(), None)
    with pytest.raises(SystemExit):
        cli.main(["bench", "no-such-bench"])
    assert "invalid choice: 'no-such-bench'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["startup", "--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["tree-simulation", "--budgets", "4,x"], "--budgets takes comma-separated integers"),
    (["tree-simulation", "--growth-temperature", "0.5"], "--growth-temperature takes a positive number, with --draft self"),
    (["tree-simulation", "--shard", "2/2"], "--shard takes K/N with 0 <= K < N, got 2/2"),
    (["tree-simulation", "--shard", "1"], "--shard takes K/N (e.g. 0/2), got '1'"),
    (["tree-simulation", "--draft", "self", "--growth-temperature", "0"], "--growth-temperature takes a positive"),
    (["stream", "--tokens", "0"], "--tokens takes positive integers"),
    (["quant", "--natural-weights", "--target", "x"], "give it or --target, not both"),
    (["cpu-kernel", "--parts", "decode,nope"], "--parts: unknown parts ['nope']: choose from crossover"),
    (["spqr-kernel", "no-such-folder"], "no-such-folder holds no config.json: give a SpQR checkpoint folder"),
    (["step-profile", "--steps", "1"], "--steps must be at least 2"),
    (["products", "--shapes", "1b,3b"], "unknown shapes or types ['3b'] (shapes: 1b, 8b"),
    (["shapes", "--shapes", "default,3b"], "shapes ['3b']: choose from default, 1b, 8b"),
    (["peers", "--engines", "ours_ram,nope"], "--engines: unknown engines nope: choose from ours_ram"),
    (["products", "--out", "no-such-folder/products.json"], "--out no-such-folder/products.json: its folder does not"),
])
def test_bad_flags_are_one_error_line(capsys, argv, message):
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.e2e
def test_tree_simulation_writes_an_acceptance_source_plan_reads(tmp_path, capsys):
    lines = textdata.path(textdata.CHAT_PROMPTS).read_text().splitlines()
    (tmp_path / "first.jsonl").write_text(lines[0] + "\n")
    (tmp_path / "second.jsonl").write_text(lines[1] + "\n")
    argv = ["bench", "tree-simulation", "--prompts", str(tmp_path / "first.jsonl"), str(tmp_path / "second.jsonl"),
            "--max-new-tokens", "12", "--budgets", "1,8", "--checkpoint-dir", str(tmp_path / "checkpoints"), "--json"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_prompts"] == 2 and [row["budget"] for row in result["rows"]] == [1, 8]
    assert result["simulation_version"] == SIMULATION_VERSION        # the growth that made the figures
    assert result["rows"][0]["tokens_per_pass"] == 1.0 < result["rows"][1]["tokens_per_pass"]
    for row in result["rows"]:          # each file's prompts apart: here one prompt each
        assert list(row["tokens_per_pass_by_file"]) == ["first.jsonl", "second.jsonl"]
        assert list(row["tokens_per_pass_by_file"].values()) == pytest.approx(row["tokens_per_pass_by_prompt"],
                                                                              abs=1e-3)
    (tmp_path / "simulation.json").write_text(json.dumps(result))
    curve = load_acceptance_curve(tmp_path / "simulation.json")
    assert curve.points == [(row["budget"], row["tokens_per_pass"]) for row in result["rows"]]
    _resumes_from_its_checkpoint_folder(argv, result, tmp_path / "checkpoints", capsys)
    _shards_share_one_run(argv, result, tmp_path / "shards", capsys)


def _resumes_from_its_checkpoint_folder(argv: list[str], result: dict, folder, capsys) -> None:
    """A rerun reads every finished item from --checkpoint-dir: an item edited there changes the report."""
    files = sorted(folder.glob("*.jsonl"))
    assert len(files) == 2                                  # the target's answers, the draft's passes
    passes = next(f for f in files if '"8/0"' in f.read_text())
    lines = [json.loads(line) for line in passes.read_text().splitlines()]
    for line in lines:
        if line["key"] == "8/0":
            line["value"]["passes"] = 1                     # as if the whole first answer took one pass
    passes.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert cli.main(argv) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["rows"][0] == result["rows"][0]
    first_answer = again["rows"][1]["tokens_per_pass_by_prompt"][0]
    assert first_answer > result["rows"][1]["tokens_per_pass_by_prompt"][0] and first_answer >= 10


def _shards_share_one_run(argv: list[str], result: dict, folder, capsys) -> None:
    """Two shards simulate a prompt each into one checkpoint; the unsharded command then reports both from it."""
    argv = [*argv[:argv.index("--checkpoint-dir") + 1], str(folder), "--json"]
    for shard in ("0/2", "1/2"):
        assert cli.main([*argv, "--shard", shard]) == 0
        part = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert part["shard"] == shard and part["num_prompts"] == 1
    items = [json.loads(line)["key"] for path in folder.glob("*.jsonl") for line in path.read_text().splitlines()]
    assert sorted(items) == ["1/0", "1/1", "8/0", "8/1", "answers"]    # one checkpoint: the full run's items
    assert cli.main(argv) == 0
    whole = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "shard" not in whole
    keep = ("budget", "tokens_per_pass", "tokens_per_pass_by_file", "tokens_per_pass_by_prompt")
    assert [{k: row[k] for k in keep} for row in whole["rows"]] == [{k: row[k] for k in keep} for row in result["rows"]]


def test_a_cpu_bench_prints_and_writes_one_result_without_the_machines_paths(tmp_path, capsys):
    out = tmp_path / "products.json"
    argv = ["bench", "products", "--shapes", "1b", "--types", "q4_0", "--rounds", "1", "--seconds", "0.02",
            "--cold-bytes", "0", "--out", str(out), "--json"]
    assert cli.main(argv) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == printed
    assert printed["command"].endswith("--cold-bytes 0 --out products.json --json")
    assert str(tmp_path) not in out.read_text()
    row = printed["files"]["1b/q4_0"]
    assert row["ours_int4_kernel_ms_per_token"] > 0 and row["ours_products"] == 5
