"""Drafts at run time: our distilled draft folders and any ordinary model sharing the target's tokenizer.

A distilled draft is an ordinary DecoderModel whose LM head covers K target tokens: `forward` returns
logits over the full target vocabulary (out-of-set tokens at -inf, so zero probability) and plugs into
everything that runs a model (`cli.py run --target DRAFT_DIR`); `forward_trimmed` returns the K-row
logits that speculation needs. `Draft` hands tree growth the same view of either kind: log-probabilities
over K rows and the target id of each row. Drafts stay resident on the compute device.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from offload import DecoderModel, ForwardOutput, KVCache, LoadedModel, LoadOptions, Tokenizer, load_model
from offload.memory_limits import default_device_memory
from offload.model.config import ModelConfig
from offload.devices import choose_device, choose_draft_dtype
from offload.loader import stop_token_ids
from offload.weights.packing import LayerLayout
from offload.planner import PlanRequest, make_plan
from offload.resident import to_device
from offload.weights.resolve import is_default_model, resolve_model
from offload.stream import StreamingLayers
from .draft_folder import (check_shared_embedding, is_draft_folder, read_draft_info, read_draft_tensors,
                           target_embedding)
from .penalties import Penalties
from .tokenizer_match import check_tokenizers_match
from .vocab_map import expand_to_target_vocab

DEFAULT_TARGET_DRAFT = Path(__file__).resolve().parent / "drafts" / "smollm2-135m-instruct"  # ships in the package


class DraftDecoderModel(DecoderModel):
    def __init__(self, config: ModelConfig, globals_: dict[str, Tensor], layers, device: torch.device,
                 dtype: torch.dtype, vocab_map: Tensor, head_bias: Tensor) -> None:
        super().__init__(config, globals_, layers, device, dtype)
        self.vocab_map = vocab_map.to(device)                 # [K] target id of each head row
        self.head_bias = head_bias.to(device=device, dtype=torch.float32)   # [K]

    def forward_trimmed(self, tokens: Tensor, cache: KVCache, positions: Tensor | None = None,
                        mask: Tensor | None = None, return_hidden: bool = False,
                        last_only: bool = False, keep_pending: bool = False,
                        rows: Tensor | None = None, prompt_chunks: list | None = None) -> ForwardOutput:
        """As DecoderModel.forward, with logits [B, N, K] over the draft's rows (map: self.vocab_map)."""
        out = super().forward(tokens, cache, positions, mask, return_hidden, last_only, keep_pending, rows, prompt_chunks)
        return ForwardOutput(out.logits + self.head_bias, out.hidden)

    def forward(self, tokens: Tensor, cache: KVCache, positions: Tensor | None = None, mask: Tensor | None = None,
                return_hidden: bool = False, last_only: bool = False, keep_pending: bool = False,
                rows: Tensor | None = None, prompt_chunks: list | None = None) -> ForwardOutput:
        """logits [B, N, V] over target ids; tokens outside the draft's vocabulary get -inf."""
        out = self.forward_trimmed(tokens, cache, positions, mask, return_hidden, last_only, keep_pending, rows,
                                   prompt_chunks)
        return ForwardOutput(expand_to_target_vocab(out.logits, self.vocab_map, self.config.vocab_size), out.hidden)


