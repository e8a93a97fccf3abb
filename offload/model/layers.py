"""The math of one decoder layer (Llama / Mistral / Qwen2 / Qwen3), as pure functions of weights."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from offload.model.config import ModelConfig
from offload.model.kvcache import KVCache
from offload.model.rope import apply_rotary


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Normalises in float32 over the last dim, casts back, then scales (as transformers does)."""
    if x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu":
        # torch's fused CPU kernel: the same bits as the steps below (tests/test_layers.py), one op instead of five
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))
    return weight * (normed if x.dtype == torch.float32 else normed.to(x.dtype))


def linear(x: Tensor, weight, bias: Tensor | None = None) -> Tensor:
    """x [..., in] @ weight [out, in]^T; a packed weight object supplies its own matmul."""
    if isinstance(weight, Tensor):
        return F.linear(x, weight, bias)
    out = weight.matmul(x)
    return out if bias is None else out + bias


def decoder_layer(x: Tensor, w: dict[str, Tensor], config: ModelConfig, layer_index: int,
                  cos: Tensor, sin: Tensor, mask: Tensor, cache: KVCache,
                  fast_chunks: list[tuple[int, int]] | None = None) -> Tensor:
    """x [B, N, H] -> [B, N, H]; mask [B, 1, N, cache.length + N] bool (True = may attend). fast_chunks: rows of
    prompt chunks that attend in x's dtype, over their own keys, even where the others attend in float64."""
    x = x + _attention(rms_norm(x, w["input_norm"], config.rms_norm_eps), w, config, layer_index,
                       cos, sin, mask, cache, fast_chunks)
    h = rms_norm(x, w["post_norm"], config.rms_norm_eps)
    if "gate_up" in w:           # gate and up stacked into one weight (packed_linear.fuse_layer)
        gate, up = linear(h, w["gate_up"]).chunk(2, dim=-1)
    else:
        gate, up = linear(h, w["gate"]), linear(h, w["up"])
    return x + linear(F.silu(gate) * up, w["down"])


def _attention(h: Tensor, w: dict[str, Tensor], config: ModelConfig, layer_index: int,
               cos: Tensor, sin: Tensor, mask: Tensor, cache: KVCache,
               fast_chunks: list[tuple[int, int]] | None = None) -> Tensor:
    batch, num_new, _ = h.shape
    q, k, v = _projections(h, w, config)
    q = _heads(q, config.num_heads)                                          # [B, H, N, D]
    k, v = _heads(k, config.num_kv_heads), _heads(v, config.num_kv_heads)     # [B, KVH, N, D]
    if config.has_qk_norm:
        q = rms_norm(q, w["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, w["k_norm"], config.rms_norm_eps)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    # Products by a row-exact kernel (packed_linear: each row's bits whatever the rows beside it) attend in
    # float64 rounded back: a row's softmax and weighted sum then do not depend on the key count, order or
    # blocking (a one-token pass and a tree pass sum differently), so a tree row gets a one-token pass's bits.
    # Such a model's cache holds float64 (DecoderModel.cache_dtype): keys and values are cast once, here; its
    # layers whose products the kernel cannot take attend so too.
    # (a cache that keeps nothing, as training's and calibration's, has no dtype: it stores nothing to cast)
    stores_float64 = getattr(cache, "dtype", None) == torch.float64
    exact = stores_float64 or getattr(w.get("qkv", w.get("q")), "is_row_exact", False)
    if exact:
        q, k, v = q.double(), k.double(), v.double()
    keys, values = cache.append(layer_index, k, v)                         # [B, KVH, S, D]
    if exact and not stores_float64:
        keys, values = keys.double(), values.double()
    gqa = config.num_heads != config.num_kv_heads
    # a slot cache's per-sequence blocks where splitting pays (the mask is block-diagonal: each attends over its
    # own keys only), else one attention over all keys under the mask
    calls = [(*segment, None) for segment in
             (cache.segments() if hasattr(cache, "segments") else None) or [(0, num_new, 0, keys.shape[2])]]
    if exact and fast_chunks:   # long prompt chunks (row_split.py) attend in h's dtype, 2.6x faster
        blocks = cache.blocks() if hasattr(cache, "blocks") else [(0, num_new, 0, keys.shape[2])]
        calls = _carve(calls, [(*block, h.dtype) for block in blocks if block[:2] in fast_chunks])
    if len(calls) == 1:         # one attention over every key under the mask (no slices, no concatenation)
        out = _attend(q, keys, values, mask, gqa, calls[0][4])                     # [B, H, N, D]
    else:
        out = torch.cat([_attend(q[:, :, q0:q1], keys[:, :, k0:k1], values[:, :, k0:k1], mask[..., q0:q1, k0:k1],
                                 gqa, dtype) for q0, q1, k0, k1, dtype in calls], dim=2)   # [B, H, N, D]
    if exact:
        out = out.to(h.dtype)
    return linear(out.transpose(1, 2).reshape(batch, num_new, -1), w["o"])


def _carve(calls: list[tuple], own: list[tuple]) -> list[tuple]:
    """Attention calls (first query, end query, first key, end key, dtype), each query row in one: the `own`
    calls' query rows taken out of `calls`, which keep the rest of theirs."""
    out, own_rows = list(own), sorted(call[:2] for call in own)
    for q0, q1, k0, k1, dtype in calls:
        row = q0
        for first, end in own_rows:
            if first < q1 and end > row:
                if first > row:
                    out.append((row, first, k0, k1, dtype))
                row = max(row, end)
        if row < q1:
            out.append((row, q1, k0, k1, dtype))
    return sorted(out, key=lambda call: call[0])


def _attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, gqa: bool, dtype: torch.dtype | None) -> Tensor:
    """q [B, H, n, D] over keys, values [B, KVH, s, D] -> [B, H, n, D]; in `dtype` when given."""
    if dtype is not None:
        q, keys, values = q.to(dtype), keys.to(dtype), values.to(dtype)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)


def _projections(h: Tensor, w: dict, config: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    """h [B, N, hidden] -> q [B, N, H * D], k and v [B, N, KVH * D]; one product when w stacks them ("qkv")."""
    if "qkv" not in w:
        return tuple(linear(h, w[name], w.get(f"{name}_bias")) for name in ("q", "k", "v"))
    kv = config.num_kv_heads * config.head_dim
    parts = linear(h, w["qkv"]).split([config.num_heads * config.head_dim, kv, kv], dim=-1)
    return tuple(p if w.get(f"{n}_bias") is None else p + w[f"{n}_bias"] for p, n in zip(parts, ("q", "k", "v")))


def _heads(x: Tensor, num_heads: int) -> Tensor:
    """[B, N, heads * D] -> [B, heads, N, D]."""
    batch, num_new, _ = x.shape
    return x.view(batch, num_new, num_heads, -1).transpose(1, 2)
