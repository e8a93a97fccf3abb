"""Wiring a self-draft (spec/self_draft.py) into a session: whether one is worth having under the plan, and at
how many bits its substitutes fit beside the resident layers (one decision: every bit a substitute keeps is
device memory a resident target layer cannot use)."""
from __future__ import annotations

import json
from dataclasses import replace
from importlib import resources

from offload import LoadOptions
from offload.loader import plan_for
from offload.devices import choose_device
from offload.model.config import ModelConfig
from offload.planner import PlanError
from offload.weights.resolve import resolve_model
from spec.self_draft import SELF_DRAFT, SUBSTITUTE_BITS, SubstituteConfig, substitute_layer_bytes

ALL_RESIDENT = "every layer is resident"
SELF_DRAFT_MAX_DEPTH = 96
NOISE = 1.05                   # a measured rate must beat another by this factor to count as faster


def bare_tiers(options: LoadOptions) -> list[str]:
    """Each layer's tier when nothing but the target is planned."""
    return plan_for(replace(options, substitute_layer_bytes=0, draft_bytes=0, draft_kv_token_bytes=0)).tier_of


def streams_without_draft(options: LoadOptions) -> bool:
    return any(tier != "device" for tier in bare_tiers(options))


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


def auto_draft(options: LoadOptions, shipped: str | None) -> tuple[str | None, str]:
    """`--draft auto`: (the draft to use, why). Where every layer is resident, the shipped draft (a self-draft would
    be the target); where layers stream, the self-draft for a target without a shipped draft, else whichever of the
    two decoded faster (by more than NOISE) end to end on the tier the plan streams from (measured on the default
    pair: drafts' step costs and acceptance together, perf/data/draft_choice.json)."""
    tiers = bare_tiers(options)
    if all(tier == "device" for tier in tiers):
        return shipped, ALL_RESIDENT
    if shipped is None:
        return SELF_DRAFT, "layers stream and the target has no shipped draft"
    tier = "disk" if "disk" in tiers else "ram"
    rates = measured_draft_rates()[tier]
    choice = SELF_DRAFT if rates[SELF_DRAFT] > NOISE * rates["shipped"] else shipped
    return choice, (f"layers stream from {tier}; measured there on the default pair: self-draft "
                    f"{rates[SELF_DRAFT]:.2f}x, shipped draft {rates['shipped']:.2f}x autoregressive")


def measured_draft_rates() -> dict[str, dict[str, float]]:
    """Per tier, each draft's end-to-end tok/s over autoregressive decoding (`bench self-draft`, this file's
    "source"), shipped in perf/data."""
    text = resources.files("perf").joinpath("data").joinpath("draft_choice.json").read_text()
    return json.loads(text)["speedup_vs_autoregressive"]
