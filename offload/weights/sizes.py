"""Bytes a model's weights take in a storage format: from config.json and the format's rules alone, or
from a GGUF file's header (tensor types and shapes; no tensor data is read).

    bf16 / fp16 / fp32        every tensor dense
    spqr-w3 / -w4 / -w4-g32   decoder layers at SpQR's expected bits per parameter, globals 16-bit
    q4_k_m / q5_k_m / q8_0    llama.cpp's tensor types for that file type (below); bytes per tensor
                              from the ggml block sizes (gguf_blocks.packed_nbytes)

The engine streams a GGUF layer as one buffer of per-tensor slots, each as large as that tensor's
largest encoding over all layers (offload/weights/gguf_source.py): a Q4_K_M layer streams at the size
of its Q6_K layers. `streamed_layer_bytes` is that buffer; `layer_file_bytes` what the file holds.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path


from offload.model.config import ModelConfig
from offload.weights.ggml_types import GGMLType as T
from offload.weights.gguf_blocks import block_geometry, packed_nbytes
from offload.weights.gguf_header import CorruptGgufError, GgufHeader, GgufTensorInfo, read_header
from offload.weights.gguf_model import check_model_metadata
from offload.weights.gguf_names import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES
from offload.weights.gguf_source import expected_shapes
from offload.weights.packing import ALIGNMENT
from offload.weights.source import layer_tensor_names

# llama.cpp's llama_tensor_get_type (src/llama-quant.cpp) for these file types, dense llama-family models
# (no experts, not Falcon):
#   every 2-D weight: the file type's base type (token_embd.weight included)
#   output.weight: Q6_K unless the base is Q8_0 (Q8_0 where the row length is not a multiple of 256)
#   attn_v, ffn_down (Q4_K_M, Q5_K_M): Q6_K in layers where use_more_bits(layer, num_layers)
#   attn_v of a model llama.cpp calls 70B (80 layers with grouped KV heads, llama-model.cpp): Q3_K/Q4_K
#       raised to Q5_K ("8 heads share the same attn_v weights ... nearly negligible increase in size")
#   a row length the block does not divide falls back: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, then F16
#   1-D tensors (norms, biases): F32 (llama.cpp quantizes only tensors of 2 or more dimensions)
LLAMA_CPP_BASE_TYPES = {"q4_k_m": T.Q4_K, "q5_k_m": T.Q5_K, "q8_0": T.Q8_0}
_MORE_BITS_MIXES = ("q4_k_m", "q5_k_m")
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


@dataclass(slots=True, frozen=True)
class WeightBytes:
    """A model's weights as stored in one format (see the module docstring)."""
    format: str                        # "bf16", "spqr-w4", "q4_k_m", "gguf" (types read from a file)
    layer_file_bytes: tuple[int, ...]  # each decoder layer as stored
    streamed_layer_bytes: int          # one layer as the engine holds and streams it (RAM tier, ring slot)
    global_file_bytes: int             # embeddings, final norm, LM head as stored
    is_packed: bool                    # decoded on the device before use
    resident_dense: bool = False       # resident layers decoded once at load and kept dense (GGUF in place)
    type_counts: tuple[tuple[str, int], ...] = ()   # tensor type -> tensors, most common first

    def __post_init__(self) -> None:
        if not self.layer_file_bytes or min(self.layer_file_bytes) <= 0 or self.streamed_layer_bytes <= 0:
            raise ValueError(f"{self.format}: layer bytes must be positive, got {self.layer_file_bytes[:3]}, "
                             f"{self.streamed_layer_bytes}")

    @property
    def total_file_bytes(self) -> int:
        return sum(self.layer_file_bytes) + self.global_file_bytes

    def as_dict(self) -> dict:
        return {"format": self.format, "file_bytes": self.total_file_bytes,
                "layer_file_bytes": sum(self.layer_file_bytes), "global_file_bytes": self.global_file_bytes,
                "streamed_layer_bytes": self.streamed_layer_bytes, "packed": self.is_packed,
                "types": dict(self.type_counts)}


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp: the first and last eighth of the layers, and every third layer in between."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def is_llama_cpp_70b(config: ModelConfig) -> bool:
    """llama.cpp's LLM_TYPE_70B for llama-family files: 80 layers and fewer KV heads than heads."""
    return config.num_layers == 80 and config.num_kv_heads < config.num_heads


