"""The self-draft: low-bit substitutes made from the target's own layers, drafting in the target's own cache.
Speculation with it must give exactly what target-only decoding gives (greedy, batched, multi-turn)."""
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import add_tiny_tokenizer, make_tiny_checkpoint
from offload import LoadOptions, load_model
from offload.byte_units import GIB
from offload.loader import streaming_device_budget
from offload.model.config import ModelConfig
from offload.planner import PlanError, make_plan, request_from_config
from quant.baselines import round_to_nearest
from quant.lowbit import LowBitWeight, from_tensors, quantize_matrix, relative_error, substitute_weight, to_tensors
from spec import DecodeConfig, DecodeRequest, Decoder, FixedBudget, SamplingConfig
from offload.weights.packed_linear import dense_q8_bytes
from quant.lowbit import DraftInt4Weight
from spec.self_draft import SubstituteConfig, draft_head, growth_temperature, load_self_draft, \
    substitute_layer_bytes
from spec.grow import Growth, GrowthConfig
from spec.self_speculator import SelfSpeculator
from spec.step_clock import CostLine, StepClock
from spec.simulation import simulate_self

CPU = torch.device("cpu")
PROMPTS = [[5, 9, 2, 7, 7, 1], [3, 3, 8], [11, 4, 6, 2, 9, 10, 12, 1, 5]]


