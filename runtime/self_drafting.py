"""Wiring a self-draft (spec/self_draft.py) into a session: whether one is worth having under the plan, and at
how many bits its substitutes fit beside the resident layers (one decision: every bit a substitute keeps is
device memory a resident target layer cannot use)."""
from __future__ import annotations

from dataclasses import replace

from offload import LoadOptions
from offload.loader import plan_for
from offload.devices import choose_device
from offload.model.config import ModelConfig
from offload.planner import PlanError
from offload.weights.resolve import resolve_model
from spec.self_draft import SUBSTITUTE_BITS, SubstituteConfig, substitute_layer_bytes

SELF_DRAFT_MAX_DEPTH = 96      # trees of a draft that agrees often run deep (a distilled draft's cap is 32)


def streams_without_draft(options: LoadOptions) -> bool:
    """Whether any layer streams when nothing but the target is planned."""
    bare = replace(options, substitute_layer_bytes=0, draft_bytes=0, draft_kv_token_bytes=0)
    return any(tier != "device" for tier in plan_for(bare).tier_of)


def choose_substitutes(options: LoadOptions, bits: int | None) -> tuple[SubstituteConfig, LoadOptions]:
    """The substitutes' settings (the given bits, else the most of 4, 3, 2 that fit the plan) and the load options
    that plan them; a PlanError naming the smallest when none fits."""
    config = ModelConfig.from_file(resolve_model(options.model, options.allow_download,
                                                 gguf_import=options.gguf_import))
    is_cpu = choose_device(options.device).type == "cpu"
    candidates = (bits,) if bits is not None else tuple(sorted(SUBSTITUTE_BITS, reverse=True))
    error = None
    for candidate in candidates:
        settings = SubstituteConfig(candidate)
        planned = replace(options, substitute_layer_bytes=substitute_layer_bytes(config, settings, is_cpu))
        try:
            plan_for(planned)
            return settings, planned
        except PlanError as err:
            error = err
    raise error
