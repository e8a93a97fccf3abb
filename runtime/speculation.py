"""Wiring speculation for a session: which draft, loaded how, and which budget policy sizes the trees."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from offload import LoadedModel, LoadOptions
from offload.cache_sizes import kv_cache_bytes
from offload.devices import choose_device, choose_draft_dtype, choose_dtype
from offload.model.config import ModelConfig
from spec import Draft, default_draft_for, load_any_draft
from spec.self_draft import SELF_DRAFT
from offload.weights.resolve import ModelNotFoundError
from spec.draft_folder import is_draft_folder, read_draft_info, read_model_config
from spec.tokenizer_match import TokenizerMismatchError

AUTO_MAX_BUDGET = {"cpu": 1024, "cuda": 2048}   # the largest tree `--budget auto` plans the workspace for


class DraftUnavailable(Exception):
    """The draft could not be loaded; decoding goes on without speculation."""


@dataclass(slots=True)
class DraftChoice:
    spec: str | None          # what to load: a draft folder, model folder, .gguf or Hub id (None: no draft)


def choose_draft(target: str | None, draft: str | None, no_draft: bool) -> DraftChoice:
    if no_draft:
        return DraftChoice(None)
    if draft is not None:
        return DraftChoice(draft)
    shipped = default_draft_for(target)
    return DraftChoice(str(shipped) if shipped else None)


def max_budget_for(budget: int | None, device: str) -> int:
    """The largest tree a session plans for: the fixed budget, or auto's ceiling on this device."""
    return budget if budget is not None else AUTO_MAX_BUDGET[choose_device(device).type]


def _draft_config(spec: str | None) -> ModelConfig | None:
    """A draft folder's model config, refused in one line where it is missing, corrupt or unusable; None
    without a draft, or for a .gguf file or a Hub id (read only as they load)."""
    folder = Path(spec).expanduser() if spec else None
    if folder is None or not folder.is_dir():
        return None
    return read_model_config(folder)


@dataclass(frozen=True, slots=True)
class DraftFootprint:
    """What a draft will take on the device, from its config alone (zeros without a draft, or for a .gguf
    file or Hub id): its weights, and its KV cache per cached token (the target's plan makes room for both)."""
    weight_bytes: int = 0
    kv_token_bytes: int = 0


def draft_dtype_bytes(spec: str | None, device: str) -> int:
    """Bytes per value of the dtype a draft loads in under "auto": a draft folder choose_draft_dtype's (bf16 on a
    CPU where it measures faster), any other model choose_dtype's."""
    where = choose_device(device)
    if spec and is_draft_folder(Path(spec).expanduser()):
        return choose_draft_dtype("auto", where).itemsize
    return choose_dtype("auto", where).itemsize


def estimated_draft_footprint(spec: str | None, dtype_bytes: int) -> DraftFootprint:
    """A self-draft's substitutes are planned as the layers they replace (LoadOptions.substitute_layer_bytes)."""
    config = None if spec == SELF_DRAFT else _draft_config(spec)
    if config is None:
        return DraftFootprint()
    folder = Path(spec).expanduser()
    layers = config.num_layers * config.layer_param_count
    if is_draft_folder(folder):          # the embedding is the target's; the head has K rows; the final norm
        weights = layers + (read_draft_info(folder).vocab_top + 1) * config.hidden_size
    else:
        weights = layers + config.global_param_count
    return DraftFootprint(weights * dtype_bytes, kv_cache_bytes(config, 1, dtype_bytes))


def load_draft_for(choice: DraftChoice, target: LoadedModel, options: LoadOptions, on_status=None,
                   on_progress=None) -> Draft:
    """The draft, resident on the target's device. A draft that names nothing or speaks another
    tokenizer is the user's to fix (raised as is); any other failure raises DraftUnavailable."""
    try:
        return load_any_draft(choice.spec, target, options, on_status, on_progress)
    except (TokenizerMismatchError, ModelNotFoundError):
        raise
    except Exception as err:   # a broken draft must not stop the target from answering
        raise DraftUnavailable(f"draft {choice.spec} could not be loaded ({err}); decoding without speculation") \
            from err

