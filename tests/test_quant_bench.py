"""bench quant on a tiny model: every method's row, bits and perplexity; round-to-nearest and NF4 against
their definitions."""
import pytest
import torch

from conftest import add_tiny_tokenizer, make_tiny_checkpoint
from quant.baselines import nf4, round_to_nearest, rtn_bits
from bench.quant_bench import QuantBenchConfig, SpqrRow, run_quant_bench


def test_round_to_nearest_matches_its_definition():
    weight = torch.tensor([[0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]])
    out = round_to_nearest(weight, bits=2, groupsize=4)          # 4 levels per group: exact here
    torch.testing.assert_close(out, weight)
    noisy = weight + torch.tensor([[0.4, -0.3, 0.2, 0.0, 0.1, 0.0, -0.4, 0.0]])
    assert (round_to_nearest(noisy, 2, 4) - noisy).abs().max() <= (noisy[0, :4].max() - noisy[0, :4].min()) / 6 + 1e-6
    assert rtn_bits(4, 16) == 6.0 and rtn_bits(3, 64) == 3.5


def test_nf4_is_bitsandbytes_four_bit():
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    out = nf4(weight)
    assert out.shape == weight.shape and 0 < (out - weight).abs().mean() < 0.1 * weight.abs().mean()
    assert len(torch.unique(out[0, :64] / weight[0, :64].abs().max())) <= 16


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("qbench")
    folder, _ = make_tiny_checkpoint(root / "m", "llama", num_hidden_layers=2, vocab_size=64)
    add_tiny_tokenizer(folder, 64)
    import os
    os.environ["SPECSTREAM_CACHE"] = str(root / "cache")
    config = QuantBenchConfig(str(folder), tokens_per_domain=96, nsamples=4, seqlen=32, chat_prompts=None,
                              spqr=(SpqrRow(4, 8.0), SpqrRow(3, 1.0), SpqrRow(4, 8.0, 32),
                                    SpqrRow(4, 8.0, 32, 8, act_order=False)))
    try:
        return run_quant_bench(config, on_status=lambda message: None)
    finally:
        del os.environ["SPECSTREAM_CACHE"]


def test_every_method_has_a_row_with_bits_and_perplexity(result):
    methods = [row["method"] for row in result["rows"]]
    assert methods == ["reference", "spqr-w4", "spqr-w3", "spqr-w4-g32", "spqr-w4-g32-s8-noact", "rtn-w4-g16", "rtn-w4-g64", "rtn-w3-g16", "rtn-w3-g64",
                       "gptq-w4-g16", "gptq-w3-g16", "nf4"]
    rows = {row["method"]: row for row in result["rows"]}
    assert rows["reference"]["bits_per_param"] == 32 and rows["reference"]["mean_increase"] == 0
    assert 4.6 < rows["spqr-w4"]["bits_per_param"] < 5.5 and 3.6 < rows["spqr-w3"]["bits_per_param"] < 4.6
    # groups of 32 halve the statistics' share: 0.3125 bits fewer, outliers and the permutation aside
    assert 0.2 < rows["spqr-w4"]["bits_per_param"] - rows["spqr-w4-g32"]["bits_per_param"] < 0.45
    # 8-bit statistics at groups of 32 cost what 3-bit ones at groups of 16 do (2 x 8 / 32 = 2 x 3 / 16 + 1 / 8);
    # in input order no permutation is stored: 16 bits per input column fewer, 16 / rows per parameter (0.125-0.25 here)
    assert 0.1 < rows["spqr-w4"]["bits_per_param"] - rows["spqr-w4-g32-s8-noact"]["bits_per_param"] < 0.3
    assert rows["spqr-w4-g32-s8-noact"]["act_order"] is False
    assert rows["gptq-w3-g16"]["bits_per_param"] > 5 and rows["nf4"]["bits_per_param"] == 4.5
    for row in result["rows"]:
        assert set(row["perplexity"]) >= {"code", "prose", "math"} and all(v > 1 for v in row["perplexity"].values())
    assert rows["spqr-w4"]["dequantize_seconds_per_layer"] > 0 and rows["spqr-w4"]["bytes_per_pass"] > 0
    assert result["window"] == 512 and result["stride"] == 256


