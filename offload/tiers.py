"""Host-side tiers: packed layer buffers in RAM (pinned when CUDA is present) and layer reads from disk."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

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

    Tensors already in the compute dtype are read with pread into their place in the buffer;
    others go through the memory map and are cast on the way."""

    def __init__(self, source: WeightSource, layout: LayerLayout) -> None:
        self.source, self.layout = source, layout
        self._fds: dict[Path, int] = {}

    def read_into(self, index: int, buffer: Tensor) -> None:
        views = self.layout.views(buffer)
        mapped = None
        for name, (path, entry) in self.source.layer_entries(index).items():
            target = views[name]
            if entry.dtype == target.dtype and buffer.device.type == "cpu":
                self._pread(path, entry.start, entry.num_bytes, target)
            else:
                mapped = mapped or self.source.layer(index)
                target.copy_(mapped[name])

    def _pread(self, path: Path, start: int, num_bytes: int, target: Tensor) -> None:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        view = memoryview(target.view(torch.uint8).view(-1).numpy())
        done = 0
        while done < num_bytes:
            count = os.preadv(fd, [view[done:num_bytes]], start + done)
            if count <= 0:
                raise OSError(f"{path}: read returned {count} bytes at offset {start + done} (file truncated?)")
            done += count

    def drop_page_cache(self) -> None:
        """Evicts the checkpoint files from the OS page cache, so the next reads hit the disk."""
        for path in self.source.file_paths():
            drop_page_cache(path)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