def _matrix(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(96, 256, generator=generator) * 0.02
    weight[torch.rand(weight.shape, generator=generator) < 0.002] *= 12        # a few outliers, as real layers have
    return weight


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_refined_scales_lose_less_than_round_to_nearest(bits):
    weight = _matrix()
    ours = relative_error(weight, quantize_matrix(weight, bits))
    rtn = float((weight - round_to_nearest(weight, bits, 32)).norm() / weight.norm())
    assert ours < rtn * (0.95 if bits < 4 else 1.0), (ours, rtn)


def test_stored_form_round_trips_and_refuses_another_shape():
    matrix = quantize_matrix(_matrix(), 3)
    again = from_tensors(to_tensors(matrix, "w"), "w", (96, 256), 3, 32)
    assert torch.equal(again.codes, matrix.codes) and torch.equal(again.scale, matrix.scale)
    with pytest.raises(ValueError, match="does not match"):
        from_tensors(to_tensors(matrix, "w"), "w", (96, 288), 3, 32)


@pytest.mark.parametrize("bits", [2, 4])
def test_substitute_products_match_the_dequantized_matrix(bits):
    matrix = quantize_matrix(_matrix(1), bits)
    x = torch.randn(7, 256)
    reference = x @ matrix.dequantize().T
    assert torch.allclose(LowBitWeight(matrix, CPU).matmul(x), reference, atol=1e-5)
    kernel = substitute_weight(matrix, CPU)          # torch's int4 kernel: bf16 activations, scales and zeros
    assert type(kernel).__name__ == "DraftInt4Weight" and not kernel.is_row_exact
    scale = matrix.scale.float().bfloat16().float()
    zero = (matrix.offset.float() + 8 * matrix.scale.float()).bfloat16().float()
    codes = matrix.codes.view(96, -1, 32).float()
    rounded = ((codes - 8) * scale[..., None] + zero[..., None]).view(96, 256)
    bf16_reference = x.bfloat16().float() @ rounded.T
    assert (kernel.matmul(x) - bf16_reference).abs().max() <= 2 ** -7 * bf16_reference.abs().max()


def test_the_plan_counts_substitutes_and_refuses_them_when_they_do_not_fit():
    config = ModelConfig.from_file(Path(__file__).parent / "fixtures" / "configs" / "llama-3.1-70b")
    bare = request_from_config(config, 2, 24 * GIB, 64 * GIB)
    full = make_plan(bare)
    with_substitutes = make_plan(replace(full.request, substitute_layer_bytes=bare.layer_bytes // 16))
    streamed = sum(t != "device" for t in with_substitutes.tier_of)
    items = [i for i in with_substitutes.items if i.component.startswith("self-draft substitutes")]
    assert streamed and items[0].num_bytes == streamed * (bare.layer_bytes // 16)
    assert with_substitutes.tier_of.count("device") < full.tier_of.count("device")
    assert with_substitutes.bytes_in("device") <= full.request.device_budget
    with pytest.raises(PlanError, match="substitutes .* do not fit"):
        make_plan(replace(full.request, substitute_layer_bytes=bare.layer_bytes // 3))   # 80 x 0.53 GiB


@pytest.fixture(scope="module")
def streamed_target(tmp_path_factory):
    """A tiny 4-layer model whose plan streams 3 layers (with room for 2-bit substitutes of them)."""
    folder, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("self"), "llama", seed=3, num_hidden_layers=4,
                                     vocab_size=64)
    add_tiny_tokenizer(folder, 64)
    settings = SubstituteConfig(2)
    options = LoadOptions(str(folder), device="cpu", dtype="fp32", max_context=128, max_pass_tokens=64)
    options.substitute_layer_bytes = substitute_layer_bytes(load_model(options).config, settings, True)
    options.gpu_mem = streaming_device_budget(options, 1)
    target = load_model(options)
    assert target.plan.tier_of.count("device") == 1
    yield target, settings
    target.close()                      # its ring's loader thread: later tests count the threads left running


def test_the_self_draft_scores_with_a_packed_head_the_plan_counts(streamed_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path))
    target, settings = streamed_target
    draft = load_self_draft(target, settings)
    head, dense = draft.model.lm_head, target.model.lm_head                 # the target keeps its dense head
    assert isinstance(head, DraftInt4Weight) and isinstance(dense, torch.Tensor)
    shape = tuple(dense.shape)
    assert target.plan.request.draft_bytes == dense_q8_bytes(shape) == head.nbytes > 0
    assert draft.device_bytes == draft.model.layers.device_bytes + head.nbytes          # what peak_device_bytes adds
    hidden = torch.randn(4, shape[1])
    assert torch.allclose(head.matmul(hidden), hidden @ dense.T, atol=0.05 * float((hidden.abs() @ dense.abs().T).max()))
    assert draft_head(dense, torch.device("meta")) is dense                 # elsewhere the head is shared


def _self_decoder(target, draft, budget: int, slots: int = 1, temperature: float | None = None) -> Decoder:
    config = DecodeConfig(max_new_tokens=24, max_context=128, max_pass_tokens=64, max_slots=slots, max_depth=64,
                          greedy_growth_temperature=temperature)
    # unpriced: trees grow to the budget whatever this machine's timings (pricing has tests of its own)
    return Decoder(target.model, set(), config, SelfSpeculator(draft, 64, slots, priced=False), FixedBudget(budget))


@pytest.mark.parametrize("budget, temperature", [(2, None), (8, None), (32, None), (8, 0.1)])
def test_greedy_self_speculation_equals_target_only_decoding(streamed_target, budget, temperature, tmp_path,
                                                             monkeypatch):
    """Also where trees grow at a low temperature (deep argmax chains): verification never reads the scores."""
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path))
    target, settings = streamed_target
    draft = load_self_draft(target, settings)
    assert draft.model.layers.num_substitutes == 3
    plain = Decoder(target.model, set(), DecodeConfig(max_new_tokens=24, max_context=128, max_pass_tokens=64))
    decoder = _self_decoder(target, draft, budget, temperature=temperature)
    passes = 0
    for prompt in PROMPTS:
        plain.reset()
        decoder.reset()
        expected = plain.generate(prompt, SamplingConfig()).token_ids
        result = decoder.generate(prompt, SamplingConfig())
        assert result.token_ids == expected
        passes += result.stats.num_target_passes
    assert passes < 3 * 24                       # the substitutes' trees were accepted, not only root tokens


def test_a_batch_and_a_second_turn_decode_as_alone(streamed_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path))
    target, settings = streamed_target
    draft = load_self_draft(target, settings)
    plain = Decoder(target.model, set(), DecodeConfig(max_new_tokens=24, max_context=128, max_pass_tokens=64))
    expected = []
    for prompt in PROMPTS:
        plain.reset()
        expected.append(plain.generate(prompt, SamplingConfig()).token_ids)
    batch, answers = _self_decoder(target, draft, 8, slots=3), {}
    requests = [DecodeRequest(p, SamplingConfig(), 24, tag=i) for i, p in enumerate(PROMPTS)]
    batch.run(requests, lambda request, result, error: answers.setdefault(request.tag, result.token_ids))
    assert [answers[i] for i in range(3)] == expected
    single = _self_decoder(target, draft, 8)
    first = single.generate(PROMPTS[0], SamplingConfig())
    second_prompt = PROMPTS[0] + first.token_ids + [4, 4]
    second = single.generate(second_prompt, SamplingConfig())         # reuses the slot's committed keys
    plain.reset()
    assert second.stats.num_reused_tokens > 0
    assert second.token_ids == plain.generate(second_prompt, SamplingConfig()).token_ids


def test_substitutes_are_cached_and_a_damaged_file_is_made_again(streamed_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path))
    target, settings = streamed_target
    lines = []
    load_self_draft(target, settings, lines.append)
    assert any("3 substitute layers made" in line for line in lines)
    files = sorted((tmp_path / "substitutes").rglob("*.safetensors"))
    assert len(files) == 3
    made_error = float(lines[0].split("mean relative weight error ")[1].rstrip(")"))
    lines.clear()
    first = load_self_draft(target, settings, lines.append)
    assert lines == []                           # read back, not made, with the error each file records
    assert first.growth_temperature == growth_temperature(made_error)
    files[0].write_bytes(b"not a safetensors file")
    again = load_self_draft(target, settings, lines.append)
    assert any("1 substitute layers made" in line for line in lines)
    x = torch.randn(1, 3, 128)                   # [B, N, intermediate]
    layer = min(first.model.layers.substitutes)
    assert torch.equal(first.model.layers.get(layer)["down"].matmul(x), again.model.layers.get(layer)["down"].matmul(x))


