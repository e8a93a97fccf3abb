"""Flags shared by commands, each declared once: the model (target, draft, device, dtype, memory) and sampling."""
from __future__ import annotations

import argparse

from offload.devices import DEVICE_NAMES, DTYPE_CHOICES

DEFAULT_MAX_NEW_TOKENS = 256


TARGET_HELP = "target model: HF folder, .gguf file or Hub id (default: embedded SmolLM2-135M-Instruct)"
DRAFT_HELP = ("draft for speculative decoding: a distilled draft folder, or any model folder, .gguf or Hub id with the "
              "target's tokenizer (default: the target's shipped draft, if any)")


def add_target(parser, help: str = TARGET_HELP) -> None:
    parser.add_argument("--target", default=None, help=help)


def add_gguf_import(parser) -> None:
    parser.add_argument("--gguf-import", action="store_true",
                        help="convert a .gguf target once to a 16/32-bit safetensors folder (~3.3x the bytes of a "
                             "Q4_K_M file per streamed pass) instead of running its blocks in place (default: off)")


def add_draft(parser, help: str = DRAFT_HELP) -> None:
    parser.add_argument("--draft", default=None, help=help)


def add_device(parser) -> None:
    parser.add_argument("--device", default="auto", choices=DEVICE_NAMES, help="compute device (default: auto)")


def add_dtype(parser, help: str = "compute dtype (default: auto = fp32 on CPU, bf16 on CUDA)") -> None:
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=help)


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """run, chat and batch: the model, its speculation and its memory."""
    group = parser.add_argument_group("model")
    add_target(group)
    add_gguf_import(group)
    add_draft(group)
    group.add_argument("--no-draft", action="store_true", help="never use a draft model (default: off)")
    group.add_argument("--judge", default=None,
                       help="AutoJudge file or 'default': also accept draft tokens it scores unimportant (lossy: "
                            "the answer may differ from the target's) (default: off, exact)")
    group.add_argument("--judge-threshold", type=float, default=None,
                       help="accept a mismatch when p(important) < this, in [0, 1] (default: the judge's "
                            "row that accepted 5%% of held-out mismatches)")
    group.add_argument("--budget", default="auto",
                       help="tree tokens verified per target pass, 1-8192, or auto: sized from the measured pass "
                            "time and recent acceptance (default: auto)")
    add_device(group)
    add_dtype(group)
    group.add_argument("--context", type=int, default=4096, help="KV cache size in tokens (default: 4096)")
    group.add_argument("--gpu-mem", default=None,
                       help="device memory budget, e.g. 24GiB (default: free device memory minus a margin)")
    group.add_argument("--ram", default=None,
                       help="host RAM budget for streamed layers, e.g. 64GiB (default: available minus a margin)")
    group.add_argument("--disk-cold", action="store_true",
                       help="drop the weights' page cache before each pass, to measure SSD streaming (default: off)")
    group.add_argument("--download", action="store_true",
                       help="allow downloading a Hub model that is not in the local cache (default: off)")


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                       help=f"tokens to generate at most (default: {DEFAULT_MAX_NEW_TOKENS})")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy decoding (default: 0)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0 = off)")
    group.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (default: 0 = off)")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x top prob (default: 0 = off)")
    group.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")
    group.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="divide the logits of tokens already in the context by this (> 1 discourages "
                            "repeats; speculation stays exact) (default: 1.0 = off)")
    group.add_argument("--presence-penalty", type=float, default=0.0,
                       help="OpenAI's: subtract this from the logit of every token already in the answer "
                            "(default: 0 = off)")
    group.add_argument("--frequency-penalty", type=float, default=0.0,
                       help="OpenAI's: subtract this times the token's count in the answer (default: 0 = off)")
    group.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="end the answer before this text (repeatable; default: none)")
