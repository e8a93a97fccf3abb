"""`bench all` wiring, never its measurements: every benchmark function is replaced by one that checks
what the suite passed it and returns a stored result (bench/results/*.json, the real shapes), except the
stream benchmark, which runs for real on a tiny random checkpoint (one pass size, one repeat). Then
report.md has every section, the JSON files are written, the plots are PNGs (or the report says how to
get them without matplotlib), and the record generator replaces exactly the marked blocks."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from conftest import add_tiny_tokenizer, make_tiny_checkpoint

import bench.draft_bench
import bench.quant_bench
import bench.quant_disk_bench
import bench.spec_bench
import bench.batch_summary
import bench.serve_bench
import bench.shapes_bench
import bench.suite_steps
from bench import record
from bench.report import SECTIONS, write_report
from bench.suite import run_suite
from bench.suite_config import FULL, QUICK, SuiteConfig, preset

RESULTS = Path(__file__).resolve().parents[1] / "bench/results"
STEP_NAMES = ("spec", "stream", "quant", "quant_disk", "draft", "peers", "llama_cpp", "cpu_shapes", "batch", "serve")
PNG = b"\x89PNG\r\n\x1a\n"


def stored(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    folder, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("suite") / "m", "llama", vocab_size=64,
                                   num_hidden_layers=4)
    return add_tiny_tokenizer(folder, 64)


@pytest.fixture
def stubbed(monkeypatch, tiny_model, tmp_path):
    """Every heavy benchmark replaced; `calls` records what the suite passed each one."""
    calls: dict[str, object] = {}
    monkeypatch.setattr("bench.peers.model_folder", lambda private_copy: tiny_model)

    def spec(config, sampling, prompts, on_status=None, **kwargs):
        calls["spec"] = (config, sampling, prompts)
        return stored("spec_resident.json")

    def quant(config, on_status=None):
        calls["quant"] = config
        return stored("quant_default.json")

    def disk(config, on_status=None):
        calls.setdefault("quant_disk", []).append(config)
        return stored("quant_disk.json")

    def draft(target, draft_model, prompts, config, **kwargs):
        calls["draft"] = (prompts, config)
        return stored("draft.json")

    class Closed:
        class layers:
            close = staticmethod(lambda: None)

    def peers(cmd, status):
        calls["peers"] = cmd
        out = Path(cmd[cmd.index("--out") + 1])
        out.write_text(json.dumps(stored("peers.json")))
        return 0, ""

    monkeypatch.setattr(bench.spec_bench, "run_spec_bench", spec)
    monkeypatch.setattr(bench.quant_bench, "run_quant_bench", quant)
    (tmp_path / "spqr").mkdir()
    (tmp_path / "spqr/config.json").write_text("{}")
    monkeypatch.setattr(bench.quant_bench, "spqr_checkpoint", lambda config, row, status, create: tmp_path / "spqr")
    monkeypatch.setattr(bench.quant_disk_bench, "run_disk_bench", disk)
    monkeypatch.setattr(bench.draft_bench, "load_pair", lambda target, draft_spec: (Closed, Closed, None))
    monkeypatch.setattr(bench.draft_bench, "bench_draft", draft)
    monkeypatch.setattr(bench.suite_steps, "stream_process", peers)
    monkeypatch.setattr(bench.suite_steps, "PEERS_PYTHON", tmp_path / "no-venv-peers/python")
    def batch(config, prompts, on_status=None):
        calls["batch"] = (config, prompts)
        return stored("batch.json")

    monkeypatch.setattr(bench.batch_summary, "run_batch_bench", batch)

    def serve(config, prompts, on_status=None):
        calls["serve"] = (config, prompts)
        return stored("serve.json")

    monkeypatch.setattr(bench.serve_bench, "run_serve_bench", serve)

    def shapes(config, on_status=None):
        calls["cpu_shapes"] = config
        return stored("cpu_shapes_vs_llama_cpp.json")

    monkeypatch.setattr(bench.shapes_bench, "run_shapes_bench", shapes)
    monkeypatch.setattr(bench.shapes_bench, "llama_python", lambda: tmp_path / "venv-llama/python")
    return calls


def tiny_config(**overrides) -> SuiteConfig:
    return preset(True, prompts=1, max_new_tokens=4, stream_sizes=(4,), stream_repeats=1, **overrides)


def test_suite_runs_every_benchmark_writes_json_and_a_report_with_plots(stubbed, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run"
    manifest = run_suite(tiny_config(), out, "specstream bench all --quick --out run")
    status = {s["name"]: s["status"] for s in manifest["steps"]}
    assert tuple(status) == STEP_NAMES
    assert status["llama_cpp"] == "skipped", manifest["steps"]
    assert all(status[name] == "ok" for name in STEP_NAMES if name != "llama_cpp"), manifest["steps"]
    for name in (*STEP_NAMES, "suite"):
        assert isinstance(json.loads((out / f"{name}.json").read_text()), dict)
    # the settings reached the benchmarks: one prompt, the quick budgets, the suite's prompt everywhere
    config, sampling, prompts = stubbed["spec"]
    assert len(prompts) == 1 and config.max_new_tokens == 4 and config.budgets == list(QUICK.budgets)
    assert sampling.is_greedy and config.target == str(stubbed_model_folder(out))
    assert stubbed["quant"].methods == QUICK.quant_methods and stubbed["quant"].chat_prompts is None
    assert [c.prompt for c in stubbed["quant_disk"]] == [prompts[0][-1]["content"]] * 2
    assert "--prompt" in stubbed["peers"] and prompts[0][-1]["content"] in stubbed["peers"]
    assert stubbed["cpu_shapes"].shapes == QUICK.cpu_shapes and stubbed["cpu_shapes"].types == QUICK.cpu_shape_types
    stream = json.loads((out / "stream.json").read_text())           # the one benchmark run for real
    assert {p["tokens"] for p in stream["tiers"]["ram"]["passes"]} == {4}
    assert stream["tiers"]["disk"]["layers"]["disk"] > 0
    report = (out / "report.md").read_text()
    for heading in SECTIONS:
        assert f"## {heading}" in report
    assert "--quick reduced: prompts: 1 (full: 4)" in report and "commit:" in report and "torch" in report
    assert "Skipped: .venv-peers is missing" in report and "| 32 |" in report       # batch sizes up to 32
    pictures = sorted(p.name for p in out.glob("*.png"))
    assert {"engines.png", "tokens_per_pass.png", "pass_time.png", "perplexity_bits.png"} <= set(pictures)
    for name in pictures:
        assert (out / name).read_bytes()[:8] == PNG and f"]({name})" in report
    assert str(tmp_path) not in report and str(Path.home()) + "/" not in (out / "suite.json").read_text()


def stubbed_model_folder(out: Path) -> Path:
    import bench.peers
    return bench.peers.model_folder(private_copy=True)


def test_without_matplotlib_the_report_keeps_its_tables_and_says_how_to_get_plots(stubbed, tmp_path, monkeypatch):
    out = tmp_path / "run"
    run_suite(tiny_config(only=("quant", "draft")), out, "specstream bench all --quick --out run")
    for png in out.glob("*.png"):
        png.unlink()
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib -> ImportError
    report = write_report(out).read_text()
    assert "pip install 'specstream[bench]'" in report and not list(out.glob("*.png"))
    assert "| spqr-w4 |" in report and "Not run in this suite run" in report


def test_a_failing_benchmark_is_recorded_and_the_others_still_run(stubbed, tmp_path, monkeypatch):
    def broken(config, sampling, prompts, **kwargs):
        raise RuntimeError("boom in /some/private/folder/file.py")
    monkeypatch.setattr(bench.spec_bench, "run_spec_bench", broken)
    manifest = run_suite(tiny_config(only=("spec", "draft")), tmp_path / "run", "x")
    assert [s["status"] for s in manifest["steps"]] == ["failed", "ok"]
    assert manifest["steps"][0]["reason"] == "RuntimeError: boom in file.py"      # no machine's folders
    assert "Failed: RuntimeError" in (tmp_path / "run/report.md").read_text()


def test_quick_reuses_a_cached_spqr_checkpoint_and_says_so_when_there_is_none(stubbed, tmp_path, monkeypatch):
    monkeypatch.setattr(bench.quant_bench, "spqr_checkpoint", lambda config, row, status, create: None)
    manifest = run_suite(tiny_config(only=("quant", "quant_disk")), tmp_path / "run", "x")
    assert [s["status"] for s in manifest["steps"]] == ["ok", "ok"]
    assert "spqr" not in stubbed["quant"].methods and stubbed["quant"].spqr == ()
    assert len(stubbed["quant_disk"]) == 1 and stubbed["quant_disk"][0].reference_dtypes == ("fp32",)  # GGUF only
    report = (tmp_path / "run/report.md").read_text()
    assert report.count("a full `bench all` run makes it") == 2


def test_bench_batch_runs_in_the_suite_with_its_settings_and_its_summary(stubbed, tmp_path):
    manifest = run_suite(tiny_config(only=("batch",)), tmp_path / "run", "x")
    assert manifest["steps"][0]["status"] == "ok", manifest["steps"]
    from spec.draft import default_draft_for    # the suite's private target copy gets the shipped draft by name
    config, prompts = stubbed["batch"]
    assert config.draft == str(default_draft_for(None)) and config.target == str(stubbed_model_folder(tmp_path))
    assert config.batch_sizes == [1, 4] and config.max_new_tokens == 4 and len(prompts) == 4
    batch = json.loads((tmp_path / "run/batch.json").read_text())
    assert batch["summary"]["saturation"] and batch["plan_70b_spqr_w4"]["largest_batch"] >= 1
    assert batch["plan_70b_spqr_w4"]["command"].startswith("plan --target bench/configs/llama-2-70b ")
    report = (tmp_path / "run/report.md").read_text()
    assert "batched 32 / batch 1" in report


def test_bench_serve_runs_in_the_suite_with_its_settings(stubbed, tmp_path):
    manifest = run_suite(tiny_config(only=("serve",)), tmp_path / "run", "x")
    assert [s["status"] for s in manifest["steps"]] == ["ok"], manifest["steps"]
    config, prompts = stubbed["serve"]
    assert config.clients == [1, 4] and config.max_new_tokens == 4 and len(prompts) == 4
    assert json.loads((tmp_path / "run/serve.json").read_text())["summary"]["all_identical"] is True


def test_record_replaces_exactly_the_marked_blocks(stubbed, tmp_path):
    out = tmp_path / "run"
    run_suite(tiny_config(only=("quant", "draft")), out, "specstream bench all --quick --out run")
    before, after = "# Title\n\nhand-written text | kept\n\n", "\n\n## Later\n\nmore text\n"
    document = tmp_path / "README.md"
    stale = "<!-- generated: bench all (headline) -->\nold table\n<!-- end generated -->"
    document.write_text(before + stale + after)
    assert record.rewrite(document, out, "run") == 1
    text = document.read_text()
    assert text.startswith(before) and text.endswith(after) and "old table" not in text
    block = text[len(before):-len(after)]
    assert block.startswith("<!-- generated: bench all (headline) from run;") and block.endswith(record.END)
    assert "Tokens per second per engine" in block and "specstream bench all --quick --out run" in block
    assert "Quantization" not in block                    # headline: engines and ratios only
    record.rewrite(document, out, "run")
    assert document.read_text() == text                   # regenerating is stable
    figures = tmp_path / "perf.md"
    figures.write_text("intro\n<!-- generated: bench all -->\n<!-- end generated -->\noutro\n")
    record.rewrite(figures, out, "run")
    assert "| spqr-w4 |" in figures.read_text() and figures.read_text().endswith("<!-- end generated -->\noutro\n")
    bare = tmp_path / "bare.md"
    bare.write_text("no markers")
    with pytest.raises(ValueError, match="no generated block"):
        record.rewrite(bare, out)


def test_quick_states_what_it_reduced_and_the_cli_parses_the_commands():
    assert FULL.reductions() == [] and any(r.startswith("budgets: 1,4,16,64 ") for r in QUICK.reductions())
    from commands import build_parser
    args = build_parser().parse_args(["bench", "all", "--quick", "--out", "x", "--only", "spec"])
    assert args.quick and args.out == Path("x") and args.only == "spec"
    assert build_parser().parse_args(["bench", "record", "--from", "x"]).source == Path("x")
    with pytest.raises(ValueError, match="unknown benchmarks"):
        run_suite(preset(True, only=("nope",)), Path("unused"), "x")


def test_the_shipped_quick_run_has_every_section_and_no_machine_paths():
    folder = RESULTS / "suite_quick"
    report = (folder / "report.md").read_text()
    for heading in SECTIONS:
        assert f"## {heading}" in report
    for path in folder.iterdir():
        if path.suffix in (".json", ".md"):
            text = path.read_text()
            assert not re.search(r"/(root|home|work|tmp)/", text), path.name
        else:
            assert path.suffix == ".png" and path.read_bytes()[:8] == PNG


def test_batch_rows_are_one_series_per_tier_and_mode():
    """A sweep over two tiers and two modes is four lines and four ratios, never one mixed series."""
    from bench.figures import batch_series, engine_rows, ratio_rows
    rows = [{"tier": tier, "mode": mode, "batch_size": size, "tokens_per_second": base * size}
            for tier, base in (("ram", 3.0), ("disk", 1.0)) for mode in ("autoregressive", "speculative")
            for size in (4, 1)]
    batch = {"rows": rows, "summary": {"speculative_vs_autoregressive": {"disk": 0.97}}}
    series = batch_series(batch)
    assert series["disk, speculative"] == [(1, 1.0), (4, 4.0)] and len(series) == 4
    ratios = {r["ratio"]: r["value"] for r in ratio_rows({"batch": batch})}
    assert ratios["batched 4 / batch 1 (ram, autoregressive), tok/s"] == 4.0
    assert ratios["best batched speculative / best batched autoregressive (disk), tok/s"] == 0.97
    engines = [r["engine"] for r in engine_rows({"batch": batch})]
    assert "specstream batched, ram, speculative, 4 sequences" in engines and len(engines) == 4


def test_a_spqr_checkpoint_is_named_by_its_settings_in_the_tables(tmp_path):
    from bench.figures import disk_label
    from bench.quant_disk_bench import checkpoint_label
    folder = tmp_path / "SmolLM2-135M-Instruct.Q4_1-215dc1-spqr-cache-key"
    folder.mkdir()
    settings = {"bits": 4, "groupsize": 32, "stats_bits": 8, "outlier_threshold": 8.0, "act_order": False}
    (folder / "config.json").write_text(json.dumps({"quantization_config": settings}))
    assert checkpoint_label(folder) == "SpQR w4-g32-s8-noact"
    (folder / "config.json").write_text(json.dumps({"quantization_config": {**settings, "groupsize": 16,
                                                                            "stats_bits": 3, "act_order": True}}))
    assert checkpoint_label(folder) == "SpQR w4"
    row = {"model": folder.name + "-ahead", "label": "SpQR w4, decoder thread"}
    assert disk_label(row) == "SpQR w4, decoder thread"
    assert disk_label({"model": "reference-bf16"}) == "reference-bf16"   # a row recorded before labels
