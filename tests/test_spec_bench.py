"""`bench spec`: the transformers rebuild of a distilled draft computes our draft's logits; the benchmark
runs every mode and the assisted-generation peer on a tiny pair; on the default pair the CLI reports the
documented keys with greedy outputs identical for every budget."""
import json
from dataclasses import replace
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import add_tiny_tokenizer, make_tiny_checkpoint
from offload import LoadOptions, load_model
from offload.weights.source import CheckpointSource
from bench.journal import changed_fields, result_from_dict, result_to_dict
from bench.hf_draft import PeerRun, build_hf_draft, peer_report
from bench.spec_bench import SpecBenchConfig, load_options, run_spec_bench
from bench.spec_report import row_report
from spec import Decoder, DecodeResult, DecodeStats, SamplingConfig
from spec.distill.draft_io import save_draft
from spec.distill.draft_model import choose_vocab, draft_from_target
from spec.draft import default_draft_for, load_draft
from spec.draft_folder import DraftInfo, embedding_fingerprint

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 64
TEMPLATE = "{% for m in messages %}t2 {{ m['content'] }} t0 {% endfor %}{% if add_generation_prompt %}t2 {% endif %}"
PROMPTS = [[{"role": "user", "content": "t5 t9 t12 t7"}], [{"role": "user", "content": "t30 t3"}]]
MODE_KEYS = {"layers", "device_budget", "autoregressive", "budgets", "auto", "pass_seconds"}
ROW_KEYS = {"tokens_per_pass", "tokens_per_second", "seconds_per_step", "overhead_share", "tokens_per_pass_histogram",
            "acceptance_by_depth", "budgets_chosen"}


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """(target folder, draft folder): a random 3-layer llama with a chat template, and a 2-layer draft over
    40 of its 64 tokens with a random head bias."""
    root = tmp_path_factory.mktemp("pair")
    target, _ = make_tiny_checkpoint(root / "target", "llama", seed=5, vocab_size=VOCAB, num_hidden_layers=3,
                                     eos_token_id=0)
    add_tiny_tokenizer(target, VOCAB)
    settings = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": TEMPLATE}))
    source = CheckpointSource(target)
    model = draft_from_target(source, "small", 2, 0, choose_vocab(torch.arange(VOCAB, 0, -1), 40, {0}))
    with torch.no_grad():
        model.head_bias.copy_(torch.randn(model.vocab_top, generator=torch.Generator().manual_seed(0)))
    info = DraftInfo("small", 0, model.vocab_top, str(target), embedding_fingerprint(source.global_tensors()["embed"]))
    save_draft(root / "draft", model, info, target)
    return target, root / "draft"


def assert_same_draft(ours, hf, prompts: list[list[int]]) -> None:
    """K-row logits to 1e-4 (fp32), hence the same greedy next tokens; out-of-set tokens at -inf."""
    vocab_map = ours.model.vocab_map
    for ids in prompts:
        expected = ours.model.forward_trimmed(torch.tensor([ids]), ours.model.new_cache(len(ids))).logits
        with torch.inference_mode():
            full = hf(torch.tensor([ids])).logits                                  # [1, N, V]
        assert torch.allclose(full[..., vocab_map], expected, atol=1e-4, rtol=0)
        assert torch.equal(full.argmax(-1), vocab_map[expected.argmax(-1)])
        assert torch.isinf(full).sum(-1).eq(full.shape[-1] - vocab_map.numel()).all()


def test_transformers_rebuild_computes_the_tiny_draft(tiny_pair):
    target_folder, draft_folder = tiny_pair
    target = load_model(LoadOptions(str(target_folder), device="cpu", dtype="fp32"))
    ours = load_draft(LoadOptions(str(draft_folder), device="cpu", dtype="fp32"), embed=target.model.embed)
    assert_same_draft(ours, build_hf_draft(draft_folder, target.model.embed), [[5, 9, 12, 7, 3], [30], [2, 2, 8]])


def _disk_cold_gpu_mem(config: SpecBenchConfig) -> int:
    """A device budget that leaves no layer resident: the fixed parts, a ring of two layers, half a layer."""
    probe = load_model(load_options(config, "resident"))
    layer_bytes = probe.plan.request.layer_bytes
    fixed = sum(item.num_bytes for item in probe.plan.items if "layers" not in item.component)
    probe.layers.close()
    return fixed + 2 * layer_bytes + layer_bytes // 2


