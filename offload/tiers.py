"""Host-side tiers: packed layer buffers in RAM (pinned when CUDA is present) and layer reads from disk."""
from __future__ import annotations

import torch
from torch import Tensor

from offload.disk_reads import BufferedReader, DirectReader, FileRun, as_bytes, plan_runs
from offload.host_io import allocate_host, drop_page_cache
from offload.weights.packing import LayerLayout
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
    """Reads a layer straight from the checkpoint files into a packed buffer.

    Tensors already in the buffer's dtype are read in file runs (offload/disk_reads.py): with O_DIRECT
    when `direct` and the file system allows it (a CPU computing while it reads), else one buffered
    preadv per run; others go through the memory map and are cast on the way."""

    def __init__(self, source: WeightSource, layout: LayerLayout, direct: bool = False) -> None:
        self.source, self.layout = source, layout
        self.is_direct = direct and all(DirectReader.supported(path) for path in source.file_paths())
        self.reader = DirectReader() if self.is_direct else BufferedReader()
        self._runs: dict[int, tuple[list[FileRun], list[str]]] = {}

    def read_into(self, index: int, buffer: Tensor) -> None:
        views = self.layout.views(buffer)
        runs, cast = self._layer_runs(index, views, buffer.device)
        targets = {piece.name: as_bytes(views[piece.name].view(-1).view(torch.uint8).numpy())
                   for run in runs for piece in run.pieces}
        for run in runs:
            self.reader.read(run, targets)
        if cast:
            mapped = self.source.layer(index)
            for name in cast:
                views[name].copy_(mapped[name])

    def _layer_runs(self, index: int, views: dict[str, Tensor], device: torch.device
                    ) -> tuple[list[FileRun], list[str]]:
        """The layer's file runs (tensors read as stored) and the names cast through the memory map."""
        if index not in self._runs:
            entries = self.source.layer_entries(index)
            stored = {name: (path, entry.start, entry.num_bytes) for name, (path, entry) in entries.items()
                      if entry.dtype == views[name].dtype and device.type == "cpu"}
            self._runs[index] = plan_runs(stored), [name for name in entries if name not in stored]
        return self._runs[index]

    def drop_page_cache(self) -> None:
        """Evicts the checkpoint files from the OS page cache, so the next reads hit the disk."""
        for path in self.source.file_paths():
            drop_page_cache(path)

    def close(self) -> None:
        self.reader.close()
