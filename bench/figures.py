"""The suite's headline figures, read from its JSON: tokens per second per engine, and the ratios, each
taken from ONE benchmark's run (both sides measured in the same process sequence, same prompt, same
threads). report.md and the generated record blocks both print these."""
from __future__ import annotations


def engine_rows(results: dict) -> list[dict]:
    """[{engine, tokens_per_second, measure, benchmark}], ours first, then the peers; rows whose benchmark
    did not run are left out (the report lists skipped benchmarks apart)."""
    rows: list[dict] = []
    _spec_rows(results.get("spec") or {}, rows)
    _peer_rows(results.get("peers") or {}, rows)
    _disk_rows(results.get("quant_disk") or {}, rows)
    llama = results.get("llama_cpp") or {}
    if llama.get("tokens_per_second"):
        rows.append(_row("llama.cpp (llama-cpp-python, Q4_1 GGUF)", llama["tokens_per_second"], DECODE, "llama_cpp"))
    for label, points in batch_series(results.get("batch") or {}).items():
        size, tps = max(points, key=lambda p: p[1])     # each series' best batch size
        rows.append(_row(f"specstream batched{', ' + label if label else ''}, {size} sequences", tps,
                         "generated tok/s, all sequences", "batch"))
    return rows


DECODE, ANSWER = "decode tok/s (prefill excluded)", "answer tok/s (prefill included)"


def _row(engine: str, tps: float, measure: str, benchmark: str) -> dict:
    return {"engine": engine, "tokens_per_second": round(float(tps), 3), "measure": measure, "benchmark": benchmark}


def _spec_rows(spec: dict, rows: list[dict]) -> None:
    for mode, report in (spec.get("modes") or {}).items():
        rows.append(_row(f"specstream {mode}, autoregressive", report["autoregressive"]["tokens_per_second"],
                         ANSWER, "spec"))
        auto = report["auto"]
        rows.append(_row(f"specstream {mode}, speculative (auto budget {auto.get('chosen_budget')})",
                         auto["tokens_per_second"], ANSWER, "spec"))
    peer = spec.get("assisted_generation") or {}
    if "tokens_per_second" in peer:
        rows.append(_row("transformers generate", peer["transformers_autoregressive_tokens_per_second"], ANSWER,
                         "spec"))
        rows.append(_row("transformers assisted generation (same draft)", peer["tokens_per_second"], ANSWER, "spec"))


PEER_NAMES = {"ours_resident": "specstream resident", "ours_ram": "specstream streamed from RAM",
              "ours_disk_warm": "specstream streamed from disk (page cache warm)",
              "ours_disk_cold": "specstream streamed from a cold disk",
              "transformers_resident": "transformers generate",
              "accelerate_disk_warm": "accelerate disk offload (warm)",
              "accelerate_disk_cold": "accelerate disk offload (cold)", "accelerate_cpu": "accelerate cpu_offload",
              "airllm": "AirLLM"}


def _peer_rows(peers: dict, rows: list[dict]) -> None:
    for engine, entry in (peers.get("engines") or {}).items():
        if entry.get("seconds_per_token"):
            rows.append(_row(PEER_NAMES.get(engine, engine), 1 / entry["seconds_per_token"], DECODE, "peers"))


def disk_label(row: dict) -> str:
    """A quant-disk row as the tables name it: its label (a SpQR checkpoint by its settings, "GGUF in place",
    ", decoder thread" for the `-ahead` twin), else (a result recorded before rows had labels) its key."""
    return row.get("label") or row["model"]


def _disk_rows(disk: dict, rows: list[dict]) -> None:
    for row in disk.get("rows") or []:
        rows.append(_row(f"specstream cold disk, {disk_label(row)}", row["tokens_per_second"], DECODE,
                         "quant_disk"))
    for row in (disk.get("gguf_in_place") or {}).get("rows") or []:
        if not row["model"].startswith("reference-"):
            rows.append(_row(f"specstream cold disk, {disk_label(row)}", row["tokens_per_second"], DECODE,
                             "quant_disk"))


