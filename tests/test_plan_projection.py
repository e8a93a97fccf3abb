"""`plan` in file bytes (llama.cpp type mixes, a GGUF file's own types) and its projection of pass time,
best tree budget and tokens per second, on cases worked out by hand in the comments."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch

import cli
from offload.model.config import ModelConfig
from offload.weights.gguf_source import GgufSource
from offload.weights.resolve import resolve_model
from offload.weights.sizes import llama_cpp_weight_bytes, use_more_bits

from test_gguf_import import Spec, write_gguf

CONFIGS = Path(__file__).resolve().parent / "fixtures" / "configs"
GIB = 1024 ** 3
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 6, "vocab_size": 1024,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096}
# One tiny layer: attention 256 x (256 + 2 x 128) + 256 x 256 = 196,608; MLP 3 x 256 x 512 = 393,216;
# norms 2 x 256 -> 590,336 params, 1,180,672 bytes in bf16.
TINY_LAYER_PARAMS, TINY_LAYER_BYTES = 590_336, 1_180_672
# Fixed device bytes at --context 64 --budget 16 on CUDA: globals (2 x 1024 x 256 + 256) x 2 = 1,049,088;
# KV cache 2 x 6 layers x 128 x 80 tokens x 2 = 245,760; workspace 16 x (4 x 256 + 3 x 512 + 8 x 64) x 2
# = 98,304, scores 16 x 80 x 3 = 3,840, logits 16 x 1024 x 6 = 98,304 -> 1,495,296. Ring of 2: 2,361,344.
# --gpu-mem 5,137,312 leaves 1,280,672 after both: one resident layer; --ram 2,361,354: two RAM layers.
TINY_FLAGS = ["--context", "64", "--budget", "16", "--device", "cuda", "--gpu-mem", "5137312", "--ram", "2361354",
              "--link-gbps", "25", "--disk-gbps", "3", "--json"]


def run_plan(capsys, *args: str) -> dict:
    assert cli.main(["plan", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def tiny(tmp_path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return tmp_path


def test_tiny_plan_transfer_is_exact(tiny, capsys):
    data = run_plan(capsys, "--target", str(tiny), *TINY_FLAGS)
    assert data["layers"] == {"device": 1, "ram": 2, "disk": 3}
    assert data["weights"]["streamed_layer_bytes"] == TINY_LAYER_BYTES
    # 2 RAM layers over 25 GB/s + 3 disk layers read at 3 GB/s, then copied at 25 GB/s:
    # 2,361,344 / 25e9 + 3,542,016 x (1 / 3e9 + 1 / 25e9) = 9.4454e-5 + 1.32235e-3 = 1.41680e-3 s
    expected = 2 * TINY_LAYER_BYTES / 25e9 + 3 * TINY_LAYER_BYTES * (1 / 3e9 + 1 / 25e9)
    assert data["predicted_transfer_seconds_per_pass"] == pytest.approx(expected, abs=1e-4)
    assert "projection" not in data and "tokens_per_second" not in data     # no GPU described


def test_tiny_projection_wiring(tiny, capsys):
    curve = tiny / "acceptance.json"
    points = [[1, 1.0], [4, 2.0], [16, 3.0]]
    curve.write_text(json.dumps({"format": "acceptance-curve", "version": 1, "points": points}))
    data = run_plan(capsys, "--target", str(tiny), *TINY_FLAGS, "--gpu-tflops", "100", "--draft-ms", "0.1",
                    "--acceptance", str(curve))
    projection = data["projection"]
    assert {"rows", "best_budget", "tokens_per_second", "transfer_seconds", "assumptions", "gpu"} <= set(projection)
    assert [row["budget"] for row in projection["rows"]] == [1, 2, 4, 8, 16]
    transfer = 2 * TINY_LAYER_BYTES / 25e9 + 3 * TINY_LAYER_BYTES * (1 / 3e9 + 1 / 25e9)
    assert projection["transfer_seconds"]["ram"] + projection["transfer_seconds"]["disk"] == pytest.approx(transfer)
    # compute per layer 2 x 590,336 x n / (100e12 x 0.7) = 1.68667e-8 n s, far below a layer's copy
    # (4.7e-5 s), so only the resident layer and the LM head (2 x 262,144 x n / 7e13) add to the transfer.
    def pass_seconds(n: int) -> float:
        return transfer + 2 * TINY_LAYER_PARAMS * n / 7e13 + 2 * 1024 * 256 * n / 7e13
    rows = {row["budget"]: row for row in projection["rows"]}
    for budget in (1, 16):
        assert rows[budget]["pass_seconds"] == pytest.approx(pass_seconds(budget))
    # draft 0.1 ms x rounds(16) = max(min(33, log2 16), 16 / 128) = 4 -> 0.4 ms; a(16) = 3.0:
    # 3 / (1.4172e-3 + 4e-4) = 1651 tokens/s beats budget 8 (2.5 / 1.7170e-3 = 1456) and the rest
    assert rows[16]["draft_seconds"] == pytest.approx(4e-4)
    assert data["best_budget"] == projection["best_budget"] == 16
    assert data["tokens_per_second"] == pytest.approx(3.0 / (pass_seconds(16) + 4e-4))
    assert rows[1]["tokens_per_second"] == pytest.approx(1 / pass_seconds(1))


def test_measured_curve_is_rescaled_to_the_plan(tiny, capsys):
    check = Path(__file__).resolve().parents[1] / "bench" / "results" / "device_check_h200.json"
    data = run_plan(capsys, "--target", str(tiny), *TINY_FLAGS, "--measured-curve", str(check))
    # H200: 4 layers moving 6,845,235,200 bytes at 55.132 GB/s took 0.12872 s at 1 token and 0.12946 s at 16:
    # the residual beyond the copy, x 6 / 4 layers, is added to this plan's 5 streamed layers over 25 GB/s,
    # and the 3 disk layers' reads at 3 GB/s come on top.
    residual = {1: 0.12872 - 6_845_235_200 / 55.132e9, 16: 0.12946 - 6_845_235_200 / 55.132e9}
    expected = {n: 5 * TINY_LAYER_BYTES / 25e9 + r * 6 / 4 + 3 * TINY_LAYER_BYTES / 3e9 for n, r in residual.items()}
    rows = {row["budget"]: row for row in data["projection"]["rows"]}
    for budget, seconds in expected.items():
        assert rows[budget]["pass_seconds"] == pytest.approx(seconds)
        assert rows[budget]["compute_seconds"] is None
    assert any("NVIDIA H200" in line for line in data["projection"]["assumptions"])
    assert data["projection"]["gpu"] is None and data["tokens_per_second"] > 0


def test_gpu_preset_sets_tflops_memory_and_link(tiny, capsys):
    data = run_plan(capsys, "--target", str(tiny), "--gpu", "rtx4090", "--ram", "1GiB", "--json")
    assert data["projection"]["gpu"] == {"name": "rtx4090", "tflops": 165.2, "memory_gbps": 1008.0}
    assert data["bandwidth_gbps"] == {"ram": 25.0, "disk": None}            # nothing on disk: no probe
    assert data["device_budget_bytes"] == 24 * GIB
    override = run_plan(capsys, "--target", str(tiny), "--gpu", "rtx4090", "--gpu-tflops", "100", "--ram", "1GiB",
                        "--link-gbps", "12", "--json")
    assert override["projection"]["gpu"]["tflops"] == 100.0 and override["bandwidth_gbps"]["ram"] == 12.0


def test_unknown_gpu_is_one_error_line(tiny, capsys):
    assert cli.main(["plan", "--target", str(tiny), "--gpu", "rtx9090", "--json"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "rtx9090" in lines[0] and "rtx4090" in lines[0]


def test_q4_k_m_types_follow_llama_cpp():
    config = ModelConfig.from_file(CONFIGS / "llama-3.1-70b")
    more_bits = [i for i in range(80) if use_more_bits(i, 80)]
    assert more_bits == list(range(10)) + list(range(12, 70, 3)) + list(range(70, 80))   # 40 of 80
    weights = llama_cpp_weight_bytes(config, "q4_k_m")
    # Q4_K: q, k, o, gate, up in all 80 layers + ffn_down in the other 40 + token_embd = 441;
    # Q6_K: 40 attn_v + 40 ffn_down + output = 81; Q5_K: the other 40 attn_v (llama.cpp's 70B rule)
    assert dict(weights.type_counts) == {"Q4_K": 441, "F32": 161, "Q6_K": 81, "Q5_K": 40}
    # a layer streams at its largest encoding per tensor: the Q6_K layers' 544,079,872 bytes
    assert weights.streamed_layer_bytes == 544_079_872 == max(weights.layer_file_bytes)


@pytest.mark.parametrize("name, mix, published", [
    ("llama-3.1-70b", "q4_k_m", 42.52e9), ("llama-3.1-70b", "q5_k_m", 49.95e9), ("llama-3.1-70b", "q8_0", 74.98e9),
    ("llama-2-70b", "q4_k_m", 41.42e9), ("qwen2.5-72b", "q4_k_m", 47.42e9)])
def test_mix_bytes_match_published_file_sizes(name, mix, published):
    """Published sizes of llama.cpp's files (Hugging Face listings: bartowski's Llama-3.1-70B-Instruct and
    Qwen2.5-72B-Instruct, TheBloke's Llama-2-70B); the file adds its header and vocabulary (a few MB)."""
    weights = llama_cpp_weight_bytes(ModelConfig.from_file(CONFIGS / name), mix)
    assert weights.total_file_bytes == pytest.approx(published, rel=3e-3)


