"""`plan --draft self`: the self-draft's substitutes against the device memory beside what never streams (fits or
not, resident layers per width), llama.cpp's partial offload arithmetic, and the command's error line for a bad
--ram-gbps; sizes worked out by hand in the comments (TINY and its fixed bytes: tests/test_plan_projection.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import cli
from offload.model.config import ModelConfig
from offload.planner import request_from_config
from offload.weights.sizes import dtype_weight_bytes
from perf.llama_cpp_offload import (GPU_READ_EFFICIENCY, LLAMA_CPP_BUFFER_BYTES, llama_cpp_weights,
                                    project_llama_cpp)
from perf.self_draft_plan import SelfDraftReport, self_curves, substitute_options

from test_plan_projection import CONFIGS, TINY, TINY_LAYER_BYTES

# TINY's matrices: q, o 256 x 256; k, v 128 x 256; gate, up 512 x 256; down 256 x 512 -> 589,824 params, plus
# 512 norm params kept fp32 (2,048 bytes). A substitute at b bits on a GPU: 589,824 x b / 8 + 589,824 / 32 x 4
# + 2,048 = 73,728 b + 75,776: 2 bits 223,232; 3 bits 296,960; 4 bits 370,688.
SUBSTITUTE = {2: 223_232, 3: 296_960, 4: 370_688}
# What never streams at context 64, budget 16 on CUDA: globals 1,049,088 + KV cache 2 x 6 layers x 128 x 64 tokens
# x 2 = 196,608 + workspace 200,448 = 1,446,144; with a ring of 2 bf16 layers (2,361,344): 3,807,488
FIXED_AND_RING = 3_807_488
# A self-draft drafts in the target's KV cache: its tree rows (1 + 2 x 16 + 256 = 289 per slot, cache_sizes.draft_slot_tokens)
# join it: 2 x 6 layers x 128 x 289 tokens x 2 = 887,808 more that never stream
TREE_KV = 887_808


@pytest.fixture
def tiny(tmp_path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return tmp_path


def _request(folder: Path, room: int):
    config = ModelConfig.from_file(folder)
    return request_from_config(config, 2, FIXED_AND_RING + TREE_KV + room, 1 << 40, max_context=64, max_tree=16)


@pytest.mark.parametrize("room, expected", [
    # 6 x 370,688 = 2,224,128 > 2,000,000: 4 bits cannot fit even with every layer streamed; 3 and 2 bits fit with
    # no room left for a resident layer (it would cost 1,180,672 - 296,960 = 883,712 more than its substitute)
    (2_000_000, {2: (True, 0), 3: (True, 0), 4: (False, 0)}),
    # 6 x 223,232 + (1,180,672 - 223,232) = 2,296,832: at 2 bits one layer stays resident; 3 and 4 bits leave
    # 515,072 and 72,704 bytes, less than a layer's extra over its substitute
    (2_296_832, {2: (True, 1), 3: (True, 0), 4: (True, 0)}),
    (1_000_000, {2: (False, 0), 3: (False, 0), 4: (False, 0)}),
])
def test_substitutes_fit_beside_what_never_streams(tiny, room, expected):
    options = substitute_options(_request(tiny, room), False, {bits: "no curve" for bits in SUBSTITUTE}, None)
    assert {o.bits: o.substitute_layer_bytes for o in options} == SUBSTITUTE
    assert {o.bits: (o.plan is not None, o.num_resident) for o in options} == expected
    assert all(o.room_bytes == room for o in options)
    for option in options:      # substitutes of the streamed layers; all six where they do not fit
        assert option.substitutes_bytes == (6 - option.num_resident) * SUBSTITUTE[option.bits]
        if option.plan is not None:
            assert option.plan.bytes_in("device") <= FIXED_AND_RING + TREE_KV + room
    report = SelfDraftReport(options, all_resident=False)
    fitting = [bits for bits, (fits, _) in expected.items() if fits]
    assert (report.chosen.bits if report.chosen else None) == (max(fitting) if fitting else None)
    if not fitting:
        assert "does not fit at any bits: 2-bit substitutes of all 6 layers take 1.3 MiB" in report.verdict()


def test_pick_is_the_most_tokens_per_second(tiny, capsys):
    """With a GPU and a curve per width the pick is by projected rate, which a poor curve at 4 bits loses."""
    curves = {2: [[16, 6.0]], 3: [[16, 6.0]], 4: [[16, 1.5]]}
    for bits, points in curves.items():
        (tiny / f"self_{bits}.json").write_text(json.dumps({"format": "acceptance-curve", "version": 1,
                                                            "points": points}))
    args = ["plan", "--target", str(tiny), "--draft", "self", "--acceptance", str(tiny / "self_{bits}.json"),
            "--gpu", "rtx4090", "--gpu-mem", str(FIXED_AND_RING + TREE_KV + 2_296_832), "--ram", "1GiB", "--context", "64",
            "--budget", "16", "--json"]
    assert cli.main(args) == 0
    report = json.loads(capsys.readouterr().out)["self_draft"]
    rates = {o["bits"]: o["tokens_per_second"] for o in report["options"]}
    assert report["chosen_bits"] == max(rates, key=rates.get) != 4
    # a few MB of device memory is less than llama.cpp's buffers alone: every layer on the CPU
    assert report["llama_cpp"]["num_gpu_layers"] == 0 and report["verdict"].startswith("winner: ")


def test_llama_cpp_partial_offload_arithmetic(tiny):
    config = ModelConfig.from_file(tiny)
    weights = llama_cpp_weights(config, dtype_weight_bytes(config, "bf16", 2), None)
    assert weights.layer_bytes == (TINY_LAYER_BYTES,) * 6 and weights.head_bytes == 1024 * 256 * 2
    kv_layer = 2 * 2 * 64 * 64 * 2                 # keys and values, 2 KV heads x 64, 64 tokens, fp16: 32,768
    memory = LLAMA_CPP_BUFFER_BYTES + 3 * (TINY_LAYER_BYTES + kv_layer) + 1000
    peer = project_llama_cpp(config, weights, memory, 1 << 30, 64, 1008.0, 60.0)
    assert (peer.num_gpu_layers, peer.head_on_gpu) == (3, False)
    # 3 layers from GPU memory at 80% of 1008 GB/s; 3 layers and the LM head from RAM at 60 GB/s
    expected = 3 * TINY_LAYER_BYTES / (1008e9 * GPU_READ_EFFICIENCY) + (3 * TINY_LAYER_BYTES + 524_288) / 60e9
    assert peer.seconds_per_token == pytest.approx(expected, rel=1e-12)
    whole = project_llama_cpp(config, weights, 2 << 30, 1 << 30, 64, 1008.0, 60.0)
    assert (whole.num_gpu_layers, whole.head_on_gpu, whole.cpu_bytes) == (6, True, 0)
    assert not project_llama_cpp(config, weights, memory, 1000, 64, 1008.0, 60.0).fits_ram


def test_70b_on_a_4090_does_not_fit_at_any_bits(capsys):
    args = ["plan", "--target", str(CONFIGS / "llama-3.1-70b"), "--weights", "q4_k_m", "--gpu", "rtx4090",
            "--gpu-mem", "24GiB", "--ram", "64GiB", "--device", "cuda", "--draft", "self", "--json"]
    assert cli.main(args) == 0
    report = json.loads(capsys.readouterr().out)["self_draft"]
    assert [o["fits"] for o in report["options"]] == [False, False, False] and report["chosen_bits"] is None
    least = report["options"][0]           # 2 bits: 80 substitutes against what is left beside the rest
    assert least["substitutes_bytes"] == 80 * least["substitute_layer_bytes"] > least["room_bytes"]
    assert report["verdict"].startswith("the self-draft does not fit at any bits")
    assert report["llama_cpp"]["tokens_per_second"] > 0


def test_bad_ram_gbps_is_one_line(tiny, capsys):
    assert cli.main(["plan", "--target", str(tiny), "--draft", "self", "--ram-gbps", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--ram-gbps must be positive" in err and "got 0" in err


def test_default_curves_cover_every_width_and_budget():
    """`plan --draft self` projects each width from the 124-prompt tree simulations shipped in bench/results/;
    a width or budget missing there would leave that width unprojected or clamped at a smaller budget."""
    curves = self_curves(None)
    assert sorted(curves) == [2, 3, 4]
    for bits, curve in curves.items():
        assert not isinstance(curve, str), curve
        assert [b for b, _ in curve.points] == [1, 16, 64, 256, 1024] and f"{bits}bit_all_128" in curve.source
        assert all(a <= b for (_, a), (_, b) in zip(curve.points, curve.points[1:]))  # more budget, no fewer
