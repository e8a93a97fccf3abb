"""Greedy output of our engine vs transformers `generate(do_sample=False)` for every chat prompt.

    .venv/bin/python bench/golden_check.py [--max-new-tokens 64] [--prompts textdata/chat/prompts.jsonl]
Prints one JSON line per prompt and a summary line; exits 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from offload import LoadOptions  # noqa: E402
from runtime.models import load_model  # noqa: E402
from offload.weights.resolve import resolve_model  # noqa: E402
from spec import DecodeConfig, Decoder, SamplingConfig  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=Path, default=Path(__file__).parents[1] / "textdata/chat/prompts.jsonl")
    parser.add_argument("--target", default=None)
    args = parser.parse_args()
    ours = load_model(LoadOptions(args.target, device="cpu", dtype="fp32"))
    reference = resolve_model(args.target, gguf_import=True)   # transformers reads the dequantized import
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    decoder = Decoder(ours.model, ours.stop_ids, DecodeConfig(args.max_new_tokens, 2048))
    num_same = 0
    prompts = [json.loads(line) for line in args.prompts.open()]
    for prompt in prompts:
        ids = ours.tokenizer.encode_chat([{"role": "user", "content": prompt["prompt"]}])
        got = decoder.generate(ids, SamplingConfig()).token_ids
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens,
                                         do_sample=False)[0, len(ids):].tolist()
        same = got == expected
        num_same += same
        print(json.dumps({"id": prompt["id"], "identical": same, "num_tokens": len(got)}), flush=True)
    print(json.dumps({"prompts": len(prompts), "identical": num_same, "max_new_tokens": args.max_new_tokens}))
    return 0 if num_same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
