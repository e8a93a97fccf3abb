"""Batched decoding on tiny random pairs: every sequence's answer in a packed batch is token for token its
answer alone (Decoder, one sequence), with and without trees, for ragged prompts, early finishers, joiners
(more prompts than slots), chunked prefills, stop conditions, penalties and seeded sampling."""
import pytest
import torch

from conftest import add_tiny_tokenizer, make_tiny_checkpoint, perturbed_copy
from offload import LoadOptions, load_model
from offload.model.masks import causal_mask
from offload.model.slots import SlotCache, block_mask
from spec import (DecodeConfig, Decoder, DecodeRequest, FixedBudget, FixedTree, SamplingConfig, Speculator,
                  load_any_draft)

VOCAB = 48
CONTEXT = 160
PASS = 64
PROMPTS = [[3, 9, 27, 5], [11, 2, 40, 40, 7, 1, 19], [6], list(range(2, 40)), [5, 5, 5]]
MAX_NEW = [20, 7, 30, 12, 25]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("batched")
    folder, _ = make_tiny_checkpoint(root / "target", "llama", seed=1, vocab_size=VOCAB, num_hidden_layers=3)
    add_tiny_tokenizer(folder, VOCAB)
    draft_folder = perturbed_copy(folder, root / "draft", 0.15, 1)
    target = load_model(LoadOptions(str(folder), device="cpu", dtype="fp32", max_context=CONTEXT,
                                    max_pass_tokens=PASS))
    draft = load_any_draft(str(draft_folder), target, LoadOptions(device="cpu", dtype="fp32", max_context=CONTEXT))
    return target, draft


def alone(pair, prompt, max_new, budget=1, sampling=None, stop=None, stop_ids=None):
    target, draft = pair
    speculator = Speculator(draft, CONTEXT, budget, PASS) if budget > 1 else None
    decoder = Decoder(target.model, target.stop_ids if stop_ids is None else stop_ids,
                      DecodeConfig(max_new, CONTEXT, PASS), speculator, FixedBudget(budget))
    return decoder.generate(prompt, sampling or SamplingConfig(), stop=stop)


def batched(pair, requests, slots, budget=1, max_pass_tokens=PASS, stop_ids=None, shared=FixedTree):
    target, draft = pair
    speculator = Speculator(draft, CONTEXT, max(budget, 1), max_pass_tokens, slots) if budget > 1 else None
    decoder = Decoder(target.model, target.stop_ids if stop_ids is None else stop_ids,
                      DecodeConfig(max_context=CONTEXT, max_pass_tokens=max_pass_tokens, max_slots=slots), speculator,
                      shared(budget))
    results, order = {}, []

    def on_finish(request, result, error):
        results[request.tag] = result if result is not None else error
        order.append(request.tag)

    decoder.run(requests, on_finish)
    return [results[i] for i in range(len(requests))], order, decoder


def requests(sampling=None, stop=None, max_new=MAX_NEW, prompts=PROMPTS):
    samplings = sampling if isinstance(sampling, list) else [sampling or SamplingConfig()] * len(prompts)
    return [DecodeRequest(p, s, m, stop, tag=i) for i, (p, m, s) in enumerate(zip(prompts, max_new, samplings))]


def test_a_packed_pass_over_two_slots_gives_each_sequence_its_own_logits(pair):
    """The forward over a SlotCache (block mask, per-slot positions) against one KVCache pass per sequence."""
    model = pair[0].model
    first, second = [3, 9, 27, 5, 8], [11, 2, 40]
    cache = SlotCache(model.config, 3, CONTEXT, model.device, model.dtype)
    cache.begin([(2, len(first)), (0, len(second))])
    tokens = torch.tensor([first + second])
    positions = torch.cat((torch.arange(len(first)), torch.arange(len(second))))[None]
    mask = block_mask([causal_mask(0, len(first), model.device), causal_mask(0, len(second), model.device)])
    packed = model.forward(tokens, cache, positions, mask).logits[0]
    for ids, rows in ((first, slice(0, 5)), (second, slice(5, 8))):
        alone_logits = model.forward(torch.tensor([ids]), model.new_cache(CONTEXT)).logits[0]
        torch.testing.assert_close(packed[rows], alone_logits, rtol=1e-5, atol=1e-5)
    cache.commit(2)
    cache.commit(0, [0, 2])                  # keeps tokens 11 and 40 of the second sequence
    assert cache.lengths == [2, 0, 5] and [p.numel() for p in cache.pending] == [0, 0, 0]


