"""The planner on real 70B-class configs (config.json only) and its budget errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from offload.byte_units import GIB, parse_bytes
from offload.model.config import ModelConfig
from offload.planner import PlanError, make_plan, request_from_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"

# Parameters per decoder layer, counted by hand from the published shapes.
LLAMA_70B_LAYER = 8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 28672 + 2 * 8192
QWEN_72B_LAYER = 8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 29568 + (8192 + 2 * 1024) + 2 * 8192


def _plan(name, gpu=24 * GIB, ram=64 * GIB, **kwargs):
    config = ModelConfig.from_file(CONFIGS / name)
    return make_plan(request_from_config(config, 2, gpu, ram, **kwargs))


@pytest.mark.parametrize("name, layer_params", [("llama-3.1-70b", LLAMA_70B_LAYER), ("qwen2.5-72b", QWEN_72B_LAYER)])
def test_70b_plan_fits_24gib_gpu_and_64gib_ram(name, layer_params):
    plan = _plan(name)
    request = plan.request
    assert request.layer_bytes == 2 * layer_params
    assert len(plan.tier_of) == 80 and set(plan.tier_of) == {"device", "ram", "disk"}
    assert plan.tier_of == sorted(plan.tier_of, key=["device", "ram", "disk"].index)   # device, then ram, then disk
    assert plan.bytes_in("device") <= 24 * GIB
    assert plan.bytes_in("ram") <= 64 * GIB
    num_ram = plan.tier_of.count("ram")
    assert num_ram == (64 * GIB) // request.layer_bytes          # RAM filled before disk
    # one more resident layer would overflow the device budget
    assert plan.bytes_in("device") + request.layer_bytes > 24 * GIB
    total = plan.bytes_in("device") + plan.bytes_in("ram") + plan.bytes_in("disk")
    layers = 80 * request.layer_bytes
    assert total == layers + sum(i.num_bytes for i in plan.items if "layers" not in i.component)


def test_llama_70b_plan_counts():
    plan = _plan("llama-3.1-70b")
    assert {t: plan.tier_of.count(t) for t in ("device", "ram", "disk")} == {"device": 8, "ram": 40, "disk": 32}
    assert plan.ring_size == 2
    seconds = plan.predicted_transfer_seconds({"ram": 25e9, "disk": 3e9})
    expected = 40 * 2 * LLAMA_70B_LAYER / 25e9 + 32 * 2 * LLAMA_70B_LAYER * (1 / 3e9 + 1 / 25e9)
    assert seconds == pytest.approx(expected)


def test_draft_and_bigger_tree_take_device_layers_away():
    base = _plan("llama-3.1-70b")
    draft = ModelConfig.from_file(CONFIGS / "llama-3.1-70b")   # a big draft just to move the numbers
    draft.num_layers = 2
    with_draft = _plan("llama-3.1-70b", draft=draft)
    assert with_draft.tier_of.count("device") < base.tier_of.count("device")
    assert any(i.component == "draft model" for i in with_draft.items)


def test_budget_too_small_names_the_minimum():
    with pytest.raises(PlanError, match=r"at least \d+\.\d+ GiB is needed"):
        _plan("llama-3.1-70b", gpu=8 * GIB)


def test_everything_fits_means_no_ring():
    plan = _plan("llama-3.1-70b", gpu=400 * GIB)
    assert set(plan.tier_of) == {"device"} and plan.ring_size == 0


@pytest.mark.parametrize("text, value", [("24GiB", 24 * GIB), ("24GB", 24 * 10 ** 9), ("512MiB", 512 * 2 ** 20),
                                         ("1.5 TiB", int(1.5 * 1024 ** 4)), ("123", 123)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_parse_bytes_rejects_garbage():
    with pytest.raises(ValueError, match="24GiB"):
        parse_bytes("lots")


def _cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_cli_plan_prints_table_and_json():
    args = ["plan", "--target", str(CONFIGS / "llama-3.1-70b"), "--gpu-mem", "24GiB", "--ram", "64GiB",
            "--device", "cuda", "--link-gbps", "25", "--disk-gbps", "3"]
    table = _cli(*args)
    assert table.returncode == 0, table.stderr
    assert "decoder layers 8-47 (streamed ram)" in table.stdout and "predicted transfer per pass" in table.stdout
    data = json.loads(_cli(*args, "--json").stdout)
    assert data["layers"] == {"device": 8, "ram": 40, "disk": 32}
    assert data["predicted_transfer_seconds_per_pass"] > 10


def test_cli_plan_with_spqr_weights_packs_more_layers_at_groups_of_32():
    args = ["plan", "--target", str(CONFIGS / "llama-3.1-70b"), "--gpu-mem", "24GiB", "--ram", "64GiB",
            "--device", "cuda", "--link-gbps", "25", "--disk-gbps", "3", "--json"]
    plans = {w: json.loads(_cli(*args, "--weights", w).stdout) for w in ("spqr-w4", "spqr-w4-g32")}
    w4, g32 = plans["spqr-w4"], plans["spqr-w4-g32"]
    assert w4["layers"]["disk"] == g32["layers"]["disk"] == 0
    assert g32["layers"]["device"] > w4["layers"]["device"]
    assert g32["predicted_transfer_seconds_per_pass"] < w4["predicted_transfer_seconds_per_pass"] < 1.5


def test_cli_plan_too_small_is_one_line():
    result = _cli("plan", "--target", str(CONFIGS / "qwen2.5-72b"), "--gpu-mem", "4GiB", "--ram", "64GiB",
                  "--device", "cuda", "--link-gbps", "25", "--disk-gbps", "3")
    assert result.returncode == 2 and "at least" in result.stderr and "Traceback" not in result.stderr


def test_resident_layers_kept_packed_only_where_that_costs_less_per_pass():
    """A decode-once source (decoded layer 3x its packed bytes): the planner compares, in units of one
    layer's transfer, streamed layers (transfer + decode each) plus resident packed ones (decode each)."""
    from dataclasses import replace
    config = ModelConfig.from_file(CONFIGS / "llama-3.1-70b")
    base = request_from_config(config, 2, 24 * GIB, 64 * GIB)
    packed_bytes = base.layer_bytes // 3
    request = replace(base, layer_bytes=packed_bytes, resident_layer_bytes=base.layer_bytes,
                      decode_workspace_bytes=base.layer_bytes)
    never = make_plan(request)                                        # decode_vs_transfer None: decoded once
    decoded = never.tier_of.count("device")
    assert not never.request.resident_packed and decoded > 0
    cheap = make_plan(replace(request, decode_vs_transfer=0.25))
    packed = cheap.tier_of.count("device")
    assert cheap.request.resident_packed and packed > 2 * decoded
    # by hand: decoded costs (80 - d)(1 + r), packed (80 - p) + 80 r; at r = 0.25 packed wins
    assert (80 - packed) + 80 * 0.25 < (80 - decoded) * 1.25
    slow = make_plan(replace(request, decode_vs_transfer=10.0))       # decode far dearer than transfer
    assert not slow.request.resident_packed and slow.tier_of == never.tier_of
    assert (80 - packed) + 80 * 10 > (80 - decoded) * 11


def test_the_draft_kv_cache_is_planned_beside_the_target_s():
    """A draft caches what the target caches plus the nodes its trees expand: per slot a context, twice the
    largest tree and a slack of 256 (draft_slot_tokens, which the speculator's cache is sized by)."""
    from dataclasses import replace
    from offload.cache_sizes import kv_cache_bytes
    config, draft = (ModelConfig.from_file(CONFIGS / name) for name in ("llama-2-70b", "llama-2-7b"))
    request = request_from_config(config, 2, 24 * GIB, 64 * GIB, draft=draft, max_context=4096, max_tree=512)
    per_token = 2 * draft.num_layers * draft.num_kv_heads * draft.head_dim * 2
    assert request.draft_kv_token_bytes == per_token == kv_cache_bytes(draft, 1, 2)
    items = {i.component: i.num_bytes for i in make_plan(request).items}
    assert items["draft KV cache"] == per_token * (4096 + 2 * 512 + 256)
    batch = {i.component: i.num_bytes for i in make_plan(replace(request, num_sequences=2, device_budget=48 * GIB)).items}
    assert batch["draft KV cache"] == per_token * 2 * (4096 + 2 * 512 + 256)
