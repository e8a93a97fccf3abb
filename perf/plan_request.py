"""The plan request for a weight format not on disk yet: what `plan` places for bf16, SpQR or a llama.cpp
type, from config.json alone (or a GGUF file's header), before anything is converted or loaded."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from offload.devices import DTYPES
from offload.loader import DECODE_VS_TRANSFER
from offload.model.config import ModelConfig
from offload.planner import PlanRequest, request_from_config
from offload.weights.sizes import (LLAMA_CPP_BASE_TYPES, WeightBytes, dtype_weight_bytes, gguf_weight_bytes,
                                   llama_cpp_weight_bytes, spqr_weight_bytes)

SPQR_FORMATS = ("spqr-w3", "spqr-w4", "spqr-w4-g32")
WEIGHT_FORMATS = (*DTYPES, *SPQR_FORMATS, *LLAMA_CPP_BASE_TYPES)


def weight_bytes_for(config: ModelConfig, weights: str | None, gguf_file: Path | None, dtype_name: str) -> WeightBytes:
    """The decoder layers' bytes: a GGUF file's own types (its header), else the `weights` format planned
    from config.json (None: dense in `dtype_name`)."""
    if gguf_file is not None:
        if weights:
            raise ValueError(f"{gguf_file.name} is a GGUF file: the plan reads its tensor types from its header; "
                             f"--weights {weights} plans a config.json only")
        return gguf_weight_bytes(gguf_file, config)
    weights = weights or dtype_name
    if weights in DTYPES:
        return dtype_weight_bytes(config, weights, DTYPES[weights].itemsize)
    if weights in LLAMA_CPP_BASE_TYPES:
        return llama_cpp_weight_bytes(config, weights)
    if weights in SPQR_FORMATS:
        from quant.spqr_format import expected_bits_per_param
        bits, _, groupsize = weights.removeprefix("spqr-w").partition("-g")
        return spqr_weight_bytes(config, weights, expected_bits_per_param(int(bits), int(groupsize or 16)))
    raise ValueError(f"unknown weight format {weights!r}; known: {', '.join(WEIGHT_FORMATS)}")


def request_for_weights(config: ModelConfig, weights: WeightBytes, dtype_bytes: int, device_memory: int,
                        host_memory: int, draft: ModelConfig | None = None, max_context: int = 4096,
                        max_tree: int = 2048, ring_size: int = 2, device_is_cpu: bool = False) -> PlanRequest:
    """A plan request with decoder layers as `weights` stores and streams them; globals, KV cache and
    activations in the compute dtype (`dtype_bytes`). Packed layers need a dense layer to decode into:
    GGUF in place keeps resident layers dense (or packed, where the planner finds that cheaper) and decodes
    streamed ones into one dense workspace (as the loader plans GgufSource); a format decoded at every use
    (SpQR) one dense workspace too."""
    base = request_from_config(config, dtype_bytes, device_memory, host_memory, draft, max_context, max_tree,
                               ring_size, device_is_cpu)
    dense = config.layer_param_count * dtype_bytes
    extra = {}
    if weights.resident_dense:
        extra = dict(resident_layer_bytes=dense, decode_workspace_bytes=dense,
                     decode_vs_transfer=DECODE_VS_TRANSFER[not device_is_cpu])
    elif weights.is_packed:
        extra = dict(decode_workspace_bytes=dense)
    return replace(base, layer_bytes=weights.streamed_layer_bytes, **extra)
