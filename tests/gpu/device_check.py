"""Device check: what the streamed regime costs on this machine, as one JSON that
perf.pass_model.load_device_check reads (`plan --measured-curve FILE`).

    python tests/gpu/device_check.py [--device auto] [--shape 70b] [--layers 8] [--tokens 1,16,...,2048]
                                     [--sections stream,spqr,gguf,lowbit,syncs] [--out FILE]
    python tests/gpu/device_check.py --merge PART.json... [--steps STEPS.txt] [--junit PYTEST.xml] --out FILE
Sections, each on its own (a failing one leaves its error under "errors", the others their results; with
--out the file is rewritten after every section, so a run killed by its time limit keeps what finished):
  stream  a random-initialised model with Llama-3.1-70B layer shapes (bf16 on CUDA), every layer streamed
          from pinned RAM through a ring of 2, runs one pass over a random token tree of each size;
          efficiency = (streamed bytes / raw pinned H2D rate) / pass seconds; host syncs of one pass beside
  spqr    SpQR w4 dequantization of one such layer (tests/gpu/dequantize_check.py)
  gguf    GGUF Q4_K and Q6_K decoding of one such layer, Triton kernels and torch decoder (likewise)
  lowbit  one such layer as a self-draft's 2/3/4-bit substitutes: a draft round's product, fused kernel vs torch
          path vs the dense bf16 layer (likewise)
  syncs   greedy speculation with the embedded default pair: tokens/s and host syncs per step by budget
          (tests/gpu/sync_check.py)
--shape tiny shrinks the layers (with --device cpu the test suite runs it); --dry-run = --device cpu --shape tiny.
--merge joins the parts of a session (tests/gpu/gpu_session.sh) into one such JSON, with each step's status.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]      # the project, and tests/ (this folder is tests/gpu)
from gpu.dequantize_check import gguf_check, lowbit_check, spqr_check  # noqa: E402
from offload.bandwidth import copy_gbps, host_to_device_gbps  # noqa: E402
from offload.host_sync import count_host_syncs  # noqa: E402
from offload.loader import LoadOptions, build_engine  # noqa: E402
from offload.model.config import ModelConfig, RopeConfig  # noqa: E402
from offload.weights.packing import LayerLayout  # noqa: E402
from offload.weights.source import layer_tensor_names  # noqa: E402
from perf.result_formats import DEVICE_CHECK  # noqa: E402
from spec.tree import Tree  # noqa: E402

SHAPES = {"70b": dict(hidden_size=8192, intermediate_size=28672, num_heads=64, num_kv_heads=8, head_dim=128),
          "tiny": dict(hidden_size=256, intermediate_size=1024, num_heads=8, num_kv_heads=2, head_dim=32)}
SECTIONS = ("stream", "spqr", "gguf", "lowbit", "syncs")
VOCAB = 1024


class RandomSource:
    """A WeightSource of random tensors with the given shapes (nothing read from disk). Every layer holds
    the same values (drawn once): the check measures moving and multiplying them, not what they say."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        self.config, self.dtype, self._layer = config, dtype, None

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, dtype=self.dtype).mul_(0.02)

    def global_tensors(self) -> dict[str, torch.Tensor]:
        c = self.config
        return {"embed": self._rand(c.vocab_size, c.hidden_size), "norm": torch.ones(c.hidden_size, dtype=self.dtype),
                "lm_head": self._rand(c.vocab_size, c.hidden_size)}

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        if self._layer is None:
            c = self.config
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            shapes = {"input_norm": (c.hidden_size,), "post_norm": (c.hidden_size,), "q": (q, c.hidden_size),
                      "k": (kv, c.hidden_size), "v": (kv, c.hidden_size), "o": (c.hidden_size, q),
                      "gate": (c.intermediate_size, c.hidden_size), "up": (c.intermediate_size, c.hidden_size),
                      "down": (c.hidden_size, c.intermediate_size)}
            self._layer = {name: self._rand(*shapes[name]) for name in layer_tensor_names(c)}
        return self._layer

    def layout(self, dtype: torch.dtype) -> LayerLayout:
        return LayerLayout.from_tensors(self.layer(0), dtype)

    def decode_layer(self, index: int, stored: dict[str, torch.Tensor], dtype: torch.dtype,
                     shared: bool = False) -> dict:
        return stored


def model_config(shape: str, num_layers: int) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=VOCAB, num_layers=num_layers, rms_norm_eps=1e-5,
                       max_position=131072, rope=RopeConfig(theta=500000.0), **SHAPES[shape])


