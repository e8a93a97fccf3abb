"""The layer-wise decoder forward: (tokens, positions, mask, cache) -> logits and hidden states.

Weights arrive one decoder layer at a time from a LayerProvider; whether a layer was resident or
streamed from RAM or disk is the provider's business, never the forward's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from offload.host_sync import send
from offload.model.config import ModelConfig
from offload.model.kvcache import KVCache
from offload.model.layers import decoder_layer, linear, rms_norm
from offload.model.masks import apply_sliding_window, causal_mask
from offload.model.rope import Rotary
from offload.weights.row_split import PromptRouting, split_rows, whole_rows


class LayerProvider(Protocol):
    """Hands out each decoder layer's weights on the compute device, in order, once per pass."""

    def begin_pass(self, num_tokens: int) -> None: ...

    def get(self, index: int) -> dict[str, Tensor]: ...

    def release(self, index: int) -> None: ...

    def end_pass(self) -> None: ...

    def abort(self) -> None: ...


@dataclass(slots=True)
class ForwardOutput:
    logits: Tensor              # [B, N, V] (or [B, 1, V] with last_only)
    hidden: Tensor | None       # [B, N, H] final-norm hidden states, when asked for


class DecoderModel:
    def __init__(self, config: ModelConfig, globals_: dict[str, Tensor], layers: LayerProvider,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.config, self.layers, self.device, self.dtype = config, layers, device, dtype
        self.embed = globals_["embed"]
        self.norm = globals_["norm"]
        self.lm_head = globals_.get("lm_head", self.embed)
        self.rotary = Rotary(config.rope, config.head_dim, config.max_position, device)
        self.num_passes = 0
        # float64 where the layers attend in float64 (products by a row-exact kernel: layers.py), so that keys
        # and values are cast once, at their append, not at every pass
        self.cache_dtype = dtype
        self.prompt_routing = PromptRouting()    # where such layers compute long prompt chunks the fast way

    def new_cache(self, max_length: int, batch_size: int = 1) -> KVCache:
        return KVCache(self.config, max_length, self.device, self.cache_dtype, batch_size)

    @torch.inference_mode()
    def forward(self, tokens: Tensor, cache: KVCache, positions: Tensor | None = None,
                mask: Tensor | None = None, return_hidden: bool = False,
                last_only: bool = False, keep_pending: bool = False, rows: Tensor | None = None,
                prompt_chunks: list[tuple[int, int]] | None = None) -> ForwardOutput:
        """tokens [B, N]; positions [B, N] (default: cache.length + arange); mask [B, N, S] or [N, S]
        bool over S = the cache's slots + N (default: causal). Adds N pending slots to `cache`, after
        the pending ones when `keep_pending` (then positions and mask are the caller's), else in
        their place. `cache` is a KVCache or a SlotCache (a packed pass over many sequences). rows [R]:
        only these new tokens' logits (and hidden states) are computed, [B, R, V]. prompt_chunks: the new tokens'
        row ranges that are prompt chunks, which a packed model attends in its dtype and multiplies dense where
        they are long (offload/weights/row_split.py)."""
        tokens = send(tokens, self.device)        # host inputs go down without waiting for the device
        batch, num_new = tokens.shape
        if positions is None:
            positions = torch.arange(cache.length, cache.length + num_new).expand(batch, -1)
        cache.reserve(num_new, positions, keep_pending)      # the cache's bookkeeping reads host positions
        positions = send(positions, self.device)
        if mask is None:
            mask = causal_mask(cache.num_slots - num_new, num_new, self.device)
        mask = self._full_mask(send(mask, self.device).expand(batch, -1, -1), positions, cache)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        x = F.embedding(tokens, self.embed).to(self.dtype)
        self.layers.begin_pass(batch * num_new)
        fast_chunks, dense_chunks = self.prompt_routing.fast(prompt_chunks)
        dense = getattr(self.layers, "dense", None) if dense_chunks else None
        try:
            for index in range(self.config.num_layers):
                w = whole_rows(self.layers.get(index), fast_chunks)
                dense_layer = dense(index) if dense else None
                if dense_layer is not None:
                    w = split_rows(w, dense_layer, dense_chunks)
                x = decoder_layer(x, w, self.config, index, cos, sin, mask[:, None], cache, fast_chunks)
                self.layers.release(index)
        except BaseException:   # Ctrl-C or a load error mid-pass: the provider resets its ring
            self.layers.abort()
            raise
        finally:
            self.layers.end_pass()
        self.num_passes += 1
        if last_only:
            x = x[:, -1:]
        elif rows is not None:
            x = x[:, send(rows, self.device)]
        hidden = rms_norm(x, self.norm, self.config.rms_norm_eps)
        logits = linear(hidden, self.lm_head).float()
        return ForwardOutput(logits, hidden if return_hidden else None)

    def synchronize(self) -> None:
        """Waits for queued device work (for honest timings on an asynchronous device)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _full_mask(self, mask: Tensor, positions: Tensor, cache: KVCache) -> Tensor:
        expected = cache.num_slots
        if mask.shape[-1] != expected:
            raise ValueError(f"mask covers {mask.shape[-1]} keys; cache + new tokens = {expected}")
        window = self.config.sliding_window
        if window is None or expected <= window:
            return mask
        return apply_sliding_window(mask, cache.key_positions().to(positions.device), positions, window)
