"""The layer provider a plan asks for: resident layers decoded once, RAM and disk tiers, and the prefetch ring
(stream.py) over them, with the decode each layer gets before use."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from offload.planner import Plan
from offload.resident import to_device
from offload.stream import StreamingLayers
from offload.tiers import DiskTier, RamTier
from offload.weights.packing import LayerLayout
from offload.weights.source import WeightSource

if TYPE_CHECKING:
    from offload.loader import LoadOptions

# A CPU's ring holds up to this many bytes of layers (2 to 6 layers): a pass's work that streams nothing (resident
# layers, the LM head, sampling, the tree) runs while the loader reads ahead into free slots. Measured on the
# default model's fp32 import from a cold disk, 1-token passes (`bench stream --ring-size`): efficiency 0.56 at 2
# slots, 0.71 at 4, 0.85 at 6 (medians of 3 runs). A GPU keeps 2: its memory holds layers instead.
CPU_RING_BYTES = 128 << 20
MAX_CPU_RING = 6


def ring_size_for(device: torch.device, layer_bytes: int, num_layers: int) -> int:
    """Slots of the prefetch ring: 2 on a GPU; on a CPU CPU_RING_BYTES of layers, 2 to MAX_CPU_RING, and at most a
    third of the model's layers (the ring's memory would hold them resident)."""
    if device.type != "cpu":
        return 2
    return max(2, min(MAX_CPU_RING, CPU_RING_BYTES // max(layer_bytes, 1), num_layers // 3))


def build_layers(source: WeightSource, layout: LayerLayout, plan: Plan, device: torch.device, dtype: torch.dtype,
                 options: LoadOptions, on_kernel: bool) -> StreamingLayers:
    """The plan executed: its resident layers decoded, its RAM and disk tiers opened, the ring over them.
    `on_kernel`: the CPU's packed kernel multiplies the layers (offload/loader.py's on_packed_kernel)."""
    tier_of = plan.tier_of
    # resident layers decoded (or repacked for the CPU's kernel) at load, not at every use, unless the plan keeps
    # them packed
    if on_kernel:
        def decode_once(index: int, device: torch.device, dtype: torch.dtype) -> dict:
            return source.kernel_layer(index, None, dtype)
    else:
        decode_once = None if plan.request.resident_packed else getattr(source, "dense_layer", None)
    resident = {i: decode_once(i, device, dtype) if decode_once else to_device(source.layer(i), device, dtype)
                for i, t in enumerate(tier_of) if t == "device"}
    ram_layers = [i for i, t in enumerate(tier_of) if t == "ram"]
    ram = None
    if ram_layers:
        ram = RamTier(source, layout, ram_layers, pin=device.type == "cuda",
                      max_pinned_bytes=int(plan.request.host_budget * 0.8))
    # O_DIRECT reads (offload/disk_reads.py): a layer read whole into a host buffer, used there by a CPU (its
    # tensors 8-byte aligned, as safetensors and GGUF align them: a view of any dtype) or copied tensor by tensor
    # from pinned memory to a GPU's ring slot
    disk = None
    if "disk" in tier_of:
        disk = DiskTier(source, layout, direct=options.direct_reads, span_align=8 if device.type == "cpu" else 1)
    return StreamingLayers(layout, resident, tier_of, ram, disk, device, plan.request.ring_size, options.disk_cold,
                           decode=_decoder(source, tier_of, dtype, decode_once is not None, options.decode_ahead,
                                           on_kernel),
                           decode_ahead=options.decode_ahead, dense=_dense_decoder(source, dtype) if on_kernel else None,
                           slot_buffer=getattr(source, "slot_buffer", None) if device.type == "cpu" else None,
                           loaders=options.loaders)


def _dense_decoder(source: WeightSource, dtype: torch.dtype):
    """A packed-kernel layer decoded dense, for a pass's long prompt rows (offload/weights/row_split.py): from a
    ring slot's bytes, or a resident layer's from the file, into the one workspace layers decoded at use share."""
    def dense(index: int, stored: dict | None) -> dict:
        layer = source.decode_layer(index, source.layer(index) if stored is None else stored, dtype, shared=True)
        return {name: value.dense() if hasattr(value, "dense") else value for name, value in layer.items()}
    return dense


def _decoder(source: WeightSource, tier_of: list[str], dtype: torch.dtype, resident_decoded: bool, ahead: bool,
             on_kernel: bool = False):
    """The ring's decode: resident layers decoded once as they are; a layer decoded just before its use (a
    resident packed one, always on the compute thread, or a streamed one) into the one workspace they all
    share, which stays in cache between layers (the compute releases a layer before the next is decoded; on
    CUDA both run in order on the compute stream); a streamed layer that a decoder thread decodes ahead into
    its ring slot's own workspace. On the CPU's kernel a streamed layer's matrices are repacked instead."""
    decode_layer = source.kernel_layer if on_kernel else source.decode_layer

    def decode(index: int, stored: dict) -> dict:
        if tier_of[index] == "device":
            return stored if resident_decoded else decode_layer(index, stored, dtype, shared=True)
        if on_kernel:    # a ring slot's: its kernel weights may be kept for the slot's next layers
            return source.kernel_layer(index, stored, dtype, shared=not ahead, in_slot=True)
        return decode_layer(index, stored, dtype, shared=not ahead)
    return decode