def batch_series(batch: dict) -> dict[str, list[tuple[int, float]]]:
    """`bench batch`'s rows as one series per (tier, mode), e.g. "disk, speculative" -> sorted (batch size,
    total tok/s); rows that name neither form the series ""."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in batch.get("rows") or []:
        size, tps = row.get("batch_size"), row.get("tokens_per_second")
        if isinstance(size, int) and isinstance(tps, (int, float)):
            label = ", ".join(str(row[key]) for key in ("tier", "mode") if row.get(key))
            series.setdefault(label, []).append((size, float(tps)))
    return {label: sorted(points) for label, points in series.items()}


def ratio_rows(results: dict) -> list[dict]:
    """[{ratio, value, benchmark, reads}]: every comparison the suite made, each within one benchmark."""
    out: list[dict] = []

    def add(name: str, value, benchmark: str, reads: str) -> None:
        if isinstance(value, (int, float)):
            out.append({"ratio": name, "value": round(float(value), 3), "benchmark": benchmark, "reads": reads})

    spec = results.get("spec") or {}
    for mode, report in (spec.get("modes") or {}).items():
        add(f"speculative (auto) / autoregressive, {mode}", report["auto"].get("speedup_vs_autoregressive"), "spec",
            ">1: speculation is faster")
    summary, peer = spec.get("summary") or {}, spec.get("assisted_generation") or {}
    add("our best tokens per pass / assisted generation's tokens per target forward",
        summary.get("ratio_tokens_per_pass_vs_assisted"), "spec", ">1: our trees accept more per pass")
    resident = (spec.get("modes") or {}).get("resident")
    if resident and peer.get("tokens_per_second"):
        add("ours speculative (auto, resident) / transformers assisted generation, tok/s",
            resident["auto"]["tokens_per_second"] / peer["tokens_per_second"], "spec", ">1: ours is faster")
        add("ours autoregressive (resident) / transformers generate, tok/s",
            resident["autoregressive"]["tokens_per_second"] / peer["transformers_autoregressive_tokens_per_second"],
            "spec", ">1: ours is faster")
    for name, value in ((results.get("peers") or {}).get("ratios") or {}).items():
        add(f"{name} (seconds per token)", value, "peers", ">1: ours is faster")
    disk = results.get("quant_disk") or {}
    for rows in (disk.get("rows") or [], (disk.get("gguf_in_place") or {}).get("rows") or []):
        for row in (r for r in rows if not r["model"].startswith("reference-")):
            add(f"{disk_label(row)} / fp32 from a cold disk, tok/s", row.get("speedup_vs_fp32"), "quant_disk",
                ">1: the packed weights are faster")
    llama = results.get("llama_cpp") or {}
    add("llama.cpp / ours resident, decode tok/s", llama.get("llama_cpp_over_ours_resident_tokens_per_second"),
        "llama_cpp + peers", ">1: llama.cpp is faster")
    for row in (results.get("cpu_shapes") or {}).get("files") or []:
        for what in ("decode", "prefill"):
            add(f"ours packed / llama.cpp, resident {what} tok/s, {row['file']}", row.get(f"{what}_over_llama_cpp"),
                "cpu_shapes", ">1: ours is faster")
    batch = results.get("batch") or {}
    for label, points in batch_series(batch).items():
        if len(points) > 1 and points[0][1]:
            add(f"batched {points[-1][0]} / batch {points[0][0]}{f' ({label})' if label else ''}, tok/s",
                points[-1][1] / points[0][1], "batch", ">1: batching adds throughput")
    for tier, value in ((batch.get("summary") or {}).get("speculative_vs_autoregressive") or {}).items():
        add(f"best batched speculative / best batched autoregressive ({tier}), tok/s", value, "batch",
            ">1: speculation adds to batching")
    return out
