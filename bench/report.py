"""report.md from a `bench all` folder: a header (command, date, machine, commit, what --quick reduced),
the tokens per second per engine, the ratios, then one section per benchmark with its table and, where
matplotlib is installed, its plot (bench/plots.py); without it the report says how to get them."""
from __future__ import annotations

import json
from pathlib import Path

from bench import plots
from bench.figures import batch_series, disk_label, engine_rows, ratio_rows
from bench.suite_config import ROOT

JUDGE_RESULTS = "bench/results/judge_eval_*.json"
PROJECTION = "bench/results/projection_llama2_70b_rtx4090.json"     # `plan` runs: no measurement, a model
SECTIONS = {   # heading -> the benchmark (suite step) behind it
    "Tokens per second per engine": None, "Ratios measured in this run": None,
    "Speculation: tokens per pass vs budget": "spec", "Streaming: pass time vs tree size": "stream",
    "Quantization: perplexity vs bits per parameter": "quant",
    "Cold disk: SpQR w4 and the in-place GGUF": "quant_disk", "Draft agreement": "draft",
    "Peers: per-token latency": "peers", "llama.cpp": "llama_cpp",
    "CPU shapes: ours packed against llama.cpp on the same files": "cpu_shapes",
    "Batched decoding: throughput vs batch size": "batch", "AutoJudge: threshold curve": None,
    "Projection: Llama-2-70B with a 7B draft on an RTX 4090": None,
    "Benchmarks in this run": None,
}


def load_results(folder: Path) -> tuple[dict, dict[str, dict]]:
    """(suite.json, {step: its JSON}) of a `bench all` folder."""
    manifest = json.loads((folder / "suite.json").read_text())
    results = {s["name"]: json.loads((folder / s["file"]).read_text()) for s in manifest["steps"]
               if s.get("file") and (folder / s["file"]).is_file()}
    return manifest, results


def judge_results() -> dict[str, dict]:
    return {json.loads(p.read_text()).get("task", p.stem): json.loads(p.read_text())
            for p in sorted(ROOT.glob(JUDGE_RESULTS))}


def table(headers: list[str], rows: list[list]) -> str:
    def cell(value) -> str:
        if isinstance(value, float) and 0 < abs(value) < 0.1:
            text = f"{value:.3g}"           # small values keep three significant digits
        else:
            text = f"{value:.3f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def header(manifest: dict) -> str:
    m = manifest["machine"]
    lines = ["# specstream benchmark report", "",
             f"- command: `{manifest['command']}`", f"- date: {manifest['date']}",
             f"- wall time: {manifest['wall_seconds'] / 60:.1f} min ({manifest['wall_seconds']:.0f} s)"
             + (" (--quick)" if manifest["quick"] else " (full run)"),
             f"- machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, {m['os']}, Python {m['python']}, "
             f"torch {m['torch']} ({manifest['config']['threads']} threads for every engine); load average at "
             f"start {', '.join(map(str, m['load_average_at_start']))}",
             f"- commit: {manifest.get('commit') or 'unknown (not a git checkout)'}"]
    if manifest["quick"]:
        lines += ["- --quick reduced: " + "; ".join(manifest["quick_reduced"])]
    return "\n".join(lines)


def step_state(manifest: dict, results: dict, name: str) -> str | None:
    """None when the benchmark ran; else the line that says why it has no figures."""
    step = next((s for s in manifest["steps"] if s["name"] == name), None)
    if step is None:
        return "Not run in this suite run (left out with --only)."
    if step["status"] == "skipped":
        return f"Skipped: {step['reason']}"
    if step["status"] == "failed":
        return f"Failed: {step['reason']} (the traceback is in {step['file']})"
    return None


def write_report(folder: Path) -> Path:
    manifest, results = load_results(folder)
    judge = judge_results()
    drawn = _draw(folder, results, judge)
    parts = [header(manifest)]
    if drawn is None:
        parts.append(f"Plots: matplotlib is not installed, so this report has tables only. `{plots.INSTALL_HINT}` "
                     "and rerun with `specstream bench all --report-only --out DIR` to add them.")
    for heading, step in SECTIONS.items():
        body = step_state(manifest, results, step) if step else None
        body = body or BODIES[heading](results, manifest, judge)
        picture = (drawn or {}).get(heading)
        parts.append(f"## {heading}\n\n{body}" + (f"\n\n![{heading}]({picture})" if picture else ""))
    path = folder / "report.md"
    path.write_text("\n\n".join(parts) + "\n")
    return path