def test_the_step_clock_prices_rounds_and_rows_in_tokens():
    clock = StepClock()
    assert clock.min_gain() == clock.min_node_gain() == clock.min_child_gain() == 0.0   # nothing measured
    clock.passed(40, 0.4, now=0.4)                   # a prompt's pass: before any step, a token is worth a pass
    assert clock.token_seconds == pytest.approx(0.4)
    assert clock.passes.per_row == pytest.approx(0.01)   # pessimistic until pass sizes spread: all of it per row
    for width, seconds in [(1, 0.012), (9, 0.028), (5, 0.020), (1, 0.012), (9, 0.028)]:
        clock.drafted(width, seconds)                # rounds: 10 ms fixed + 2 ms a row
    assert clock.rounds.fixed == pytest.approx(0.010) and clock.rounds.per_row == pytest.approx(0.002)
    clock.step_started(1.0)
    clock.passed(11, 0.11, now=1.5)                  # the step ends with its target pass
    clock.emitted(5)
    clock.step_started(9.0)                          # the time after the pass (a new prompt, say) is no step's
    assert clock.token_seconds == pytest.approx(0.1)
    assert clock.min_gain() == pytest.approx(0.1)
    assert clock.min_child_gain() == pytest.approx(clock.passes.per_row / 0.1)
    assert clock.min_node_gain() == pytest.approx((0.002 + clock.passes.per_row) / 0.1)


def test_a_cost_line_fits_rising_rows_and_ignores_a_falling_one():
    line = CostLine(pessimistic=True)
    line.add(37, 0.30)                               # a cold first pass ...
    line.add(101, 0.27)                              # ... then a larger, warm one: no row is free
    mean_rows, mean_seconds = 37 + 0.05 * (101 - 37), 0.30 + 0.05 * (0.27 - 0.30)    # exponential means
    assert line.per_row == pytest.approx(mean_seconds / mean_rows) and line.pessimistic
    for rows, seconds in [(10, 0.12), (100, 0.30), (50, 0.20)] * 40:
        line.add(rows, seconds)
    assert line.per_row == pytest.approx(0.002, rel=0.05) and line.fixed == pytest.approx(0.10, rel=0.1)


