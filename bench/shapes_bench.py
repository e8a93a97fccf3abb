"""Our CPU engine against llama.cpp on the same GGUF files and threads, in one run: the default model's own file
and synthetic files of Llama-3.2-1B's and Llama-3.1-8B's decoder shapes (bench/synthetic_gguf.NAMED_SHAPES:
random valid blocks, so speed only) in Q4_0, Q4_1 and Q4_K.

    python cli.py bench shapes --out bench/results/cpu_shapes_vs_llama_cpp.json

Per file: llama.cpp (bench/llama_cpp_runner.py in its own environment) and ours resident with the packed int4
kernel (bench/shapes_ours.py), each in its own process, taken in turn --rounds times: greedy decode tok/s
after a warm-up (prefill excluded: the same prompt ids) and one 512-token prefill from an empty cache. Then
ours streamed, every layer from host RAM and from a cold disk, dense and packed. Where ours falls short, the
same run says why: the bytes each engine reads per token, the int4 kernel's time per token from a profile
of the timed steps, and what is left of a step besides it. `specstream bench shapes` runs it (flags:
commands/bench_cpu_flags.py): one summary line and a table, then the JSON."""
from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from bench.shapes_cost import markdown_table, token_bytes, verdict
from bench.suite_config import ROOT

GOALS = {"default": 0.6, "1b": 0.8, "8b": 0.8}      # resident decode, ours / llama.cpp (issue 36)
LLAMA_PYTHONS = (ROOT / ".venv-peers/bin/python", ROOT / ".venv-llama/bin/python")


@dataclass(slots=True)
class ShapesBenchConfig:
    shapes: tuple[str, ...] = ("default", "1b", "8b")
    types: tuple[str, ...] = ("q4_0", "q4_1", "q4_k")      # the synthetic files' (the default file is Q4_1)
    new_tokens: int = 16             # timed greedy tokens per engine (after --warmup-tokens)
    warmup_tokens: int = 4
    prefill_tokens: int = 512
    rounds: int = 1                  # llama.cpp and ours resident, in turn; medians
    stream_steps: int = 4            # timed one-token steps per streamed row (after one untimed)
    stream_tiers: tuple[str, ...] = ("ram", "disk")
    stream_kernels: tuple[str, ...] = ("dense", "packed")
    threads: int = 2
    timeout: int = 1800              # seconds per child process
    omp_wait_policy: str = "PASSIVE"  # every child's OMP_WAIT_POLICY ("default": the environment's, as a user runs)
    resident_kernels: tuple[str, ...] = ("packed",)   # and "ggml": ggml's kernels through llama.cpp's libggml

    def __post_init__(self) -> None:
        unknown = set(self.shapes) - set(GOALS)
        if unknown:
            raise ValueError(f"shapes {sorted(unknown)}: choose from {', '.join(GOALS)}")
        if set(self.resident_kernels) - {"packed", "ggml"} or not self.resident_kernels:
            raise ValueError(f"resident kernels: packed, ggml; got {self.resident_kernels}")
        if self.omp_wait_policy not in ("default", "PASSIVE", "ACTIVE"):
            raise ValueError(f"omp_wait_policy must be default, PASSIVE or ACTIVE, got {self.omp_wait_policy!r}")
        if self.new_tokens < 2 or self.rounds < 1 or self.stream_steps < 1 or self.prefill_tokens < 16:
            raise ValueError(f"need new_tokens >= 2, rounds >= 1, stream_steps >= 1 and prefill_tokens >= 16: {self}")


def llama_python() -> Path | None:
    """The first environment with llama-cpp-python: .venv-peers (scripts/setup_peers.sh --llama-cpp), .venv-llama."""
    return next((p for p in LLAMA_PYTHONS if p.exists() and subprocess.run(
        [str(p), "-c", "import llama_cpp"], capture_output=True).returncode == 0), None)