def mix_tensor_type(mix: str, name: str, shape: tuple[int, ...], layer: int, config: ModelConfig) -> T:
    """The type llama.cpp's `mix` file type gives tensor `name` (a canonical layer name, or "embed",
    "norm", "lm_head") of torch shape `shape` in decoder layer `layer` (ignored for globals)."""
    if mix not in LLAMA_CPP_BASE_TYPES:
        raise ValueError(f"unknown llama.cpp file type {mix!r}; known: {', '.join(LLAMA_CPP_BASE_TYPES)}")
    base = LLAMA_CPP_BASE_TYPES[mix]
    if len(shape) < 2:
        return T.F32
    is_output = name == "lm_head" or (name == "embed" and config.tie_word_embeddings)
    if is_output:
        return T.Q8_0 if base == T.Q8_0 or shape[-1] % 256 else T.Q6_K
    qtype = base
    if name in ("v", "down") and mix in _MORE_BITS_MIXES and use_more_bits(layer, config.num_layers):
        qtype = T.Q6_K
    if name == "v" and is_llama_cpp_70b(config) and qtype in (T.Q3_K, T.Q4_K):
        qtype = T.Q5_K
    return _fit_row(qtype, shape[-1])


def _fit_row(qtype: T, row_length: int) -> T:
    while row_length % block_geometry(qtype)[0]:
        qtype = _FALLBACK.get(qtype, T.F16)
    return qtype


def slot_layout_bytes(layers: list[dict[str, int]]) -> int:
    """One streamed layer as GgufSource lays it out: per tensor, its largest size over all layers,
    rounded up to ALIGNMENT bytes."""
    return sum(-(-max(layer[name] for layer in layers) // ALIGNMENT) * ALIGNMENT for name in layers[0])


def dtype_weight_bytes(config: ModelConfig, dtype_name: str, dtype_bytes: int) -> WeightBytes:
    layer = config.layer_param_count * dtype_bytes
    return WeightBytes(dtype_name, (layer,) * config.num_layers, layer, config.global_param_count * dtype_bytes,
                       is_packed=False, type_counts=((dtype_name, config.num_layers),))


def spqr_weight_bytes(config: ModelConfig, name: str, bits_per_param: float) -> WeightBytes:
    """SpQR decoder layers at `bits_per_param` (quant.spqr_format.expected_bits_per_param); globals fp16."""
    layer = int(config.layer_param_count * bits_per_param / 8)
    return WeightBytes(name, (layer,) * config.num_layers, layer, config.global_param_count * 2, is_packed=True,
                       type_counts=((f"{name} ({bits_per_param:.2f} bits)", config.num_layers),))


def llama_cpp_weight_bytes(config: ModelConfig, mix: str) -> WeightBytes:
    """A GGUF file of llama.cpp's file type `mix`, from config.json alone."""
    shapes = expected_shapes(config)
    layer_types = [{name: mix_tensor_type(mix, name, shapes[name], index, config)
                    for name in layer_tensor_names(config)} for index in range(config.num_layers)]
    layers = [{name: packed_nbytes(qtype, shapes[name]) for name, qtype in types.items()} for types in layer_types]
    global_shapes = {"embed": (config.vocab_size, config.hidden_size), "norm": (config.hidden_size,)}
    if not config.tie_word_embeddings:
        global_shapes["lm_head"] = (config.vocab_size, config.hidden_size)
    global_types = {name: mix_tensor_type(mix, name, shape, 0, config) for name, shape in global_shapes.items()}
    counts = Counter(t.name for types in [*layer_types, global_types] for t in types.values())
    return WeightBytes(mix, tuple(sum(layer.values()) for layer in layers), slot_layout_bytes(layers),
                       sum(packed_nbytes(t, global_shapes[n]) for n, t in global_types.items()), is_packed=True,
                       resident_dense=True, type_counts=tuple(counts.most_common()))


def gguf_weight_bytes(path: str | Path, config: ModelConfig) -> WeightBytes:
    """A GGUF file's real tensor types and bytes, from its header (checked as the engine checks it)."""
    header = read_header(path)
    check_model_metadata(header)
    names = layer_tensor_names(config)
    layers = [{name: _tensor(header, f"blk.{index}.{GGUF_LAYER_NAMES[name]}") for name in names}
              for index in range(config.num_layers)]
    tensors = header.tensors
    globals_ = [tensors[gguf_name] for gguf_name in GGUF_GLOBAL_NAMES.values() if gguf_name in tensors]
    sizes = [{name: info.num_bytes for name, info in layer.items()} for layer in layers]
    counts = Counter(info.type_name for info in [*globals_, *(i for layer in layers for i in layer.values())])
    return WeightBytes("gguf", tuple(sum(layer.values()) for layer in sizes), slot_layout_bytes(sizes),
                       sum(info.num_bytes for info in globals_), is_packed=True, resident_dense=True,
                       type_counts=tuple(counts.most_common()))


def _tensor(header: GgufHeader, gguf_name: str) -> GgufTensorInfo:
    info = header.tensors.get(gguf_name)
    if info is None or info.num_bytes is None:
        raise CorruptGgufError(f"{header.path}: tensor {gguf_name!r} is missing or has a type this build cannot size")
    return info
