"""Greedy speculation with the default pair against target-only greedy decoding, token for token, at a fixed
budget and at the auto budget (was bench/spec_exactness.py): two MT-Bench first turns, 24 tokens each
(tests/test_e2e_speculative.py samples chat prompts at budgets 8 and 48). SPEC_EXACTNESS_ALL=1 runs every chat
prompt and MT-Bench first turn at 128 tokens, the auto budget up to 1,024 (hours on 2 cores)."""
import json
import os

import pytest

import textdata
from offload import LoadOptions
from perf.probe import auto_budget
from perf.tree_size import parse_budget
from runtime.models import load_model
from spec import DecodeConfig, Decoder, FixedBudget, SamplingConfig, Speculator, default_draft_for, load_any_draft

pytestmark = pytest.mark.e2e
EVERY = os.environ.get("SPEC_EXACTNESS_ALL") == "1"
MAX_NEW_TOKENS = 128 if EVERY else 24
BUDGETS = [parse_budget(b) for b in ("16", "auto")]
MAX_BUDGET = 1024 if EVERY else 64          # the auto budget's largest tree (its pass-time probe goes this far)
SAMPLE_IDS = {"81", "121"}     # MT-Bench writing and coding


def prompts() -> list[tuple[str, str]]:
    out = []
    for path in (textdata.path(textdata.CHAT_PROMPTS), textdata.path(textdata.MT_BENCH)):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out.append((str(row.get("id", row.get("question_id"))), row.get("prompt") or row["turns"][0]))
    return out if EVERY else [p for p in out if p[0] in SAMPLE_IDS]


@pytest.fixture(scope="module")
def decoders():
    max_budget = MAX_BUDGET
    target = load_model(LoadOptions(None, device="cpu", dtype="fp32", max_context=2048,
                                    max_pass_tokens=max(512, max_budget)))
    draft = load_any_draft(str(default_draft_for(None)), target, LoadOptions(device="cpu", max_context=2048))
    config = DecodeConfig(MAX_NEW_TOKENS, 2048, max_pass_tokens=max(512, max_budget))
    reference = Decoder(target.model, target.stop_ids, config)
    decoders = {b: Decoder(target.model, target.stop_ids, config, Speculator(draft, 2048, b or max_budget),
                           FixedBudget(b) if b else auto_budget(target, max_budget)) for b in BUDGETS}
    return target, reference, decoders


def test_the_sample_is_found_in_both_prompt_files():
    assert {prompt_id for prompt_id, _ in prompts()} >= SAMPLE_IDS


@pytest.mark.parametrize("prompt", prompts(), ids=lambda p: p[0])
def test_greedy_speculation_equals_target_greedy(decoders, prompt):
    target, reference, by_budget = decoders
    ids = target.tokenizer.encode_chat([{"role": "user", "content": prompt[1]}])
    expected = reference.generate(ids, SamplingConfig()).token_ids
    results = {budget or "auto": decoder.generate(ids, SamplingConfig()) for budget, decoder in by_budget.items()}
    assert {budget: result.token_ids for budget, result in results.items()} == {budget: expected for budget in results}
    assert results[16].stats.tokens_per_pass > 1          # the tree was used (auto may choose no tree on a CPU)
