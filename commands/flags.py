"""Flags shared by commands, each declared once: the model (target, draft, device, dtype, memory) and sampling."""
from __future__ import annotations

import argparse

from offload.devices import DEVICE_NAMES, DTYPE_CHOICES

DEFAULT_MAX_NEW_TOKENS = 256


TARGET_HELP = "target model: HF folder, .gguf file or Hub id (default: embedded SmolLM2-135M-Instruct)"
DRAFT_HELP = ("draft for speculative decoding: self (the target with low-bit substitutes of its streamed layers), a "
              "distilled draft folder, or any model folder, .gguf or Hub id with the target's tokenizer (default: the "
              "target's shipped draft, if any)")


def add_target(parser, help: str = TARGET_HELP) -> None:
    parser.add_argument("--target", default=None, help=help)


def add_gguf_import(parser) -> None:
    parser.add_argument("--gguf-import", action="store_true",
                        help="convert a .gguf target once to a 16/32-bit safetensors folder (~3.3x the bytes of a "
                             "Q4_K_M file per streamed pass) instead of running its blocks in place (default: off)")


def add_cpu_kernel(parser) -> None:
    from offload.loader import CPU_KERNELS, DEFAULT_CPU_KERNEL
    parser.add_argument("--cpu-kernel", default=DEFAULT_CPU_KERNEL, choices=CPU_KERNELS,
                        help="on the CPU, a GGUF's Q4_0/Q4_1/Q4_K/Q5_*/Q6_K/Q8_0 matrices and a SpQR checkpoint's "
                             "w4 g32 ones: packed = multiplied as stored by torch's int4 kernel in bf16, ggml = a "
                             "GGUF's by ggml's kernels from its blocks (needs llama-cpp-python), auto = ggml for a GGUF "
                             "mostly of Q4_0/Q4_K where it is installed, else packed (speculation stays exact on "
                             f"each), dense = decoded to fp32 (default: {DEFAULT_CPU_KERNEL})")


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
    add_cpu_kernel(group)
    add_draft(group)
    group.add_argument("--no-draft", action="store_true", help="never use a draft model (default: off)")
    group.add_argument("--draft-bits", type=int, default=None, choices=(2, 3, 4),
                       help="--draft self: bits per substitute weight (default: the most that fit beside the resident "
                            "layers)")
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


MODEL_DEFAULTS_HELP = ("a setting not given is the model's own (a GGUF's general.sampling.* metadata, else its "
                       "generation_config.json), else specstream's default; --temperature 0 is plain greedy decoding "
                       "(the model's and specstream's settings then do not apply)")


def add_sampling_flags(parser: argparse.ArgumentParser, model_defaults: bool = False,
                       max_new_tokens_help: str = "tokens to generate at most",
                       max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> None:
    """Sampling flags; with model_defaults (chat, serve) a flag not given is None: the model's stated setting
    or specstream's default applies (runtime/sampling_defaults.py)."""
    from runtime.sampling_defaults import SPECSTREAM_DEFAULTS as ours
    group = parser.add_argument_group("sampling", MODEL_DEFAULTS_HELP if model_defaults else None)

    def add(flag: str, kind, name: str, greedy: float, help: str, off: str = "off") -> None:
        if model_defaults:
            default, note = None, f"(default: the model's, else {f'{ours[name]:g}' if name in ours else off})"
        else:
            default, note = greedy, f"(default: {greedy:g} = {off})"
        group.add_argument(flag, type=kind, default=default, help=f"{help} {note}")

    group.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                       help=f"{max_new_tokens_help} (default: {max_new_tokens})")
    add("--temperature", float, "temperature", 0.0, "0 = greedy decoding", off="greedy")
    add("--top-p", float, "top_p", 1.0, "nucleus sampling mass")
    add("--top-k", int, "top_k", 0, "sample among the k most likely")
    add("--min-p", float, "min_p", 0.0, "drop tokens below min-p x top prob")
    group.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")
    add("--repetition-penalty", float, "repetition_penalty", 1.0,
        "divide the logits of tokens already in the context by this (> 1 discourages repeats; speculation stays "
        "exact)")
    add("--presence-penalty", float, "presence_penalty", 0.0,
        "OpenAI's: subtract this from the logit of every token already in the answer")
    add("--frequency-penalty", float, "frequency_penalty", 0.0,
        "OpenAI's: subtract this times the token's count in the answer")
    group.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="end the answer before this text (repeatable; default: none)")


SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
                  "frequency_penalty")


def explicit_sampling(args) -> dict:
    """The sampling flags as given (None: not given, under model defaults)."""
    return {name: getattr(args, name) for name in SAMPLING_FLAGS}


def batch_size(text: str) -> int | None:
    """--batch-size: 'auto' (None) or a positive integer."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 'auto' or a positive integer, got {text!r}")
    return value
