"""SpQR checkpoints end to end on a tiny model: quantize (and resume), load like any model in every tier,
compute exactly what a dense model holding the dequantized weights computes, and refuse bad files."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import add_tiny_tokenizer, load_ours, make_tiny_checkpoint
import offload
from offload import LoadOptions
from runtime import load_model
from offload.weights.safetensors_io import CorruptCheckpointError, SafetensorsFile, write_safetensors
from quant.checkpoint import MATRICES, layer_path
from quant.quantize import QuantizeConfig, quantize
from spec import DecodeConfig, Decoder, SamplingConfig

LAYERS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("spqr")
    folder, _ = make_tiny_checkpoint(root / "dense", "llama", num_hidden_layers=LAYERS, vocab_size=64)
    add_tiny_tokenizer(folder, 64)
    return root, folder


@pytest.fixture(scope="module")
def quantized(tiny):
    root, folder = tiny
    out = root / "w3"
    summary = quantize(QuantizeConfig(str(folder), out, bits=3, outlier_threshold=1.0, nsamples=8, seqlen=32))
    return out, summary


def dense_reference(root, quantized_folder):
    """A plain checkpoint holding the packed weights, dequantized (the independent reference)."""
    loaded = load_model(LoadOptions(str(quantized_folder), device="cpu", dtype="fp32"))
    dense = root / "dequantized"
    shutil.rmtree(dense, ignore_errors=True)
    dense.mkdir()
    tensors = {}
    from offload.weights.source import HF_GLOBAL_NAMES, HF_LAYER_NAMES
    for index in range(LAYERS):
        decoded = loaded.source.decode_layer(index, loaded.source.layer(index), torch.float32)
        for name, value in decoded.items():
            weight = value.matrix.dequantize() if name in MATRICES else value
            tensors[f"model.layers.{index}.{HF_LAYER_NAMES[name]}"] = weight.contiguous()
    for name, value in loaded.source.global_tensors().items():
        tensors[HF_GLOBAL_NAMES[name]] = value.clone()
    write_safetensors(dense / "model.safetensors", tensors, {"format": "pt"})
    config = json.loads((quantized_folder / "config.json").read_text())
    config.pop("quantization_config")
    (dense / "config.json").write_text(json.dumps(config))
    return dense


def test_quantize_reports_bits_from_the_bytes_and_errors_per_layer(quantized):
    out, summary = quantized
    assert summary["layers"] == LAYERS and len(summary["layer_reports"]) == LAYERS
    assert 3.6 < summary["bits_per_param"] < 6 and 0 < summary["mean_error"] < 0.5
    assert (out / "quantize_report.json").exists() and not (out / ".state" / "hidden.safetensors").exists()


@pytest.mark.parametrize("tier", ["device", "ram", "disk"])
def test_packed_model_computes_what_its_dequantized_weights_compute(tiny, quantized, tier):
    root, _ = tiny
    out, _ = quantized
    reference = load_ours(dense_reference(root, out))
    options = LoadOptions(str(out), device="cpu", dtype="fp32", max_context=64, max_pass_tokens=16)
    if tier != "device":
        probe = load_model(options)
        fixed = sum(i.num_bytes for i in probe.plan.items if "layers" not in i.component)
        layer_bytes = probe.plan.request.layer_bytes
        options.gpu_mem = fixed + 3 * layer_bytes
        options.ram = 1 if tier == "disk" else 100 * layer_bytes
    model = load_model(options)
    assert model.plan.tier_of.count(tier) >= 1
    assert model.plan.request.layer_bytes == max(layout.num_bytes for layout in model.source.inner) // 256 * 256 + \
        (256 if max(layout.num_bytes for layout in model.source.inner) % 256 else 0)
    ids = torch.tensor([[3, 17, 5, 9, 31, 2, 40]])
    expected = reference.forward(ids, reference.new_cache(16)).logits
    got = model.model.forward(ids, model.model.new_cache(16)).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    decoder = Decoder(model.model, set(), DecodeConfig(8, 64))
    assert len(decoder.generate([3, 17, 5], SamplingConfig()).token_ids) == 8
    model.layers.close()


def test_a_killed_quantization_resumes_at_the_next_layer(tiny, quantized):
    root, folder = tiny
    out = root / "resumed"
    config = QuantizeConfig(str(folder), out, bits=3, outlier_threshold=1.0, nsamples=8, seqlen=32)

    def stop_after_layer_one(event):
        if event["layer"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize(config, stop_after_layer_one)
    assert layer_path(out, 1).exists() and not layer_path(out, 2).exists()
    seen = []
    config.resume = True
    quantize(config, lambda event: seen.append(event["layer"]))
    assert seen == [2, 3]
    complete, _ = quantized
    for index in range(LAYERS):
        assert layer_path(out, index).read_bytes() == layer_path(complete, index).read_bytes()


def _copy(quantized, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(quantized[0], folder)
    return folder


def test_unknown_format_version_is_refused_naming_the_file(quantized, tmp_path):
    folder = _copy(quantized, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["format_version"] = 99
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CorruptCheckpointError, match="config.json.*version 99"):
        load_model(LoadOptions(str(folder), device="cpu"))


def test_truncated_packed_layer_is_refused_naming_the_file(quantized, tmp_path):
    folder = _copy(quantized, tmp_path)
    path = layer_path(folder, 2)
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(CorruptCheckpointError, match=str(path)):
        load_model(LoadOptions(str(folder), device="cpu"))


def test_mismatched_shapes_are_refused_naming_the_file(quantized, tmp_path):
    folder = _copy(quantized, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 2 * config["intermediate_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CorruptCheckpointError, match="layer-00000.*gate"):
        load_model(LoadOptions(str(folder), device="cpu"))


def test_unsupported_bits_and_shapes_are_refused(tiny, tmp_path):
    _, folder = tiny
    with pytest.raises(ValueError, match="3, 4"):
        QuantizeConfig(str(folder), tmp_path / "x", bits=5)
    with pytest.raises(ValueError, match="not a multiple of --groupsize 128"):
        quantize(QuantizeConfig(str(folder), tmp_path / "y", groupsize=128, nsamples=2, seqlen=16))


def test_packed_formats_are_passed_explicitly_never_registered_on_import(quantized):
    """The engine alone refuses an SpQR folder (it is never opened as a plain checkpoint); the runtime's
    composition root passes the format and it loads."""
    folder, _ = quantized
    with pytest.raises(ValueError, match="'specstream-spqr' packed weights, a format this loader was not given"):
        offload.load_model(LoadOptions(str(folder), device="cpu", dtype="fp32"))
    assert load_model(LoadOptions(str(folder), device="cpu", dtype="fp32")).source.quantization["bits"] == 3


def test_without_act_order_no_permutation_is_stored_or_gathered(tiny):
    """Format version 2: a matrix quantized in input order stores an empty permutation, its layer computes
    what its dequantized weights compute, and a version-1 file (always a permutation) still loads."""
    root, folder = tiny
    out = root / "in-order"
    quantize(QuantizeConfig(str(folder), out, bits=4, groupsize=16, stats_bits=3, act_order=False,
                            nsamples=4, seqlen=32))
    loaded = load_model(LoadOptions(str(out), device="cpu", dtype="fp32"))
    decoded = loaded.source.decode_layer(0, loaded.source.layer(0), torch.float32)
    assert all(decoded[name].matrix.perm.numel() == 0 for name in MATRICES)
    reference = load_ours(dense_reference(root, out))
    ids = torch.tensor([[3, 17, 5, 9]])
    torch.testing.assert_close(loaded.model.forward(ids, loaded.model.new_cache(8)).logits,
                               reference.forward(ids, reference.new_cache(8)).logits, rtol=1e-5, atol=1e-5)
    loaded.layers.close()


def test_version_one_checkpoints_still_load(quantized):
    out, _ = quantized
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["format_version"] == 2
    old = out.parent / "version-one"
    shutil.copytree(out, old, dirs_exist_ok=True)
    config["quantization_config"]["format_version"] = 1
    (old / "config.json").write_text(json.dumps(config))
    for index in range(LAYERS):
        opened = SafetensorsFile(layer_path(old, index))
        tensors = {key: opened.tensor(key).clone() for key in opened.entries}
        write_safetensors(layer_path(old, index), tensors, {**opened.metadata, "version": "1"})
    load_model(LoadOptions(str(old), device="cpu", dtype="fp32")).layers.close()


def test_a_source_on_a_q4_1_grid_gets_the_aligned_settings_unless_the_user_chose():
    from quant.quantize import resolve_settings
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (32, 64), generator=generator).float()
    codes[:, 0::32], codes[:, 1::32] = 0, 15          # Q4_1: each block's minimum and maximum on the grid
    scale, low = torch.rand(32, 2, 1, generator=generator) + 0.1, torch.randn(32, 2, 1, generator=generator)
    on_grid = {"q": (codes.view(32, 2, 32) * scale + low).view(32, 64)}
    natural = {"q": torch.randn(32, 64, generator=generator)}
    root_out = Path("unused")
    config = QuantizeConfig(None, root_out, bits=4)
    aligned, message = resolve_settings(config, on_grid)
    assert (aligned.groupsize, aligned.stats_bits, aligned.act_order) == (32, 8, False) and "aligned" in message
    plain, hint = resolve_settings(config, natural)
    assert (plain.groupsize, plain.stats_bits, plain.act_order) == (16, 3, True) and hint is None
    chosen, hint = resolve_settings(QuantizeConfig(None, root_out, bits=4, groupsize=16), on_grid)
    assert (chosen.groupsize, chosen.stats_bits, chosen.act_order) == (16, 3, True) and "--no-act-order" in hint
    three, _ = resolve_settings(QuantizeConfig(None, root_out, bits=3), on_grid)
    assert (three.groupsize, three.act_order) == (16, True)


def test_a_spqr_target_drafts_for_itself(quantized, tmp_path, monkeypatch):
    """The self-draft's substitutes start from the checkpoint's own weights in their column order (SpqrLinear.dense),
    and speculating with them gives target-only decoding's tokens."""
    from spec import FixedBudget
    from spec.self_draft import SubstituteConfig, dense_layer, load_self_draft
    from spec.self_speculator import SelfSpeculator
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path))
    out, _ = quantized
    model = load_model(LoadOptions(str(out), device="cpu", dtype="fp32", max_context=64, max_pass_tokens=16))
    decoded = model.source.decode_layer(1, model.source.layer(1), torch.float32)
    assert torch.equal(dense_layer(model.source, 1)["down"], decoded["down"].matrix.dequantize())
    draft = load_self_draft(model, SubstituteConfig(4), layers=[1, 2, 3])
    plain = Decoder(model.model, set(), DecodeConfig(12, 64)).generate([3, 17, 5], SamplingConfig())
    spec = Decoder(model.model, set(), DecodeConfig(12, 64, max_pass_tokens=16),
                   SelfSpeculator(draft, 8, priced=False), FixedBudget(8)).generate([3, 17, 5], SamplingConfig())
    assert spec.token_ids == plain.token_ids and spec.stats.num_target_passes < 12