def load_draft(options: LoadOptions, on_status=None, embed: Tensor | None = None,
               target_folder: str | Path | None = None) -> LoadedModel:
    """Loads the draft folder `options.model` like load_model loads a model, in choose_draft_dtype's dtype.
    The token embedding is `embed` when given (the running target's), else read from the draft's target."""
    folder = Path(options.model).expanduser()
    info = read_draft_info(folder)
    config = ModelConfig.from_file(folder)
    device = choose_device(options.device)
    dtype = choose_draft_dtype(options.dtype, device)
    layer_tensors, stored = read_draft_tensors(folder, config)
    if embed is None:
        if on_status:
            on_status(f"draft {folder.name}: reading the token embedding of its target ({info.target})")
        embed = target_embedding(info, folder, target_folder)
    check_shared_embedding(info, folder, embed)
    # Looked-up embedding rows are cast to the compute dtype, so the table stays in its own dtype: a
    # running target's is shared, not copied.
    globals_ = {"embed": embed.to(device), **to_device({"norm": stored["norm"], "lm_head": stored["lm_head"]},
                                                       device, dtype)}
    global_bytes = sum(t.numel() * t.element_size() for t in globals_.values())
    layout = LayerLayout.from_tensors(layer_tensors[0], dtype)
    plan = make_plan(PlanRequest(
        config=config, layer_bytes=layout.num_bytes, global_bytes=global_bytes,
        device_budget=options.gpu_mem or default_device_memory(device), host_budget=options.ram or 1,
        max_context=options.max_context, max_tree=options.max_pass_tokens, dtype_bytes=dtype.itemsize,
        ring_size=options.ring_size or 2, device_is_cpu=device.type == "cpu"))
    if any(tier != "device" for tier in plan.tier_of):
        raise ValueError(f"draft {folder} does not fit the device budget; a draft must stay resident")
    resident = {i: to_device(layer, device, dtype) for i, layer in enumerate(layer_tensors)}
    layers = StreamingLayers(layout, resident, plan.tier_of, None, None, device, plan.request.ring_size)
    model = DraftDecoderModel(config, globals_, layers, device, dtype, stored["vocab_map"], stored["head_bias"])
    tokenizer = Tokenizer(folder)
    return LoadedModel(folder, config, tokenizer, model, layers, plan, stop_token_ids(folder, config, tokenizer),
                       global_bytes)


def default_draft_for(target: str | None) -> Path | None:
    """The shipped draft for a target spec (None / "default": the embedded model, or a folder derived
    from it, e.g. its SpQR checkpoint, whose config says `"specstream_source": "default"`), if one exists."""
    if not is_default_model(target) and _derived_from(target) != "default":
        return None
    return DEFAULT_TARGET_DRAFT if (DEFAULT_TARGET_DRAFT / "config.json").exists() else None


def require_draft(target: str | None, draft: str | None, alternative: str = "") -> str:
    """The draft a run speculates with: the one named, else the target's shipped draft; a ValueError naming
    --draft (and `alternative`, e.g. " or --no-draft") when there is neither."""
    spec = draft or default_draft_for(target)
    if spec is None:
        raise ValueError(f"this target has no shipped draft: give --draft DIR (see `distill`){alternative}")
    return str(spec)


def _derived_from(target: str) -> str | None:
    config = Path(target).expanduser() / "config.json"
    try:
        return json.loads(config.read_text()).get("specstream_source") if config.is_file() else None
    except (OSError, ValueError):
        return None