def test_70b_q4_k_m_on_a_4090_needs_no_disk_and_projects(capsys):
    data = run_plan(capsys, "--target", str(CONFIGS / "llama-3.1-70b"), "--weights", "q4_k_m", "--gpu", "rtx4090",
                    "--ram", "64GiB", "--device", "cuda", "--json")
    assert data["layers"]["disk"] == 0 and data["layers"]["ram"] > 0
    assert data["weights"]["file_bytes"] == pytest.approx(42.52e9, rel=0.03)
    assert data["tokens_per_second"] > 0 and data["best_budget"] >= 1
    components = [item["component"] for item in data["items"]]
    # GGUF on a GPU: resident layers kept packed (0.51 GiB, not 1.59 GiB decoded), decoded at each use into
    # one workspace shared with the streamed layers (the ring's slots hold packed bytes only): 28 layers on
    # 24 GiB where 7 fit decoded (20 with a dense layer per ring slot; 26 while the KV cache was counted with
    # a tree's tokens beyond its context)
    assert "decode workspace (1 dense layer)" in components
    assert any("packed: decoded at each use" in c for c in components) and data["layers"]["device"] == 28
    spqr = run_plan(capsys, "--target", str(CONFIGS / "llama-3.1-70b"), "--weights", "spqr-w4", "--gpu", "rtx4090",
                    "--ram", "64GiB", "--json")
    assert "decode workspace (1 dense layer)" in [item["component"] for item in spqr["items"]]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECSTREAM_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", Spec(layers=3))


