"""report.md's pictures, drawn with matplotlib (the optional `bench` extra: pip install 'specstream[bench]').
matplotlib is imported only here and only when a plot is drawn; each function takes the suite's JSON and
returns the PNG's file name, or None when the benchmark behind it has no figures to draw."""
from __future__ import annotations

import statistics
from pathlib import Path

from bench.figures import batch_series, engine_rows

INSTALL_HINT = "pip install 'specstream[bench]'"


def have_matplotlib() -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    return bool(matplotlib.__version__)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")       # files only, never a window
    import matplotlib.pyplot as plt
    return plt


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    _pyplot().close(fig)
    return name


def tokens_per_pass(spec: dict, out: Path) -> str | None:
    modes = spec.get("modes") or {}
    if not modes:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for (mode, report), (marker, style) in zip(modes.items(), [("o", "-"), ("s", "--"), ("^", ":")] * 3):
        rows = report["budgets"]      # greedy: every mode accepts the same tokens, so the lines may coincide
        ax.plot([r["budget"] for r in rows], [r["tokens_per_pass"] for r in rows], marker=marker, linestyle=style,
                markersize=8 if marker == "o" else 5, label=mode)
    peer = spec.get("assisted_generation") or {}
    if peer.get("tokens_per_target_forward"):
        ax.axhline(peer["tokens_per_target_forward"], linestyle="--", color="grey",
                   label="transformers assisted (tokens per target forward)")
    ax.set(xscale="log", xlabel="tree budget (tokens verified per pass)", ylabel="tokens accepted per pass",
           title="Tokens per pass vs budget")
    ax.legend()
    return _save(fig, out, "tokens_per_pass.png")


def pass_time(stream: dict, out: Path) -> str | None:
    """Pass time vs pass size per tier, each beside its raw-bandwidth floor (bytes streamed / raw GB/s)."""
    tiers = dict((stream.get("tiers") or {}).items())
    gpu = stream.get("gpu_reference")
    if not tiers and not gpu:
        return None
    plt = _pyplot()
    panels = [("CPU (this machine)", tiers)]
    if gpu:
        panels.append((f"{gpu['device']} ({gpu['date']})", {"pinned RAM": gpu}))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (title, by_tier) in zip(axes[0], panels):
        lows, highs = [], []
        for tier, report in by_tier.items():
            rows = report["passes"]
            sizes, seconds = [r["tokens"] for r in rows], [r["pass_seconds"] for r in rows]
            raw = statistics.median(r["raw_gbps"] for r in rows)        # the tier's rate, measured per size
            floor = statistics.median(r["bytes_streamed"] for r in rows) / (raw * 1e9)
            line, = ax.plot(sizes, seconds, marker="o", label=f"{tier}: pass time")
            ax.axhline(floor, linestyle="--", color=line.get_color(),
                       label=f"{tier}: bytes / raw bandwidth ({raw:.1f} GB/s)")
            lows.append(min(floor, *seconds))
            highs.append(max(seconds))
        ax.set(xscale="log", yscale="log", xlabel="tokens per pass (tree size)", ylabel="seconds per pass",
               title=title, ylim=(min(lows) / 2, max(highs) * 2))
        ax.legend(fontsize=8)
    return _save(fig, out, "pass_time.png")


def perplexity_bits(quant: dict, out: Path) -> str | None:
    rows = [r for r in quant.get("rows") or [] if r["method"] != "reference"]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    families: dict[str, list[dict]] = {}
    for row in rows:
        families.setdefault(row["method"].split("-")[0], []).append(row)
    for family, members in families.items():
        ax.scatter([r["bits_per_param"] for r in members], [100 * r["mean_increase"] for r in members], label=family)
        for r in members:
            ax.annotate(r["method"], (r["bits_per_param"], 100 * r["mean_increase"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_yscale("symlog", linthresh=1.0)          # +0.5% and +800% on one axis
    ax.set_ylim(-0.5, 3 * max(100 * r["mean_increase"] for r in rows) + 1)
    ax.set(xlabel="bits per parameter", ylabel="mean perplexity increase over fp32 (%)",
           title="Perplexity vs bits per parameter (fp32: 32 bits, 0%)")
    ax.legend()
    return _save(fig, out, "perplexity_bits.png")


def engines(results: dict, out: Path) -> str | None:
    rows = engine_rows(results)
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.2))
    names = [f"{r['engine']} [{r['benchmark']}]" for r in rows]
    colours = ["tab:blue" if r["engine"].startswith("specstream") else "tab:orange" for r in rows]
    values = [r["tokens_per_second"] for r in rows]
    bars = ax.barh(names, values, color=colours)
    ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=7, padding=2)
    ax.invert_yaxis()
    ax.set(xscale="log", xlim=(min(values) / 2, max(values) * 3),
           xlabel="tokens per second, log scale (blue: ours, orange: peers)", title="Tokens per second per engine")
    ax.tick_params(axis="y", labelsize=7)
    return _save(fig, out, "engines.png")


def batch_throughput(batch: dict, out: Path) -> str | None:
    series = batch_series(batch)
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in series.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label or None)
    if any(series):
        ax.legend(fontsize=8)
    ax.set(xscale="log", xlabel="batch size (sequences)", ylabel="tokens per second, all sequences",
           title="Throughput vs batch size")
    return _save(fig, out, "batch_throughput.png")


def judge_curve(judge: dict[str, dict], out: Path) -> str | None:
    """Tokens per pass and answer agreement per judge threshold, one line per task."""
    if not judge:
        return None
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for task, result in judge.items():
        rows = result["thresholds"]
        thresholds = [r["threshold"] for r in rows]
        line, = left.plot(thresholds, [r["tokens_per_pass"] for r in rows], marker="o", label=task)
        left.axhline(result["lossless"]["tokens_per_pass"], linestyle="--", color=line.get_color(),
                     label=f"{task} lossless")
        right.plot(thresholds, [r["answer_agreement"] for r in rows], marker="o", label=task)
    left.set(xscale="log", xlabel="judge threshold (accept when p(important) < t)", ylabel="tokens per pass",
             title="Judge: tokens per pass vs threshold")
    right.set(xscale="log", xlabel="judge threshold", ylabel="answers equal to lossless", ylim=(0, 1.05),
              title="Judge: answer agreement vs threshold")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    return _save(fig, out, "judge_threshold.png")
