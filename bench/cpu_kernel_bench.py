"""The CPU's packed int4 kernel against today's dense fp32 decode, side by side in one run on the same GGUF
(the embedded default model unless --target): every figure is a ratio of two timings taken alternately.

    python cli.py bench cpu-kernel --parts crossover,decode,stream,quality --out FILE.json

crossover  one pass of M new tokens (M = 1..512) after a 128-token context: packed / dense seconds
decode     greedy one-token decoding, resident: tokens per second, packed and dense (prefill excluded), and
           with --llama-cpp llama.cpp on the same file, prompt ids and threads
prefill    one pass of N prompt tokens (N = 64..4,096), packed: all rows as tree rows (float64 attention, int4
           products), prompt rows attending in fp32, and attending in fp32 with dense products (row_split.py);
           the dense fp32 model beside them
context    one-token steps after 100-1,900 tokens: packed attending in float64 (exact), in fp32, and dense
stream     every layer streamed from RAM: one-token pass seconds; and one layer repacked vs decoded
quality    perplexity on held-out code, prose and math (bench quant's texts), greedy answers to the chat
           prompts identical to dense fp32, and packed speculation (the default draft) identical to packed
           one-token decoding
`specstream bench cpu-kernel` runs it (flags: commands/bench_cpu_flags.py): one summary line, then the JSON (also
written to --out, indented, with the command that made it)."""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

import textdata
from offload import LoadOptions
from offload.loader import streaming_device_budget
from offload.weights.row_split import NEVER, PromptRouting
from runtime.models import load_model

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("dense", "packed")
PARTS = ("crossover", "prefill", "decode", "context", "stream", "quality")
PEERS_PYTHON = "peers"                   # --llama-cpp without a value: .venv-peers
PASS_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CONTEXT = 128
PREFILL_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096)
ROUTINGS = {"packed": PromptRouting(NEVER, NEVER), "fp32_attention": PromptRouting(1, NEVER),
            "fp32_attention_dense": PromptRouting(1, 1)}


def _load(target: str | None, kernel: str, **kwargs):
    return load_model(LoadOptions(target, device="cpu", dtype="fp32", cpu_kernel=kernel, max_context=2048,
                                  max_pass_tokens=512, **kwargs))


def _alternate(run: dict, repeats: int) -> dict:
    """kernel -> median seconds of run[kernel](), the kernels taken in turn `repeats` times after a warm-up."""
    times = {kernel: [] for kernel in run}
    for kernel in run:
        run[kernel]()
    for _ in range(repeats):
        for kernel, call in run.items():
            start = time.perf_counter()
            call()
            times[kernel].append(time.perf_counter() - start)
    return {kernel: statistics.median(values) for kernel, values in times.items()}


def _pass(model, context: torch.Tensor, num_tokens: int):
    cache = model.new_cache(CONTEXT + num_tokens + 1)
    model.forward(context, cache)
    cache.commit()
    tokens = torch.randint(0, model.config.vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(1))
    return lambda: (cache.truncate(CONTEXT), model.forward(tokens, cache))


