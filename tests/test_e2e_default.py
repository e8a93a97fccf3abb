"""End-to-end checks on the embedded default model against transformers (the independent reference)."""
import json
from pathlib import Path

import pytest

import textdata
import torch

from offload import LoadOptions, load_model
from offload.weights.resolve import resolve_model
from spec import DecodeConfig, Decoder, SamplingConfig

pytestmark = pytest.mark.e2e
PROMPTS = [json.loads(line) for line in textdata.path(textdata.CHAT_PROMPTS).open()]
SAMPLE_IDS = {"general-001", "writing-013", "code-023", "math-035"}


@pytest.fixture(scope="module")
def ours():
    return load_model(LoadOptions(device="cpu", dtype="fp32"))


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    folder = resolve_model(None, gguf_import=True)   # transformers reads the dequantized import
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return transformers.AutoTokenizer.from_pretrained(folder), model


def _greedy(loaded, prompt_ids, max_new_tokens=64):
    decoder = Decoder(loaded.model, loaded.stop_ids, DecodeConfig(max_new_tokens, 1024))
    return decoder.generate(prompt_ids, SamplingConfig()).token_ids


def test_golden_greedy_answer(ours):
    ids = ours.tokenizer.encode_chat([{"role": "user", "content": "What is 2+2?"}])
    text = ours.tokenizer.decode(_greedy(ours, ids, 32))
    assert text == "The answer to this classic math problem is 4."


def test_chat_template_matches_transformers_for_every_prompt(ours, reference):
    hf_tokenizer, _ = reference
    for prompt in PROMPTS:
        for messages in ([{"role": "user", "content": prompt["prompt"]}],
                         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt["prompt"]}]):
            expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
            assert ours.tokenizer.encode_chat(messages) == list(expected), prompt["id"]


def test_prefill_logits_match_transformers(ours, reference):
    _, hf_model = reference
    ids = ours.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[0]["prompt"]}])
    cache = ours.model.new_cache(256)
    logits = ours.model.forward(torch.tensor([ids]), cache).logits
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("prompt", [p for p in PROMPTS if p["id"] in SAMPLE_IDS], ids=lambda p: p["id"])
def test_greedy_64_tokens_identical_to_transformers_generate(ours, reference, prompt):
    _, hf_model = reference
    ids = ours.tokenizer.encode_chat([{"role": "user", "content": prompt["prompt"]}])
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
    expected = out[0, len(ids):].tolist()
    assert _greedy(ours, ids) == expected


def test_repetition_penalty_matches_transformers_and_speculation_stays_exact(ours, reference):
    """Greedy with repetition_penalty=1.3: ours one token per pass = transformers' generate; speculation with
    the shipped draft (trees of 16) = ours one token per pass; and the penalty changes the answer."""
    from spec import FixedBudget, Speculator, default_draft_for, load_any_draft
    _, hf_model = reference
    ids = ours.tokenizer.encode_chat([{"role": "user", "content": "List ten fruits, one per line."}])
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False, repetition_penalty=1.3)
    penalized = SamplingConfig(repetition_penalty=1.3)
    plain = Decoder(ours.model, ours.stop_ids, DecodeConfig(48, 1024)).generate(ids, penalized).token_ids
    assert plain == out[0, len(ids):].tolist() and plain != _greedy(ours, ids, 48)
    draft = load_any_draft(str(default_draft_for(None)), ours, LoadOptions(device="cpu", dtype="fp32"))
    speculative = Decoder(ours.model, ours.stop_ids, DecodeConfig(48, 1024), Speculator(draft, 1024, 16),
                          FixedBudget(16)).generate(ids, penalized)
    assert speculative.token_ids == plain and speculative.stats.tokens_per_pass > 1