def targets(config: ShapesBenchConfig, on_status: Callable[[str], None]) -> list[tuple[str, Path, dict]]:
    """(shape, file, what the JSON says of it) per file measured; synthetic files are written once, cached."""
    from bench.synthetic_gguf import named_target
    from offload.weights.resolve import default_model_gguf
    found = []
    for shape in config.shapes:
        if shape == "default":
            path = default_model_gguf()
            found.append((shape, path, {"shape": shape, "type": "q4_1", "file": path.name,
                                        "file_bytes": path.stat().st_size}))
        else:
            found += [(shape, *named_target(shape, t, on_status)) for t in config.types]
    return found


def prompt_ids(count: int) -> tuple[list[int], list[int]]:
    """(the first chat prompt's ids, `count` ids of held-out prose): every file here has the default tokenizer."""
    import textdata
    from offload import Tokenizer
    from offload.weights.gguf_model import gguf_model_folder
    from offload.weights.resolve import default_model_gguf
    from quant.calibration_data import documentation_prose
    tokenizer = Tokenizer(gguf_model_folder(default_model_gguf()))
    chat = tokenizer.encode_chat([{"role": "user", "content": textdata.records(textdata.CHAT_PROMPTS)[0]["prompt"]}])
    return chat, tokenizer.encode(documentation_prose(0))[:count]


@functools.lru_cache(maxsize=None)
def ggml_library(python: Path | None) -> str | None:
    """The libggml folder of the llama.cpp environment (for our `--cpu-kernel ggml` child), if it has one."""
    if python is None:
        return None
    code = "import importlib.util as u; s = u.find_spec('llama_cpp'); print(list(s.submodule_search_locations)[0])"
    found = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return str(Path(found.stdout.strip()) / "lib") if found.returncode == 0 else None


def _child(cmd: list[str], timeout: int, policy: str, extra_env: dict | None = None) -> dict:
    # PASSIVE as bench/peers.py (no spinning on a shared machine); "default" leaves the environment as a user has it
    env = {**os.environ, **({} if policy == "default" else {"OMP_WAIT_POLICY": policy}), **(extra_env or {})}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": f"exit {proc.returncode}, no JSON: {proc.stderr[-800:]}"}


def run_llama(python: Path, path: Path, ids: dict, config: ShapesBenchConfig) -> dict:
    return _child([str(python), str(ROOT / "bench/llama_cpp_runner.py"), "--model", str(path), "--ids",
                   json.dumps(ids["prompt_ids"]), "--max-new-tokens", str(config.new_tokens), "--ignore-eos",
                   "--threads", str(config.threads), "--context", str(config.prefill_tokens + config.new_tokens + 64),
                   "--warmup-tokens", str(config.warmup_tokens), "--prefill-ids", json.dumps(ids["prefill_ids"])],
                  config.timeout, config.omp_wait_policy)


def run_ours(path: Path, ids: dict, config: ShapesBenchConfig, tier: str, kernel: str = "packed",
             ggml_lib: str | None = None) -> dict:
    if kernel == "ggml" and ggml_lib is None and not os.environ.get("SPECSTREAM_GGML_LIB"):
        return {"error": "no libggml: no llama.cpp environment with llama-cpp-python"}
    # the child's ggml: the environment's own SPECSTREAM_GGML_LIB, else the llama.cpp environment's libggml
    extra_env = {"SPECSTREAM_GGML_LIB": ggml_lib} if ggml_lib and not os.environ.get("SPECSTREAM_GGML_LIB") else {}
    cfg = {**ids, "path": str(path), "tier": tier, "kernel": kernel, "threads": config.threads,
           "max_context": config.prefill_tokens + config.new_tokens + 64, "new_tokens": config.new_tokens,
           "warmup_tokens": config.warmup_tokens, "stream_steps": config.stream_steps}
    return _child([sys.executable, "-m", "bench.shapes_ours", "--cfg", json.dumps(cfg)], config.timeout,
                  config.omp_wait_policy, extra_env)


