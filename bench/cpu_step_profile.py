"""Where a one-token decode step of a GGUF model on the CPU spends its time (the embedded default model unless
--target; the Decoder without a draft, as `specstream run --no-draft` decodes):

    python cli.py bench step-profile --cpu-kernel packed --steps 64 --rounds 3 --out FILE.json

Each timed function is wrapped by a timer that counts its own time, its timed callees' excluded: the matrix
products by kind (qkv, o, gate_up, down, lm_head; Int4Weight.matmul or F.linear, the input's casts included),
the LM head's exact recomputation of its top logits (Int4Head), attention (the SDPA call), the KV cache's
append, norms and rope, the layer's other work (casts, views, activation, residuals), the forward's other work
(embedding, mask, layer provider), sampling (target_choices) and the loop's other work (tree, commit, tokens:
its host reads). Allocations and host reads per step are counted in separate, untimed steps (torch.profiler's
aten::empty / aten::empty_strided calls; offload.host_sync's reads). --baseline-src DIR runs the same profile
on another checkout (e.g. `git archive COMMIT | tar -x -C DIR`) in turn with this one, round by round, each
in its own process: medians per part, and the step's time as a ratio to the baseline's."""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


class StepTimer:
    """Wraps functions (restored by `close`) to sum each label's exclusive seconds per decode step."""

    def __init__(self) -> None:
        self.stack: list[list[float]] = []      # per open call: its timed callees' seconds
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self._restore: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, label) -> None:
        """label: a str, or a function of the call's arguments giving one."""
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            self.stack.append([0.0])
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                children = self.stack.pop()[0]
                self.current[label(*args) if callable(label) else label] += elapsed - children
                if self.stack:
                    self.stack[-1][0] += elapsed
                else:                                   # the step itself: one record per step
                    self.steps.append(dict(self.current))
                    self.current.clear()
        setattr(owner, name, timed)
        self._restore.append((owner, name, original))

    def close(self) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()


def product_kind(config, shape: tuple[int, ...]) -> str:
    """A [N, K] product's role in the default layer layout, from its shape."""
    hidden, heads = config.hidden_size, config.num_heads * config.head_dim
    kinds = {(heads + 2 * config.num_kv_heads * config.head_dim, hidden): "qkv", (hidden, heads): "o",
             (2 * config.intermediate_size, hidden): "gate_up", (hidden, config.intermediate_size): "down",
             (config.vocab_size, hidden): "lm_head"}
    return "product " + kinds.get(tuple(shape), f"other {tuple(shape)}")


def install(timer: StepTimer, config) -> None:
    import offload.model.decoder as decoder
    import offload.model.layers as layers
    import spec.pass_parts as pass_parts
    from offload.model.kvcache import KVCache
    from offload.model.rope import Rotary
    from offload.model.slots import SlotCache
    from offload.weights.packed_linear import Int4Head, Int4Weight
    from spec import Decoder
    timer.wrap(Decoder, "step", "loop other (tree, commit, tokens)")
    timer.wrap(pass_parts, "target_choices", "sampling")
    timer.wrap(decoder.DecoderModel, "forward", "forward other (embedding, mask, layer provider)")
    timer.wrap(decoder, "decoder_layer", "layer other (casts, views, activation, residuals)")
    for module in (decoder, layers):
        timer.wrap(module, "rms_norm", "norms, rope")
    timer.wrap(layers, "apply_rotary", "norms, rope")
    timer.wrap(Rotary, "cos_sin", "norms, rope")
    timer.wrap(F, "scaled_dot_product_attention", "attention")
    for cache in (KVCache, SlotCache):
        timer.wrap(cache, "append", "kv cache append")
    timer.wrap(F, "linear", lambda x, weight, *_: product_kind(config, weight.shape))
    timer.wrap(Int4Weight, "matmul", lambda self, x: product_kind(config, self.shape))
    timer.wrap(Int4Head, "matmul", "lm_head exact recompute")


def _decoder(loaded, steps: int):
    from spec import DecodeConfig, Decoder
    return Decoder(loaded.model, set(), DecodeConfig(steps + 1, 2048, max_pass_tokens=512))


def profile(cpu_kernel: str, target: str | None, steps: int) -> dict:
    """One process's profile: `steps` one-token steps after a chat prompt's prefill, twice (a warm-up, then timed),
    then counted (allocations, host reads)."""
    from offload import LoadOptions
    from offload.host_sync import count_host_syncs
    from runtime.models import load_model
    from spec import SamplingConfig
    loaded = load_model(LoadOptions(target, device="cpu", dtype="fp32", cpu_kernel=cpu_kernel, max_context=2048,
                                    max_pass_tokens=512))
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": "Tell me about the history of the printing press."}])
    decoder = _decoder(loaded, steps)
    decoder.generate(ids, SamplingConfig())                   # warm-up; the timed run reuses the prompt's keys
    decoder.reset()
    plain = time.perf_counter()
    decoder.generate(ids, SamplingConfig())
    plain = time.perf_counter() - plain
    timer = StepTimer()
    install(timer, loaded.config)
    try:
        decoder.reset()
        decoder.generate(ids, SamplingConfig())
    finally:
        timer.close()
    one_token = timer.steps[1:]                               # the first step is the prompt's prefill
    parts = {label: statistics.median(step.get(label, 0.0) for step in one_token) * 1e3
             for label in sorted({label for step in one_token for label in step})}
    counted = _counted(decoder, ids, count_host_syncs)
    return {"cpu_kernel": cpu_kernel, "steps": len(one_token), "prompt_tokens": len(ids),
            "untimed_run_seconds": round(plain, 4), "step_ms": round(sum(parts.values()), 3),
            "parts_ms": {k: round(v, 3) for k, v in parts.items()}, **counted}


