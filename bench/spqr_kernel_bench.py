"""A SpQR w4 g32 checkpoint on the CPU's int4 kernel (quant/spqr_packed.py, --cpu-kernel packed) against today's
SpQR path (each layer dequantized, then fp32 products), side by side in one run on the same checkpoint; every figure
is a ratio of timings taken alternately ("dense" rows are today's path).

    python cli.py bench spqr-kernel CHECKPOINT --parts outliers,decode,stream,perplexity --out FILE.json

outliers    every packed matrix of the model multiplied once at M rows (1 and 16): the kernel's product alone, and
            the outliers' addition by index_add_ (the one used) and by a torch sparse CSR product (addmm)
decode      greedy one-token decoding, resident: tokens per second (cpu_kernel_bench's decode part)
stream      every layer from RAM: one-token pass seconds; and one layer repacked for the kernel against one layer
            dequantized (SpqrLinear.prepare: decode_layer alone defers the dequantization to the product)
perplexity  held-out code, prose and math (bench quant's texts)
quality     cpu_kernel_bench's quality part: perplexity, greedy answers to the 44 chat prompts identical to today's
            path, packed speculation (the default draft) identical to packed one-token decoding
`specstream bench spqr-kernel` runs it (flags: commands/bench_cpu_flags.py): one summary line, then the JSON (also
written to --out, indented, with the command that made it)."""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench import cpu_kernel_bench as kernel_bench
from offload import LoadOptions
from offload.loader import streaming_device_budget
from quant.spqr_packed import SpqrInt4Weight
from runtime.models import load_model, with_formats

PARTS = ("outliers", "decode", "stream", "perplexity", "quality")
OUTLIER_ROWS = (1, 16)


def outliers(model, repeats: int) -> dict:
    weights = [w for layer in model.layers.resident.values() for w in layer.values() if isinstance(w, SpqrInt4Weight)]
    sparse = [_csr(w) for w in weights]
    rows = []
    for num_rows in OUTLIER_ROWS:
        inputs = [torch.randn(num_rows, w.shape[1]) for w in weights]
        outputs = [torch.zeros(num_rows, w.shape[0]) for w in weights]
        runs = {"kernel": lambda: [w.weight.matmul(x) for w, x in zip(weights, inputs)],
                "index_add": lambda: [_index_add(w, x, y) for w, x, y in zip(weights, inputs, outputs)],
                "csr": lambda: [torch.addmm(y.t(), s, x.t()) for s, x, y in zip(sparse, inputs, outputs)]}
        seconds = kernel_bench._alternate(runs, repeats)
        rows.append({"rows": num_rows, **{f"{k}_ms": round(s * 1e3, 3) for k, s in seconds.items()},
                     "index_add_over_kernel": round(seconds["index_add"] / seconds["kernel"], 3),
                     "csr_over_index_add": round(seconds["csr"] / seconds["index_add"], 2)})
    share = sum(w.outlier_rows.numel() for w in weights) / sum(w.shape[0] * w.shape[1] for w in weights)
    return {"matrices": len(weights), "outlier_share": round(share, 6), "products": rows}


def _index_add(weight: SpqrInt4Weight, x: torch.Tensor, out: torch.Tensor) -> None:
    """What SpqrInt4Weight.matmul adds after the kernel's product (x in permuted order)."""
    terms = x.index_select(1, weight.outlier_cols).mul_(weight.outlier_deltas)
    out.index_add_(1, weight.outlier_rows, terms)


def _csr(weight: SpqrInt4Weight) -> torch.Tensor:
    """[N, K] sparse CSR of the outliers' differences."""
    order = torch.argsort(weight.outlier_rows, stable=True)
    counts = torch.bincount(weight.outlier_rows, minlength=weight.shape[0])
    crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return torch.sparse_csr_tensor(crow, weight.outlier_cols[order], weight.outlier_deltas[order], weight.shape)


