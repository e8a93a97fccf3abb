"""Loading a model for inference: resolve the source, read config + tokenizer, plan the tiers,
and build the forward over a streaming layer provider."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .budgets import default_device_budget, default_host_budget
from .config import ModelConfig
from .devices import check_names, choose_device, choose_dtype
from .host_memory import keep_freed_host_memory
from .model import DecoderModel
from .packing import LayerLayout
from .planner import Plan, PlanRequest, make_plan, streaming_budget
from .resident import to_device
from .sources import resolve_model
from .stream import StreamingLayers
from .tiers import DiskTier, RamTier
from .tokenizer import Tokenizer
from .formats import open_source
from .weights import WeightSource


@dataclass(slots=True)
class LoadOptions:
    model: str | None = None        # None: the embedded default model
    device: str = "auto"
    dtype: str = "auto"
    allow_download: bool = False
    gpu_mem: int | None = None      # device budget in bytes; None: free device memory minus a margin
    ram: int | None = None          # host budget for streamed layers; None: available RAM minus a margin
    max_context: int = 4096
    max_pass_tokens: int = 512      # largest pass (prefill chunk or tree) the workspace must hold
    draft_bytes: int = 0
    ring_size: int = 2
    disk_cold: bool = False
    # A decoder thread dequantizes streamed packed layers between their read and their compute. Measured
    # on 2 CPU cores (SpQR w4, cold disk): it pays for passes of ~128 tokens and more (579 vs 720 ms) and
    # loses below (377 vs 319 ms at 1 token): two Python threads issuing small torch ops hand the GIL back
    # and forth. Off by default.
    decode_ahead: bool = False

    def __post_init__(self) -> None:
        check_names(self.device, self.dtype)
        if self.ring_size < 1:
            raise ValueError(f"ring size must be >= 1, got {self.ring_size}")


@dataclass(slots=True)
class LoadedModel:
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    model: DecoderModel
    layers: StreamingLayers
    plan: Plan
    stop_ids: set[int] = field(default_factory=set)
    global_bytes: int = 0
    source: WeightSource | None = None

    @property
    def device_bytes(self) -> int:
        """Engine-accounted device memory for weights: globals, resident layers, ring buffers."""
        return self.global_bytes + self.layers.device_bytes


def load_model(options: LoadOptions, on_status=None, on_progress=None) -> LoadedModel:
    path = resolve_model(options.model, options.allow_download, on_status, on_progress)
    config = ModelConfig.from_file(path)
    source = open_source(path, config)
    tokenizer = Tokenizer(path)
    engine = build_engine(source, options)
    return LoadedModel(path, config, tokenizer, engine.model, engine.layers, engine.plan,
                       stop_token_ids(path, config, tokenizer), engine.global_bytes, source)


def streaming_device_budget(options: LoadOptions, resident_layers: int = 0) -> int:
    """The --gpu-mem at which this model, loaded with `options`, keeps only `resident_layers` decoder
    layers on the device and streams the rest (its layer bytes as stored: packed formats count packed)."""
    path = resolve_model(options.model, options.allow_download)
    source = open_source(path, ModelConfig.from_file(path))
    device = choose_device(options.device)
    dtype = choose_dtype(options.dtype, device)
    global_bytes = sum(t.numel() * dtype.itemsize for t in source.global_tensors().values())
    request = _plan_request(options, source.config, source.layout(dtype), global_bytes, device, dtype)
    return streaming_budget(request, resident_layers)


@dataclass(slots=True)
class Engine:
    model: DecoderModel
    layers: StreamingLayers
    plan: Plan
    global_bytes: int


def build_engine(source: WeightSource, options: LoadOptions) -> Engine:
    """Device and dtype chosen once here; the planner places the layers; the ring streams them."""
    keep_freed_host_memory()
    config = source.config
    device = choose_device(options.device)
    dtype = choose_dtype(options.dtype, device)
    globals_ = to_device(source.global_tensors(), device, dtype)
    global_bytes = sum(t.numel() * t.element_size() for t in globals_.values())
    layout = source.layout(dtype)
    plan = make_plan(_plan_request(options, config, layout, global_bytes, device, dtype))
    layers = _build_layers(source, layout, plan, device, dtype, options)
    return Engine(DecoderModel(config, globals_, layers, device, dtype), layers, plan, global_bytes)


def _plan_request(options: LoadOptions, config: ModelConfig, layout: LayerLayout, global_bytes: int,
                  device: torch.device, dtype: torch.dtype) -> PlanRequest:
    return PlanRequest(
        config=config, layer_bytes=layout.num_bytes, global_bytes=global_bytes,
        device_budget=options.gpu_mem or default_device_budget(device),
        host_budget=options.ram or default_host_budget(),
        draft_bytes=options.draft_bytes, max_context=options.max_context, max_tree=options.max_pass_tokens,
        dtype_bytes=dtype.itemsize, ring_size=options.ring_size, device_is_cpu=device.type == "cpu")


def _build_layers(source: WeightSource, layout: LayerLayout, plan: Plan, device: torch.device,
                  dtype: torch.dtype, options: LoadOptions) -> StreamingLayers:
    tier_of = plan.tier_of
    resident = {i: to_device(source.layer(i), device, dtype) for i, t in enumerate(tier_of) if t == "device"}
    ram_layers = [i for i, t in enumerate(tier_of) if t == "ram"]
    ram = None
    if ram_layers:
        ram = RamTier(source, layout, ram_layers, pin=device.type == "cuda",
                      max_pinned_bytes=int(plan.request.host_budget * 0.8))
    disk = DiskTier(source, layout) if "disk" in tier_of else None
    return StreamingLayers(layout, resident, tier_of, ram, disk, device, options.ring_size, options.disk_cold,
                           decode=lambda index, stored: source.decode_layer(index, stored, dtype),
                           decode_ahead=options.decode_ahead)


def stop_token_ids(path: Path, config: ModelConfig, tokenizer: Tokenizer) -> set[int]:
    """EOS ids from the generation config and model config, plus the chat template's end-of-turn."""
    ids = set(config.eos_token_ids) | tokenizer.end_of_turn_ids()
    generation = path / "generation_config.json"
    if generation.exists():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    return ids