def test_pruning_drops_nodes_too_unlikely_to_pay_for_their_target_row():
    vocab = torch.arange(6)
    root = torch.log_softmax(torch.tensor([4.0, 1.5, 1.0, 0.5, 0.0, -0.5]), -1)
    growth = Growth(0, root, GrowthConfig(32, max_children=6, max_depth=1, min_child_gain=0.05), vocab)
    assert growth.next_round(1000).numel() == 0                 # depth 1: children added, none expanded
    tree, _ = growth.result()
    kept = torch.log_softmax(torch.tensor([4.0, 1.5, 1.0, 0.5, 0.0, -0.5]), -1).exp() >= 0.05
    assert tree.num_nodes == 1 + int(kept.sum()) < 7 and tree.parents[0] == -1


def test_growth_stops_where_a_round_cannot_earn_its_cost():
    vocab = torch.arange(6)
    root = torch.log_softmax(torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5]), -1)

    def grow(min_gain: float) -> int:
        growth = Growth(0, root, GrowthConfig(32, max_children=3, min_gain=min_gain), vocab)
        rounds = 0
        while (chosen := growth.next_round(1000)).numel():
            growth.expanded(chosen, root.expand(chosen.numel(), -1), 100 + 10 * rounds)
            rounds += 1
        return rounds

    assert grow(0.0) > grow(0.5) >= 1


@pytest.mark.parametrize("temperature", [None, 0.1])
def test_simulated_passes_equal_live_self_speculation(streamed_target, temperature, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path))
    target, settings = streamed_target
    draft = load_self_draft(target, settings)
    decoder = Decoder(target.model, set(), DecodeConfig(max_new_tokens=24, max_context=128, max_pass_tokens=64,
                                                         max_depth=64, greedy_growth_temperature=temperature),
                      SelfSpeculator(draft, 64, priced=False), FixedBudget(8))
    for prompt in PROMPTS:
        decoder.reset()
        live = decoder.generate(prompt, SamplingConfig())
        simulated = simulate_self(draft, target.model, prompt, live.token_ids, 8, 24, max_depth=64,
                                  greedy_growth_temperature=temperature)
        assert simulated == live.stats.num_target_passes - 1          # the prefill pass emits the first token


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    # layers large beside the self-draft's tree rows in the KV cache (a plan weighs one against the other)
    folder, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("auto"), "llama", seed=5, num_hidden_layers=8,
                                     vocab_size=64, hidden_size=128, intermediate_size=1024, num_key_value_heads=1)
    return add_tiny_tokenizer(folder, 64)


def _session(folder, gpu_mem, lines, **overrides):
    from runtime import RuntimeConfig, Session
    config = RuntimeConfig(str(folder), device="cpu", dtype="fp32", max_context=128, gpu_mem=gpu_mem, budget=8,
                           **overrides)
    return Session(config, on_status=lines.append)


def test_auto_drafts_with_the_target_itself_where_layers_stream(tiny_folder, tmp_path, monkeypatch):
    from runtime.models import weight_formats
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path))
    options = LoadOptions(str(tiny_folder), "cpu", "fp32", max_context=128, max_pass_tokens=512,
                          formats=weight_formats())
    options.substitute_layer_bytes = substitute_layer_bytes(load_model(options).config, SubstituteConfig(4), True)
    lines = []
    with _session(tiny_folder, streaming_device_budget(options, 1), lines) as session:    # no --draft: auto
        assert session.draft is not None and session.draft.is_self
        assert session.draft_name.startswith("self (4-bit substitutes")
        assert any(line.startswith("draft: self (auto: layers stream") for line in lines)
        ids = [5, 9, 2, 7]
        text, result = session.generate(ids, SamplingConfig(), 16)
    with _session(tiny_folder, streaming_device_budget(options, 1), [], no_draft=True) as plain:
        assert plain.generate(ids, SamplingConfig(), 16)[1].token_ids == result.token_ids


def test_a_resident_target_has_no_self_draft_and_bits_need_it(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path))
    lines = []
    with _session(tiny_folder, None, lines, draft="self") as session:
        assert session.draft is None
    assert any("every layer is resident" in line for line in lines)
    from runtime import RuntimeConfig
    with pytest.raises(ValueError, match="--draft-bits"):
        RuntimeConfig(str(tiny_folder), draft_bits=3)


