"""Bits per parameter of a loaded model's decoder-layer matrices, from the bytes its files hold."""
from __future__ import annotations

from offload import LoadedModel
from .checkpoint import MATRICES, SpqrSource, matrix_shapes


def bits_per_param(model: LoadedModel) -> float:
    config, source = model.config, model.source
    params = config.num_layers * sum(rows * cols for rows, cols in matrix_shapes(config).values())
    if isinstance(source, SpqrSource):
        stored = sum(slot.num_bytes for layout in source.inner for slot in layout.slots
                     if slot.name.split(".")[0] in MATRICES and "." in slot.name)
    else:
        stored = sum(entry.num_bytes for index in range(config.num_layers)
                     for name, (_, entry) in source.layer_entries(index).items() if name in MATRICES)
    return 8 * stored / params
