"""The device check (tests/gpu/device_check.py) and the one-call GPU session (tests/gpu/gpu_session.sh): their
Python parts on the CPU with small shapes, the session script's shape, and the CUDA paths where a GPU exists."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu.device_check import card_slug, merge, random_tree
from perf.pass_model import load_device_check

ROOT = Path(__file__).resolve().parents[1]
CHECK = [sys.executable, str(ROOT / "tests" / "gpu" / "device_check.py")]


def test_device_check_dry_run_writes_json(tmp_path):
    out = tmp_path / "check.json"
    subprocess.run(["bash", str(ROOT / "tests" / "gpu" / "device_check.sh"), "--dry-run", str(out)], check=True,
                   timeout=300)
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and [p["tokens"] for p in result["passes"]] == [1, 16, 64]
    for row in result["passes"]:
        assert row["bytes_streamed"] == 3 * result["layer_bytes"]
        assert 0 < row["efficiency"] and row["pass_seconds"] > 0
        assert row["host_syncs_per_pass"] == 0 and row["torch_ops_per_pass"] > 0   # a pass reads nothing back
    dequantize = result["spqr_w4_dequantize"]
    assert dequantize["torch_ms"] > 0 and dequantize["transfer_ms"] > 0 and dequantize["fused_available"] is False
    # 4 bits + 6/16 + 64/256 per weight, no outliers: 4.625 bits, plus the permutations and row pointers
    assert 4.625 < 8 * dequantize["packed_bytes"] / dequantize["params"] < 4.8
    gguf = result["gguf_q4_k_dequantize"]        # 144 bytes per 256 weights: 4.5 bits
    assert gguf["torch_ms"] > 0 and gguf["triton_available"] is False and gguf["packed_bytes"] * 8 == 4.5 * gguf["params"]
    assert gguf["dense_transfer_ms"] > gguf["transfer_ms"] and result["errors"] == {}
    q6_k = result["gguf_q6_k_dequantize"]        # 210 bytes per 256 weights: 6.5625 bits
    assert q6_k["torch_ms"] > 0 and q6_k["packed_bytes"] * 8 == 6.5625 * q6_k["params"]
    curve = load_device_check(out)
    assert curve.num_layers == 3 and curve.max_tokens == 64 and curve.bytes_streamed == 3 * result["layer_bytes"]


def test_two_tiny_layers_on_the_cpu_give_a_curve_the_planner_reads(tmp_path):
    out = tmp_path / "tiny.json"
    subprocess.run([*CHECK, "--device", "cpu", "--layers", "2", "--shape", "tiny", "--tokens", "1,8",
                    "--sections", "stream", "--out", str(out)], check=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["ring_size"] == 1 and result["tree_passes"] is True and result["sections"] == ["stream"]
    assert load_device_check(out).points[-1][0] == 8


def test_a_failing_section_leaves_the_others_and_the_json(tmp_path):
    out = tmp_path / "failed.json"
    run = subprocess.run([*CHECK, "--dry-run", "--layers", "1", "--sections", "stream,gguf", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    assert run.returncode == 1 and "Traceback" in run.stderr
    assert set(result["errors"]) == {"stream"} and "--layers >= 2" in result["errors"]["stream"]
    assert result["gguf_q4_k_dequantize"]["torch_ms"] > 0 and "passes" not in result


def test_a_session_merges_into_one_device_check(tmp_path):
    header = {"check": "device", "device": "NVIDIA H100 80GB HBM3", "layers": 8, "pinned_h2d_gbps": 50.0}
    passes = [{"tokens": n, "pass_seconds": 0.3 + n * 1e-5, "bytes_streamed": 8 * 10**9} for n in (1, 2048)]
    parts = {"part_stream.json": {**header, "sections": ["stream"], "errors": {}, "passes": passes},
             "part_kernels.json": {**header, "pinned_h2d_gbps": 49.0, "sections": ["spqr", "gguf"],
                                   "errors": {"gguf": "ModuleNotFoundError: No module named 'gguf'"},
                                   "spqr_w4_dequantize": {"fused_ms": 3.0}}}
    for name, data in parts.items():
        (tmp_path / name).write_text(json.dumps(data))
    (tmp_path / "steps.txt").write_text("cuda_tests 0 41\nstream 0 88\nkernels 1 30\nsyncs 124 100\n")
    (tmp_path / "tests.xml").write_text('<testsuites><testsuite tests="9" failures="1" errors="0" skipped="2">'
                                        '</testsuite></testsuites>')
    result = merge([tmp_path / "part_stream.json", tmp_path / "part_kernels.json", tmp_path / "part_syncs.json"],
                   tmp_path / "steps.txt", tmp_path / "tests.xml")
    assert result["pinned_h2d_gbps"] == 50.0 and result["sections"] == ["stream", "spqr", "gguf"]
    assert set(result["errors"]) == {"gguf", "part_syncs.json"} and result["spqr_w4_dequantize"] == {"fused_ms": 3.0}
    assert result["steps"][3] == {"name": "syncs", "rc": 124, "seconds": 100}
    assert result["cuda_tests"] == {"tests": 9, "failures": 1, "errors": 0, "skipped": 2}
    (tmp_path / "session.json").write_text(json.dumps(result))
    assert load_device_check(tmp_path / "session.json").max_tokens == 2048
    empty = merge([tmp_path / "missing.json"], None, None)                   # nothing measured: still a JSON,
    (tmp_path / "empty.json").write_text(json.dumps(empty))                 # which the planner refuses
    with pytest.raises(ValueError, match="not a device-check result with passes"):
        load_device_check(tmp_path / "empty.json")


def test_card_names_and_random_trees():
    assert card_slug("NVIDIA H100 80GB HBM3") == "h100" and card_slug("NVIDIA H200") == "h200"
    tree = random_tree(64, 100, torch.Generator().manual_seed(0))
    assert tree.num_nodes == 64 and tree.max_depth >= 3 and tree.attention_mask(5).shape == (64, 69)


def test_the_gpu_session_fits_one_device_call():
    """Each step under its own limit; the limits together inside a call's 600 s (the script says 580)."""
    script = (ROOT / "tests" / "gpu" / "gpu_session.sh").read_text()
    subprocess.run(["bash", "-n", str(ROOT / "tests" / "gpu" / "gpu_session.sh")], check=True)
    limits = {name: int(limit) for name, limit in re.findall(r"^step (\w+) (\d+) ", script, re.MULTILINE)}
    assert list(limits) == ["cuda_tests", "stream", "kernels", "syncs", "batch", "self_draft", "merge"]
    assert sum(limits.values()) == 580 and "580 s of limits" in script and "batch_$card.json" in script
    assert "self_draft_$card.json" in script
    for name, limit in limits.items():       # the header's table states the same limits
        assert re.search(rf"#\s+{name}\s+{limit}\s", script), name
    assert "--continue-on-collection-errors" in script and "gpu_session_$card.json" in script


