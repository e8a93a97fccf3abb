"""A multi-GB GGUF for `bench stream --synthetic-gguf` and bench/shapes_bench.py: the default model's
architecture and tokenizer with its hidden and intermediate sizes (and head counts, head size kept) scaled
up, or a named model's exact shape (NAMED_SHAPES: Llama-3.2-1B's, Llama-3.1-8B's), every tensor random
VALID blocks (gguf_blocks.random_blocks) of one type, or of llama.cpp's Q4_K_M mix (Q4_K, with attn_v and
ffn_down Q6_K in the layers offload/weights/sizes.use_more_bits names: the usual download), written one
tensor at a time (RAM holds one tensor, not the file). Made once, cached under $SPECSTREAM_CACHE/bench_gguf/."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from offload.weights.gguf_blocks import packed_nbytes, random_blocks
from offload.weights.gguf_import import cache_root
from offload.weights.gguf_names import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES
from offload.weights.resolve import default_model_gguf
from offload.weights.sizes import use_more_bits

# file type -> its matrices' type; a mix raises some layers' tensors (MORE_BITS) as llama.cpp does
SYNTHETIC_TYPES = {"q4_0": T.Q4_0, "q4_1": T.Q4_1, "q4_k": T.Q4_K, "q8_0": T.Q8_0, "q4_k_m": T.Q4_K}
MORE_BITS = {"q4_k_m": (T.Q6_K, ("attn_v.weight", "ffn_down.weight"))}
ARCH = "llama"
# metadata the shapes below replace; everything else (tokenizer, rope, eps) is the default model's
_REPLACED = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.file_type",
             f"{ARCH}.block_count", f"{ARCH}.embedding_length", f"{ARCH}.feed_forward_length",
             f"{ARCH}.attention.head_count", f"{ARCH}.attention.head_count_kv", f"{ARCH}.rope.dimension_count"}


@dataclass(slots=True)
class SyntheticShape:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    num_layers: int

    def __post_init__(self) -> None:
        if min(self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.num_layers) < 1:
            raise ValueError(f"synthetic GGUF sizes must be positive, got {self}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"heads {self.num_heads} must divide hidden {self.hidden_size} and be a multiple "
                             f"of kv heads {self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """GGUF layer tensor name -> torch shape [rows, cols] (blocks run along cols)."""
        q, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        hidden, inter = self.hidden_size, self.intermediate_size
        shapes = {"input_norm": (hidden,), "post_norm": (hidden,), "q": (q, hidden), "k": (kv, hidden),
                  "v": (kv, hidden), "o": (hidden, q), "gate": (inter, hidden), "up": (inter, hidden),
                  "down": (hidden, inter)}
        return {GGUF_LAYER_NAMES[name]: shape for name, shape in shapes.items()}


# Decoder shapes of real models (their vocabularies and untied heads are not kept: the file has the default
# model's tokenizer and a tied Q4_0 embedding, so its output product is vocab 49,152 x hidden)
NAMED_SHAPES = {"1b": SyntheticShape(2048, 8192, 32, 8, 16),      # Llama-3.2-1B: head size 64
                "8b": SyntheticShape(4096, 14336, 32, 8, 32)}     # Llama-3.1-8B: head size 128


def _type_of(name: str, shape: tuple[int, ...], file_type: str, num_layers: int) -> T:
    """Norms stay F32, as in llama.cpp's files; the embedding (decoded once, never streamed) is Q4_0 to
    keep the file's non-layer bytes small."""
    if len(shape) == 1:
        return T.F32
    if name == GGUF_GLOBAL_NAMES["embed"]:
        return T.Q4_0
    raised, names = MORE_BITS.get(file_type, (None, ()))
    parts = name.split(".", 2)                      # blk, index, tensor name
    if parts[0] == "blk" and parts[2] in names and use_more_bits(int(parts[1]), num_layers):
        return raised
    return SYNTHETIC_TYPES[file_type]


