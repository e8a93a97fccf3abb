"""GGUF tensors to sharded safetensors, a few rows at a time: each chunk's bytes are read from the file
with pread (no mapping, so the file's pages never count as this process's memory), dequantized with
gguf.quants, put back in Hugging Face row order and appended to a streaming safetensors writer.
Peak memory is a few chunks, whatever the model size."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from offload.weights.gguf_names import hf_tensor_name
from offload.weights.safetensors_io import SafetensorsStreamWriter

if TYPE_CHECKING:                  # the import path loads `gguf` when it runs, not at start-up
    from gguf import GGMLQuantizationType, GGUFReader

MAX_SHARD_BYTES = 2 << 30
MAX_CHUNK_BYTES = 32 << 20          # fp32 bytes dequantized at once
MAX_FP32_PARAMS = 1_000_000_000     # larger models are stored in bf16
INDEX_NAME = "model.safetensors.index.json"


@dataclass(slots=True, frozen=True)
class TensorJob:
    gguf_name: str
    hf_name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]   # row-major (numpy/torch) order, the reverse of GGUF's ne[]
    offset: int              # absolute file offset of the raw bytes
    num_bytes: int           # raw (possibly quantized) bytes
    num_heads: int = 0       # > 0: llama.cpp permuted the rows of each of this many heads

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))


def plan_tensors(reader: GGUFReader, heads: dict[str, int], permuted: bool) -> tuple[list[TensorJob], list[str]]:
    """Jobs for the tensors our loader reads, in file order, and the names of those it does not."""
    jobs, skipped = [], []
    for tensor in reader.tensors:
        mapped = hf_tensor_name(tensor.name)
        if mapped is None:
            skipped.append(tensor.name)
            continue
        hf_name, head_kind = mapped
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        num_heads = heads[head_kind] if permuted and head_kind else 0
        jobs.append(TensorJob(tensor.name, hf_name, tensor.tensor_type, shape, int(tensor.data_offset),
                              int(tensor.n_bytes), num_heads))
    return jobs, skipped


def storage_dtype(jobs: list[TensorJob]) -> torch.dtype:
    return torch.float32 if sum(j.numel for j in jobs) <= MAX_FP32_PARAMS else torch.bfloat16


def plan_shards(jobs: list[TensorJob], dtype: torch.dtype, max_shard_bytes: int) -> list[list[TensorJob]]:
    """Consecutive jobs grouped into shards of at most max_shard_bytes (a larger tensor gets its own)."""
    shards: list[list[TensorJob]] = [[]]
    size = 0
    for job in jobs:
        num_bytes = job.numel * dtype.itemsize
        if shards[-1] and size + num_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(job)
        size += num_bytes
    return shards


def shard_name(index: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_shards(gguf_path: Path, jobs: list[TensorJob], out: Path, dtype: torch.dtype,
                 on_progress: Callable[[int, int], None] | None = None) -> dict[str, str]:
    """Writes the shards and model.safetensors.index.json into `out`; returns the weight map."""
    shards = plan_shards(jobs, dtype, MAX_SHARD_BYTES)
    weight_map: dict[str, str] = {}
    done = 0
    with open(gguf_path, "rb") as source:
        for index, shard in enumerate(shards):
            name = shard_name(index, len(shards))
            specs = {job.hf_name: (dtype, job.shape) for job in shard}
            with SafetensorsStreamWriter(out / name, specs, {"format": "pt"}) as writer:
                for job in shard:
                    for chunk in converted_chunks(source.fileno(), job):
                        writer.append(chunk.to(dtype))
                    weight_map[job.hf_name] = name
                    done += 1
                    if on_progress:
                        on_progress(done, len(jobs))
    total = sum(job.numel for job in jobs) * dtype.itemsize
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index_json, indent=2))
    return weight_map


def converted_chunks(fd: int, job: TensorJob):
    """Yields the tensor in fp32, in Hugging Face order, as consecutive blocks of whole rows
    ([rows, *shape[1:]]); a vector comes in one piece."""
    if job.num_heads and job.shape[0] % (2 * job.num_heads):
        raise ValueError(f"{job.gguf_name}: {job.shape[0]} rows do not split into {job.num_heads} rotary heads")
    num_rows = _num_rows(job)
    step = max(1, MAX_CHUNK_BYTES // (4 * (job.numel // num_rows)))
    if job.num_heads and num_rows > 1:  # the permutation stays inside a head: chunks hold whole heads
        head_rows = num_rows // job.num_heads
        step = max(head_rows, step // head_rows * head_rows)
    for start in range(0, num_rows, step):
        yield _convert_rows(fd, job, start, min(num_rows, start + step))


def _num_rows(job: TensorJob) -> int:
    """Quantization blocks run along the last axis, so a row (of a matrix) is whole blocks."""
    return job.shape[0] if len(job.shape) > 1 else 1


def _convert_rows(fd: int, job: TensorJob, start: int, stop: int) -> torch.Tensor:
    row_bytes = job.num_bytes // _num_rows(job)
    raw = _pread(fd, job.offset + start * row_bytes, (stop - start) * row_bytes)
    shape = (stop - start, *job.shape[1:]) if len(job.shape) > 1 else job.shape
    from gguf.quants import dequantize
    values = dequantize(raw.reshape(stop - start, row_bytes), job.qtype).reshape(shape)  # fp32
    if job.num_heads:
        values = reverse_permute(values, job.num_heads * (stop - start) // _num_rows(job))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def reverse_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k permutation (transformers' LlamaTensorProcessor._reverse_permute_weights):
    within a head of D rows, llama.cpp stores rotary pairs interleaved, [D/2, 2]; Hugging Face stores
    the two halves one after the other, [2, D/2]."""
    half = weights.shape[0] // num_heads // 2
    grouped = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return grouped.swapaxes(2, 1).reshape(weights.shape)


def _pread(fd: int, offset: int, num_bytes: int) -> np.ndarray:
    """[num_bytes] uint8, read into a fresh buffer."""
    buffer = np.empty(num_bytes, dtype=np.uint8)
    view, done = memoryview(buffer), 0
    while done < num_bytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise ValueError(f"GGUF file ends {num_bytes - done} bytes before tensor data it declares")
        done += got
    return buffer