def test_the_speculation_sync_check_on_a_tiny_pair(tmp_path):
    from conftest import tiny_pair
    from gpu.sync_check import speculation_syncs
    _, _, target, draft = tiny_pair(tmp_path, 3, 256, 0.3, 256, 64)
    result = speculation_syncs(target, draft, [5, 17, 33, 2], [1, 16], 12, 256)
    rows = {row["budget"]: row for row in result["rows"]}
    assert list(rows) == ["autoregressive", 1, 16] and all(row["identical_to_autoregressive"] for row in rows.values())
    assert rows["autoregressive"]["host_reads_per_step"] == rows[1]["host_reads_per_step"] == 3.0
    assert rows[16]["tokens_per_pass"] > 1 and rows[16]["host_reads_per_step"] > 3 and result["counted_tokens"] == 12


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_cuda_streaming_matches_cuda_resident(tier, tiny_checkpoint):
    from offload.loader import LoadOptions, build_engine
    from offload.weights.source import CheckpointSource
    folder, _ = tiny_checkpoint("llama", num_hidden_layers=6)
    base = dict(device="cuda", dtype="bf16", max_context=64, max_pass_tokens=16)
    resident = build_engine(CheckpointSource(folder), LoadOptions(**base))
    fixed = sum(i.num_bytes for i in resident.plan.items if "layers" not in i.component)
    layer_bytes = resident.plan.request.layer_bytes
    streamed = build_engine(CheckpointSource(folder), LoadOptions(**base, gpu_mem=fixed + 3 * layer_bytes,
                                                                  ram=1 if tier == "disk" else None))
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9]])
    expected = resident.model.forward(tokens, resident.model.new_cache(64)).logits
    got = streamed.model.forward(tokens, streamed.model.new_cache(64)).logits
    streamed.layers.close()
    assert streamed.plan.tier_of.count(tier) >= 4
    assert torch.equal(got, expected)


def test_the_lowbit_section_times_a_draft_rounds_product(tmp_path):
    out = tmp_path / "lowbit.json"
    subprocess.run([*CHECK, "--dry-run", "--layers", "1", "--sections", "lowbit", "--out", str(out)], check=True,
                   timeout=300)
    result = json.loads(out.read_text())["lowbit_substitutes"]
    assert result["fused_available"] is False and list(result["rows"]) == ["1", "16", "64"]
    for figures in result["rows"].values():          # no kernel on a CPU: the torch path and the dense product
        assert set(figures) == {"dense_bf16_ms", "w2_torch_ms", "w3_torch_ms", "w4_torch_ms"}
        assert all(ms > 0 for ms in figures.values())
