"""The prefetch ring: streamed layers flow through `ring_size` device buffers.

A loader thread walks the streamed layers in pass order forever (wrapping into the next pass),
filling slot k % ring_size with the k-th streamed layer as soon as the compute that used the slot
last has released it; so the copy of layer i+k overlaps the compute of layer i, and the next pass's
first layers load while the current pass finishes. On a CPU two loader threads share the walk (every
other layer each), so a second read is in flight while one loader waits for a core. The planner decides
which layers stream from which tier; this engine only executes.
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref

import torch
from torch import Tensor

from offload.weights.packing import LayerLayout
from offload.host_io import copy_host
from offload.pass_stats import PassStats
from offload.ring_slots import DeviceCopies, RingSlot, new_slot
from offload.tiers import DiskTier, RamTier

POLL_SECONDS = 0.1   # waits wake up this often, so Ctrl-C and loader errors are never missed

# Rings whose loader (and decoder) threads run. Owners close their ring; this is the safety net for one
# left open: a daemon thread still inside a torch op while the interpreter finalizes aborts the process
# ("terminate called without an active exception", exit code 134), so they are stopped and joined first.
_running_rings: weakref.WeakSet[StreamingLayers] = weakref.WeakSet()


@atexit.register
def _close_running_rings() -> None:
    for ring in list(_running_rings):
        ring.close()


class StreamError(RuntimeError):
    """Loading a layer failed; the message names the layer and the tier."""


def _as_stored(index: int, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return tensors


class StreamingLayers:
    """A LayerProvider over three tiers: device-resident layers, RAM buffers and disk reads. `decode`
    turns a layer's stored tensors into what the layer math takes (packed formats dequantize there,
    on the compute device, just before use). With `decode_ahead` (for a CPU, where a second core is free
    while compute runs) a decoder thread takes each loaded layer, decodes it and calls `prepare()` on
    every decoded value that has one (a packed weight dequantizes then): reading, dequantizing and
    computing are three stages that overlap, so a layer costs the slowest of them rather than
    dequantization plus compute. A ring slot then also holds its layer's decoded weights until released.

    Slot states: free -> loading -> ready -> in_use -> free, or with decode_ahead
    free -> loading -> loaded -> decoding -> ready -> in_use -> free."""

    def __init__(self, layout: LayerLayout, resident: dict[int, dict[str, Tensor]], tier_of: list[str],
                 ram: RamTier | None, disk: DiskTier | None, device: torch.device, ring_size: int,
                 disk_cold: bool = False, decode=_as_stored, decode_ahead: bool = False, dense=None,
                 slot_buffer=None, loaders: int = 1) -> None:
        if ring_size < 1:
            raise ValueError(f"ring size must be >= 1, got {ring_size}")
        if loaders < 1:
            raise ValueError(f"loaders must be >= 1, got {loaders}")
        self.layout, self.resident, self.tier_of = layout, resident, tier_of
        self.ram, self.disk, self.device, self.disk_cold, self.decode = ram, disk, device, disk_cold, decode
        self.decode_ahead = decode_ahead
        self._dense = dense              # (index, stored or None for a resident layer) -> the layer decoded dense
        self.streamed = [i for i, tier in enumerate(tier_of) if tier != "device"]
        self.is_cuda = device.type == "cuda"
        # a disk layer read whole by O_DIRECT into a host buffer, used in place (CPU) or copied per tensor
        span_bytes = disk.span_bytes([i for i in self.streamed if tier_of[i] == "disk"]) if disk else 0
        host_bytes = max(layout.num_bytes, span_bytes)
        # slot_buffer: on a CPU, bytes -> a slot's memory, DIRECT_ALIGN-aligned (None: an aligned host buffer)
        self.slots = [new_slot(layout.num_bytes, host_bytes, device, disk is not None, slot_buffer)
                      for _ in range(min(ring_size, max(len(self.streamed), 1)))]
        self.num_loaders = min(loaders, len(self.slots)) if self._reads_concurrently() else 1
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._decoder: threading.Thread | None = None
        self._stop = False
        self._error: BaseException | None = None
        self._next_use = 0                 # index (over all passes) of the next streamed layer to compute
        self._pass_start = 0.0
        self.last_pass = PassStats()
        self.total = PassStats()
        self._copies = DeviceCopies(device, ram, disk, {slot.name: slot.offset for slot in layout.slots},
                                    layout.num_bytes) if self.is_cuda else None

    @property
    def device_bytes(self) -> int:
        ring = len(self.slots) * self.layout.num_bytes if self.streamed else 0
        resident = sum(t.nbytes for layer in self.resident.values() for t in layer.values())   # tensors, packed weights
        return ring + resident

    # LayerProvider -------------------------------------------------------------------------------
    def begin_pass(self, num_tokens: int) -> None:
        self.last_pass = PassStats(num_tokens)
        self._pass_start = time.perf_counter()
        if self.streamed and not self._threads:
            self._start_loader()

    def get(self, index: int) -> dict[str, Tensor]:
        if self.tier_of[index] == "device":
            return self.decode(index, self.resident[index])
        slot = self.slots[self._next_use % len(self.slots)]
        waited = time.perf_counter()
        with self._cond:
            while not (slot.state == "ready" and slot.layer == index):
                self._raise_if_failed(index)
                self._cond.wait(POLL_SECONDS)
            slot.state = "in_use"
        transfer = slot.load_seconds
        if self.is_cuda:
            slot.copied.synchronize()   # host waits here (counted as waiting) while the copy is in flight
            transfer += slot.copy_started.elapsed_time(slot.copied) / 1000
        stats = self.last_pass
        stats.wait_seconds += time.perf_counter() - waited
        stats.transfer_seconds += transfer
        stats.decode_seconds += slot.decode_seconds
        stats.bytes_by_tier[self.tier_of[index]] += self.layout.num_bytes
        if slot.decoded is not None:
            return slot.decoded
        return self.decode(index, self._stored(slot))

    def dense(self, index: int) -> dict[str, Tensor] | None:
        """The layer `get` handed out, decoded dense (valid until the next call), or None where its products
        have no dense form (row_split.py)."""
        if self._dense is None:
            return None
        if self.tier_of[index] == "device":
            return self._dense(index, None)
        return self._dense(index, self._stored(self.slots[self._next_use % len(self.slots)]))

    def release(self, index: int) -> None:
        if self.tier_of[index] == "device":
            return
        slot = self.slots[self._next_use % len(self.slots)]
        if self.is_cuda:
            slot.released.record(torch.cuda.current_stream(self.device))
        with self._cond:
            slot.state, slot.decoded = "free", None
            self._next_use += 1
            self._cond.notify_all()

    def wait_filled(self, timeout: float = 60.0) -> bool:
        """Waits until the loaders have filled every slot ahead of the compute (they are idle then); False on
        timeout or with no loader running (True when nothing streams). Benchmarks use it before timing a tier alone."""
        if not self.streamed:
            return True
        deadline = time.perf_counter() + timeout
        with self._cond:
            while any(slot.state in ("free", "loading") for slot in self.slots):
                if not self._threads or self._error is not None or time.perf_counter() > deadline:
                    return False
                self._cond.wait(POLL_SECONDS)
        return True

    def end_pass(self) -> None:
        self.last_pass.seconds = time.perf_counter() - self._pass_start
        self.total.num_tokens += self.last_pass.num_tokens
        self.total.seconds += self.last_pass.seconds
        self.total.wait_seconds += self.last_pass.wait_seconds
        self.total.transfer_seconds += self.last_pass.transfer_seconds
        self.total.decode_seconds += self.last_pass.decode_seconds
        for tier, count in self.last_pass.bytes_by_tier.items():
            self.total.bytes_by_tier[tier] += count

    def abort(self) -> None:
        """After an interrupted pass: stop the loader and forget the ring (the next pass restarts it)."""
        self.close()
        self._next_use = 0
        for slot in self.slots:
            slot.state, slot.layer, slot.decoded = "free", -1, None

    def close(self) -> None:
        """Stops the loader and decoder threads and joins them (a load in flight finishes first); the next
        pass starts them again."""
        threads = self._threads + ([self._decoder] if self._decoder is not None else [])
        if not threads:
            return
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for thread in threads:
            thread.join()
        self._threads, self._decoder, self._stop = [], None, False
        _running_rings.discard(self)

    # loader thread -------------------------------------------------------------------------------
    def _reads_concurrently(self) -> bool:
        """Whether loads may run in several threads at once: on a CPU, where each streamed layer lands in its own
        slot's memory (RAM copies, whole-layer O_DIRECT span reads), none through the disk tier's shared bounce
        buffer. (A GPU's layers are large enough that one loader's gap between two reads is lost in them.)"""
        return not self.is_cuda and all(self.tier_of[i] == "ram" or self.disk.span_plan(i) is not None
                                        for i in self.streamed)

    def _start_loader(self) -> None:
        self._error = None
        _running_rings.add(self)
        # With n loaders, loader k fills the streamed layers k, k + n, k + 2n, ... (over all passes): n reads in
        # flight, so the disk's queue never drains while one loader waits to be scheduled for its next read.
        self._threads = [threading.Thread(target=self._loader_main, args=(k, self.num_loaders),
                                          name=f"layer-loader-{k}", daemon=True) for k in range(self.num_loaders)]
        for thread in self._threads:
            thread.start()
        if self.decode_ahead:
            self._decoder = threading.Thread(target=self._decoder_main, name="layer-decoder", daemon=True)
            self._decoder.start()

    def _loader_main(self, first: int = 0, step: int = 1) -> None:
        load_count = self._next_use + first
        try:
            while True:
                layer = self.streamed[load_count % len(self.streamed)]
                slot = self.slots[load_count % len(self.slots)]
                # the slot's previous layer (load_count - ring) must be released, not only any earlier one
                if not self._claim(slot, "free", None, layer, "loading", released=load_count - len(self.slots)):
                    return
                # O_DIRECT reads bypass the page cache: only buffered reads need it emptied to stay cold
                if self.disk_cold and load_count % len(self.streamed) == 0 and self.disk and not self.disk.is_direct:
                    self.disk.drop_page_cache()
                self._load(layer, slot)
                with self._cond:
                    slot.state = "loaded" if self.decode_ahead else "ready"
                    self._cond.notify_all()
                load_count += step
        except BaseException as err:  # handed to the compute thread, which raises it with context
            self._fail(err)

    def _decoder_main(self) -> None:
        decode_count = self._next_use
        try:
            while True:
                layer = self.streamed[decode_count % len(self.streamed)]
                slot = self.slots[decode_count % len(self.slots)]
                if not self._claim(slot, "loaded", layer, layer, "decoding"):
                    return
                self._decode_ahead(layer, slot)
                with self._cond:
                    slot.state = "ready"
                    self._cond.notify_all()
                decode_count += 1
        except BaseException as err:
            self._fail(err)

    def _claim(self, slot: RingSlot, state: str, layer: int | None, new_layer: int, new_state: str,
               released: int = -1) -> bool:
        """Waits until `slot` is in `state` (holding `layer`, unless None) and the streamed use number `released`
        has been released, then moves it on; False when the engine is stopping."""
        with self._cond:
            while not (slot.state == state and layer in (None, slot.layer) and self._next_use > released) \
                    and not self._stop:
                self._cond.wait(POLL_SECONDS)
            if self._stop:
                return False
            slot.state, slot.layer = new_state, new_layer
            return True

    def _fail(self, err: BaseException) -> None:
        with self._cond:
            self._error = err
            self._cond.notify_all()

    def _load(self, layer: int, slot: RingSlot) -> None:
        start = time.perf_counter()
        tier = self.tier_of[layer]
        slot.views = None
        if self.is_cuda:
            self._copies.load(layer, slot, tier)
        elif tier == "ram":
            copy_host(slot.buffer[:self.layout.num_bytes], self.ram.buffers[layer])
        elif self.disk.span_plan(layer) is not None:
            slot.views = self.disk.typed_views(self.disk.read_span(layer, slot.buffer))
        else:
            self.disk.read_into(layer, slot.buffer)
        slot.load_seconds = time.perf_counter() - start

    def _stored(self, slot: RingSlot) -> dict[str, Tensor]:
        return slot.views if slot.views is not None else self.layout.views(slot.buffer)

    def _decode_ahead(self, layer: int, slot: RingSlot) -> None:
        start = time.perf_counter()
        decoded = self.decode(layer, self._stored(slot))
        for value in decoded.values():
            if hasattr(value, "prepare"):
                value.prepare()
        slot.decoded, slot.decode_seconds = decoded, time.perf_counter() - start

    def _raise_if_failed(self, index: int) -> None:
        if self._error is not None:
            err = self._error
            raise StreamError(f"loading decoder layer {index} from {self.tier_of[index]} failed: {err}") from err
        if not self._threads or not all(thread.is_alive() for thread in self._threads):
            raise StreamError(f"the layer loader is not running (layer {index} was never loaded)")
        if self.decode_ahead and (self._decoder is None or not self._decoder.is_alive()):
            raise StreamError(f"the layer decoder is not running (layer {index} was never decoded)")