def stream_check(config: ModelConfig, device: torch.device, dtype: torch.dtype, pass_tokens: list[int]) -> dict:
    """Every layer streamed from pinned RAM through a ring of 2 (of 1 for 2 layers, which a ring of 2 would
    hold resident); one pass per tree size (best of 2 after a warm-up)."""
    if config.num_layers < 2:
        raise ValueError(f"the stream section needs --layers >= 2, got {config.num_layers}")
    source, max_tokens, ring_size = RandomSource(config, dtype), max(pass_tokens), min(2, config.num_layers - 1)
    probe = LoadOptions(device=device.type, dtype={torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype],
                        max_context=max_tokens + 1, max_pass_tokens=max_tokens, gpu_mem=1 << 50, ram=1 << 50,
                        ring_size=ring_size)
    fixed = _fixed_bytes(build_engine(source, probe))
    layer_bytes = config.layer_param_count * dtype.itemsize
    probe.gpu_mem = fixed + ring_size * layer_bytes + layer_bytes // 2     # no layer fits beside the ring
    engine = build_engine(source, probe)
    try:
        rows = [_measure(engine, config, n) for n in pass_tokens]
    finally:
        engine.layers.close()
    return {"layers": config.num_layers, "layer_bytes": engine.layers.layout.num_bytes, "tier": "ram",
            "ring_size": ring_size, "tree_passes": True, "passes": rows}


def _fixed_bytes(engine) -> int:
    fixed = sum(i.num_bytes for i in engine.plan.items if "layers" not in i.component)
    engine.layers.close()
    return fixed


def random_tree(num_nodes: int, vocab_size: int, generator: torch.Generator) -> Tree:
    """A random tree (each node's parent uniform among the nodes before it), as a pass sees a grown one."""
    parents = [-1] + [int(torch.randint(0, node, (1,), generator=generator)) for node in range(1, num_nodes)]
    depths = [0] * num_nodes
    for node in range(1, num_nodes):
        depths[node] = depths[parents[node]] + 1
    return Tree(torch.randint(0, vocab_size, (num_nodes,), generator=generator), torch.tensor(parents),
                torch.tensor(depths), torch.zeros(num_nodes))


def _measure(engine, config: ModelConfig, num_tokens: int) -> dict:
    model, layers = engine.model, engine.layers
    tree = random_tree(num_tokens, config.vocab_size, torch.Generator().manual_seed(num_tokens))
    inputs = (tree.tokens[None], tree.positions(0), tree.attention_mask(0, model.device))

    def run_pass() -> None:
        model.forward(inputs[0], model.new_cache(num_tokens + 1), *inputs[1:])
        model.synchronize()

    timings = []
    for _ in range(3):   # the first is a warm-up
        start = time.perf_counter()
        run_pass()
        timings.append((time.perf_counter() - start, layers.last_pass))
    seconds, stats = min(timings[1:], key=lambda t: t[0])
    with count_host_syncs(model.device) as syncs:
        run_pass()
    sources = [layers.ram.buffers[i] for i in layers.streamed]
    raw = copy_gbps(sources, layers.slots[0].buffer)
    return {"tokens": num_tokens, "pass_seconds": round(seconds, 5), "bytes_streamed": stats.bytes_streamed,
            "wait_seconds": round(stats.wait_seconds, 5), "raw_gbps": round(raw, 3),
            "efficiency": round(stats.bytes_streamed / (raw * 1e9) / seconds, 4),
            "host_syncs_per_pass": syncs.num_host_syncs, "torch_ops_per_pass": syncs.num_torch_ops}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or 'unknown'})"


def card_slug(name: str) -> str:
    """A file-name word for a device name: 'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200'."""
    words = [w for w in name.lower().replace("nvidia", "").replace("(", " ").replace(")", " ").split() if w]
    return (words[0] if words else "device").replace("/", "-")


