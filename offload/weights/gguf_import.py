"""GGUF files are converted once into a cached safetensors folder, so that every later start
memory-maps it. Tensors are dequantized a chunk at a time (offload/weights/gguf_tensors.py), so converting
a 70B GGUF needs a few hundred MB of RAM, not the model in fp32. Config, tokenizer and chat template
come from the GGUF metadata through transformers' GGUF readers, which need no model (nor accelerate)."""
from __future__ import annotations

import copy
import hashlib
import importlib
import json
import os
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from offload.weights.disk_errors import write_text_atomic, writing
from offload.weights.gguf_header import GgufHeader, StringArray
from offload.weights.gguf_names import HF_ARCHITECTURES, SUPPORTED_GGUF_ARCHITECTURES, check_architecture
from offload.weights.gguf_tensors import TensorJob, plan_tensors, storage_dtype, write_shards

if TYPE_CHECKING:                  # imported when a file is converted, not at start-up
    from gguf import GGUFReader

FORMAT_NAME = "gguf-import"
FORMAT_VERSION = 4  # 2: streamed conversion, sharded, bf16 above 1B parameters; 3-4: special tokens from metadata only
SPECIAL_TOKEN_IDS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
                     "unk": "tokenizer.ggml.unknown_token_id", "pad": "tokenizer.ggml.padding_token_id"}
DTYPE_LABELS = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def cache_root() -> Path:
    return Path(os.environ.get("SPECSTREAM_CACHE", Path.home() / ".cache" / "specstream"))