def _draw(folder: Path, results: dict, judge: dict) -> dict[str, str] | None:
    if not plots.have_matplotlib():
        return None
    drawn = {"Tokens per second per engine": plots.engines(results, folder),
             "Speculation: tokens per pass vs budget": plots.tokens_per_pass(results.get("spec") or {}, folder),
             "Streaming: pass time vs tree size": plots.pass_time(results.get("stream") or {}, folder),
             "Quantization: perplexity vs bits per parameter":
                 plots.perplexity_bits(results.get("quant") or {}, folder),
             "Batched decoding: throughput vs batch size": plots.batch_throughput(results.get("batch") or {}, folder),
             "AutoJudge: threshold curve": plots.judge_curve(judge, folder)}
    return {k: v for k, v in drawn.items() if v}


def _engines(results, manifest, judge) -> str:
    rows = engine_rows(results)
    return (table(["engine", "tok/s", "measure", "benchmark"],
                  [[r["engine"], r["tokens_per_second"], r["measure"], r["benchmark"]] for r in rows])
            + "\n\nRows from different benchmarks differ in prompt count, answer length and measure: compare "
              "within a benchmark (the ratios below)." if rows else "No engine ran.")


def _ratios(results, manifest, judge) -> str:
    rows = ratio_rows(results)
    return table(["ratio", "value", "benchmark", "reads"], [[r["ratio"], r["value"], r["benchmark"], r["reads"]]
                                                            for r in rows]) if rows else "No comparison ran."


def _spec(results, manifest, judge) -> str:
    spec = results["spec"]
    parts = [f"{spec['prompts']} prompts x {spec['max_new_tokens']} tokens, greedy, {spec.get('dtype', 'fp32')}, "
             f"{spec['threads']} threads; target {spec['target']}, draft {spec['draft']}."]
    for mode, r in spec["modes"].items():
        rows = [["autoregressive", 1, r["autoregressive"]["tokens_per_pass"],
                 r["autoregressive"]["tokens_per_second"], 1.0, "-"]]
        rows += [[f"budget {b['budget']}", b["budget"], b["tokens_per_pass"], b["tokens_per_second"],
                  b["speedup_vs_autoregressive"], b.get("identical_to_autoregressive", "-")] for b in r["budgets"]]
        a = r["auto"]
        rows.append([f"auto (chose {a['chosen_budget']})", a["mean_budget"], a["tokens_per_pass"],
                     a["tokens_per_second"], a["speedup_vs_autoregressive"], a.get("identical_to_autoregressive", "-")])
        parts.append(f"**{mode}** (layers {r['layers']})\n\n"
                     + table(["row", "budget", "tok/pass", "tok/s", "x autoregressive", "same answers"], rows))
    peer = spec["assisted_generation"]
    if "tokens_per_second" in peer:
        parts.append(f"transformers assisted generation with the same draft: {peer['tokens_per_target_forward']} "
                     f"tokens per target forward, {peer['tokens_per_second']} tok/s "
                     f"({peer['speedup_vs_transformers_autoregressive']}x its own generate at "
                     f"{peer['transformers_autoregressive_tokens_per_second']} tok/s).")
    else:
        parts.append(f"transformers assisted generation: {peer.get('skipped')}")
    return "\n\n".join(parts)


def _stream(results, manifest, judge) -> str:
    stream, parts = results["stream"], []
    for tier, r in stream["tiers"].items():
        parts.append(f"**{tier}** (layers {r['layers']}, {r['layer_bytes'] / 2**20:.1f} MiB per layer)\n\n" + table(
            ["tokens", "s/pass", "MB streamed", "raw GB/s", "achieved GB/s", "efficiency"],
            [[p["tokens"], p["pass_seconds"], round(p["bytes_streamed"] / 1e6, 1), p["raw_gbps"], p["achieved_gbps"],
              p["efficiency"]] for p in r["passes"]]))
    gpu = stream.get("gpu_reference")
    if gpu:
        parts.append(f"GPU line: {gpu['device']}, {gpu['dtype']}, pinned host-to-device {gpu['pinned_h2d_gbps']} "
                     f"GB/s, from {gpu['source']} ({gpu['date']}; measured on a lent GPU, not re-run here).")
    parts.append("efficiency = (bytes streamed / raw tier bandwidth) / pass time: 1.0 hides all compute.")
    return "\n\n".join(parts)


