"""Greedy output of our engine against transformers `generate(do_sample=False)` on the embedded default model
(was bench/golden_check.py): a writing and a code prompt, 32 tokens each (tests/test_e2e_default.py holds
"What is 2+2?"). The full check (every chat prompt x 64 tokens, bench/results/golden_check.jsonl: 44 / 44)
is the same test with GOLDEN_ALL=1 (about 2 minutes on 2 cores)."""
import json
import os

import pytest
import torch

import textdata
from offload import LoadOptions
from offload.weights.resolve import resolve_model
from runtime.models import load_model
from spec import DecodeConfig, Decoder, SamplingConfig

pytestmark = pytest.mark.e2e
PROMPTS = [json.loads(line) for line in textdata.path(textdata.CHAT_PROMPTS).open()]
EVERY = os.environ.get("GOLDEN_ALL") == "1"
MAX_NEW_TOKENS = 64 if EVERY else 32
SAMPLE = PROMPTS if EVERY else [p for p in PROMPTS if p["id"] in ("writing-013", "code-023")]


@pytest.fixture(scope="module")
def engines():
    transformers = pytest.importorskip("transformers")
    ours = load_model(LoadOptions(None, device="cpu", dtype="fp32"))
    reference = resolve_model(None, gguf_import=True)   # transformers reads the dequantized import
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    decoder = Decoder(ours.model, ours.stop_ids, DecodeConfig(MAX_NEW_TOKENS, 2048))
    return ours, decoder, hf_model


@pytest.mark.parametrize("prompt", SAMPLE, ids=lambda p: p["id"])
def test_greedy_output_equals_transformers_generate(engines, prompt):
    ours, decoder, hf_model = engines
    ids = ours.tokenizer.encode_chat([{"role": "user", "content": prompt["prompt"]}])
    got = decoder.generate(ids, SamplingConfig()).token_ids
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS,
                                     do_sample=False)[0, len(ids):].tolist()
    assert got == expected and len(got) > 1
