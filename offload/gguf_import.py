"""GGUF files are dequantized once through transformers' GGUF support and cached as a
safetensors folder, so that every later start memory-maps it."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from .safetensors_io import write_safetensors

FORMAT_NAME = "gguf-import"
FORMAT_VERSION = 1


def cache_root() -> Path:
    return Path(os.environ.get("SPECSTREAM_CACHE", Path.home() / ".cache" / "specstream"))


def gguf_cache_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{FORMAT_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{digest}"


def import_gguf(gguf_path: str | Path, on_status=None) -> Path:
    """Returns the cached safetensors folder for `gguf_path`, converting it on first use."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    folder = gguf_cache_dir(gguf_path)
    if (folder / "import.json").exists():
        return folder
    if on_status:
        on_status(f"converting {gguf_path.name} to safetensors (once) in {folder}")
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _convert(gguf_path, tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def _convert(gguf_path: Path, out: Path) -> None:
    import transformers  # heavy; only needed once per GGUF file
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    kwargs = {"gguf_file": gguf_path.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, **kwargs)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    write_safetensors(out / "model.safetensors", state, {"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "source": str(gguf_path),
            "dtype": str(next(iter(state.values())).dtype)}
    (out / "import.json").write_text(json.dumps(meta, indent=2))
