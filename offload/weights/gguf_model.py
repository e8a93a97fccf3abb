"""What a GGUF file must say about its model before it runs in place, and the small folder that holds
its config.json, generation_config.json and tokenizer files (no weights): written once from the GGUF
metadata by the import's own code (transformers' GGUF readers), cached under
$SPECSTREAM_CACHE/gguf-inplace/ keyed by the file's path, size and mtime. `gguf.json` in the folder
names the GGUF file the weights are read from."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from offload.weights.gguf_blocks import SUPPORTED_TYPES
from offload.weights.gguf_header import CorruptGgufError, GgufHeader, read_header
from offload.weights.gguf_names import check_architecture, hf_tensor_name
from offload.weights.gguf_tensors import MAX_FP32_PARAMS

MARKER = "gguf.json"
FORMAT_NAME, FORMAT_VERSION = "gguf-inplace", 1
FALLBACK_FLAG = "--gguf-import"
_BLOCK = re.compile(r"blk\.(\d+)\.")


def check_model_metadata(header: GgufHeader) -> str:
    """Refuses (one line naming the file and the key or tensor) metadata that contradicts itself or the
    tensors, and tensor types this build cannot decode in place; returns the architecture."""
    path, arch = header.path, header.field("general.architecture")
    try:
        check_architecture(arch, path)
    except ValueError as err:
        raise CorruptGgufError(str(err)) from None
    splits = int(header.metadata.get("split.count", 1))
    if splits > 1:
        raise CorruptGgufError(f"{path} is part 1 of a {splits}-file split GGUF; merge the parts first "
                               "(llama-gguf-split --merge) and give the merged file")
    hidden, heads = int(header.field(f"{arch}.embedding_length")), int(header.field(f"{arch}.attention.head_count"))
    kv_heads = int(header.metadata.get(f"{arch}.attention.head_count_kv", heads))
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise CorruptGgufError(f"{path}: {arch}.attention.head_count {heads} is not a positive multiple of "
                               f"{arch}.attention.head_count_kv {kv_heads}")
    if f"{arch}.attention.key_length" not in header.metadata and hidden % heads:
        raise CorruptGgufError(f"{path}: {arch}.attention.head_count {heads} does not divide "
                               f"{arch}.embedding_length {hidden}")
    _check_blocks(header, arch)
    _check_types(header)
    return arch


def _check_blocks(header: GgufHeader, arch: str) -> None:
    num_blocks = int(header.field(f"{arch}.block_count"))
    found = {int(m.group(1)) for m in map(_BLOCK.match, header.tensors) if m}
    if found != set(range(num_blocks)):
        missing = sorted(set(range(num_blocks)) - found)
        detail = f"block {missing[0]} has no tensors" if missing else f"tensors name block {max(found)}"
        raise CorruptGgufError(f"{header.path}: {arch}.block_count is {num_blocks} but {detail}")


def _check_types(header: GgufHeader) -> None:
    supported = ", ".join(t.name for t in SUPPORTED_TYPES)
    for tensor in header.tensors.values():
        if hf_tensor_name(tensor.name) is None:
            continue
        if tensor.qtype not in [int(t) for t in SUPPORTED_TYPES]:
            fallback = (f"; {FALLBACK_FLAG} dequantizes the file to safetensors instead" if tensor.num_bytes is not None
                        else "")
            raise CorruptGgufError(f"{header.path}: tensor {tensor.name!r} is {tensor.type_name}, which does not "
                                   f"run in place (supported: {supported}){fallback}")
        if tensor.num_bytes is None:
            raise CorruptGgufError(f"{header.path}: tensor {tensor.name!r} has shape {list(tensor.shape)}, which "
                                   f"{tensor.type_name} blocks cannot hold")


def storage_dtype_name(header: GgufHeader) -> str:
    """The dtype the import would store this model in: fp32 up to 1B parameters, else bf16."""
    numel = sum(int(np.prod(t.shape)) for t in header.tensors.values() if hf_tensor_name(t.name) is not None)
    return "float32" if numel <= MAX_FP32_PARAMS else "bfloat16"


def metadata_cache_dir(gguf_path: Path) -> Path:
    from offload.weights.gguf_import import cache_root
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{FORMAT_VERSION}"
    return cache_root() / "gguf-inplace" / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def gguf_model_folder(gguf_path: str | Path, on_status: Callable[[str], None] | None = None) -> Path:
    """The config + tokenizer folder of a GGUF run in place, written on first use (no weights copied)."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    folder = metadata_cache_dir(gguf_path)
    if (folder / MARKER).is_file():
        return folder
    header = read_header(gguf_path)
    check_model_metadata(header)
    if on_status:
        on_status(f"reading {gguf_path.name}'s config and tokenizer (once) into {folder}")
    from offload.weights.gguf_import import header_special_tokens, write_metadata
    import torch
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_metadata(gguf_path, tmp, getattr(torch, storage_dtype_name(header)), header_special_tokens(header))
    marker = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "source": str(gguf_path.resolve())}
    (tmp / MARKER).write_text(json.dumps(marker, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def gguf_file_of(folder: Path) -> Path | None:
    """The GGUF file a model folder runs in place, or None for any other folder."""
    marker = folder / MARKER
    if not marker.is_file():
        return None
    raw = json.loads(marker.read_text())
    if raw.get("format") != FORMAT_NAME or raw.get("version") != FORMAT_VERSION:
        raise CorruptGgufError(f"{marker}: format {raw.get('format')!r} version {raw.get('version')!r}; this build "
                               f"reads {FORMAT_NAME} version {FORMAT_VERSION}")
    return Path(raw["source"])