def check(device: torch.device, shape: str, num_layers: int, pass_tokens: list[int], sections: list[str],
          out: Path | None, sync_budgets: list[int], sync_tokens: int) -> dict:
    """The sections asked for, in order -> the result (also written to `out` after each section)."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = model_config(shape, num_layers)
    result = {"check": DEVICE_CHECK, "date": date.today().isoformat(), "device": device_name(device),
              "dry_run": shape != "70b", "shape": shape, "dtype": str(dtype).removeprefix("torch."),
              "layers": num_layers, "sections": sections, "errors": {}}
    runs = {"stream": lambda: stream_check(config, device, dtype, pass_tokens),
            "spqr": lambda: {"spqr_w4_dequantize": spqr_check(config, device, result["pinned_h2d_gbps"])},
            "gguf": lambda: {f"gguf_{name.lower()}_dequantize":
                             gguf_check(config, device, result["pinned_h2d_gbps"], name) for name in ("Q4_K", "Q6_K")},
            "lowbit": lambda: {"lowbit_substitutes": lowbit_check(config, device, result["pinned_h2d_gbps"])},
            "syncs": lambda: {"speculation_syncs": _default_pair_syncs(device, sync_budgets, sync_tokens)}}
    layer_bytes = config.layer_param_count * dtype.itemsize
    for section in ["link", *sections]:
        started = time.perf_counter()
        try:
            if section == "link":
                result["pinned_h2d_gbps"] = round(host_to_device_gbps(min(2 * layer_bytes, 2 << 30), device), 3)
            else:
                result.update(runs[section]())
        except Exception as error:     # recorded and shown; the next section still runs
            result["errors"][section] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
        print(f"device check: {section} took {time.perf_counter() - started:.1f} s", file=sys.stderr)
        write(result, out)
    return result


def _default_pair_syncs(device: torch.device, budgets: list[int], max_new_tokens: int) -> dict:
    from gpu.sync_check import default_pair_syncs
    return default_pair_syncs(device.type, budgets, max_new_tokens)


def write(result: dict, out: Path | None) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".tmp").write_text(json.dumps(result, indent=1))
        out.with_suffix(".tmp").replace(out)


def merge(parts: list[Path], steps: Path | None, junit: Path | None) -> dict:
    """One JSON from a session's part results (in order, each key from the first part that has it; errors
    and sections joined), its steps' exit codes and seconds ("name rc seconds" lines) and pytest's junit
    summary. Written whatever failed: without a stream part its passes are empty."""
    result: dict = {"check": DEVICE_CHECK, "passes": [], "errors": {}, "sections": []}
    for part in parts:
        try:
            data = json.loads(part.read_text())
        except (OSError, ValueError) as error:
            result["errors"][part.name] = f"unreadable: {error}"
            continue
        for key, value in data.items():
            if key == "errors":
                result["errors"].update(value)
            elif key == "sections":
                result["sections"] += [s for s in value if s not in result["sections"]]
            elif not result.get(key):
                result[key] = value
    if steps is not None and steps.exists():
        result["steps"] = [dict(zip(("name", "rc", "seconds"), _step_fields(line.split())))
                           for line in steps.read_text().splitlines() if line.strip()]
    if junit is not None and junit.exists():
        suite = ElementTree.parse(junit).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        result["cuda_tests"] = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    return result


def summary(result: dict) -> str:
    """A few lines to read in a device call's output tail."""
    lines = [f"{result.get('device')}: pinned link {result.get('pinned_h2d_gbps')} GB/s, {result.get('layers')} "
             f"layers of {result.get('layer_bytes')} bytes"]
    lines += [f"  tree {p['tokens']:>5}: {1e3 * p['pass_seconds']:8.1f} ms/pass, efficiency {p['efficiency']:.3f}, "
              f"raw {p['raw_gbps']} GB/s, {p.get('host_syncs_per_pass')} host syncs" for p in result.get("passes", [])]
    for key in ("spqr_w4_dequantize", "gguf_q4_k_dequantize", "gguf_q6_k_dequantize"):
        if key in result:
            figures = {k: v for k, v in result[key].items() if k.endswith(("_ms", "equals_torch"))}
            lines.append(f"  {key}: {figures}")
    for rows, figures in result.get("lowbit_substitutes", {}).get("rows", {}).items():
        lines.append(f"  lowbit substitutes, {rows} rows: {figures}")
    for row in result.get("speculation_syncs", {}).get("rows", []):
        lines.append(f"  budget {row['budget']!s:>14}: {row['tokens_per_second']:7.1f} tok/s, "
                     f"{row['tokens_per_pass']:.2f} tok/pass, {row['host_reads_per_step']} host reads/step "
                     f"({row.get('sync_warnings_per_step', '-')} sync warnings), same {row['identical_to_autoregressive']}")
    lines += [f"  cuda tests: {result['cuda_tests']}"] if "cuda_tests" in result else []
    lines += [f"  steps: {result['steps']}"] if "steps" in result else []
    lines += [f"  errors: {result['errors']}"] if result.get("errors") else []
    return "\n".join(lines)


def _step_fields(words: list[str]) -> list:
    return [words[0], *(int(w) for w in words[1:3])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="= --device cpu --shape tiny")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--shape", default="70b", choices=list(SHAPES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", default="1,16,64,256,1024,2048", help="tree sizes of the stream section")
    parser.add_argument("--sections", default="stream,spqr,gguf", help=f"any of {','.join(SECTIONS)}")
    parser.add_argument("--sync-budgets", default="1,4,16,64,256,1024", help="budgets of the syncs section")
    parser.add_argument("--sync-tokens", type=int, default=64, help="answer tokens of the syncs section")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: print it)")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, metavar="PART", help="join parts into --out")
    parser.add_argument("--steps", type=Path, default=None, help="with --merge: 'name rc seconds' lines")
    parser.add_argument("--junit", type=Path, default=None, help="with --merge: pytest's junit XML")
    parser.add_argument("--summary", action="store_true", help="print a few lines on the result (to stderr)")
    args = parser.parse_args()
    if args.merge:
        result = merge(args.merge, args.steps, args.junit)
        write(result, args.out)
        print(json.dumps(result) if args.out is None else f"wrote {args.out}")
        if args.summary:
            print(summary(result), file=sys.stderr)
        return 0
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if not sections or set(sections) - set(SECTIONS):
        parser.error(f"--sections takes {','.join(SECTIONS)}, got {args.sections!r}")
    device = torch.device("cpu" if args.dry_run else "cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    shape = "tiny" if args.dry_run else args.shape
    result = check(device, shape, args.layers, [int(x) for x in args.tokens.split(",")], sections, args.out,
                   [int(x) for x in args.sync_budgets.split(",")], args.sync_tokens)
    if args.out is None:
        print(json.dumps(result))
    if args.summary:
        print(summary(result), file=sys.stderr)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