def _quant(results, manifest, judge) -> str:
    q = results["quant"]
    domains = list(q["rows"][0]["perplexity"])
    skipped = f"\n\nSpQR rows left out: {q['spqr_skipped']}." if q.get("spqr_skipped") else ""
    return (f"{q['tokens_per_domain']} held-out tokens per domain ({', '.join(domains)}); calibration "
            f"{q['calibration']['nsamples']} x {q['calibration']['seqlen']} tokens.\n\n"
            + table(["method", "bits/param", *domains, "mean increase"],
                    [[r["method"], r["bits_per_param"], *[r["perplexity"][d] for d in domains],
                      f"{100 * r['mean_increase']:+.1f}%"] for r in q["rows"]]) + skipped)


def _quant_disk(results, manifest, judge) -> str:
    d = results["quant_disk"]
    gguf = d.get("gguf_in_place") or {}
    # the GGUF call's own fp32 row only where the main call measured none (a quick run without SpQR)
    rows = d["rows"] + [r for r in gguf.get("rows", []) if not d["rows"] or not r["model"].startswith("reference-")]
    parts = [f"Every layer streamed from disk with the page cache dropped before each pass; {d['new_tokens']} tokens, "
             f"{d['rounds']} round(s), medians; `decoder thread`: packed layers dequantized between their read and "
             "their compute (`LoadOptions.decode_ahead`)."]
    if rows:
        parts.append(table(["model", "tok/s", "MiB/pass", "x fp32", "wait ms/layer", "dequantize ms/layer"],
                           [[disk_label(r), r["tokens_per_second"], round(r["bytes_per_pass"] / 2**20, 1),
                             r.get("speedup_vs_fp32", "-"), r["per_layer_ms"]["wait"], r["per_layer_ms"]["dequantize"]]
                            for r in rows]))
    if d.get("spqr_skipped"):
        parts.append(f"SpQR w4 not measured: {d['spqr_skipped']}.")
    if "rows" in gguf:
        parts.append("GGUF in place: the default model's own GGUF file, its blocks read from disk as stored and "
                     "dequantized per layer; its ratio is against the fp32 run of its own call.")
    elif gguf:
        parts.append(f"GGUF in place not measured: {gguf.get('skipped') or gguf.get('error')}")
    return "\n\n".join(parts)


def _draft(results, manifest, judge) -> str:
    d = results["draft"]
    return table(["prompts", "answer tokens", "top-1 agreement", "top-4 coverage", "cost ratio", "estimated speedup"],
                 [[d["num_prompts"], d["num_answer_tokens"], round(d["top1_agreement"], 3),
                   round(d["topk_coverage"].get("4", 0.0), 3), round(d["cost_ratio"], 3),
                   round(d["estimated_speedup"], 2)]])


def _peers(results, manifest, judge) -> str:
    p = results["peers"]
    rows = [[name, e.get("seconds_per_token", "-"), e.get("tokens", "-"), e.get("same_tokens", "-"),
             e.get("error") or e.get("skipped") or ""] for name, e in p["engines"].items()]
    return (f"Prompt of {p['prompt_tokens']} tokens, {p['max_new_tokens']} new tokens, {p['rounds']} round(s), "
            f"{p['threads']} threads, device budget {p['gpu_mem_bytes'] / 2**20:.0f} MiB; every engine in its own "
            "process; seconds per token excludes the prefill.\n\n"
            + table(["engine", "s/token", "tokens", "same tokens as ours", "note"], rows))


def _llama(results, manifest, judge) -> str:
    r = results["llama_cpp"]
    return (f"llama-cpp-python {r['llama_cpp_python']} on {r['model']}, {r['threads']} threads, the same "
            f"{r['prompt_tokens']} prompt ids, greedy: {r['tokens_per_second']} tok/s decode "
            f"({r['seconds_per_token']} s/token), ours resident {r['ours_resident_seconds_per_token']} s/token in "
            f"the peers run: llama.cpp / ours = {r['llama_cpp_over_ours_resident_tokens_per_second']}. Tokens equal "
            f"to ours for the first {r['same_tokens_as_ours_prefix']}. {r['notes']}.")