class Draft:
    """What tree growth needs of a draft: log-probabilities over its K output rows and each row's target id."""

    def __init__(self, loaded: LoadedModel, target_vocab_size: int, is_self: bool = False,
                 growth_temperature: float = 1.0) -> None:
        self.loaded, self.model = loaded, loaded.model
        self.is_self = is_self          # the target with substitute layers (spec/self_draft.py): shares its cache
        self.growth_temperature = growth_temperature   # its trees' scores for a greedy target (GrowthConfig)
        self.is_trimmed = isinstance(loaded.model, DraftDecoderModel)
        if self.is_trimmed:
            self.vocab_map = loaded.model.vocab_map                                  # [K]
        else:   # padded embedding tables may differ in size; ids past the shared range never occur
            rows = min(loaded.config.vocab_size, target_vocab_size)
            self.vocab_map = torch.arange(rows, device=loaded.model.device)
        self.num_rows = self.vocab_map.numel()
        # target id -> draft row, num_rows where the draft has none (a padding column when penalizing)
        self.row_of = torch.full((target_vocab_size,), self.num_rows, dtype=torch.long, device=self.vocab_map.device)
        self.row_of[self.vocab_map] = torch.arange(self.num_rows, device=self.vocab_map.device)

    @property
    def path(self) -> Path:
        return self.loaded.path

    @property
    def device_bytes(self) -> int:
        """Weights on the device; a distilled draft's embedding is the target's, counted there."""
        embed = self.model.embed
        shared = embed.numel() * embed.element_size() if self.is_trimmed else 0
        return self.loaded.device_bytes - shared

    def log_probs(self, tokens: Tensor, cache: KVCache, positions: Tensor | None = None,
                  mask: Tensor | None = None, last_only: bool = False, keep_pending: bool = False,
                  penalties: Penalties | None = None, paths: Tensor | None = None) -> Tensor:
        """tokens [1, N] -> [N, K] float32 log-probabilities over the draft's rows (or [1, K] last_only),
        under the target's sampling `penalties` when given (paths [N, D]: each row's node and ancestors up
        to the tree's root). The repetition penalty depends on the logits' level (positive ones are divided,
        negative ones multiplied) and a distilled draft's logits sit lower than its target's (top-1 ~13 vs
        ~25 on the default pair), so the rows are first shifted, all by one constant, to the target's
        log-sum-exp at the newest position; presence and frequency penalties do not depend on it."""
        return self.to_log_probs(self.logits(tokens, cache, positions, mask, last_only, keep_pending),
                                 penalties, paths)

    def logits(self, tokens: Tensor, cache, positions: Tensor | None = None, mask: Tensor | None = None,
               last_only: bool = False, keep_pending: bool = False, rows: Tensor | None = None) -> Tensor:
        """tokens [1, N] -> [N, K] float32 logits over the draft's rows ([1, K] last_only, [R, K] rows);
        `cache` a KVCache or a SlotCache (a packed pass over many sequences)."""
        forward = self.model.forward_trimmed if self.is_trimmed else self.model.forward
        logits = forward(tokens, cache, positions, mask, last_only=last_only, keep_pending=keep_pending,
                         rows=rows).logits
        return logits[0, :, :self.num_rows].float()

    def to_log_probs(self, logits: Tensor, penalties: Penalties | None = None, paths: Tensor | None = None,
                     temperature: float = 1.0) -> Tensor:
        """One sequence's logits [N, K] -> log-probabilities [N, K] under its `penalties` (see log_probs), at
        `temperature`."""
        if penalties is not None:
            if penalties.repetition != 1.0:
                logits = logits - logits.logsumexp(-1).mean() + penalties.logit_level
            logits = penalties.apply(logits, paths, self.row_of)
        return torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)

    def close(self) -> None:
        self.loaded.layers.close()


def load_any_draft(spec: str | Path, target: LoadedModel, options: LoadOptions, on_status=None,
                   on_progress=None) -> Draft:
    """A draft for `target`: a distilled draft folder (sharing the target's embedding) or any model the
    runtime loads (HF folder, .gguf, Hub id) with the target's tokenizer, kept wholly on the device."""
    folder = Path(spec).expanduser()
    if is_draft_folder(folder):
        check_tokenizers_match(target.path, folder)
        loaded = load_draft(_draft_options(options, str(folder)), on_status, embed=target.model.embed)
        return Draft(loaded, target.config.vocab_size)
    folder = resolve_model(str(spec), options.allow_download, on_status, on_progress)
    check_tokenizers_match(target.path, folder)
    loaded = load_model(_draft_options(options, str(folder)), on_status)
    if any(tier != "device" for tier in loaded.plan.tier_of):
        loaded.layers.close()
        raise ValueError(f"draft {spec} does not fit the device budget; a draft must stay resident "
                         f"({loaded.plan.tier_of.count('device')} of {len(loaded.plan.tier_of)} layers fit)")
    return Draft(loaded, target.config.vocab_size)


def _draft_options(options: LoadOptions, model: str) -> LoadOptions:
    return LoadOptions(model, options.device, options.dtype, options.allow_download, gpu_mem=options.gpu_mem,
                       ram=options.ram, max_context=options.max_context, max_pass_tokens=options.max_pass_tokens,
                       formats=options.formats)