def test_bench_runs_every_mode_and_the_peer_on_a_tiny_pair(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path))     # the pass-time curve cache
    target_folder, draft_folder = tiny_pair
    config = SpecBenchConfig(str(target_folder), str(draft_folder), 12, [1, 8], ["resident"])
    config.gpu_mem, config.modes = _disk_cold_gpu_mem(config), ["resident", "disk-cold"]
    lines = []
    report = run_spec_bench(config, SamplingConfig(), PROMPTS, on_status=lines.append)
    finished = [line for line in lines if "tok/pass" in line]      # a cut-off run keeps these rows
    assert len(finished) == 2 * 2 * 4 and all(line.endswith(", same") and "ms/step draft" in line for line in finished)
    assert report["target"] == "target" and report["draft"] == "draft" and report["prompts"] == 2
    assert report["dtype"] == "fp32" and report["modes"]["disk-cold"]["layers"]["device"] == 0
    for mode in report["modes"].values():
        assert set(mode) == MODE_KEYS and [r["budget"] for r in mode["budgets"]] == [1, 8]
        for row in [*mode["budgets"], mode["auto"]]:
            assert ROW_KEYS <= set(row) and row["identical_to_autoregressive"] == 2
        assert mode["autoregressive"]["tokens_per_pass"] == mode["budgets"][0]["tokens_per_pass"] == 1.0
        for row in [mode["autoregressive"], *mode["budgets"], mode["auto"]]:     # counted on the first prompt
            reads = row["host_reads_per_step"]
            assert row["torch_ops_per_step"] > 0 and reads == pytest.approx(sum(row["host_reads_by_kind"].values()), abs=0.05)
        assert mode["budgets"][1]["host_reads_per_step"] > mode["autoregressive"]["host_reads_per_step"] > 0
    assert report["host_syncs"]["counted_on"] == "cpu" and "upper bound" in report["host_syncs"]["meaning"]
    peer = report["assisted_generation"]
    assert peer["identical_to_autoregressive"] == 2 and peer["transformers_autoregressive_identical"] == 2
    assert peer["tokens_per_target_forward"] >= 1.0 and peer["settings"]["num_assistant_tokens"] > 0
    summary = report["summary"]
    assert summary["disk_cold_limit"] > 0 and summary["ratio_tokens_per_pass_vs_assisted"] > 0
    assert "/" not in json.dumps({k: v for k, v in report.items() if k != "modes"}).replace("tok/", "")


def _figures(report: dict) -> dict:
    """What a fixed row's tokens decide (not its seconds): tokens per pass and sameness, per mode and the peer
    (the auto row's choices depend on what its chooser learnt in this run)."""
    rows = [(mode, row["budget"], row["tokens_per_pass"], row["identical_to_autoregressive"])
            for mode, result in report["modes"].items() for row in result["budgets"]]
    rows += [(mode, result["auto"]["identical_to_autoregressive"]) for mode, result in report["modes"].items()]
    peer = report["assisted_generation"]
    return {"rows": rows, "peer": (peer["target_forwards"], peer["identical_to_autoregressive"])}


def test_a_killed_bench_resumes_where_it_stopped(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path))
    target_folder, draft_folder = tiny_pair
    config = SpecBenchConfig(str(target_folder), str(draft_folder), 12, [1, 8], ["resident"])
    full = run_spec_bench(config, SamplingConfig(), PROMPTS)
    assert full["resumed_rows"] == 0
    journal = next((tmp_path / "bench_journal").glob("spec-*.jsonl"))
    lines = journal.read_text().splitlines()
    assert len(lines) == 1 + 2 * (4 + 2)             # header, then per prompt 4 rows of ours and 2 of the peer
    journal.write_text("\n".join(lines[:7]) + '\n{"key": ["resident", "x", "au')   # killed mid-write
    ran = []
    monkeypatch.setattr(Decoder, "generate", _counting(Decoder.generate, ran))
    partial = run_spec_bench(config, SamplingConfig(), PROMPTS, partial=True)
    assert partial["prompts"] == 1 and partial["partial"] == {"prompts_finished": 1, "prompts_given": 2}
    assert len(ran) == 2 and partial["assisted_generation"]["identical_to_autoregressive"] == 1   # warm-ups only
    ran.clear()
    resumed = run_spec_bench(config, SamplingConfig(), PROMPTS, resume=True)
    counted = 2 * 4                                   # per row, a one-token and a counted answer (host syncs)
    assert resumed["resumed_rows"] == 6 and _figures(resumed) == _figures(full)
    assert len(ran) == 2 + 4 + counted                # the two warm-ups, then the second prompt's rows
    ran.clear()
    afresh = run_spec_bench(config, SamplingConfig(), PROMPTS)
    assert afresh["resumed_rows"] == 0 and len(ran) == 2 + 8 + counted and _figures(afresh) == _figures(full)
    other = SpecBenchConfig(str(target_folder), str(draft_folder), 10, [1, 8], ["resident"])
    assert run_spec_bench(other, SamplingConfig(), PROMPTS, resume=True)["resumed_rows"] == 0   # another journal
    journals = sorted((tmp_path / "bench_journal").iterdir())
    with pytest.raises(ValueError, match="--partial: no prompt"):
        run_spec_bench(replace(other, budgets=[1, 4]), SamplingConfig(), PROMPTS, partial=True)
    assert sorted((tmp_path / "bench_journal").iterdir()) == journals     # --partial writes nothing


