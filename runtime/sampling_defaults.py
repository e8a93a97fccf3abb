"""The sampling a chat user gets without flags (`chat`, `serve`): each setting from a flag or request if given,
else as the model states it (a GGUF's general.sampling.* metadata, else its generation_config.json), else
specstream's default. Greedy decoding with no repetition control loops on small models (the same sentence
until the token limit), so these sample.

specstream's defaults, against the two references a local user meets:
    llama.cpp:    temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat penalty 1.0 (off; 1.1 before 2024)
    transformers: greedy unless the model's generation config samples; when it does: temperature 1.0,
                  top-k 50, top-p 1.0, repetition penalty 1.0
    specstream:   temperature 0.7, top-p 0.95, min-p 0.05, repetition penalty 1.1
A little cooler than llama.cpp (small models drift sooner), llama.cpp's top-p and min-p (min-p alone cuts the
tail that derails a sample; top-k adds nothing under it), and Ollama's repetition penalty 1.1 as the
repetition control: ours divides the logits of every token in the context (transformers' rule, no window),
so it stays mild. `--temperature 0` (or a request's temperature 0) is plain greedy decoding: the stated and
default settings then do not apply, only those given explicitly.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from spec import SamplingConfig

SPECSTREAM_DEFAULTS = {"temperature": 0.7, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1}
# llama.cpp's keys (gguf-py Keys.General.SAMPLING_*) -> SamplingConfig fields; penalty_last_n has no
# counterpart (our penalty spans the whole context), mirostat and XTC neither
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
SAMPLING_FIELDS = {f.name for f in fields(SamplingConfig)}


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request that says nothing gets: the model's stated settings over specstream's, with where the
    model's came from ('' when it states none)."""
    stated: dict[str, float]
    source: str = ""

    def resolve(self, explicit: dict[str, float | int | None]) -> SamplingConfig:
        """explicit (flags or request fields; None = not given) over the stated settings over ours; a
        temperature of 0 keeps only the explicit settings (plain greedy)."""
        given = {name: value for name, value in explicit.items() if value is not None}
        unknown = set(given) - SAMPLING_FIELDS
        if unknown:
            raise ValueError(f"not a sampling setting: {', '.join(sorted(unknown))}")
        merged = {**SPECSTREAM_DEFAULTS, **self.stated, **given}
        if merged["temperature"] == 0:
            merged = {"temperature": 0.0, **given}
        return SamplingConfig(**{name: value for name, value in merged.items() if name in SAMPLING_FIELDS})

    def describe(self, explicit: dict[str, float | int | None]) -> str:
        """One line: the settings in force and where each came from."""
        sampling = self.resolve(explicit)
        if sampling.is_greedy:
            return "sampling: greedy (temperature 0)" + _penalties(sampling)
        given = {name for name, value in explicit.items() if value is not None}
        parts = [f"temperature {sampling.temperature:g}"]
        parts += [f"top-p {sampling.top_p:g}"] if sampling.top_p < 1 else []
        parts += [f"top-k {sampling.top_k}"] if sampling.top_k else []
        parts += [f"min-p {sampling.min_p:g}"] if sampling.min_p else []
        origin = [f"the model's {self.source}: {', '.join(sorted(self.stated))}"] if self.stated else []
        origin += [f"flags: {', '.join(sorted(given))}"] if given else []
        if set(SPECSTREAM_DEFAULTS) - given - set(self.stated):
            origin += ["the rest specstream's defaults" if origin else "specstream's defaults: the model states none"]
        return (f"sampling: {', '.join(parts)}{_penalties(sampling)} ({'; '.join(origin)}); "
                "--temperature 0 for greedy")


def _penalties(sampling: SamplingConfig) -> str:
    parts = [f"repetition penalty {sampling.repetition_penalty:g}"] if sampling.repetition_penalty != 1 else []
    parts += [f"presence penalty {sampling.presence_penalty:g}"] if sampling.presence_penalty else []
    parts += [f"frequency penalty {sampling.frequency_penalty:g}"] if sampling.frequency_penalty else []
    return "".join(f", {part}" for part in parts)


def model_sampling_defaults(model_folder: Path) -> SamplingDefaults:
    """The settings a model states: a GGUF run in place reads its file's general.sampling.* keys; otherwise
    (or when it has none) its folder's generation_config.json. A value out of range is left out."""
    from offload.weights.gguf_model import gguf_file_of
    gguf_file = gguf_file_of(model_folder)
    if gguf_file is not None:
        from offload.weights.gguf_header import read_header
        metadata = read_header(gguf_file).metadata
        stated = _valid({field: metadata[key] for key, field in GGUF_KEYS.items() if key in metadata})
        if stated:
            return SamplingDefaults(stated, "GGUF metadata (general.sampling.*)")
    path = model_folder / "generation_config.json"
    if not path.is_file():
        return SamplingDefaults({})
    config = json.loads(path.read_text())
    stated = _valid({key: config[key] for key in GENERATION_CONFIG_KEYS if config.get(key) is not None})
    if config.get("do_sample") is False:        # the model states greedy decoding
        stated = {"temperature": 0.0}
    return SamplingDefaults(stated, "generation_config.json") if stated else SamplingDefaults({})


def _valid(stated: dict) -> dict[str, float]:
    """The stated values SamplingConfig accepts (one at a time, so one bad key drops only itself)."""
    kept = {}
    for name, value in stated.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        value = int(value) if name == "top_k" else float(value)
        try:
            SamplingConfig(**{name: value})
        except (TypeError, ValueError):
            continue
        kept[name] = value
    return kept