def layers_bytes(shape: SyntheticShape, file_type: str) -> int:
    """The file's decoder layers' bytes, all layers."""
    return sum(packed_nbytes(_type_of(f"blk.{i}.{n}", s, file_type, shape.num_layers), s)
               for i in range(shape.num_layers) for n, s in shape.layer_shapes().items())


def scaled_shape(file_type: str, scale: int, size_gb: float) -> SyntheticShape:
    """The default model's shapes with hidden/intermediate/heads times `scale`; as many layers (at most the
    default's) as make the file's decoder layers about `size_gb` GB."""
    reader = GGUFReader(default_model_gguf())
    base = {key: int(reader.get_field(f"{ARCH}.{key}").contents()) for key in
            ("embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv",
             "block_count")}
    full = SyntheticShape(base["embedding_length"] * scale, base["feed_forward_length"] * scale,
                          base["attention.head_count"] * scale, base["attention.head_count_kv"] * scale,
                          base["block_count"])
    try:
        per_layer = layers_bytes(full, file_type) / full.num_layers
    except ValueError as err:
        raise ValueError(f"--scale {scale}: {err} (K-quants need hidden sizes in multiples of 256: scale 4, 8, 12...)") \
            from None
    full.num_layers = max(1, min(base["block_count"], round(size_gb * 1e9 / per_layer)))
    return full


def synthetic_gguf(file_type: str, shape: SyntheticShape, on_status: Callable[[str], None] = lambda m: None,
                   folder: Path | None = None) -> Path:
    """The cached file for (file type, shape), written on first use."""
    _check_type(file_type)
    folder = folder or cache_root() / "bench_gguf"
    name = (f"synthetic-{file_type}-h{shape.hidden_size}-i{shape.intermediate_size}-"
            f"a{shape.num_heads}x{shape.num_kv_heads}-l{shape.num_layers}.gguf")
    path = folder / name
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    on_status(f"writing {name} ({layers_bytes(shape, file_type) / 1e9:.2f} GB of layers, once)")
    tmp = path.with_name(name + ".partial")
    try:
        _write(tmp, file_type, shape)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return path


def _tensor_shapes(shape: SyntheticShape, vocab: int) -> dict[str, tuple[int, ...]]:
    shapes = {GGUF_GLOBAL_NAMES["embed"]: (vocab, shape.hidden_size), GGUF_GLOBAL_NAMES["norm"]: (shape.hidden_size,)}
    for index in range(shape.num_layers):   # tied embeddings, as the default model: no output.weight
        shapes.update({f"blk.{index}.{name}": s for name, s in shape.layer_shapes().items()})
    return shapes


def _write(path: Path, file_type: str, shape: SyntheticShape) -> None:
    reader = GGUFReader(default_model_gguf())
    vocab = len(reader.get_field("tokenizer.ggml.tokens").contents())
    writer = GGUFWriter(path, ARCH)
    for field in reader.fields.values():
        if field.name not in _REPLACED:
            sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    writer.add_block_count(shape.num_layers)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    shapes = _tensor_shapes(shape, vocab)
    for name, s in shapes.items():
        tensor_type = _type_of(name, s, file_type, shape.num_layers)
        writer.add_tensor_info(name, s, np.dtype(np.float32), packed_nbytes(tensor_type, s), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    generator = np.random.default_rng(0)
    for name, s in shapes.items():
        writer.write_tensor_data(_tensor_data(name, s, file_type, shape.num_layers, generator))
    writer.close()


def _check_type(type_name: str) -> None:
    if type_name not in SYNTHETIC_TYPES:
        raise ValueError(f"synthetic GGUF type {type_name!r}: choose one of {', '.join(SYNTHETIC_TYPES)}")


def _tensor_data(name: str, shape: tuple[int, ...], file_type: str, num_layers: int,
                 generator: np.random.Generator) -> np.ndarray:
    """Norms are ones (an initialized model's): the logits then spread as a trained model's do, so the packed
    output product's exact recount near the top logit (packed_linear.Int4Head) takes a few rows, not thousands."""
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)
    return random_blocks(_type_of(name, shape, file_type, num_layers), shape, generator)


