"""The trainable draft: the target's token embedding (frozen), decoder layers at the target's width,
a final norm and an LM head over a trimmed vocabulary of K target tokens.

Layers hold their weights as nn.Parameters under the canonical names of offload/weights/source.py, so the
forward is offload/model/layers.decoder_layer itself: what trains is exactly what the runtime runs.
The first `num_frozen` layers are copies of target layers kept frozen (an early-exit draft).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from offload.model.config import ModelConfig
from offload.model.layers import decoder_layer, linear, rms_norm
from offload.model.rope import Rotary
from spec.draft_folder import DRAFT_KINDS


class PassThroughCache:
    """A cache that keeps nothing: training sees each sequence whole in one pass."""
    length = 0

    def append(self, layer: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        return keys, values


class DraftLayer(nn.Module):
    def __init__(self, weights: dict[str, Tensor], is_trainable: bool) -> None:
        super().__init__()
        self.weights = nn.ParameterDict({name: nn.Parameter(t.detach().float().clone(), requires_grad=is_trainable)
                                         for name, t in weights.items()})


class DraftModel(nn.Module):
    def __init__(self, config: ModelConfig, embed: Tensor, layers: list[dict[str, Tensor]], norm: Tensor,
                 head: Tensor, head_bias: Tensor, vocab_map: Tensor, num_frozen: int) -> None:
        """config: the draft's (num_layers = len(layers)); embed [V, H] shared with the target and never
        trained; head [K, H]; head_bias [K]; vocab_map [K] target ids of the head's rows."""
        super().__init__()
        if head.shape[0] != vocab_map.numel():
            raise ValueError(f"head has {head.shape[0]} rows but the vocab map {vocab_map.numel()}")
        self.config, self.num_frozen = config, num_frozen
        self.register_buffer("embed", embed, persistent=False)
        self.layers = nn.ModuleList(DraftLayer(w, i >= num_frozen) for i, w in enumerate(layers))
        self.norm = nn.Parameter(norm.detach().float().clone())
        self.head = nn.Parameter(head.detach().float().clone())
        self.head_bias = nn.Parameter(head_bias.detach().float().clone())
        self.register_buffer("vocab_map", vocab_map.long(), persistent=False)
        self.rotary = Rotary(config.rope, config.head_dim, config.max_position, torch.device("cpu"))

    @property
    def vocab_top(self) -> int:
        return self.vocab_map.numel()

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens [B, N] (each row a sequence starting at position 0; right padding is harmless)
        -> logits [B, N, K] float32 over the draft's rows."""
        batch, num_tokens = tokens.shape
        if self.rotary.inv_freq.device != tokens.device:      # the module was moved (.to(device))
            self.rotary = Rotary(self.config.rope, self.config.head_dim, self.config.max_position, tokens.device)
        positions = torch.arange(num_tokens, device=tokens.device).expand(batch, -1)
        cos, sin = self.rotary.cos_sin(positions, torch.float32)
        mask = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=tokens.device).tril()[None, None]
        x = F.embedding(tokens, self.embed).float()                                  # [B, N, H]
        cache = PassThroughCache()
        with torch.no_grad():
            for index in range(self.num_frozen):
                x = decoder_layer(x, self.layers[index].weights, self.config, index, cos, sin, mask, cache)
        for index in range(self.num_frozen, len(self.layers)):
            x = decoder_layer(x, self.layers[index].weights, self.config, index, cos, sin, mask, cache)
        hidden = rms_norm(x, self.norm, self.config.rms_norm_eps)
        return linear(hidden, self.head).float() + self.head_bias                   # [B, N, K]


def draft_model_config(target: ModelConfig, num_layers: int) -> ModelConfig:
    """The target's config with fewer layers (same width, heads, rope and vocabulary)."""
    return ModelConfig(
        family=target.family, vocab_size=target.vocab_size, hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size, num_layers=num_layers, num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads, head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps,
        max_position=target.max_position, rope=target.rope, tie_word_embeddings=False,
        attention_bias=target.attention_bias, sliding_window=target.sliding_window,
        bos_token_id=target.bos_token_id, eos_token_ids=target.eos_token_ids, torch_dtype="float16")


def init_layer_indices(kind: str, num_layers: int, num_frozen: int, num_target_layers: int) -> list[int]:
    """Target layers each draft layer starts from: the first `num_layers` (early-exit keeps the first
    `num_frozen` frozen; small trains them all). On SmolLM2-135M a thinned copy started worse (target
    layers [0, 29]: 0.27 held-out agreement after 80 steps, layers [0, 1, 2]: 0.30): a layer expects
    the residual stream of the layers before it."""
    if kind not in DRAFT_KINDS:
        raise ValueError(f"draft kind must be one of {', '.join(DRAFT_KINDS)}, got {kind!r}")
    if num_layers >= num_target_layers:
        raise ValueError(f"a draft of {num_layers} layers is not smaller than its {num_target_layers}-layer target")
    return list(range(num_layers))


def choose_vocab(counts: Tensor, vocab_top: int, always: set[int]) -> Tensor:
    """counts [V] -> [K] int64 target ids, ascending: the `always` ids (stop tokens) and the most
    frequent others. Tokens never seen are not worth a row, so K may come out smaller."""
    if vocab_top <= len(always):
        raise ValueError(f"vocab-top {vocab_top} must exceed the {len(always)} tokens always kept")
    ranked = counts.clone().float()
    ranked[list(always)] = float("inf")
    num_seen = int((ranked > 0).sum())
    return ranked.topk(min(vocab_top, num_seen)).indices.sort().values


def draft_from_target(source, kind: str, num_layers: int, num_frozen: int, vocab_map: Tensor,
                      init_layers: list[int] | None = None) -> DraftModel:
    """A new draft initialised from a target WeightSource: layers copied from `init_layers` (default:
    init_layer_indices), final norm copied, LM head = the target's head rows of the kept tokens."""
    target = source.config
    if kind == "small" and num_frozen:
        raise ValueError("a small draft trains all its layers; frozen layers make it an early-exit draft")
    if not 0 <= num_frozen < num_layers:
        raise ValueError(f"frozen layers must lie in [0, {num_layers}) so that one layer trains, got {num_frozen}")
    indices = init_layers or init_layer_indices(kind, num_layers, num_frozen, target.num_layers)
    if len(indices) != num_layers:
        raise ValueError(f"{len(indices)} init layers given for a {num_layers}-layer draft")
    globals_ = source.global_tensors()
    head = globals_.get("lm_head", globals_["embed"])[vocab_map]                      # [K, H]
    layers = [source.layer(i) for i in indices]
    return DraftModel(draft_model_config(target, num_layers), globals_["embed"].float(), layers,
                      globals_["norm"], head, torch.zeros(vocab_map.numel()), vocab_map, num_frozen)
