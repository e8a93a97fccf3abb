"""`bench spec`'s report: per-row figures summed over prompts, the per-mode report, the summary against
transformers' assisted generation, and the tables printed from it."""
from __future__ import annotations

from offload.planner import Plan
from spec import DecodeResult, DecodeStats, SamplingConfig
from perf.pass_curve import PassTimeCurve


def mode_report(plan: Plan, results: dict, reference: list[list[int]], sampling: SamplingConfig,
                curve: PassTimeCurve, syncs: dict | None = None) -> dict:
    """syncs: row -> host reads and torch ops per step (bench.spec_bench.count_row_syncs), merged into the rows."""
    syncs = syncs or {}
    autoregressive = {**row_report(results["autoregressive"], None, None), **syncs.get("autoregressive", {})}
    base = autoregressive["tokens_per_second"]
    budgets = [{"budget": row, **row_report(rs, reference if sampling.is_greedy else None, base), **syncs.get(row, {})}
               for row, rs in results.items() if isinstance(row, int)]
    auto = {**row_report(results["auto"], reference if sampling.is_greedy else None, base), **syncs.get("auto", {})}
    auto["chosen_budget"] = int(max(auto["budgets_chosen"].items(), key=lambda item: item[1], default=("1", 0))[0])
    t1, tb = curve.seconds(1), curve.seconds(auto["chosen_budget"])
    auto["limit_speedup"] = round(auto["tokens_per_pass"] * t1 / tb, 3)   # tokens/pass at pass-time cost only
    return {"layers": {t: plan.tier_of.count(t) for t in ("device", "ram", "disk")},
            "device_budget": plan.request.device_budget,
            "autoregressive": autoregressive, "budgets": budgets, "auto": auto,
            "pass_seconds": {str(int(n)): round(s, 5) for n, s in curve.points}}


def row_report(results: list[DecodeResult], reference: list[list[int]] | None, base_tps: float | None) -> dict:
    """Figures summed over prompts: tokens per pass = sum(new - 1) / sum(steps); tok/s = tokens / seconds."""
    stats = merge_stats([r.stats for r in results])
    following = sum(max(r.stats.num_new_tokens - 1, 0) for r in results)
    speculation = stats.speculation_report()
    chosen = speculation.pop("budget")     # a fixed budget shrinks only near the end of the context
    row = {"new_tokens": stats.num_new_tokens, "seconds": round(stats.seconds, 3),
           "tokens_per_pass": round(following / max(stats.num_steps, 1), 4),
           "tokens_per_second": round(stats.tokens_per_second, 3), **speculation,
           "budgets_chosen": chosen["histogram"], "mean_budget": chosen["mean"]}
    if base_tps:
        row["speedup_vs_autoregressive"] = round(stats.tokens_per_second / base_tps, 3)
    if reference is not None:
        row["identical_to_autoregressive"] = sum(r.token_ids == ids for r, ids in zip(results, reference))
    return row


def progress_line(mode: str, index: int, count: int, row, result: DecodeResult, reference: DecodeResult) -> str:
    """One finished row (a run cut off by a time limit keeps these): tokens, passes, speed, ms per step
    by part, and whether the output equals autoregressive decoding's."""
    stats, steps = result.stats, max(result.stats.num_steps, 1)
    same = "same" if result.token_ids == reference.token_ids else "DIFFERS"
    return (f"{mode}: prompt {index + 1}/{count} {row}: {stats.num_new_tokens} tokens, {stats.tokens_per_pass:.2f} "
            f"tok/pass, {stats.tokens_per_second:.1f} tok/s, ms/step draft {1e3 * stats.draft_seconds / steps:.1f} "
            f"target {1e3 * stats.target_seconds / steps:.1f} other {1e3 * stats.overhead_seconds / steps:.1f}, {same}")