@pytest.mark.parametrize("split", [True, False])
def test_attention_block_by_block_equals_one_masked_attention(pair, monkeypatch, split):
    """Past SPLIT_MIN_SAVED the layer attends per sequence over its own keys; both ways give each
    sequence the logits of its own pass alone, and the cache says which way it went."""
    import offload.model.slots as slots_module
    monkeypatch.setattr(slots_module, "SPLIT_MIN_SAVED", 0 if split else 1 << 40)
    model = pair[0].model
    prompts = [[3, 9, 27, 5, 8, 1, 4], [11, 2, 40], [6, 6, 7, 30]]
    cache = SlotCache(model.config, 4, CONTEXT, model.device, model.dtype)
    cache.begin([(3, 7), (1, 3), (0, 4)])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])[None]
    mask = block_mask([causal_mask(0, len(p), model.device) for p in prompts])
    packed = model.forward(torch.tensor([sum(prompts, [])]), cache, positions, mask).logits[0]
    assert cache.segments() == ([(0, 7, 0, 7), (7, 10, 7, 10), (10, 14, 10, 14)] if split else None)
    start = 0
    for ids in prompts:
        alone_logits = model.forward(torch.tensor([ids]), model.new_cache(CONTEXT)).logits[0]
        torch.testing.assert_close(packed[start:start + len(ids)], alone_logits, rtol=1e-5, atol=1e-5)
        start += len(ids)


def test_a_pass_splits_its_attention_only_where_that_saves_enough():
    from offload.model.slots import SPLIT_MIN_SAVED, _worth_splitting
    decode_step = [(i, i + 1, 300 * i, 300 * (i + 1)) for i in range(16)]     # 16 x 1 token over 300 keys
    assert not _worth_splitting(decode_step)            # 72k entries saved: not worth 15 more calls
    trees = [(64 * i, 64 * (i + 1), 364 * i, 364 * (i + 1)) for i in range(16)]   # 16 trees of 64 tokens
    assert _worth_splitting(trees) and 1024 * 5824 - 16 * 64 * 364 > 15 * SPLIT_MIN_SAVED
    assert not _worth_splitting(trees[:1])


@pytest.mark.parametrize("budget", [1, 8])
@pytest.mark.parametrize("slots", [1, 2, 3, 5])
def test_greedy_answers_in_a_batch_equal_their_answers_alone(pair, budget, slots):
    reference = [alone(pair, p, m, budget) for p, m in zip(PROMPTS, MAX_NEW)]
    results, order, decoder = batched(pair, requests(), slots, budget)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    assert [r.stats.stop_reason for r in results] == [r.stats.stop_reason for r in reference]
    if slots > 1:
        assert order != list(range(len(PROMPTS)))          # short answers finish first and leave
        assert decoder.num_passes < sum(MAX_NEW)           # passes are shared


@pytest.mark.parametrize("budget", [1, 6])
def test_stop_tokens_end_each_sequence_where_it_ends_alone(pair, budget):
    free = alone(pair, PROMPTS[0], 30, stop_ids=set()).token_ids
    stop_ids = {free[5], free[11]}
    reference = [alone(pair, p, 30, stop_ids=stop_ids) for p in PROMPTS]
    results, _, _ = batched(pair, requests(max_new=[30] * 5), 3, budget, stop_ids=stop_ids)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    assert [r.stats.stop_reason for r in results] == [r.stats.stop_reason for r in reference]
    assert "eos" in [r.stats.stop_reason for r in results]


class EndsAfter:
    """A StopCondition that holds once the answer ends with `tail` (as a stop string's text would)."""

    def __init__(self, tail: list[int]) -> None:
        self.tail = tail

    def reached(self, answer_ids: list[int]) -> bool:
        return answer_ids[-len(self.tail):] == self.tail


def test_stop_conditions_and_penalties_act_per_sequence(pair):
    free = alone(pair, PROMPTS[1], 30, stop_ids=set()).token_ids
    stop = EndsAfter(free[3:5])
    samplings = [SamplingConfig(repetition_penalty=1.5), SamplingConfig(), SamplingConfig(presence_penalty=1.0),
                 SamplingConfig(frequency_penalty=0.5, repetition_penalty=1.2), SamplingConfig()]
    items = requests(samplings)
    items[1].stop = stop
    reference = [alone(pair, r.prompt_ids, r.max_new_tokens, 8, r.sampling, r.stop).token_ids for r in items]
    results, _, _ = batched(pair, items, 3, 8)
    assert [r.token_ids for r in results] == reference
    assert results[1].stats.stop_reason == "stop_string"


@pytest.mark.parametrize("budget", [1, 4])
def test_seeded_sampling_does_not_depend_on_the_batch(pair, budget):
    """Each sequence draws with its own seed's position-keyed uniforms, as Decoder does alone; the shared
    budget splits a pass between the sequences, so each tree's size depends on the batch (1 to 4 slots),
    and the answers must not."""
    samplings = [SamplingConfig(temperature=0.9, top_p=0.95, seed=seed) for seed in (1, 2, 3, 4, 5)]
    reference = [alone(pair, p, m, budget, s).token_ids for p, m, s in zip(PROMPTS, MAX_NEW, samplings)]
    for slots in (1, 4):
        results, _, _ = batched(pair, requests(samplings), slots, 4 * budget, shared=FixedBudget)
        assert [r.token_ids for r in results] == reference, slots
    other_seeds = [SamplingConfig(temperature=0.9, top_p=0.95, seed=seed) for seed in (6, 7, 8, 9, 10)]
    results, _, _ = batched(pair, requests(other_seeds), 4, 4 * budget, shared=FixedBudget)
    assert [r.token_ids for r in results] != reference     # the seed matters


