"""Host-side tiers: packed layer buffers in RAM (pinned when CUDA is present) and layer reads from disk."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from offload.disk_reads import (BufferedReader, DirectReader, FileRun, SpanPlan, aligned_buffer, as_bytes,
                                plan_runs, span_plan)
from offload.host_io import allocate_host, drop_page_cache
from offload.weights.packing import LayerLayout
from offload.weights.safetensors_io import TensorEntry
from offload.weights.source import WeightSource


class RamTier:
    """Layers packed once into host buffers; a layer's bytes are one contiguous buffer."""

    def __init__(self, source: WeightSource, layout: LayerLayout, layers: list[int], pin: bool,
                 max_pinned_bytes: int) -> None:
        self.buffers: dict[int, Tensor] = {}
        pinned = 0
        for index in layers:
            use_pin = pin and pinned + layout.num_bytes <= max_pinned_bytes
            buffer = allocate_host(layout.num_bytes, use_pin)
            pinned += layout.num_bytes if buffer.is_pinned() else 0
            layout.pack_into(buffer, source.layer(index))
            self.buffers[index] = buffer
        self.pinned_bytes = pinned

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())


class DiskTier:
    """Reads a layer straight from the checkpoint files.

    A layer's tensors are read in file runs (offload/disk_reads.py): with O_DIRECT when `direct` and the
    file system allows it, else one buffered preadv per run. `read_into` lands them at the layout's places
    in a slot's buffer (a tensor stored in another dtype lands in a staging buffer first and is cast into
    place); `read_span` (direct, no cast) reads the runs whole into a host buffer and hands back views."""

    def __init__(self, source: WeightSource, layout: LayerLayout, direct: bool = False, span_align: int = 16) -> None:
        self.source, self.layout, self.span_align = source, layout, span_align
        self.paths = sorted({path for index in range(source.config.num_layers)      # the files layers are read from
                             for path, _ in source.layer_entries(index).values()})
        self.is_direct = direct and all(DirectReader.supported(path) for path in self.paths)
        self.reader = DirectReader() if self.is_direct else BufferedReader()
        self._runs: dict[int, tuple[list[FileRun], dict[str, TensorEntry]]] = {}
        self._cast_staging = np.empty(0, dtype=np.uint8)
        self._spans: dict[int, SpanPlan | None] = {}
        self._slots = {slot.name: slot for slot in layout.slots}

    def read_into(self, index: int, buffer: Tensor) -> None:
        views = self.layout.views(buffer)
        runs, cast = self._layer_runs(index)
        staged = self._staging_for(cast)
        targets = {piece.name: staged[piece.name] if piece.name in cast
                   else as_bytes(views[piece.name].view(-1).view(torch.uint8).numpy())
                   for run in runs for piece in run.pieces}
        for run in runs:
            self.reader.read(run, targets)
        for name, entry in cast.items():
            views[name].copy_(torch.from_numpy(staged[name]).view(entry.dtype).view(entry.shape))

    def _staging_for(self, cast: dict[str, TensorEntry]) -> dict[str, np.ndarray]:
        """A byte region per cast tensor, 64-byte aligned, in one buffer the tier keeps and grows."""
        places, total = {}, 0
        for name, entry in cast.items():
            places[name], total = total, total + -(-entry.num_bytes // 64) * 64
        if len(self._cast_staging) < total:
            self._cast_staging = aligned_buffer(total)
        return {name: self._cast_staging[places[name]:places[name] + entry.num_bytes] for name, entry in cast.items()}

    def span_bytes(self, layers: list[int]) -> int:
        """The host buffer `read_span` needs for any of `layers` (0: none of them can be read so)."""
        return max((plan.num_bytes for plan in map(self.span_plan, layers) if plan is not None), default=0)

    def span_plan(self, index: int) -> SpanPlan | None:
        """The layer's runs end to end; None unless direct, with no cast, every tensor `span_align`-aligned in
        its file (its place in the span keeps that alignment: the span starts on an aligned block). A CPU
        computes on the views in place (16); a GPU ring copies each tensor's bytes to its slot (1)."""
        if index not in self._spans:
            runs, cast = self._layer_runs(index)
            aligned = all(piece.start % self.span_align == 0 for run in runs for piece in run.pieces)
            self._spans[index] = span_plan(runs) if self.is_direct and not cast and aligned else None
        return self._spans[index]

    def read_span(self, index: int, buffer: Tensor) -> dict[str, Tensor]:
        """The layer read with no copy into `buffer` (host, aligned to DIRECT_ALIGN, >= span_bytes) ->
        name: uint8 [the tensor's stored bytes], a view into `buffer`."""
        plan = self.span_plan(index)
        self.reader.read_span(plan, buffer.numpy())
        return {piece.name: buffer[plan.places[piece.name]:plan.places[piece.name] + piece.num_bytes]
                for run in plan.runs for piece in run.pieces}

    def typed_views(self, stored: dict[str, Tensor]) -> dict[str, Tensor]:
        """read_span's byte views as the layout's slots: dtype and shape where the bytes fill the slot; a
        packed slot larger than its tensor (sized for the largest over the layers) gets the bytes as they
        are, the prefix its format's decoder reads."""
        views = {}
        for name, data in stored.items():
            slot = self._slots[name]
            views[name] = data.view(slot.dtype).view(slot.shape) if data.numel() == slot.num_bytes else data
        return views

    def _layer_runs(self, index: int) -> tuple[list[FileRun], dict[str, TensorEntry]]:
        """The layer's file runs (every tensor) and the entries of those stored in another dtype than their
        slot's (read into staging, then cast)."""
        if index not in self._runs:
            entries = self.source.layer_entries(index)
            spans = {name: (path, entry.start, entry.num_bytes) for name, (path, entry) in entries.items()}
            cast = {name: entry for name, (_, entry) in entries.items() if entry.dtype != self._slots[name].dtype}
            self._runs[index] = plan_runs(spans), cast
        return self._runs[index]

    def drop_page_cache(self) -> None:
        """Evicts the checkpoint files from the OS page cache, so the next reads hit the disk."""
        for path in self.paths:
            drop_page_cache(path)

    def close(self) -> None:
        self.reader.close()
