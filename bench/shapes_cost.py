"""What bench/shapes_bench.py reads its figures with: the bytes each engine reads per decoded token (from the
file's header), the ratios against llama.cpp with the goal and where a step's time goes, and the table
docs/gguf.md and the `bench all` report show."""
from __future__ import annotations

from pathlib import Path

from offload.weights.gguf_header import read_header
from offload.weights.packed_linear import kernel_bytes, takes


def token_bytes(path: Path) -> dict:
    """Matrix bytes one decoded token reads: as stored (llama.cpp), and in the int4 kernel's layout (ours packed;
    a type it does not take counts as fp32). The embedding counts once, as the output matrix, where it is tied."""
    header = read_header(path)
    tied = "output.weight" not in header.tensors
    stored = packed = 0
    for name, tensor in header.tensors.items():
        if len(tensor.shape) != 2 or (name == "token_embd.weight" and not tied):
            continue
        stored += tensor.num_bytes
        rows, cols = tensor.shape
        packed += kernel_bytes(tensor.qtype, tensor.shape) if takes(tensor.qtype, tensor.shape) else rows * cols * 4
    return {"llama_cpp": stored, "ours_packed": packed}


def verdict(row: dict, goal: float) -> dict:
    """Ours resident over llama.cpp (decode, prefill), the goal, and where our one-token step goes: the int4
    kernel's time and the rest of a profiled step (the profiler's own cost lands in the rest), the bytes per
    second each engine's matrices stream at."""
    ours, theirs = row["ours_resident"], row["llama_cpp"]
    if "tokens_per_second" not in ours or "tokens_per_second" not in theirs:
        return {}
    decode = round(ours["tokens_per_second"] / theirs["tokens_per_second"], 3)
    profiled, kernel_ms = ours["profile"]["step_ms"], ours["profile"]["kernel_ms_per_token"]
    their_ms, nbytes = 1e3 * theirs["seconds_per_token"], row["bytes_per_token"]
    why = {"step_ms": round(1e3 * ours["seconds_per_token"], 2), "profiled_step_ms": profiled,
           "int4_kernel_ms": kernel_ms, "rest_ms": round(profiled - kernel_ms, 2),
           "llama_cpp_step_ms": round(their_ms, 2),
           "ours_kernel_gbps": round(nbytes["ours_packed"] / kernel_ms / 1e6, 2) if kernel_ms else None,
           "llama_cpp_gbps": round(nbytes["llama_cpp"] / their_ms / 1e6, 2),
           "kernel_alone_over_llama_cpp": round(their_ms / kernel_ms, 3) if kernel_ms else None}
    return {"decode_over_llama_cpp": decode, "goal": goal, "goal_met": decode >= goal,
            "prefill_over_llama_cpp": round(ours["prefill_tokens_per_second"] / theirs["prefill_tokens_per_second"], 3),
            "why": why}


def _cell(row: dict, *keys: str) -> str:
    value = row
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return "-" if value is None else str(value)


STREAM_KERNELS = ("dense", "packed", "ggml")


def _streamed(row: dict, tier: str) -> str:
    rates = [_cell(row, "streamed", f"{tier}_{kernel}", "tokens_per_second") for kernel in STREAM_KERNELS]
    return " / ".join(rates)


def markdown_table(result: dict) -> str:
    """One row per file: decode and prefill tok/s of both engines (ours on the int4 kernel, and on ggml's where it
    ran), ours streamed, and the step's split."""
    kernels = " / ".join(STREAM_KERNELS)
    lines = ["| file | GB | decode tok/s llama.cpp | ours | ours / llama.cpp (goal) | ours on ggml / llama.cpp "
             f"| prefill 512 tok/s llama.cpp | ours | ours / llama.cpp | RAM-streamed tok/s {kernels} "
             f"| disk-cold {kernels} | ours profiled step ms: int4 kernel + rest |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["files"]:
        why = row.get("why", {})
        lines.append(f"| {row['file']} | {row['file_bytes'] / 1e9:.2f} "
                     f"| {_cell(row, 'llama_cpp', 'tokens_per_second')} "
                     f"| {_cell(row, 'ours_resident', 'tokens_per_second')} | {_cell(row, 'decode_over_llama_cpp')} "
                     f"({_cell(row, 'goal')}) | {_cell(row, 'ours_ggml_over_llama_cpp')} "
                     f"| {_cell(row, 'llama_cpp', 'prefill_tokens_per_second')} "
                     f"| {_cell(row, 'ours_resident', 'prefill_tokens_per_second')} "
                     f"| {_cell(row, 'prefill_over_llama_cpp')} | {_streamed(row, 'ram')} | {_streamed(row, 'disk')} "
                     f"| {why.get('int4_kernel_ms', '-')} + {why.get('rest_ms', '-')} |")
    return "\n".join(lines)