def test_auto_choice_reads_the_measured_rates_of_the_default_pair():
    import json
    import re
    from importlib import resources
    from runtime.self_drafting import measured_draft_rates
    rates = measured_draft_rates()
    sources = json.loads(resources.files("perf").joinpath("data").joinpath("draft_choice.json").read_text())["source"]
    for tier in ("disk", "ram"):
        name = re.search(r"bench/results/(\S+\.json)", sources[tier]).group(1)       # the run the rates came from
        rows = json.loads((Path(__file__).parents[1] / "bench" / "results" / name).read_text())["rows"]
        assert rates[tier] == {"shipped": rows["shipped"]["speedup_vs_autoregressive"],
                               "self": rows["self"]["speedup_vs_autoregressive"]}


def test_a_substitute_no_smaller_than_its_layer_is_refused():
    config = ModelConfig.from_file(Path(__file__).parent / "fixtures" / "configs" / "llama-3.1-70b")
    request = request_from_config(config, 2, 24 * GIB, 64 * GIB)
    with pytest.raises(PlanError, match="no smaller than the resident layer"):
        make_plan(replace(request, substitute_layer_bytes=request.layer_bytes))


def test_the_plan_counts_the_self_drafts_tree_rows_in_the_kv_cache(streamed_target, tmp_path, monkeypatch):
    """The decoder's slot cache holds a context and a self-draft's tree per slot; the plan's KV item is its bytes."""
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path))
    target, settings = streamed_target
    speculator = SelfSpeculator(load_self_draft(target, settings), target.plan.request.max_tree)
    decoder = Decoder(target.model, set(), DecodeConfig(max_context=target.plan.request.max_context,
                                                        max_pass_tokens=64), speculator, FixedBudget(8))
    [kv] = [item for item in target.plan.items if item.component.startswith("KV cache")]
    assert "self-draft tree" in kv.component and kv.num_bytes == decoder.cache.num_bytes


def test_growth_temperature_follows_the_substitutes_error_and_the_request():
    assert [growth_temperature(e) for e in (0.0, 0.019, 0.139, 0.2, 0.322, None)] == [0.1, 0.1, 0.5, 1.0, 1.0, 1.0]
    config = DecodeConfig(greedy_growth_temperature=0.1)
    assert config.growth(64, 100).temperature == 0.1
    assert config.growth(64, 100, SamplingConfig(temperature=0.7)).temperature == 0.7     # the target's own
    assert DecodeConfig().growth(64, 100).temperature == 1.0
    with pytest.raises(ValueError, match="growth temperature must be > 0"):
        GrowthConfig(8, temperature=0.0)


def test_a_low_growth_temperature_grows_deeper_trees():
    """The same draft scores, sharpened: the argmax chain outranks the siblings and the tree deepens."""
    vocab = 50
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    logits[7] += 2.0
    depths = {}
    for temperature in (1.0, 0.1):
        growth = Growth(0, torch.log_softmax(logits / temperature, -1), GrowthConfig(64, 8, 8, 40, temperature=temperature),
                        torch.arange(vocab))
        while (chosen := growth.next_round(10_000)).numel():
            growth.expanded(chosen, torch.log_softmax(logits / temperature, -1).expand(chosen.numel(), -1), 0)
        depths[temperature] = int(growth.result()[0].depths.max())
    assert depths[0.1] > 2 * depths[1.0]


def test_rows_running_out_leave_the_best_line_its_depth():
    """A confident draft whose eight siblings stay within reach: wide rounds spend the cache rows, and the last
    ones go to the likely line, one a level, so it still reaches the depth cap (17-24 levels of 40 without)."""
    vocab = 50
    logits = torch.full((vocab,), -20.0)
    logits[:8] = torch.linspace(0.0, 2.0, 8)
    logits[7] = 6.0
    logprobs = torch.log_softmax(logits, -1)
    for rows in (60, 100, 300):
        growth, room, widths = Growth(0, logprobs, GrowthConfig(256, 64, 8, 40), torch.arange(vocab)), rows, []
        while (chosen := growth.next_round(room)).numel():
            growth.expanded(chosen, logprobs.expand(chosen.numel(), -1), rows - room)
            room -= chosen.numel()
            widths.append(chosen.numel())
        assert int(growth.result()[0].depths.max()) == 40 and room >= 0
        assert max(widths) > 8          # the rounds did grow wide first