def test_long_prompts_prefill_in_chunks_alongside_decoding(pair):
    """A pass of 12 tokens: a 38-token prompt joins over several passes while the others decode."""
    reference = [alone(pair, p, m, 4).token_ids for p, m in zip(PROMPTS, MAX_NEW)]
    results, _, decoder = batched(pair, requests(), 3, 4, max_pass_tokens=12, shared=FixedBudget)
    assert [r.token_ids for r in results] == reference
    assert decoder.speculator.cache.num_seq_slots == 3


def test_a_request_that_cannot_run_gets_an_error_and_the_rest_go_on(pair):
    items = requests()
    items[2].prompt_ids = []
    results, _, _ = batched(pair, items, 2)
    assert results[2] == "the prompt is empty"
    assert results[0].token_ids == alone(pair, PROMPTS[0], MAX_NEW[0]).token_ids


def test_the_planner_sizes_kv_slots_and_refuses_a_batch_that_does_not_fit():
    from dataclasses import replace
    from pathlib import Path

    from offload.byte_units import GIB
    from offload.cache_sizes import kv_cache_bytes
    from offload.model.config import ModelConfig
    from offload.planner import PlanError, largest_batch, make_plan, request_from_config
    config = ModelConfig.from_file(Path(__file__).parent / "fixtures" / "configs" / "llama-3.1-70b")
    request = request_from_config(config, 2, 24 * GIB, 64 * GIB, max_context=4096, max_tree=512)
    one = make_plan(request)
    largest = largest_batch(request)
    assert 1 < largest < 1024
    many = make_plan(replace(request, num_sequences=largest))
    kv = next(i for i in many.items if i.component.startswith("KV cache"))
    assert kv.num_bytes == kv_cache_bytes(config, largest * 4096, 2)
    assert many.tier_of.count("device") < one.tier_of.count("device")     # slots take resident layers' room
    with pytest.raises(PlanError, match=f"the largest that fits is {largest} ") as error:
        make_plan(replace(request, num_sequences=largest + 1))
    assert "\n" not in str(error.value)


def test_run_batch_writes_each_line_as_its_request_ends_and_resumes(tmp_path):
    import json

    from runtime.batch import run_batch
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join([json.dumps({"id": str(i), "prompt": "x" * (5 - i)}) for i in range(4)]
                                + ['{"custom_id": "e", "url": "/v1/embeddings", "body": {"messages": '
                                   '[{"role": "user", "content": "q"}]}}', "garbage"]) + "\n")
    calls = []

    def generate_many(jobs, on_done):          # short prompts finish first; one request fails
        calls.append([item.id for item, _, _ in jobs])
        for item, sampling, max_tokens in sorted(jobs, key=lambda job: len(job[0].messages[0]["content"])):
            on_done(item, "too long" if item.id == "0" else
                    ("ok", {"num_prompt_tokens": 1, "num_new_tokens": max_tokens, "stop_reason": "length"}))
            if item.id == "2":
                raise KeyboardInterrupt            # kill mid-batch: lines written so far stay
    with pytest.raises(KeyboardInterrupt):
        run_batch(source, out, None, SamplingConfig(), 8, "m", generate_many=generate_many)
    assert [json.loads(line)["custom_id"] for line in out.read_text().splitlines()] == ["e", "3", "2"]
    summary = run_batch(source, out, None, SamplingConfig(), 8, "m", generate_many=generate_many)
    assert calls[-1] == ["0", "1"] and summary.num_done_before == 3
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == ["e", "3", "2", "1", "0"]
    assert rows[-1]["error"]["message"] == "too long" and summary.num_failed == 1


def test_auto_batch_size_stops_where_more_sequences_add_no_throughput():
    """By hand, t(B) = 0.7 + 0.3 B up to 16: B / t(B) is 2.909 at 16, 98% of it 2.851; 14 / 4.9 = 2.857
    reaches it, 13 / 4.6 = 2.826 does not. A flat curve (streamed weights) takes the largest; a pass time
    proportional to its tokens (compute-bound) gains nothing from batching; a noisy dip does not stop it."""
    from perf.pass_curve import PassTimeCurve
    from perf.probe import throughput_batch
    assert throughput_batch(PassTimeCurve([(1, 1.0), (16, 5.5)]), 16) == 14
    assert throughput_batch(PassTimeCurve([(1, 1.0), (64, 1.0)]), 32) == 32
    assert throughput_batch(PassTimeCurve([(1, 0.1), (32, 3.2)]), 32) == 1
    assert throughput_batch(PassTimeCurve([(1, 1.0), (16, 5.5)]), 2) == 2
    noisy = PassTimeCurve([(1, 0.036), (2, 0.062), (4, 0.056), (8, 0.052), (16, 0.063), (32, 0.086)])
    assert throughput_batch(noisy, 6) == 6      # the default model's measured curve, batch of six lines
    with pytest.raises(ValueError):
        throughput_batch(PassTimeCurve([(1, 1.0)]), 0)
