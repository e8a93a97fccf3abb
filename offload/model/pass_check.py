"""Does a pass over many tokens compute what one-token passes compute? Greedy speculation is
token-identical to one-token decoding exactly when it does; in fp32 the two agree to rounding, in bf16 they
may part at near-ties (tests/test_pass_invariance.py measures where)."""
from __future__ import annotations

import torch

from .decoder import DecoderModel


@torch.inference_mode()
def compare_passes(model: DecoderModel, prompt_ids: list[int], num_tokens: int) -> dict:
    """One prompt: one-token greedy passes vs one block pass over the same tokens."""
    cache = model.new_cache(len(prompt_ids) + num_tokens + 1)
    first = model.forward(torch.tensor([prompt_ids], device=model.device), cache, last_only=True)
    cache.commit()
    tokens, single = [int(first.logits[0, -1].argmax())], []
    for _ in range(num_tokens):
        logits = model.forward(torch.tensor([tokens[-1:]], device=model.device), cache).logits[0, -1]   # [V]
        cache.commit()
        single.append(logits)
        tokens.append(int(logits.argmax()))
    cache.truncate(len(prompt_ids))
    block = model.forward(torch.tensor([tokens[:num_tokens]], device=model.device), cache).logits[0]    # [N, V]
    single = torch.stack(single)                                                                       # [N, V]
    flips = (single.argmax(-1) != block.argmax(-1)).nonzero().flatten().tolist()
    top2 = single.topk(2, dim=-1).values
    return {"positions": num_tokens, "max_logit_difference": float((single - block).abs().max()),
            "flips": len(flips), "margins_at_flips": [round(float(top2[i, 0] - top2[i, 1]), 4) for i in flips]}