def test_the_settings_fingerprint_names_only_what_differs_from_the_defaults():
    assert changed_fields(SamplingConfig()) == {} and changed_fields(SamplingConfig(seed=0)) == {"seed": 0}
    assert changed_fields(SpecBenchConfig(budgets=[1, 4, 16, 64, 256, 1024, 4096])) == {}
    assert changed_fields(SpecBenchConfig(budgets=[1024])) == {"budgets": [1024]}


def _counting(generate, calls: list):
    def counted(self, *args, **kwargs):
        calls.append(1)
        return generate(self, *args, **kwargs)
    return counted


def test_journaled_results_read_back_equal():
    result = _result(10, [3, 1, 4], 2.5)
    result.stats.depth_reached = [3, 2, 1]
    back = result_from_dict(json.loads(json.dumps(result_to_dict(result))))
    assert back == result and back.stats.yields[3] == 1 and back.stats.tokens_per_pass == result.stats.tokens_per_pass


def _result(num_new: int, yields: list[int], seconds: float) -> DecodeResult:
    stats = DecodeStats(num_new_tokens=num_new, seconds=seconds, speculative=True)
    for count in yields:
        stats.record_step(8, 8, count, 0.01, 0.02, 0.001)
    return DecodeResult(list(range(num_new)), stats)


def test_rows_weight_tokens_per_pass_by_tokens():
    # 9 tokens after the first in 3 steps, and a one-token answer (no step): 9 / 3, not the mean of 3 and 1
    row = row_report([_result(10, [3, 3, 3], 2.0), _result(1, [], 0.5)], [list(range(10)), [7]], base_tps=2.0)
    assert row["tokens_per_pass"] == 3.0 and row["tokens_per_second"] == 11 / 2.5
    assert row["speedup_vs_autoregressive"] == round(11 / 2.5 / 2.0, 3) and row["identical_to_autoregressive"] == 1
    assert row["tokens_per_pass_histogram"] == {"3": 3} and row["acceptance_by_depth"] == [1.0, 1.0]


def test_assisted_tokens_per_forward_exclude_the_first_forward():
    runs = [PeerRun(list(range(10)), 4, 1.0), PeerRun(list(range(5)), 2, 1.0)]
    report = peer_report(runs, runs, [list(range(10)), [0]], {})
    assert report["tokens_per_target_forward"] == (9 + 4) / (3 + 1)
    assert report["new_tokens_per_target_forward"] == 15 / 6 and report["identical_to_autoregressive"] == 1


@pytest.mark.parametrize("kwargs, fragment", [({"budgets": [0]}, "budget must lie"),
                                              ({"modes": ["ram"]}, "--modes takes"),
                                              ({"gpu_mem": 0}, "--gpu-mem")])
def test_bad_settings_are_named(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        SpecBenchConfig(**kwargs)


@pytest.mark.e2e
def test_transformers_rebuild_computes_the_shipped_draft():
    target = load_model(LoadOptions(device="cpu", dtype="fp32"))
    folder = default_draft_for(None)
    ours = load_draft(LoadOptions(str(folder), device="cpu", dtype="fp32"), embed=target.model.embed)
    prompts = [target.tokenizer.encode_chat([{"role": "user", "content": text}])
               for text in ("What is 2+2?", "Write a haiku about the sea.", "def fibonacci(n):")]
    assert_same_draft(ours, build_hf_draft(folder, target.model.embed), prompts)


@pytest.mark.e2e
def test_cli_bench_spec_reports_every_budget_and_the_peer():
    args = ["bench", "spec", "--prompts", "textdata/chat/prompts.jsonl", "--limit", "1", "--max-new-tokens", "12",
            "--budgets", "1,4", "--modes", "resident", "--json"]
    done = subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True, text=True,
                          timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert {"bench", "target", "draft", "prompts", "max_new_tokens", "sampling", "modes", "assisted_generation",
            "summary"} <= set(report) and list(report["modes"]) == ["resident"]
    resident = report["modes"]["resident"]
    assert set(resident) == MODE_KEYS and [r["budget"] for r in resident["budgets"]] == [1, 4]
    assert all(r["identical_to_autoregressive"] == 1 for r in [*resident["budgets"], resident["auto"]])
    peer = report["assisted_generation"]
    assert peer["identical_to_autoregressive"] == 1 and peer["tokens_per_target_forward"] > 0
    assert {"best_budget_tokens_per_pass", "best_budget_by_tokens_per_second", "ratio_tokens_per_pass_vs_assisted",
            "disk_cold_auto_speedup_vs_autoregressive", "disk_cold_limit"} == set(report["summary"])
