"""Batched vs alone, token for token, on the embedded default pair (was bench/batch_exactness.py): chat
prompts answered greedily one at a time (Decoder), then together in a packed batch with fewer slots than
prompts (the same Decoder with more slots: a finished sequence's slot takes the next prompt), with and without
speculation."""
import json

import pytest

import textdata
from offload import LoadOptions
from runtime.models import load_model
from spec import (DecodeConfig, Decoder, DecodeRequest, FixedBudget, SamplingConfig, Speculator, default_draft_for,
                  load_any_draft)

pytestmark = pytest.mark.e2e
CONTEXT, PASS = 2048, 512
NUM_PROMPTS, BATCH_SIZE, MAX_NEW_TOKENS, BUDGET = 3, 2, 12, 16


@pytest.fixture(scope="module")
def pair():
    target = load_model(LoadOptions(None, device="cpu", dtype="fp32", max_context=CONTEXT, max_pass_tokens=PASS,
                                    num_sequences=BATCH_SIZE))
    draft = load_any_draft(str(default_draft_for(None)), target, LoadOptions(device="cpu", max_context=CONTEXT))
    rows = [json.loads(line) for line in textdata.path(textdata.CHAT_PROMPTS).read_text().splitlines()]
    prompts = [target.tokenizer.encode_chat([{"role": "user", "content": row["prompt"]}])
               for row in rows[::len(rows) // NUM_PROMPTS][:NUM_PROMPTS]]       # spread over the categories
    return target, draft, prompts


@pytest.mark.parametrize("budget", [1, BUDGET], ids=["autoregressive", "speculative"])
def test_batched_answers_equal_answers_alone(pair, budget):
    target, draft, prompts = pair
    expected = _alone(target, draft, prompts, budget)
    assert _batched(target, draft, prompts, budget) == expected
    assert len(expected) == NUM_PROMPTS and all(len(answer) > 1 for answer in expected)


def _alone(target, draft, prompts, budget) -> list[list[int]]:
    speculator = Speculator(draft, CONTEXT, budget, PASS) if budget > 1 else None
    decoder = Decoder(target.model, target.stop_ids, DecodeConfig(MAX_NEW_TOKENS, CONTEXT, PASS), speculator,
                      FixedBudget(budget))
    answers = []
    for ids in prompts:
        decoder.reset()
        answers.append(decoder.generate(ids, SamplingConfig()).token_ids)
    return answers


def _batched(target, draft, prompts, budget) -> list[list[int]]:
    speculator = Speculator(draft, CONTEXT, PASS, PASS, BATCH_SIZE) if budget > 1 else None
    decoder = Decoder(target.model, target.stop_ids, DecodeConfig(max_context=CONTEXT, max_pass_tokens=PASS,
                      max_slots=BATCH_SIZE), speculator, FixedBudget(budget * BATCH_SIZE))
    answers: dict[int, list[int]] = {}
    requests = [DecodeRequest(ids, SamplingConfig(), MAX_NEW_TOKENS, tag=i) for i, ids in enumerate(prompts)]
    decoder.run(requests, lambda request, result, error: answers.__setitem__(request.tag, result.token_ids))
    return [answers[i] for i in range(len(prompts))]