def gguf_cache_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{FORMAT_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{digest}"


def import_gguf(gguf_path: str | Path, on_status: Callable[[str], None] | None = None,
                on_progress: Callable[[int, int], None] | None = None) -> Path:
    """Returns the cached safetensors folder for `gguf_path`, converting it on first use.
    on_progress(done, total) is called after each converted tensor."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    folder = gguf_cache_dir(gguf_path)
    if (folder / "import.json").exists():
        return folder
    reader = open_gguf(gguf_path)
    jobs, skipped = read_tensor_plan(reader, gguf_path)
    dtype = storage_dtype(jobs)
    if on_status:
        on_status(f"converting {gguf_path.name} to safetensors ({DTYPE_LABELS[dtype]}, once) in {folder}")
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    needed = sum(job.numel for job in jobs) * dtype.itemsize
    size = f"{needed / 2**30:.1f} GiB" if needed >= 2**30 else f"{needed / 2**20:.1f} MiB"
    with writing(tmp, "nothing (the partial conversion was removed)", f"rerun the command: the conversion starts "
                 f"over and needs {size} in {cache_root()} (SPECSTREAM_CACHE picks another disk)"):
        _convert(reader, gguf_path, jobs, skipped, dtype, tmp, on_progress)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def _convert(reader: GGUFReader, gguf_path: Path, jobs: list[TensorJob], skipped: list[str], dtype: torch.dtype,
             out: Path, on_progress: Callable[[int, int], None] | None) -> None:
    """Writes the converted folder into `out`; a failed write removes it (a full disk gets its space back)."""
    try:
        out.mkdir(parents=True)
        write_metadata(gguf_path, out, dtype, special_tokens(reader, gguf_path))
        write_shards(gguf_path, jobs, out, dtype, on_progress)
        meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "source": str(gguf_path),
                "dtype": str(dtype).removeprefix("torch."), "skipped_tensors": skipped}
        write_text_atomic(out / "import.json", json.dumps(meta, indent=2))
    except OSError:
        shutil.rmtree(out, ignore_errors=True)
        raise


def open_gguf(gguf_path: Path) -> GGUFReader:
    """The file's parsed header (tensor data stays memory-mapped, unread)."""
    from gguf import GGUFReader
    try:
        return GGUFReader(gguf_path)
    except (ValueError, OSError) as err:
        raise ValueError(f"{gguf_path} is not a readable GGUF file ({err})") from None


def read_tensor_plan(reader: GGUFReader, gguf_path: Path) -> tuple[list[TensorJob], list[str]]:
    """The tensors to convert (and the names of those skipped), from the header only."""
    architecture = _field(reader, "general.architecture", gguf_path)
    check_architecture(architecture, gguf_path)
    num_splits = _field(reader, "split.count", gguf_path, default=1)
    if num_splits > 1:
        raise ValueError(f"{gguf_path} is part 1 of a {num_splits}-file split GGUF; merge the parts first "
                         "(llama-gguf-split --merge) and give the merged file")
    heads = _field(reader, f"{architecture}.attention.head_count", gguf_path)
    # llama.cpp permutes k with the kv head count; a file without one has as many kv heads as heads
    kv_heads = _field(reader, f"{architecture}.attention.head_count_kv", gguf_path, default=heads)
    counts = {"heads": int(heads), "kv_heads": int(kv_heads)}
    return plan_tensors(reader, counts, SUPPORTED_GGUF_ARCHITECTURES[architecture])


def _field(reader: GGUFReader, key: str, path: Path, default=None):
    field = reader.get_field(key)
    if field is None:
        if default is None:
            raise ValueError(f"{path}: GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def write_metadata(gguf_path: Path, out: Path, dtype: torch.dtype, specials: dict[str, tuple[int, str]]) -> None:
    """config.json, generation_config.json and the tokenizer files, from the GGUF metadata; `specials` as
    special_tokens (or header_special_tokens) reads them."""
    import transformers  # heavy; only needed once per GGUF file
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with _one_gguf_parse():
        _write_config_and_tokenizer(transformers, gguf_path, out, dtype, specials)


@contextmanager
def _one_gguf_parse():
    """transformers parses the whole file for the config and again for the tokenizer (4.4 s each for the
    default model's 100 MB); inside this block the second asks get the first parse (a deep copy each, so
    neither sees the other's edits). A transformers without the function simply parses twice."""
    module = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    original = getattr(module, "load_gguf_checkpoint", None)
    parsed: dict[str, dict] = {}

    def parse_once(path, *args, **kwargs):
        if args or kwargs.get("return_tensors") or kwargs.get("model_to_load") is not None:
            return original(path, *args, **kwargs)         # tensors or a model to fill: not shared
        key = str(Path(path).resolve())
        if key not in parsed:
            parsed[key] = original(path, **kwargs)
        return copy.deepcopy(parsed[key])

    if original is not None:
        module.load_gguf_checkpoint = parse_once
    try:
        yield
    finally:
        if original is not None:
            module.load_gguf_checkpoint = original


def _write_config_and_tokenizer(transformers, gguf_path: Path, out: Path, dtype: torch.dtype,
                                specials: dict[str, tuple[int, str]]) -> None:
    kwargs = {"gguf_file": gguf_path.name}
    config = transformers.AutoConfig.from_pretrained(gguf_path.parent, **kwargs)
    if config.model_type not in HF_ARCHITECTURES:
        raise ValueError(f"{gguf_path}: transformers reads it as model type {config.model_type!r}, "
                         f"which is not supported (supported: {', '.join(HF_ARCHITECTURES)})")
    config.architectures = [HF_ARCHITECTURES[config.model_type]]
    for name, (token_id, _) in specials.items():
        if name != "unk":
            setattr(config, f"{name}_token_id", token_id)
    raw = config.to_dict()
    raw.pop("quantization_config", None)
    raw["dtype"] = str(dtype).removeprefix("torch.")
    if "torch_dtype" in raw:  # transformers 4.x
        raw["torch_dtype"] = raw["dtype"]
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    transformers.GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    for name in SPECIAL_TOKEN_IDS:  # one the file does not name stays unset, whatever the reader invented
        setattr(tokenizer, f"{name}_token", specials[name][1] if name in specials else None)
    tokenizer.clean_up_tokenization_spaces = False  # llama.cpp decodes without it; 5.17's reader turned it on
    tokenizer.save_pretrained(out)


def special_tokens(reader: GGUFReader, gguf_path: Path) -> dict[str, tuple[int, str]]:
    """"bos"/"eos"/"unk"/"pad" -> (id, text) as the GGUF metadata names them. transformers' GGUF
    tokenizer reader is not trusted with these: 5.17 made '<|im_start|>' (the bos) the default model's
    eos, so the shipped draft, read with the true eos, was refused as another tokenizer."""
    tokens = _field(reader, "tokenizer.ggml.tokens", gguf_path, default=[])
    ids = {name: int(_field(reader, key, gguf_path, default=-1)) for name, key in SPECIAL_TOKEN_IDS.items()}
    return {name: (token_id, tokens[token_id]) for name, token_id in ids.items() if 0 <= token_id < len(tokens)}


def header_special_tokens(header: GgufHeader) -> dict[str, tuple[int, str]]:
    """special_tokens from the runtime's own header parse: the few token strings read where they lie, not
    the whole file parsed by gguf's reader (seconds on a 100 MB file)."""
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    count = tokens.count if isinstance(tokens, StringArray) else 0
    ids = {name: int(header.metadata.get(key, -1)) for name, key in SPECIAL_TOKEN_IDS.items()}
    wanted = {name: token_id for name, token_id in ids.items() if 0 <= token_id < count}
    texts = header.strings_at("tokenizer.ggml.tokens", list(wanted.values())) if wanted else {}
    return {name: (token_id, texts[token_id]) for name, token_id in wanted.items()}
