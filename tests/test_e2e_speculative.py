"""The default pair: greedy speculation with the shipped draft gives target-only greedy output token for
token (a sample of the chat prompts here; every chat and MT-Bench prompt in tests/test_spec_exactness.py)."""
import json
from pathlib import Path

import pytest

import textdata

from offload import LoadOptions, load_model
from spec import DecodeConfig, Decoder, FixedBudget, SamplingConfig, Speculator, default_draft_for, load_any_draft

pytestmark = pytest.mark.e2e
PROMPTS = [json.loads(line) for line in textdata.path(textdata.CHAT_PROMPTS).open()]
SAMPLE_IDS = {"general-002", "writing-014", "code-024", "math-036"}


@pytest.fixture(scope="module")
def pair():
    target = load_model(LoadOptions(device="cpu", dtype="fp32", max_context=1024))
    return target, load_any_draft(str(default_draft_for(None)), target, LoadOptions(device="cpu", max_context=1024))


@pytest.mark.parametrize("prompt", [p for p in PROMPTS if p["id"] in SAMPLE_IDS], ids=lambda p: p["id"])
def test_greedy_speculation_is_token_identical_to_target_greedy(pair, prompt):
    target, draft = pair
    ids = target.tokenizer.encode_chat([{"role": "user", "content": prompt["prompt"]}])
    reference = Decoder(target.model, target.stop_ids, DecodeConfig(64, 1024)).generate(ids, SamplingConfig())
    for budget in (8, 48):
        decoder = Decoder(target.model, target.stop_ids, DecodeConfig(64, 1024), Speculator(draft, 1024, budget),
                          FixedBudget(budget))
        result = decoder.generate(ids, SamplingConfig())
        assert result.token_ids == reference.token_ids, budget
        assert result.stats.num_steps < reference.stats.num_steps