def crossover(models: dict, repeats: int) -> dict:
    context = torch.randint(0, 1000, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    rows = []
    for num_tokens in PASS_TOKENS:
        seconds = _alternate({k: _pass(m.model, context, num_tokens) for k, m in models.items()},
                             repeats if num_tokens <= 64 else max(2, repeats // 3))
        rows.append({"tokens": num_tokens, **{f"{k}_ms": round(s * 1e3, 2) for k, s in seconds.items()},
                     "packed_over_dense": round(seconds["packed"] / seconds["dense"], 3)})
    slower = [row["tokens"] for row in rows if row["packed_over_dense"] > 1]
    return {"context": CONTEXT, "passes": rows, "packed_slower_from": min(slower) if slower else None}


def prefill(target: str | None, repeats: int) -> dict:
    """Pass seconds of N prompt tokens by routing (row_split.py), alternated, and the dense fp32 model's."""
    largest = max(PREFILL_TOKENS)
    models = {k: load_model(LoadOptions(target, device="cpu", dtype="fp32", cpu_kernel=k, max_context=largest + 1,
                                        max_pass_tokens=largest)).model for k in KERNELS}
    rows = []
    for num_tokens in PREFILL_TOKENS:
        tokens = torch.randint(0, 1000, (1, num_tokens), generator=torch.Generator().manual_seed(0))

        def one_pass(model, routing=None):
            if routing is not None:
                model.prompt_routing = routing
            model.forward(tokens, model.new_cache(num_tokens + 1), last_only=True, prompt_chunks=[(0, num_tokens)])
        runs = {name: (lambda r=routing: one_pass(models["packed"], r)) for name, routing in ROUTINGS.items()}
        runs["dense_model"] = lambda: one_pass(models["dense"])
        seconds = _alternate(runs, repeats if num_tokens <= 512 else max(2, repeats // 3))
        rows.append({"tokens": num_tokens, **{f"{k}_s": round(v, 4) for k, v in seconds.items()},
                     **{f"packed_over_{k}": round(seconds["packed"] / seconds[k], 3) for k in seconds if k != "packed"}})
    models["packed"].prompt_routing = PromptRouting()
    return {"passes": rows, "routing_default": {"attention_rows": PromptRouting().attention_rows,
                                                "dense_rows": PromptRouting().dense_rows}}


def _chat_ids(tokenizer, limit: int | None = None) -> list[list[int]]:
    rows = textdata.records(textdata.CHAT_PROMPTS)[:limit]
    return [tokenizer.encode_chat([{"role": "user", "content": row["prompt"]}]) for row in rows]


def greedy_steps(model, prompt: list[int], new_tokens: int):
    """One-token greedy passes after the prompt (prefill untimed, as bench/llama_cpp_runner.py times llama.cpp)."""
    cache = model.new_cache(len(prompt) + new_tokens + 1)
    first = int(model.forward(torch.tensor([prompt]), cache, last_only=True).logits[0, -1].argmax())
    cache.commit()

    def steps() -> list[int]:
        cache.truncate(len(prompt))
        tokens = [first]
        for _ in range(new_tokens - 1):
            tokens.append(int(model.forward(torch.tensor([tokens[-1:]]), cache).logits[0, -1].argmax()))
            cache.commit()
        return tokens
    return steps


def decode(models: dict, repeats: int, new_tokens: int, llama_cpp: Path | None) -> dict:
    ids = _chat_ids(models["dense"].tokenizer, 1)[0]
    seconds = _alternate({k: greedy_steps(m.model, ids, new_tokens) for k, m in models.items()}, repeats)
    rates = {k: round((new_tokens - 1) / s, 2) for k, s in seconds.items()}
    result = {"new_tokens": new_tokens, "prompt_tokens": len(ids), "tokens_per_second": rates,
              "packed_over_dense_speed": round(rates["packed"] / rates["dense"], 3)}
    if llama_cpp:
        result["llama_cpp"] = _llama_cpp(models["dense"], ids, new_tokens, repeats, llama_cpp)
        if "tokens_per_second" in result["llama_cpp"]:
            theirs = result["llama_cpp"]["tokens_per_second"]
            result["over_llama_cpp"] = {k: round(rate / theirs, 3) for k, rate in rates.items()}
    return result


def _llama_cpp(loaded, ids: list[int], new_tokens: int, rounds: int, python: Path) -> dict:
    """llama.cpp (llama-cpp-python in `python`'s environment, .venv-peers as bench all runs it, built as
    scripts/setup_peers.sh builds it) on the same file, ids and threads."""
    import subprocess
    from offload.weights.gguf_model import gguf_file_of
    if not python.exists():
        return {"skipped": f"{python} is missing: run scripts/setup_peers.sh --llama-cpp"}
    cmd = [str(python), str(Path(__file__).with_name("llama_cpp_runner.py")), "--model",
           str(gguf_file_of(loaded.path)), "--ids", json.dumps(ids), "--max-new-tokens", str(new_tokens),
           "--threads", str(torch.get_num_threads())]
    runs = []
    for _ in range(rounds):
        lines = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout.splitlines()
        runs.append(json.loads(next((line for line in reversed(lines) if line.startswith("{")), '{"error": "no JSON"}')))
        if runs[-1].get("seconds_per_token") is None:
            return {"error": runs[-1].get("error", "no timing"), "runs": runs}
    per_token = statistics.median(run["seconds_per_token"] for run in runs)
    return {"tokens_per_second": round(1 / per_token, 2), "rounds": rounds,
            "llama_cpp_python": runs[-1].get("llama_cpp_python_version")}


CONTEXTS = (100, 1000, 1900)


def context(models: dict, repeats: int) -> dict:
    """What exactness costs: packed one-token steps after 100-1,900 tokens of context, attending in float64 over
    the float64 KV cache (row-exact) against fp32 over an fp32 cache (not row-exact), and dense fp32."""
    from offload.model.kvcache import KVCache
    from offload.weights.packed_linear import Int4Weight
    from quant.calibration_data import documentation_prose
    ids = models["dense"].tokenizer.encode(documentation_prose(0))[:max(CONTEXTS)]
    rows = []
    for length in CONTEXTS:
        steps = {}
        for name, loaded, cache_dtype in (("packed_float64", models["packed"], torch.float64),
                                          ("packed_fp32", models["packed"], torch.float32),
                                          ("dense", models["dense"], torch.float32)):
            cache = KVCache(loaded.config, length + 2, torch.device("cpu"), cache_dtype)
            loaded.model.forward(torch.tensor([ids[:length]]), cache)
            cache.commit()
            steps[name] = _step(loaded.model, cache, length, exact=name != "packed_fp32")
        seconds = _alternate(steps, repeats)
        rows.append({"context": length, **{f"{k}_ms": round(v * 1e3, 2) for k, v in seconds.items()}})
    Int4Weight.is_row_exact = True
    return {"steps": rows}


def _step(model, cache, length: int, exact: bool):
    from offload.weights.packed_linear import Int4Weight

    def step():
        Int4Weight.is_row_exact = exact         # off: fp32 attention (layers.py), for this measurement only
        cache.truncate(length)
        model.forward(torch.tensor([[42]]), cache)
    return step


def stream(target: str | None, repeats: int) -> dict:
    models = {}
    for kernel in KERNELS:
        options = LoadOptions(target, device="cpu", dtype="fp32", max_context=256, max_pass_tokens=16,
                              cpu_kernel=kernel)
        models[kernel] = load_model(replace(options, gpu_mem=streaming_device_budget(options)))   # all from RAM
    try:
        context = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
        passes = {}
        for k, m in models.items():
            cache = m.model.new_cache(64)
            m.model.forward(context, cache)
            cache.commit()
            passes[k] = lambda m=m, cache=cache: (cache.truncate(16), m.model.forward(context[:, :1], cache))
        seconds = _alternate(passes, repeats)
        source = models["packed"].source
        stored = {name: raw.clone() for name, raw in source.layer(0).items()}       # one layer's blocks in RAM
        with torch.inference_mode():      # the shared workspace the passes made is an inference tensor
            layer = _alternate({"dense": lambda: source.decode_layer(0, stored, torch.float32, shared=True),
                                "packed": lambda: source.kernel_layer(0, stored, torch.float32, shared=True)}, repeats)
        tiers = models["packed"].plan.tier_of
    finally:
        for m in models.values():
            m.layers.close()
    return {"tiers": {t: tiers.count(t) for t in set(tiers)},
            "one_token_pass_ms": {k: round(s * 1e3, 2) for k, s in seconds.items()},
            "packed_over_dense": round(seconds["packed"] / seconds["dense"], 3),
            "layer_0_ms": {"decode_fp32": round(layer["dense"] * 1e3, 3), "repack_int4": round(layer["packed"] * 1e3, 3)},
            "repack_over_decode": round(layer["packed"] / layer["dense"], 3)}


def quality(models: dict, target: str | None, tokens_per_domain: int, new_tokens: int, spec_prompts: int,
            draft_target: str | None) -> dict:
    from bench.quant_bench import QuantBenchConfig, heldout_texts
    from quant.perplexity import PerplexityConfig, perplexity
    from spec import DecodeConfig, Decoder, FixedBudget, SamplingConfig, Speculator, default_draft_for, load_any_draft
    texts = heldout_texts(models["dense"], QuantBenchConfig(target, tokens_per_domain, chat_prompts=None), print)
    config = PerplexityConfig(max_tokens=tokens_per_domain)
    scores = {k: {d: round(perplexity(m, t, config)["perplexity"], 4) for d, t in texts.items()}
              for k, m in models.items()}
    increase = {d: round(100 * (scores["packed"][d] / scores["dense"][d] - 1), 3) for d in texts}
    decode_config = DecodeConfig(new_tokens, 2048, max_pass_tokens=512)
    answers = {k: [Decoder(m.model, m.stop_ids, decode_config).generate(ids, SamplingConfig()).token_ids
                   for ids in _chat_ids(m.tokenizer)] for k, m in models.items()}
    identical = sum(a == b for a, b in zip(answers["dense"], answers["packed"]))
    target_model = models["packed"]
    draft = load_any_draft(str(default_draft_for(draft_target)), target_model,
                           LoadOptions(device="cpu", max_context=2048))
    speculative = Decoder(target_model.model, target_model.stop_ids, decode_config,
                          Speculator(draft, 2048, 16), FixedBudget(16))
    spec_same = [speculative.generate(ids, SamplingConfig()).token_ids == answers["packed"][i]
                 for i, ids in enumerate(_chat_ids(target_model.tokenizer, spec_prompts))]
    return {"perplexity": scores, "perplexity_increase_percent": increase, "tokens_per_domain": tokens_per_domain,
            "greedy_answers": len(answers["dense"]), "greedy_new_tokens": new_tokens,
            "greedy_identical_to_dense": identical,
            "speculation_budget_16_identical_to_packed_greedy": f"{sum(spec_same)}/{len(spec_same)}"}


def from_args(args) -> dict:
    """The parts `args.parts` names, measured in one run (flags: commands/bench_cpu_flags.py)."""
    parts = args.parts.split(",") if args.parts else list(PARTS)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"--parts: unknown parts {unknown}: choose from {', '.join(PARTS)}")
    target, draft_target = args.target, args.target
    if args.kernel == "ggml" and not os.environ.get("SPECSTREAM_GGML_LIB"):
        from bench.shapes_bench import ggml_library, llama_python
        folder = ggml_library(llama_python())
        if folder:
            os.environ["SPECSTREAM_GGML_LIB"] = folder
    if args.requantize:
        from bench.synthetic_gguf import requantized_default
        target, draft_target = str(requantized_default(args.requantize, print)), None   # the default's draft
    result = {"bench": "cpu-kernel", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "torch": torch.__version__, "kernel": args.kernel}       # the kernel the JSON calls "packed"
    models = {k: _load(target, args.kernel if k == "packed" else k) for k in KERNELS} \
        if set(parts) - {"stream", "prefill"} else {}
    if "crossover" in parts:
        result["crossover"] = crossover(models, args.repeats)
    if "prefill" in parts:
        result["prefill"] = prefill(target, args.repeats)
    if "decode" in parts:
        result["decode"] = decode(models, max(3, args.repeats // 3), args.new_tokens, _llama_python(args.llama_cpp))
    if "context" in parts:
        result["context"] = context(models, args.repeats)
    if "stream" in parts:
        streamed = target
        if args.stream_synthetic:
            from bench.synthetic_gguf import synthetic_target
            path, result["stream_synthetic_gguf"] = synthetic_target(args.stream_synthetic, 8, 2.5, print)
            streamed = str(path)
        result["stream"] = stream(streamed, args.repeats)
    if "quality" in parts:
        result["quality"] = quality(models, target, args.tokens_per_domain, args.new_tokens, args.spec_prompts,
                                    draft_target)
    return result


def _llama_python(value: str | None) -> Path | None:
    if value is None:
        return None
    return ROOT / ".venv-peers/bin/python" if value == PEERS_PYTHON else Path(value)


def headline(result: dict) -> str:
    return "cpu-kernel: " + "; ".join(f"{part}: {_headline(part, result[part])}" for part in PARTS if part in result)


def _headline(part: str, value: dict) -> str:
    if part == "crossover":
        return f"packed slower from {value['packed_slower_from']} tokens per pass"
    if part == "decode":
        return f"{value['tokens_per_second']} tok/s"
    if part == "prefill":
        return "packed / routed " + ", ".join(f"{r['tokens']}: {r['packed_over_fp32_attention']}/"
                                              f"{r['packed_over_fp32_attention_dense']}" for r in value["passes"])
    if part == "context":
        return "one-token step ms " + ", ".join(f"{r['context']}: {r['packed_float64_ms']}/{r['packed_fp32_ms']}/"
                                               f"{r['dense_ms']}" for r in value["steps"]) + " (float64/fp32/dense)"
    if part == "stream":
        return f"packed/dense one-token pass {value['packed_over_dense']}, repack/decode {value['repack_over_decode']}"
    return (f"perplexity +{value['perplexity_increase_percent']}%, {value['greedy_identical_to_dense']}/"
            f"{value['greedy_answers']} greedy answers identical, speculation "
            f"{value['speculation_budget_16_identical_to_packed_greedy']} exact")

