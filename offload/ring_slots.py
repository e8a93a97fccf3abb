"""The prefetch ring's slots, and the GPU path that fills them: a host read, then an asynchronous copy.

A slot is one streamed layer's place on the compute device. On a CPU its buffer is host memory the
layer is read into (and used in place); on a GPU the layer is read or found on the host, then copied
on a copy stream of its own, so the next disk read (or the next queued copy) overlaps this one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from offload.host_io import aligned_host
from offload.tiers import DiskTier, RamTier


@dataclass(slots=True)
class RingSlot:
    buffer: Tensor                       # [layout bytes] uint8 on the device (a CPU's: aligned, >= span bytes)
    staging: Tensor | None               # pinned aligned host buffer for disk reads when the device is a GPU
    views: dict | None = None            # the layer's tensors when not at the layout's places (a span read)
    layer: int = -1
    state: str = "free"                  # free -> loading -> ready -> in_use -> free
    load_seconds: float = 0.0            # host-side load time (disk read, CPU copy)
    decoded: dict | None = None          # the layer decoded by the decoder thread (decode_ahead)
    decode_seconds: float = 0.0
    copy_started: object = None          # CUDA event (timed): host->device copy queued
    copied: object = None                # CUDA event (timed): copy into `buffer` done
    released: object = None              # CUDA event: compute reading `buffer` done


def new_slot(layout_bytes: int, host_bytes: int, device: torch.device, staged: bool, slot_buffer=None) -> RingSlot:
    """A slot for layers of `layout_bytes` (`host_bytes` >= that: a whole-layer span read lands there). A GPU's
    slot has a pinned staging buffer when `staged` (a disk tier feeds it) and its copy events; a CPU's buffer
    comes from `slot_buffer(bytes)` when given (else an aligned host buffer)."""
    if device.type == "cuda":
        buffer = torch.empty(layout_bytes, dtype=torch.uint8, device=device)
        slot = RingSlot(buffer, aligned_host(host_bytes, pin=True) if staged else None)
        slot.copy_started = torch.cuda.Event(enable_timing=True)
        slot.copied = torch.cuda.Event(enable_timing=True)
        slot.released = torch.cuda.Event()
        return slot
    buffer = slot_buffer(host_bytes) if slot_buffer is not None else aligned_host(host_bytes, pin=False)
    return RingSlot(buffer, None)


class DeviceCopies:
    """Fills a GPU's slots: a RAM layer is copied from its pinned buffer, a disk layer read into the slot's staging
    buffer first (whole, or as a span whose tensors are copied each to its place in the slot)."""

    def __init__(self, device: torch.device, ram: RamTier | None, disk: DiskTier | None, offsets: dict[str, int],
                 layout_bytes: int) -> None:
        self.stream = torch.cuda.Stream(device)
        self.ram, self.disk, self.offsets, self.layout_bytes = ram, disk, offsets, layout_bytes

    def load(self, layer: int, slot: RingSlot, tier: str) -> None:
        host, pieces = None, None
        if tier == "ram":
            host = self.ram.buffers[layer]
        else:
            slot.copied.synchronize()   # the staging buffer's previous copy must be finished
            if self.disk.span_plan(layer) is not None:
                pieces = self.disk.read_span(layer, slot.staging)
            else:
                self.disk.read_into(layer, slot.staging)
                host = slot.staging[:self.layout_bytes]
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(slot.released)
            slot.copy_started.record(self.stream)
            if pieces is None:
                slot.buffer.copy_(host, non_blocking=True)
            else:
                for name, data in pieces.items():
                    start = self.offsets[name]
                    slot.buffer[start:start + data.numel()].copy_(data, non_blocking=True)
            slot.copied.record(self.stream)
