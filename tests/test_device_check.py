"""The GPU check script's dry run (CPU, small shapes) and the CUDA paths where a GPU exists."""
import json
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_device_check_dry_run_writes_json(tmp_path):
    out = tmp_path / "check.json"
    subprocess.run(["bash", str(ROOT / "tests" / "device_check.sh"), "--dry-run", str(out)], check=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and [p["tokens"] for p in result["passes"]] == [1, 16, 64]
    for row in result["passes"]:
        assert row["bytes_streamed"] == 3 * result["layer_bytes"]
        assert 0 < row["efficiency"] and row["pass_seconds"] > 0
    dequantize = result["spqr_w4_dequantize"]
    assert dequantize["torch_ms"] > 0 and dequantize["transfer_ms"] > 0 and dequantize["fused_available"] is False
    # 4 bits + 6/16 + 64/256 per weight, no outliers: 4.625 bits, plus the permutations and row pointers
    assert 4.625 < 8 * dequantize["packed_bytes"] / dequantize["params"] < 4.8


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_cuda_streaming_matches_cuda_resident(tier, tiny_checkpoint):
    from offload.loader import LoadOptions, build_engine
    from offload.weights import CheckpointSource
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
