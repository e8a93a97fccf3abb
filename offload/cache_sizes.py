"""Bytes and rows of what a plan keeps on the device beside the layers: the KV caches (the target's, a
self-draft's tree rows in it, a small draft's own) and the largest pass's activations."""
from __future__ import annotations

from typing import TYPE_CHECKING

from offload.model.config import ModelConfig

if TYPE_CHECKING:
    from offload.planner import PlanRequest


def kv_cache_bytes(config: ModelConfig, num_tokens: int, dtype_bytes: int) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * num_tokens * dtype_bytes


def workspace_bytes(request: PlanRequest) -> int:
    """Activations of the largest pass: layer intermediates, attention scores and the logits."""
    cfg, tokens = request.config, request.max_tree
    keys = request.num_sequences * request.max_context + tokens
    per_token = (4 * cfg.hidden_size + 3 * cfg.intermediate_size
                 + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim) * request.dtype_bytes
    scores = tokens * keys * (cfg.num_heads * 4 if request.device_is_cpu else 3)
    logits = tokens * cfg.vocab_size * (4 + request.dtype_bytes)
    # a packed pass over many slots gathers their keys and values (one layer at a time) and its mask
    gathered = 2 * keys * cfg.num_kv_heads * cfg.head_dim * request.kv_bytes + tokens * keys \
        if request.num_sequences > 1 else 0
    return tokens * per_token + scores + logits + gathered


def kv_cache_tokens(request: PlanRequest) -> int:
    """Tokens the target's KV cache holds: a context per slot (a tree never takes a slot past its context), and a
    self-draft's tree rows past it (it drafts in this cache: spec/self_speculator.py)."""
    tree_rows = draft_slot_tokens(1, request.max_tree) if request.substitute_layer_bytes else 0
    return request.num_sequences * (request.max_context + tree_rows)


def draft_slot_tokens(max_context: int, max_tree: int) -> int:
    """Tokens one slot of the draft's KV cache holds: the committed sequence plus every node a tree of max_tree
    tokens expands, with slack for expanded nodes that later drop out (growth stops before overflowing it)."""
    return max_context + 2 * max_tree + 256


def draft_cache_tokens(request: PlanRequest) -> int:
    return request.num_sequences * draft_slot_tokens(request.max_context, request.max_tree)
