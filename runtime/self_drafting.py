"""Wiring a self-draft (spec/self_draft.py) into a session: whether one is worth having under the plan, and at
how many bits its substitutes fit beside the resident layers (one decision: every bit a substitute keeps is
device memory a resident target layer cannot use)."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from importlib import resources

from offload import LoadOptions
from offload.loader import plan_for
from offload.devices import choose_device
from offload.model.config import ModelConfig
from offload.planner import PlanError
from offload.weights.resolve import resolve_model
from offload.weights.safetensors_io import CorruptCheckpointError
from spec.self_draft import SELF_DRAFT, SUBSTITUTE_BITS, SubstituteConfig, substitute_layer_bytes
from .speculation import DraftChoice

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


def auto_draft_choice(options: LoadOptions, shipped: str | None, fallback: DraftChoice, on_status=None) -> DraftChoice:
    """`--draft auto` (no --draft) for a session planned with `options` (no draft in them): auto_draft's pick, said
    in a status line where layers stream; `fallback` where the plan fails (the load then raises the same error,
    with its own context)."""
    try:
        spec, why = auto_draft(options, shipped)
    except (PlanError, CorruptCheckpointError):
        return fallback
    if on_status and why != ALL_RESIDENT:
        on_status(f"draft: {'self' if spec == SELF_DRAFT else 'the shipped draft'} (auto: {why})")
    return DraftChoice(spec)


@dataclass(frozen=True, slots=True)
class SelfDraftPlan:
    choice: DraftChoice                      # the self-draft, no draft (all resident), or the shipped draft
    substitutes: SubstituteConfig | None     # the self-draft's, where it is kept
    options: LoadOptions                     # the target's load options, substitutes planned


def plan_self_draft(options: LoadOptions, bits: int | None, asked: bool, shipped: str | None,
                    on_status=None) -> SelfDraftPlan:
    """Room in the plan for a self-draft's substitutes. None where every layer is resident without them (the
    self-draft would be the target: decoding goes on without a draft); where they do not fit, the shipped draft
    unless the user `asked` for the self-draft or there is none (then the PlanError)."""
    if not streams_without_draft(options):
        if on_status:
            on_status("self-draft: every layer is resident, so it would cost what the target costs; "
                      "decoding without a draft")
        return SelfDraftPlan(DraftChoice(None), None, options)
    try:
        substitutes, planned = choose_substitutes(options, bits)
    except PlanError as err:
        if asked or shipped is None:
            raise
        if on_status:
            on_status(f"draft: the shipped draft (auto: the self-draft does not fit: {err})")
        return SelfDraftPlan(DraftChoice(shipped), None, options)
    return SelfDraftPlan(DraftChoice(SELF_DRAFT), substitutes, planned)
