"""`bench batch`'s report: the measured rows (bench/batch_bench.py), the two goal ratios, where throughput
saturates and why, and what `plan` predicts for a 70B at SpQR w4 on a 24 GiB GPU with 64 GiB of RAM (the
70B's config.json ships in bench/configs, so an installed copy plans it too)."""
from __future__ import annotations

from pathlib import Path

from bench.batch_bench import BatchBenchConfig, Status, run_batch_bench

GOAL_BATCH_SPEEDUP = 8.0          # disk-cold autoregressive tok/s at batch 16 over batch 1
GOAL_SPECULATION_SPEEDUP = 1.2    # best batched speculative tok/s over best batched autoregressive
SATURATION_GAIN = 1.10            # saturated: the next batch size adds < 10% throughput
COMPUTE_BOUND_SHARE = 0.8         # pass time growing >= 80% as fast as tokens per pass: compute-bound
PLAN_CONFIG = "bench/configs/llama-2-70b"     # as `plan --target` names it in a checkout; installed as package data


def batch_report(config: BatchBenchConfig, prompts: list[list[dict[str, str]]], on_status: Status) -> dict:
    """`bench batch`'s JSON (what `bench all` records too): the rows, their summary and the 70B plan."""
    result = run_batch_bench(config, prompts, on_status=on_status)
    result["target"] = Path(config.target).name if config.target else "default"
    result["summary"] = summarize(result)
    result["plan_70b_spqr_w4"] = plan_70b()
    return result


def summarize(result: dict) -> dict:
    rows = [r for r in result["rows"] if "refused" not in r]
    summary = {"disk_batch16_vs_batch1": _batch_speedup(rows),
               "speculative_vs_autoregressive": {t: _speculation_speedup(rows, t) for t in result["tiers"]},
               "saturation": [_saturation(result, tier, mode) for tier in result["tiers"] for mode in result["modes"]]}
    summary["goals"] = {"disk_batch16_vs_batch1": GOAL_BATCH_SPEEDUP,
                        "speculative_vs_autoregressive": GOAL_SPECULATION_SPEEDUP}
    return summary


def _tps(rows: list[dict], tier: str, mode: str) -> dict[int, float]:
    return {r["batch_size"]: r["tokens_per_second"] for r in rows if r["tier"] == tier and r["mode"] == mode}


def _batch_speedup(rows: list[dict]) -> float | None:
    tps = _tps(rows, "disk", "autoregressive")
    return round(tps[16] / tps[1], 2) if 16 in tps and 1 in tps else None


def _speculation_speedup(rows: list[dict], tier: str) -> float | None:
    plain, speculative = _tps(rows, tier, "autoregressive"), _tps(rows, tier, "speculative")
    if not plain or not speculative:
        return None
    return round(max(speculative.values()) / max(plain.values()), 3)


def _saturation(result: dict, tier: str, mode: str) -> dict:
    """The first batch size after which throughput grows < 10%, and a reason read off the measurements."""
    rows = sorted((r for r in result["rows"] if r["tier"] == tier and r["mode"] == mode),
                  key=lambda r: r["batch_size"])
    measured = [r for r in rows if "refused" not in r]
    out = {"tier": tier, "mode": mode, "saturates_at": None}
    for row, following in zip(measured, measured[1:]):
        if following["tokens_per_second"] < SATURATION_GAIN * row["tokens_per_second"]:
            out.update(saturates_at=row["batch_size"], reason=_reason(row, following, result["prompts"]))
            return out
    refused = [r for r in rows if "refused" in r]
    if refused and measured:
        out.update(saturates_at=measured[-1]["batch_size"], reason=f"memory: {refused[0]['refused']}")
    elif measured:
        out["reason"] = f"still growing >= 10% per step up to batch {measured[-1]['batch_size']}"
    return out


def _reason(row: dict, following: dict, num_prompts: int) -> str:
    if following["batch_size"] > num_prompts:
        return (f"batch {following['batch_size']} has more slots than the {num_prompts} prompts: "
                "the extra slots stay empty")
    token_growth = following["tokens_per_pass"] / max(row["tokens_per_pass"], 1e-9)
    time_growth = following["pass_seconds"] / max(row["pass_seconds"], 1e-9)
    figures = (f"batch {row['batch_size']}->{following['batch_size']}: tokens per pass x{token_growth:.2f}, "
               f"target pass time x{time_growth:.2f}")
    if time_growth >= COMPUTE_BOUND_SHARE * token_growth:
        return f"compute-bound ({figures}: the pass costs per token, streaming no longer dominates)"
    if following["target_share"] < 0.7:
        return (f"host overhead ({figures}; target passes only {following['target_share']:.0%} of the wall time: "
                "drafting and per-sequence bookkeeping dominate)")
    return f"transfer hidden, compute rising ({figures})"


def plan_70b(gpu: str = "rtx4090", device_budget_gib: int = 24, host_budget_gib: int = 64) -> dict:
    """`plan --target bench/configs/llama-2-70b --weights spqr-w4 --gpu rtx4090 --gpu-mem 24GiB
    --ram 64GiB --json` through its library (link: the preset's), and the largest batch that fits."""
    from offload.model.config import ModelConfig
    from offload.planner import largest_batch, make_plan
    from perf.pass_model import gpu_preset
    from perf.plan_projection import ProjectionSettings, project_plan
    from perf.plan_request import request_for_weights, weight_bytes_for
    from perf.projection import default_acceptance_curve
    config = ModelConfig.from_file(Path(__file__).resolve().parent / "configs" / Path(PLAN_CONFIG).name)
    preset = gpu_preset(gpu)
    weights = weight_bytes_for(config, "spqr-w4", None, "bf16")
    request = request_for_weights(config, weights, 2, device_budget_gib << 30, host_budget_gib << 30)
    plan = make_plan(request)
    projection = project_plan(plan, ProjectionSettings(default_acceptance_curve(), preset.link_gbps, preset))
    return {"command": f"plan --target {PLAN_CONFIG} --weights spqr-w4 --gpu {gpu} --gpu-mem {device_budget_gib}GiB "
                       f"--ram {host_budget_gib}GiB --json",
            **plan.as_dict(), "weights": weights.as_dict(), "projection": projection.as_dict(),
            "best_budget": projection.projection.best_budget,
            "tokens_per_second": projection.projection.tokens_per_second,
            "tokens_per_second_meaning": "per sequence (one sequence, speculation at the best budget)",
            "largest_batch": largest_batch(request)}


def summary_line(result: dict) -> str:
    summary = result["summary"]
    speculation = ", ".join(f"{t} x{v}" for t, v in summary["speculative_vs_autoregressive"].items())
    saturation = "; ".join(f"{s['tier']}/{s['mode']} at {s['saturates_at']}" for s in summary["saturation"])
    return (f"bench batch: disk-cold autoregressive batch 16 / batch 1 = x{summary['disk_batch16_vs_batch1']} "
            f"(goal x{GOAL_BATCH_SPEEDUP:g}); best speculative / best autoregressive: {speculation or 'n/a'} "
            f"(goal x{GOAL_SPECULATION_SPEEDUP:g}); saturates: {saturation}")