def synthetic_target(type_name: str, scale: int, size_gb: float,
                     on_status: Callable[[str], None] = lambda m: None) -> tuple[Path, dict]:
    """`bench stream --synthetic-gguf`: the cached file and what to say about it in the JSON."""
    _check_type(type_name)
    if scale < 1 or size_gb <= 0:
        raise ValueError(f"--scale must be >= 1 and --size-gb > 0, got {scale} and {size_gb}")
    shape = scaled_shape(type_name, scale, size_gb)
    path = synthetic_gguf(type_name, shape, on_status)
    return path, {"type": type_name, "scale": scale, **_described(path, shape)}


def named_target(shape_name: str, type_name: str, on_status: Callable[[str], None] = lambda m: None,
                 folder: Path | None = None) -> tuple[Path, dict]:
    """A NAMED_SHAPES model in one of SYNTHETIC_TYPES: the cached file and what to say about it in the JSON."""
    if shape_name not in NAMED_SHAPES:
        raise ValueError(f"synthetic shape {shape_name!r}: choose one of {', '.join(NAMED_SHAPES)}")
    shape = NAMED_SHAPES[shape_name]
    path = synthetic_gguf(type_name, shape, on_status, folder)
    return path, {"type": type_name, "shape": shape_name, **_described(path, shape)}


REQUANTIZABLE = {"q5_0": T.Q5_0, "q5_1": T.Q5_1}     # types gguf.quants.quantize writes beyond the 4/8-bit ones


def requantized_default(type_name: str, on_status: Callable[[str], None] = lambda m: None) -> Path:
    """The default model with its decoder matrices decoded and quantized again to `type_name` (gguf.quants'
    reference quantizer), everything else as the file has it: a real model's weights in a type it does not ship
    in, for quality figures (perplexity, greedy answers). Made once, cached under $SPECSTREAM_CACHE/bench_gguf/."""
    if type_name not in REQUANTIZABLE:
        raise ValueError(f"requantized type {type_name!r}: choose one of {', '.join(REQUANTIZABLE)}")
    source = Path(default_model_gguf())
    path = cache_root() / "bench_gguf" / f"{source.stem}-requantized-{type_name}.gguf"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    on_status(f"writing {path.name} (the default model's matrices requantized to {type_name}, once)")
    tmp = path.with_name(path.name + ".partial")
    try:
        _write_requantized(source, tmp, REQUANTIZABLE[type_name])
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return path


def _write_requantized(source: Path, path: Path, qtype: T) -> None:
    import torch
    from offload.weights.gguf_blocks import dequantize, quantize_reference
    reader = GGUFReader(source)
    writer = GGUFWriter(path, ARCH)
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        data, tensor_type = tensor.data, T(tensor.tensor_type)
        shape = tuple(int(n) for n in reversed(tensor.shape))                  # torch order: [rows, cols]
        if tensor.name.startswith("blk.") and len(shape) == 2:
            dense = dequantize(torch.from_numpy(np.array(data)).view(-1), tensor_type, shape)
            data, tensor_type = quantize_reference(qtype, dense.numpy()).reshape(shape[0], -1), qtype
        writer.add_tensor(tensor.name, data, raw_dtype=tensor_type)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()


def _described(path: Path, shape: SyntheticShape) -> dict:
    return {"file": path.name, "file_bytes": path.stat().st_size, "hidden_size": shape.hidden_size,
            "intermediate_size": shape.intermediate_size, "num_heads": shape.num_heads,
            "num_kv_heads": shape.num_kv_heads, "num_layers": shape.num_layers}
