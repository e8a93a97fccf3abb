"""llama.cpp's partial offload projected for a card and its host, the peer `plan --draft self` names a winner
against. llama.cpp (`-ngl N`) keeps the last N decoder layers on the GPU and computes the rest on the CPU from
RAM, one token per pass, no speculation; batch-1 decoding reads every weight once per token:

    t = (GPU layers' bytes [+ LM head]) / (memory GB/s x GPU_READ_EFFICIENCY)
      + (CPU layers' bytes [+ LM head]) / ram_gbps
    GPU layers: the most that fit device memory - LLAMA_CPP_BUFFER_BYTES - their own KV cache (fp16, full
    context); the LM head joins them only when every layer is there (llama.cpp's -ngl L+1)

Not modelled: attention over the context (as in the pass model), the activations crossing PCIe (a few KB a
token), the token embedding (one row read a token, kept on the CPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from offload.byte_units import GIB
from offload.cache_sizes import kv_cache_bytes
from offload.model.config import ModelConfig
from offload.weights.gguf_blocks import packed_nbytes
from offload.weights.gguf_header import read_header
from offload.weights.sizes import (LLAMA_CPP_BASE_TYPES, WeightBytes, llama_cpp_weight_bytes,
                                   mix_tensor_type)

GB = 1e9
LLAMA_CPP_BUFFER_BYTES = int(1.5 * GIB)   # CUDA context + llama.cpp's compute buffers at 4K context (assumed)
GPU_READ_EFFICIENCY = 0.8                 # batch-1 GEMV weight reads on the GPU (as the draft's, assumed)
FALLBACK_MIX = "q4_k_m"                   # what a llama.cpp user runs where the plan's format is not llama.cpp's
DEFAULT_RAM_GBPS = 60.0                   # dual-channel DDR5-5600: 89.6 GB/s peak, about two thirds reached


@dataclass(frozen=True, slots=True)
class LlamaCppWeights:
    format: str
    layer_bytes: tuple[int, ...]     # each decoder layer as llama.cpp holds it (the file's bytes)
    head_bytes: int                  # the LM head (output.weight; the embedding where tied)
    note: str = ""                   # why this format, where it is not the plan's


def llama_cpp_weights(config: ModelConfig, weights: WeightBytes, gguf_file: Path | None) -> LlamaCppWeights:
    """The plan's own weights where llama.cpp runs them (a GGUF file, its type mixes, bf16/fp16/fp32), else
    FALLBACK_MIX (SpQR is not a llama.cpp format)."""
    if gguf_file is not None:
        tensors = read_header(gguf_file).tensors
        head = tensors.get("output.weight") or tensors["token_embd.weight"]
        return LlamaCppWeights(gguf_file.name, weights.layer_file_bytes, head.num_bytes)
    head_shape = (config.vocab_size, config.hidden_size)
    mix, note = weights.format, ""
    if mix not in LLAMA_CPP_BASE_TYPES and not weights.is_packed:
        dtype_bytes = weights.streamed_layer_bytes // config.layer_param_count
        return LlamaCppWeights(mix, weights.layer_file_bytes, config.vocab_size * config.hidden_size * dtype_bytes)
    if mix not in LLAMA_CPP_BASE_TYPES:
        mix, note = FALLBACK_MIX, f"{weights.format} is not a llama.cpp format: llama.cpp at {FALLBACK_MIX}"
    head_name = "embed" if config.tie_word_embeddings else "lm_head"
    head = packed_nbytes(mix_tensor_type(mix, head_name, head_shape, 0, config), head_shape)
    return LlamaCppWeights(mix, llama_cpp_weight_bytes(config, mix).layer_file_bytes, head, note)


@dataclass(frozen=True, slots=True)
class LlamaCppOffload:
    weights: LlamaCppWeights
    num_gpu_layers: int
    head_on_gpu: bool
    gpu_bytes: int                   # weights read from GPU memory per token
    cpu_bytes: int                   # weights read from RAM per token
    gpu_budget: int                  # device memory for layers: memory - buffers (KV counted per layer)
    memory_gbps: float
    ram_gbps: float
    fits_ram: bool                   # the CPU's layers fit the host memory (else llama.cpp pages them from disk)

    @property
    def seconds_per_token(self) -> float:
        return self.gpu_bytes / (self.memory_gbps * GB * GPU_READ_EFFICIENCY) + self.cpu_bytes / (self.ram_gbps * GB)

    @property
    def tokens_per_second(self) -> float:
        return 1 / self.seconds_per_token

    def describe(self) -> str:
        num_layers = len(self.weights.layer_bytes)
        head = "LM head on the GPU" if self.head_on_gpu else "LM head on the CPU"
        return (f"llama.cpp -ngl {self.num_gpu_layers + self.head_on_gpu} ({self.weights.format}): "
                f"{self.num_gpu_layers} of {num_layers} layers on the GPU ({self.gpu_bytes / GB:.2f} GB at "
                f"{GPU_READ_EFFICIENCY:.0%} of {self.memory_gbps:g} GB/s), {num_layers - self.num_gpu_layers} from "
                f"RAM ({self.cpu_bytes / GB:.2f} GB at {self.ram_gbps:g} GB/s), {head}: "
                f"{self.seconds_per_token:.3f} s/token, {self.tokens_per_second:.2f} tok/s"
                + ("" if self.fits_ram else "; its CPU layers exceed the RAM: paged from disk, slower than this"))

    def as_dict(self) -> dict:
        return {"format": self.weights.format, "note": self.weights.note, "num_gpu_layers": self.num_gpu_layers,
                "num_cpu_layers": len(self.weights.layer_bytes) - self.num_gpu_layers,
                "head_on_gpu": self.head_on_gpu, "gpu_bytes": self.gpu_bytes, "cpu_bytes": self.cpu_bytes,
                "gpu_budget_bytes": self.gpu_budget, "buffer_bytes": LLAMA_CPP_BUFFER_BYTES,
                "memory_gbps": self.memory_gbps, "gpu_read_efficiency": GPU_READ_EFFICIENCY,
                "ram_gbps": self.ram_gbps, "fits_ram": self.fits_ram,
                "seconds_per_token": self.seconds_per_token, "tokens_per_second": self.tokens_per_second}


def project_llama_cpp(config: ModelConfig, weights: LlamaCppWeights, device_memory: int, host_memory: int,
                      max_context: int, memory_gbps: float, ram_gbps: float) -> LlamaCppOffload:
    if not ram_gbps > 0:
        raise ValueError(f"--ram-gbps must be positive (e.g. {DEFAULT_RAM_GBPS:g} for dual-channel DDR5), "
                         f"got {ram_gbps:g}")
    kv_per_layer = kv_cache_bytes(config, max_context, 2) // config.num_layers
    budget, used, num_gpu = device_memory - LLAMA_CPP_BUFFER_BYTES, 0, 0
    for layer in reversed(weights.layer_bytes):          # llama.cpp offloads the last layers first
        if used + layer + kv_per_layer > budget:
            break
        used, num_gpu = used + layer + kv_per_layer, num_gpu + 1
    head_on_gpu = num_gpu == config.num_layers and used + weights.head_bytes <= budget
    split = config.num_layers - num_gpu
    gpu = sum(weights.layer_bytes[split:]) + weights.head_bytes * head_on_gpu
    cpu = sum(weights.layer_bytes[:split]) + weights.head_bytes * (not head_on_gpu)
    return LlamaCppOffload(weights, num_gpu, head_on_gpu, gpu, cpu, budget, memory_gbps, ram_gbps,
                           cpu <= host_memory)