def _counted(decoder, ids: list[int], count_host_syncs) -> dict:
    """Per one-token step: allocations (aten::empty, aten::empty_strided calls) and host reads, from a run's
    steps less its prefill-only twin's."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    from spec import SamplingConfig
    rows = []
    for max_new_tokens in (1, decoder.config.max_new_tokens):
        decoder.config.max_new_tokens = max_new_tokens
        decoder.reset()
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof, count_host_syncs("cpu") as syncs:
            decoder.generate(ids, SamplingConfig())
        events = prof.key_averages()
        rows.append((sum(e.count for e in events if e.key in ("aten::empty", "aten::empty_strided")), syncs))
    num_steps = decoder.config.max_new_tokens - 1
    return {"allocations_per_step": round((rows[1][0] - rows[0][0]) / num_steps, 1),
            **rows[1][1].minus(rows[0][1]).report(num_steps)}


def compare(args) -> dict:
    """Rounds in turn: this checkout's profile, then the baseline's, each in its own process."""
    runs = {"this": [], "baseline": []} if args.baseline_src else {"this": []}
    if args.baseline_src:
        shutil.copy(Path(__file__), args.baseline_src / "bench" / Path(__file__).name)
    for _ in range(args.rounds):
        for name in runs:
            cwd = args.baseline_src if name == "baseline" else ROOT
            cmd = [sys.executable, "-m", "bench.cpu_step_profile", "--one", "--cpu-kernel", args.cpu_kernel,
                   "--steps", str(args.steps), *(["--target", args.target] if args.target else [])]
            out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(out.splitlines()[-1]))
    result = {name: _median_run(rows) for name, rows in runs.items()}
    if args.baseline_src:
        result["step_over_baseline"] = round(result["this"]["step_ms"] / result["baseline"]["step_ms"], 3)
        result["untimed_run_over_baseline"] = round(
            result["this"]["untimed_run_seconds"] / result["baseline"]["untimed_run_seconds"], 3)
    return result


def _median_run(rows: list[dict]) -> dict:
    labels = sorted({label for row in rows for label in row["parts_ms"]})
    parts = {label: round(statistics.median(row["parts_ms"].get(label, 0.0) for row in rows), 3) for label in labels}
    keep = ("cpu_kernel", "steps", "prompt_tokens", "allocations_per_step", "host_reads_per_step",
            "torch_ops_per_step", "host_reads_by_kind")
    return {**{k: rows[-1][k] for k in keep}, "rounds": len(rows),
            "untimed_run_seconds": round(statistics.median(r["untimed_run_seconds"] for r in rows), 4),
            "step_ms": round(statistics.median(r["step_ms"] for r in rows), 3), "parts_ms": parts}


def from_args(args) -> dict:
    """Rounds of profiles, each in its own process (flags: commands/bench_cpu_flags.py)."""
    if args.steps < 2 or args.rounds < 1:
        raise ValueError("--steps must be at least 2 and --rounds at least 1")
    if args.baseline_src and not (args.baseline_src / "bench").is_dir():
        raise FileNotFoundError(f"--baseline-src {args.baseline_src} is not a checkout of this project (no bench/)")
    return {"bench": "cpu-step-profile", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "cpu_kernel": args.cpu_kernel, **compare(args)}


def headline(result: dict) -> str:
    this = result["this"]
    return (f"cpu-step-profile: {result['cpu_kernel']} one-token step {this['step_ms']} ms, "
            + ", ".join(f"{k} {v}" for k, v in sorted(this["parts_ms"].items(), key=lambda kv: -kv[1])[:4])
            + (f"; {result['step_over_baseline']}x the baseline's" if "step_over_baseline" in result else ""))


def _one(argv: list[str]) -> int:
    """The child of compare(): one profile in this process, its JSON on one line (`--one`; a baseline checkout
    runs this file, copied into it, so both sides profile alike)."""
    parser = argparse.ArgumentParser(description="one profile, its JSON on one line")
    parser.add_argument("--one", action="store_true", required=True)
    parser.add_argument("--target", default=None)
    parser.add_argument("--cpu-kernel", default="packed", choices=("dense", "packed"))
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args(argv)
    print(json.dumps(profile(args.cpu_kernel, args.target, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(_one(sys.argv[1:]))
