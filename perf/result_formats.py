"""The result files `plan` reads, each defined once, here, for the code that writes it and the code that reads it.

  device check      {"check": "device", "device", "layers", "pinned_h2d_gbps", "passes": [{"tokens",
                    "pass_seconds", "bytes_streamed", ...}, ...]}: written by tests/gpu/device_check.py (a lent
                    GPU), read by `plan --measured-curve` (perf/pass_model.load_device_check)
  acceptance        tokens per pass by tree budget, read by `plan --acceptance` (perf/projection.py) from any of:
    bench spec      {"bench": "spec", "modes": {mode: {"budgets": [{"budget", "tokens_per_pass"}, ...],
                    "autoregressive": {"tokens_per_pass"}}}}: `bench spec` (bench/spec_bench.py)
    tree simulation {"bench": "tree-simulation", "rows": [{"budget", "tokens_per_pass"}, ...]}: `bench
                    tree-simulation` (bench/tree_simulation.py); its parts gathered in one file:
                    {"bench": "tree-simulation-all-prompts", "parts": [tree simulation, ...]}
    curve file      {"format": "acceptance-curve", "version": 1, "points": [[budget, tokens_per_pass], ...]}
                    (perf/data/acceptance_default.json: one key per variant instead of "points")
"""
from __future__ import annotations

from dataclasses import dataclass

DEVICE_CHECK = "device"                               # under "check"
SPEC = "spec"                                         # under "bench"
TREE_SIMULATION = "tree-simulation"                   # under "bench"
TREE_SIMULATION_PARTS = "tree-simulation-all-prompts"  # under "bench"
ACCEPTANCE_CURVE, ACCEPTANCE_CURVE_VERSION = "acceptance-curve", 1     # under "format", "version"


@dataclass(frozen=True, slots=True)
class DeviceCheck:
    """What `plan` takes from a device check: the measured pass time by tree size and what it moved."""
    points: list[tuple[int, float]]        # (tokens per pass, seconds), ascending
    bytes_streamed: int                    # per pass
    pinned_h2d_gbps: float
    num_layers: int
    device: str


def read_device_check(data: dict, source: str) -> DeviceCheck:
    if data.get("check") != DEVICE_CHECK or not data.get("passes"):
        raise ValueError(f"{source} is not a device-check result with passes (check={data.get('check')!r})")
    passes = data["passes"]
    return DeviceCheck([(p["tokens"], p["pass_seconds"]) for p in passes], passes[0]["bytes_streamed"],
                       data["pinned_h2d_gbps"], data["layers"], data.get("device", "a GPU"))


def acceptance_points(data: dict, source: str, mode: str | None = None) -> list[tuple[int, float]]:
    """(budget, tokens per pass) from any acceptance source above; `mode`: which of a `bench spec` result's
    modes (default: its first)."""
    kind = data.get("format") or data.get("bench")
    readers = {ACCEPTANCE_CURVE: curve_points, SPEC: lambda d: _from_spec(d, mode),
               TREE_SIMULATION: _from_tree_simulation, TREE_SIMULATION_PARTS: _from_parts}
    if kind not in readers:
        raise ValueError(f"{source}: not an acceptance source (format/bench {kind!r}); "
                         f"readable: {', '.join(readers)}")
    return readers[kind](data)


def curve_points(data: dict, key: str = "points") -> list[tuple[int, float]]:
    if data.get("format") != ACCEPTANCE_CURVE or data.get("version") != ACCEPTANCE_CURVE_VERSION:
        raise ValueError(f"not a {ACCEPTANCE_CURVE} v{ACCEPTANCE_CURVE_VERSION}: format={data.get('format')!r}, "
                         f"version={data.get('version')!r}")
    return [(b, a) for b, a in data[key]]


def _from_spec(data: dict, mode: str | None) -> list[tuple[int, float]]:
    modes = data.get("modes") or {}
    name = mode or next(iter(modes), None)
    if name not in modes:
        raise ValueError(f"bench spec result has no mode {name!r}; modes: {', '.join(modes) or 'none'}")
    result = modes[name]
    points = {row["budget"]: row["tokens_per_pass"] for row in result.get("budgets", [])}
    if "autoregressive" in result:
        points[1] = result["autoregressive"]["tokens_per_pass"]
    return sorted(points.items())


def _from_tree_simulation(data: dict) -> list[tuple[int, float]]:
    return [(row["budget"], row["tokens_per_pass"]) for row in data["rows"]]


def _from_parts(data: dict) -> list[tuple[int, float]]:
    """Each part's row: tokens_per_pass = (answer_tokens - num_prompts) / passes (a prompt's first
    answer token comes from the prefill), so passes add up across parts."""
    tokens: dict[int, float] = {}
    passes: dict[int, float] = {}
    for part in data["parts"]:
        part_tokens = part["answer_tokens"] - part["num_prompts"]
        for row in part["rows"]:
            tokens[row["budget"]] = tokens.get(row["budget"], 0.0) + part_tokens
            passes[row["budget"]] = passes.get(row["budget"], 0.0) + part_tokens / row["tokens_per_pass"]
    return sorted((budget, tokens[budget] / passes[budget]) for budget in tokens)