def merge_stats(parts: list[DecodeStats]) -> DecodeStats:
    total = DecodeStats(speculative=True)
    for part in parts:
        for name in ("num_new_tokens", "num_steps", "tree_tokens", "seconds", "draft_seconds", "target_seconds",
                     "overhead_seconds"):
            setattr(total, name, getattr(total, name) + getattr(part, name))
        total.budgets.update(part.budgets)
        total.yields.update(part.yields)
        size = max(len(total.depth_reached), len(part.depth_reached))
        total.depth_reached = [a + b for a, b in zip(_padded(total.depth_reached, size),
                                                     _padded(part.depth_reached, size))]
        total.last_budget = part.last_budget
    return total


def _padded(values: list[int], size: int) -> list[int]:
    return values + [0] * (size - len(values))


def summarize(report: dict) -> dict:
    """Best fixed budgets per mode; our best tokens per pass over transformers' tokens per target forward;
    disk-cold auto vs autoregressive, and its limit: auto's tokens per pass x t(1) / t(chosen budget), the
    speedup if drafting and overhead cost nothing."""
    modes, peer = report["modes"], report["assisted_generation"]
    best_pass = {m: max(r["budgets"], key=lambda row: row["tokens_per_pass"]) for m, r in modes.items()}
    best_speed = {m: max(r["budgets"], key=lambda row: row["tokens_per_second"]) for m, r in modes.items()}
    first = next(iter(modes))
    cold = modes.get("disk-cold")
    peer_tpp = peer.get("tokens_per_target_forward")
    return {
        "best_budget_tokens_per_pass": {m: {"budget": r["budget"], "tokens_per_pass": r["tokens_per_pass"]}
                                        for m, r in best_pass.items()},
        "best_budget_by_tokens_per_second": {
            m: {"budget": r["budget"], "tokens_per_second": r["tokens_per_second"],
                "speedup_vs_autoregressive": r["speedup_vs_autoregressive"]} for m, r in best_speed.items()},
        "ratio_tokens_per_pass_vs_assisted": round(best_pass[first]["tokens_per_pass"] / peer_tpp, 3)
        if peer_tpp else None,
        "disk_cold_auto_speedup_vs_autoregressive": cold["auto"]["speedup_vs_autoregressive"] if cold else None,
        "disk_cold_limit": cold["auto"]["limit_speedup"] if cold else None,
    }


def print_tables(report: dict, console) -> None:
    """One compact table per mode, then the assisted-generation line (rich, on `console`)."""
    from rich import box
    from rich.table import Table
    for mode, result in report["modes"].items():
        table = Table(title=f"bench spec, {mode} ({report['prompts']} prompts, {report['max_new_tokens']} tokens)",
                      box=box.SIMPLE_HEAD, caption="ms per step: draft / target / overhead; per step: host "
                                                   "reads (syncs on a GPU) and torch ops, counted")
        for column in ("budget", "tok/pass", "tok/s", "xAR", "draft", "target", "ovh", "ovh%", "reads", "ops", "same"):
            table.add_column(column, justify="right")
        rows = [("AR", result["autoregressive"])] + [(str(r["budget"]), r) for r in result["budgets"]]
        rows.append((f"auto ({result['auto']['chosen_budget']})", result["auto"]))
        for name, row in rows:
            step = row["seconds_per_step"]
            table.add_row(name, f"{row['tokens_per_pass']:.2f}", f"{row['tokens_per_second']:.1f}",
                          f"{row.get('speedup_vs_autoregressive', 1.0):.2f}", f"{1e3 * step['draft']:.1f}",
                          f"{1e3 * step['target']:.1f}", f"{1e3 * step['overhead']:.1f}",
                          f"{100 * row['overhead_share']:.0f}", f"{row.get('host_reads_per_step', '-')}",
                          f"{row.get('torch_ops_per_step', '-')}", str(row.get("identical_to_autoregressive", "-")))
        console.print(table)
    peer = report["assisted_generation"]
    if "skipped" in peer:
        console.print(f"assisted generation skipped: {peer['skipped']}")
    else:
        console.print(f"transformers assisted generation: {peer['tokens_per_target_forward']:.2f} tok/forward, "
                      f"{peer['tokens_per_second']:.1f} tok/s ({peer['speedup_vs_transformers_autoregressive']:.2f}x "
                      f"its autoregressive), identical {peer.get('identical_to_autoregressive', '-')}")