def test_gguf_target_reads_its_own_types(tiny_gguf, capsys):
    data = run_plan(capsys, "--target", str(tiny_gguf), "--device", "cuda", "--gpu-mem", "1GiB", "--ram", "1GiB",
                    "--link-gbps", "25", "--json")
    reader = gguf.GGUFReader(tiny_gguf)                       # independent: gguf's own reader
    layers = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("blk."))
    globals_ = sum(int(t.n_bytes) for t in reader.tensors if t.name in ("token_embd.weight", "output_norm.weight",
                                                                        "output.weight"))
    assert data["weights"]["format"] == "gguf"
    assert (data["weights"]["layer_file_bytes"], data["weights"]["global_file_bytes"]) == (layers, globals_)
    folder = resolve_model(str(tiny_gguf))
    source = GgufSource(tiny_gguf, ModelConfig.from_file(folder))   # what the engine would stream per layer
    assert data["weights"]["streamed_layer_bytes"] == source.layout(torch.bfloat16).num_bytes


def test_gguf_target_refuses_weights_flag(tiny_gguf, capsys):
    assert cli.main(["plan", "--target", str(tiny_gguf), "--weights", "q4_k_m", "--device", "cuda",
                     "--gpu-mem", "1GiB", "--ram", "1GiB", "--json"]) == 2
    assert "header" in capsys.readouterr().err