def stream(checkpoint: str, repeats: int) -> dict:
    """Every layer streamed from RAM: one-token passes on the kernel (each layer repacked per pass) and on today's
    path (each layer dequantized per pass), and one layer's repack against its dequantization."""
    models = {}
    for kernel in kernel_bench.KERNELS:
        options = with_formats(LoadOptions(checkpoint, device="cpu", dtype="fp32", max_context=256,
                                           max_pass_tokens=16, cpu_kernel=kernel))
        models[kernel] = load_model(replace(options, gpu_mem=streaming_device_budget(options)))
    try:
        context = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
        passes = {kernel: _one_token_pass(loaded.model, context) for kernel, loaded in models.items()}
        seconds = kernel_bench._alternate(passes, repeats)
        source = models["packed"].source
        stored = {name: raw.clone() for name, raw in source.layer(0).items()}        # one layer's bytes in RAM
        layer = kernel_bench._alternate({"dequantize": lambda: _dequantized(source, stored),
                                         "repack": lambda: source.kernel_layer(0, stored, torch.float32)}, repeats)
        tiers = {kernel: loaded.plan.tier_of.count("ram") for kernel, loaded in models.items()}
    finally:
        for loaded in models.values():
            loaded.layers.close()
    return {"layers_from_ram": tiers, "one_token_pass_ms": {k: round(s * 1e3, 2) for k, s in seconds.items()},
            "packed_over_dense": round(seconds["packed"] / seconds["dense"], 3),
            "layer_0_ms": {k: round(v * 1e3, 3) for k, v in layer.items()},
            "repack_over_dequantize": round(layer["repack"] / layer["dequantize"], 3)}


def _one_token_pass(model, context: torch.Tensor):
    cache = model.new_cache(64)
    model.forward(context, cache)
    cache.commit()
    return lambda: (cache.truncate(context.shape[1]), model.forward(context[:, :1], cache))


def _dequantized(source, stored: dict) -> dict:
    layer = source.decode_layer(0, stored, torch.float32)
    for weight in layer.values():
        if hasattr(weight, "prepare"):
            weight.prepare()
    return layer


def perplexity(models: dict, tokens_per_domain: int) -> dict:
    """Perplexity on bench quant's held-out code, prose and math, packed against today's path (cpu_kernel_bench's
    quality part without its greedy answers and speculation)."""
    from bench.quant_bench import QuantBenchConfig, heldout_texts
    from quant.perplexity import PerplexityConfig, perplexity as score
    texts = heldout_texts(models["dense"], QuantBenchConfig(None, tokens_per_domain, chat_prompts=None), print)
    config = PerplexityConfig(max_tokens=tokens_per_domain)
    scores = {k: {d: round(score(m, t, config)["perplexity"], 4) for d, t in texts.items()} for k, m in models.items()}
    increase = {d: round(100 * (scores["packed"][d] / scores["dense"][d] - 1), 3) for d in texts}
    return {"perplexity": scores, "perplexity_increase_percent": increase, "tokens_per_domain": tokens_per_domain}


def from_args(args) -> dict:
    """The parts `args.parts` names, measured in one run (flags: commands/bench_cpu_flags.py)."""
    parts = args.parts.split(",") if args.parts else list(PARTS)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"--parts: unknown parts {unknown}: choose from {', '.join(PARTS)}")
    config_file = Path(args.checkpoint) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{args.checkpoint} holds no config.json: give a SpQR checkpoint folder")
    result = {"bench": "spqr-kernel", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "torch": torch.__version__,
              "quantization": json.loads(config_file.read_text()).get("quantization_config")}
    models = {k: kernel_bench._load(args.checkpoint, k) for k in kernel_bench.KERNELS} \
        if set(parts) - {"stream"} else {}
    if "outliers" in parts:
        result["outliers"] = outliers(models["packed"], args.repeats)
    if "decode" in parts:
        result["decode"] = kernel_bench.decode(models, max(3, args.repeats // 3), args.new_tokens, None)
    if "stream" in parts:
        result["stream"] = stream(args.checkpoint, args.repeats)
    if "perplexity" in parts:
        result["perplexity"] = perplexity(models, args.tokens_per_domain)
    if "quality" in parts:
        result["quality"] = kernel_bench.quality(models, args.checkpoint, args.tokens_per_domain, args.new_tokens,
                                                 args.spec_prompts, args.checkpoint)
    return result


def headline(result: dict) -> str:
    return "spqr-kernel: " + "; ".join(f"{part}: {_headline(part, result[part])}" for part in PARTS if part in result)


def _headline(part: str, value: dict) -> str:
    if part == "outliers":
        return ", ".join(f"M={r['rows']}: index_add {r['index_add_over_kernel']}x the kernel's time, csr "
                         f"{r['csr_over_index_add']}x index_add" for r in value["products"])
    if part == "perplexity":
        return f"perplexity packed vs today {value['perplexity_increase_percent']}%"
    if part == "stream":
        return (f"packed/today one-token pass from RAM {value['packed_over_dense']}, layer repack/dequantize "
                f"{value['repack_over_dequantize']}")
    return kernel_bench._headline(part, value)

