"""Perplexity of any loaded model on a text: fixed windows with a stride, scoring only each window's
tokens not already scored by the previous one (the usual sliding-window evaluation)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from offload import LoadedModel


@dataclass(slots=True)
class PerplexityConfig:
    window: int = 512
    stride: int = 256
    max_tokens: int | None = None      # evaluate only the first N tokens of the text

    def __post_init__(self) -> None:
        if not 0 < self.stride <= self.window:
            raise ValueError(f"need 0 < stride <= window, got stride {self.stride}, window {self.window}")


@torch.inference_mode()
def perplexity(model: LoadedModel, text: str, config: PerplexityConfig) -> dict:
    tokens = model.tokenizer.encode(text)[:config.max_tokens]
    if len(tokens) < 2:
        raise ValueError("the text has fewer than 2 tokens")
    total_nll, scored, previous_end = 0.0, 0, 0
    cache = model.model.new_cache(config.window)
    for begin in range(0, len(tokens) - 1, config.stride):
        end = min(begin + config.window, len(tokens))
        window = torch.tensor([tokens[begin:end]])
        cache.truncate(0)
        logits = model.model.forward(window, cache).logits[0, :-1].float()           # [n - 1, V]
        targets = window[0, 1:].to(logits.device)
        first_new = max(previous_end - begin - 1, 0)                                  # targets scored before
        losses = torch.nn.functional.cross_entropy(logits[first_new:], targets[first_new:], reduction="sum")
        total_nll += float(losses)
        scored += targets.numel() - first_new
        previous_end = end
        if end == len(tokens):
            break
    return {"perplexity": math.exp(total_nll / scored), "tokens": scored, "window": config.window,
            "stride": config.stride}