def test_disk_bench_streams_every_layer_cold_and_compares_bytes_and_speed(tmp_path, monkeypatch):
    from bench.quant_disk_bench import DiskBenchConfig, run_disk_bench
    from quant.quantize import QuantizeConfig, quantize
    folder, _ = make_tiny_checkpoint(tmp_path / "m", "llama", num_hidden_layers=3, vocab_size=64)
    add_tiny_tokenizer(folder, 64)
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path / "cache"))
    packed = tmp_path / "w4"
    quantize(QuantizeConfig(str(folder), packed, bits=4, outlier_threshold=8.0, nsamples=4, seqlen=32))
    result = run_disk_bench(DiskBenchConfig(str(folder), [packed], new_tokens=4, rounds=2), on_status=lambda m: None)
    rows = {row["model"]: row for row in result["rows"]}
    assert list(rows) == ["reference-fp32", "reference-bf16", "w4", "w4-ahead"]
    assert rows["w4"]["label"] == "SpQR w4" and rows["w4-ahead"]["label"] == "SpQR w4, decoder thread"
    for row in rows.values():
        assert row["layers_from_disk"] == 3 and row["decode_passes"] >= 1 and row["tokens_per_second"] > 0
        by_round = row["tokens_per_second_by_round"]          # the median of two rounds is their mean
        assert len(by_round) == 2 and abs(row["tokens_per_second"] - sum(by_round) / 2) <= 1e-3
    assert 1.9 < rows["reference-fp32"]["bytes_per_pass"] / rows["reference-bf16"]["bytes_per_pass"] <= 2  # + alignment
    assert rows["w4"]["bytes_ratio_vs_fp32"] > 4 and rows["reference-fp32"]["speedup_vs_fp32"] == 1.0
    w4, bf16 = rows["w4"]["tokens_per_second_by_round"], rows["reference-bf16"]["tokens_per_second_by_round"]
    paired = (w4[0] / bf16[0] + w4[1] / bf16[1]) / 2                   # each round's own ratio, then the median
    assert rows["w4"]["paired_speedup_vs_bf16"] == pytest.approx(paired, abs=1e-3)
    assert rows["w4"]["per_layer_ms"]["dequantize"] > 0 == rows["reference-fp32"]["per_layer_ms"]["dequantize"]
    # the default row dequantizes on the compute thread, the -ahead row in the decoder thread
    assert rows["w4-ahead"]["per_layer_ms"]["decoded_ahead"] > 0 == rows["w4"]["per_layer_ms"]["decoded_ahead"]
    assert rows["w4"]["bytes_per_pass"] == rows["w4-ahead"]["bytes_per_pass"]
    copies = list((tmp_path / "cache" / "bench_quant").glob("*-bf16"))   # the bf16 row read bf16 bytes
    assert len(copies) == 1 and (copies[0] / "config.json").exists()
    with pytest.raises(ValueError, match="--packed"):
        DiskBenchConfig(str(folder), [])
    with pytest.raises(ValueError, match="rounds"):
        DiskBenchConfig(str(folder), [packed], rounds=0)


def test_chat_answers_are_cached_per_length(tmp_path, monkeypatch):
    """A cache made for a short held-out text once stood in for every longer one (191 tokens, not 4,096)."""
    from offload import LoadOptions
    from runtime import load_model
    from bench.quant_bench import _chat_answers
    folder, _ = make_tiny_checkpoint(tmp_path / "m", "llama", num_hidden_layers=1, vocab_size=64)
    add_tiny_tokenizer(folder, 64)
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path / "cache"))
    model = load_model(LoadOptions(str(folder), device="cpu", dtype="fp32"))
    texts = {n: _chat_answers(model, QuantBenchConfig(str(folder), tokens_per_domain=n), lambda m: None) for n in (64, 400)}
    lengths = {n: len(model.tokenizer.encode(text)) for n, text in texts.items()}
    assert lengths[400] > lengths[64] and lengths[400] >= 300
    assert len(list((tmp_path / "cache" / "bench_quant").glob("*chat-answers*"))) == 2


def test_methods_choose_the_rows_and_unknown_ones_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown methods"):
        QuantBenchConfig(methods=("spqr", "awq"))
    folder, _ = make_tiny_checkpoint(tmp_path / "m", "llama", num_hidden_layers=1, vocab_size=64)
    add_tiny_tokenizer(folder, 64)
    config = QuantBenchConfig(str(folder), tokens_per_domain=64, chat_prompts=None, methods=("nf4",))
    assert [row["method"] for row in run_quant_bench(config, on_status=lambda m: None)["rows"]] == ["reference", "nf4"]
