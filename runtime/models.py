"""The composition root for weights: the packed formats the loader is given (quant/'s SpQR), and
model loading with them. Everything that loads a user's model goes through here."""
from __future__ import annotations

from dataclasses import replace

from offload import LoadedModel, LoadOptions
from offload import load_model as load_with
from offload.weights.formats import WeightFormat


def weight_formats() -> tuple[WeightFormat, ...]:
    from quant.checkpoint import SpqrFormat
    return (SpqrFormat(),)


def with_formats(options: LoadOptions) -> LoadOptions:
    return replace(options, formats=weight_formats())


def load_model(options: LoadOptions, on_status=None, on_progress=None) -> LoadedModel:
    """offload.load_model with every packed format this runtime implements."""
    return load_with(with_formats(options), on_status, on_progress)