def _cpu_shapes(results, manifest, judge) -> str:
    from bench.shapes_cost import markdown_table
    r = results["cpu_shapes"]
    return (f"llama-cpp-python {r['llama_cpp_python']} and ours resident (`--cpu-kernel packed`, and `ggml` through "
            "its libggml), each in its own "
            f"process, in turn, {r['threads']} threads, the same {r['prompt_tokens']} prompt ids; decode excludes "
            f"the prefill; prefill is one {r['config']['prefill_tokens']}-token pass from an empty cache. 1B and 8B "
            "rows: synthetic files of those decoder shapes (random valid blocks, the default tokenizer). Goals, "
            "decode over llama.cpp: " + ", ".join(f"{shape} {goal}" for shape, goal in
                                                  r["goals_resident_decode_over_llama_cpp"].items())
            + ".\n\n" + markdown_table(r))


def _batch(results, manifest, judge) -> str:
    series = batch_series(results["batch"])
    if not series:
        return "`bench batch` ran; its report has no (batch size, tok/s) rows: see batch.json."
    sizes = sorted({size for points in series.values() for size, _ in points})
    values = {label: dict(points) for label, points in series.items()}
    header = [f"tok/s, {label}" if label else "tok/s (all sequences)" for label in series]
    return table(["batch size", *header], [[size, *(values[label].get(size, "") for label in series)] for size in sizes])


def _judge(results, manifest, judge) -> str:
    if not judge:
        return f"No judge evaluation in {JUDGE_RESULTS} (see `specstream judge eval`)."
    rows = [[task, r["threshold"], r["tokens_per_pass"], j["lossless"]["tokens_per_pass"], r["answer_agreement"],
             r["tokens_per_second"]] for task, j in judge.items() for r in j["thresholds"]]
    return (f"From {JUDGE_RESULTS} (`judge eval`, not re-run by the suite).\n\n"
            + table(["task", "threshold", "tok/pass", "lossless tok/pass", "answer agreement", "tok/s"], rows))


def _projection(results, manifest, judge) -> str:
    path = ROOT / PROJECTION
    if not path.is_file():
        return f"No projection in {PROJECTION} (see `specstream plan --gpu rtx4090 ... --json`)."
    projection = json.loads(path.read_text())
    rows = [[run["kind"].split(":")[0], run["weights"]["format"], run["best_budget"],
             round(run["tokens_per_second"], 2), round(1 / run["tokens_per_second"], 2),
             "/".join(str(run["layers"][t]) for t in ("device", "ram", "disk"))] for run in projection["runs"]]
    peers = "; ".join(f"{name}: {text}" for name, text in projection["peers"].items())
    return (f"From {PROJECTION} (each row's `plan` command is in the file; nothing measured on a GPU). "
            f"Published: {peers}.\n\n"
            + table(["curve", "weights", "best budget", "tok/s", "s/token", "layers device/RAM/disk"], rows)
            + "\n\nWhere the assumptions differ: the main rows use our default pair's acceptance curve (a 135M "
              "target with its own small draft: 3.3-3.6 tokens per pass) where SpecExec's Llama-2 7B -> 70B pair "
              "accepts 8-20 per pass; the sensitivity rows with SpecExec's sample curve come within 16% of its "
              "5.7 tok/s at 4 bits. Sequoia's 0.57 s/token is fp16 with every layer in host RAM; with 64 GiB our "
              "fp16 plan streams 38 layers from disk. The draft's cost per growth round, 70% of the GPU's peak "
              "for the tree, a 25 GB/s link and the decode rate of packed layers are modelled, not measured.")


def _steps(results, manifest, judge) -> str:
    return table(["benchmark", "status", "seconds", "file", "reason"],
                 [[s["name"], s["status"], s["seconds"], s["file"] or "-", s["reason"] or ""]
                  for s in manifest["steps"]])


BODIES = dict(zip(SECTIONS, (_engines, _ratios, _spec, _stream, _quant, _quant_disk, _draft, _peers, _llama,
                             _cpu_shapes, _batch, _judge, _projection, _steps)))