def _median_of(runs: list[dict]) -> dict:
    """The last good run with its timings replaced by the medians over the good runs."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[-1]
    keys = ("seconds_per_token", "tokens_per_second", "prefill_tokens_per_second", "prefill_seconds")
    return {**good[-1], **{k: round(statistics.median(r[k] for r in good), 5) for k in keys if k in good[-1]},
            "rounds": len(good)}


def measure_file(shape: str, path: Path, info: dict, ids: dict, config: ShapesBenchConfig, python: Path | None,
                 on_status: Callable[[str], None]) -> dict:
    runs: dict[str, list[dict]] = {"llama_cpp": [], **{kernel: [] for kernel in config.resident_kernels}}
    for index in range(config.rounds):
        if python:
            on_status(f"{info['file']}: llama.cpp, round {index + 1}/{config.rounds}")
            runs["llama_cpp"].append(run_llama(python, path, ids, config))
        for kernel in config.resident_kernels:
            on_status(f"{info['file']}: ours resident ({kernel}), round {index + 1}/{config.rounds}")
            runs[kernel].append(run_ours(path, ids, config, "resident", kernel, ggml_library(python)))
    row = {**info, "llama_cpp": _median_of(runs["llama_cpp"]) if python else {"skipped": "no llama-cpp-python"},
           "ours_resident": _median_of(runs[config.resident_kernels[0]]), "streamed": {}}
    if "ggml" in config.resident_kernels[1:]:
        row["ours_resident_ggml"] = _median_of(runs["ggml"])
        theirs = row["llama_cpp"].get("tokens_per_second")
        if theirs and "tokens_per_second" in row["ours_resident_ggml"]:
            row["ours_ggml_over_llama_cpp"] = round(row["ours_resident_ggml"]["tokens_per_second"] / theirs, 3)
    for tier in config.stream_tiers:
        for kernel in config.stream_kernels:
            on_status(f"{info['file']}: ours streamed from {tier}, {kernel}")
            row["streamed"][f"{tier}_{kernel}"] = run_ours(path, ids, config, tier, kernel, ggml_library(python))
    row["bytes_per_token"] = token_bytes(path)
    row.update(verdict(row, GOALS[shape]))
    return row


def run_shapes_bench(config: ShapesBenchConfig, on_status: Callable[[str], None] = print) -> dict:
    import torch
    python = llama_python()
    prompt, prefill = prompt_ids(config.prefill_tokens)
    ids = {"prompt_ids": prompt, "prefill_ids": prefill}
    started, load_at_start = time.perf_counter(), [round(x, 2) for x in os.getloadavg()]
    files = [measure_file(*t, ids, config, python, on_status) for t in targets(config, on_status)]
    llama_version = next((f["llama_cpp"].get("llama_cpp_python_version") for f in files
                          if "llama_cpp_python_version" in f["llama_cpp"]), None)
    return {"bench": "cpu-shapes", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "config": asdict(config), "prompt_tokens": len(prompt), "threads": config.threads,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "llama_cpp_python": llama_version, "goals_resident_decode_over_llama_cpp": GOALS,
            "load_average": {"start": load_at_start, "end": [round(x, 2) for x in os.getloadavg()]},
            "wall_seconds": round(time.perf_counter() - started, 1), "files": files}


def _tuple(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def from_args(args) -> dict:
    """The config's defaults, less the flags given: one flag per field, comma-separated for a tuple field
    (flags: commands/bench_cpu_flags.py)."""
    defaults = ShapesBenchConfig()
    given = {f.name: getattr(args, f.name) for f in fields(ShapesBenchConfig) if getattr(args, f.name) is not None}
    given = {name: _tuple(value) if isinstance(getattr(defaults, name), tuple) else value
             for name, value in given.items()}
    return run_shapes_bench(ShapesBenchConfig(**given), lambda m: print(m, file=sys.stderr, flush=True))


def headline(result: dict) -> str:
    return ("cpu-shapes: " + "; ".join(f"{f['file']}: decode x{f.get('decode_over_llama_cpp')}, prefill "
                                       f"x{f.get('prefill_over_llama_cpp')}" for f in result["files"])
            + "\n" + markdown_table(result))
