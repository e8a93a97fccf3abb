"""Loading a model for inference: resolve the source, read config + tokenizer, plan the tiers,
and build the forward over a streaming layer provider."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from offload.memory_limits import default_device_memory, default_host_memory
from offload.model.config import ModelConfig
from offload.devices import check_names, choose_device, choose_dtype
from offload.allocator import keep_freed_host_memory
from offload.model.decoder import DecoderModel
from offload.weights.packing import LayerLayout
from offload.weights import ggml_linear, kernel_cache
from offload.weights.gguf_import import cache_root
from offload.weights.packed_linear import draft_head_copy_bytes
from offload.planner import Plan, PlanError, PlanRequest, largest_batch, make_plan, streaming_budget
from offload.weights.resolve import is_default_model, resolve_model
from offload.layer_provider import build_layers, ring_size_for
from offload.resident import to_device
from offload.stream import StreamingLayers
from offload.weights.tokenizer import Tokenizer
from offload.weights.formats import WeightFormat, open_source
from offload.weights.source import WeightSource
from offload.weights.row_split import PromptRouting


CPU_KERNELS = ("auto", "dense", "packed", "ggml")
# The commands' default (run, chat, batch, serve; RuntimeConfig): auto = ggml for a GGUF mostly of the types it
# repacks (Q4_0, Q4_K: 0.84-0.88x llama.cpp's decode on the 1B/8B shapes against 0.53-0.61x on the int4 kernel,
# perplexity +0.1-0.25%) where a libggml is found, else packed (perplexity -0.03 to -0.14% on held-out code, prose,
# math, 3.7x dense decode speed; the default model's Q4_1: 0.66x llama.cpp against ggml's 0.56x); both keep
# speculation exact (bench/results/cpu_kernel_*.json, cpu_shapes_*.json). A library load (LoadOptions) keeps the
# exact fp32 decode, the one tests compare with transformers.
DEFAULT_CPU_KERNEL = "auto"


# Threads loading streamed layers at once on a CPU (stream.py): with one, the disk's queue drained between two
# layers while the loader waited for a core beside the compute's threads. The default model's fp32 import, cold
# disk, 1-token passes, 8 rounds in turn (`bench stream --loaders 1|2|3`): efficiency 0.756 / 0.878 / 0.876, pass
# 0.173 / 0.152 / 0.153 s; 64-token passes unchanged (compute-bound).
LOADERS = 2


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
    num_sequences: int = 1          # sequences decoded together (batch): a KV cache slot each
    draft_bytes: int = 0
    draft_kv_token_bytes: int = 0   # the draft's KV cache per cached token (planned beside the target's)
    ring_size: int | None = None    # streamed layers in flight; None: ring_size_for(device, layer bytes)
    loaders: int = LOADERS          # streamed layers loaded at once, where each lands in its own slot (CPU)
    disk_cold: bool = False
    # A decoder thread dequantizes streamed packed layers between their read and their compute. Measured
    # on 2 CPU cores (SpQR w4, cold disk): it pays for passes of ~128 tokens and more (579 vs 720 ms) and
    # loses below (377 vs 319 ms at 1 token): two Python threads issuing small torch ops hand the GIL back
    # and forth. Off by default.
    decode_ahead: bool = False
    formats: tuple[WeightFormat, ...] = ()   # packed formats beyond plain checkpoints (runtime.weight_formats)
    gguf_import: bool = False       # a GGUF is dequantized once to a safetensors folder rather than run in place
    direct_reads: bool = True       # disk-tier reads with O_DIRECT where the file system allows it; else buffered
    # On the CPU, a GGUF's Q4_0/Q4_1/Q4_K/Q5_*/Q6_K/Q8_0 matrices: "packed" multiplies them as stored with torch's
    # int4 kernel in bf16 (offload/weights/packed_linear.py), "ggml" with ggml's kernels from the blocks in place
    # (offload/weights/ggml_linear.py: needs llama-cpp-python's libggml; SpQR checkpoints stay on the int4
    # kernel), "dense" decodes them to fp32 (exact to gguf.quants)
    cpu_kernel: str = "dense"
    substitute_layer_bytes: int = 0 # a self-draft's low-bit copy of each streamed layer, kept on the device

    def __post_init__(self) -> None:
        check_names(self.device, self.dtype)
        if self.cpu_kernel not in CPU_KERNELS:
            raise ValueError(f"cpu kernel must be one of {', '.join(CPU_KERNELS)}, got {self.cpu_kernel!r}")
        if self.ring_size is not None and self.ring_size < 1:
            raise ValueError(f"ring size must be >= 1, got {self.ring_size}")
        if self.loaders < 1:
            raise ValueError(f"loaders must be >= 1, got {self.loaders}")


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

    def close(self) -> None:
        """Stops and joins the ring's loader threads (the model stays usable: a pass restarts them)."""
        self.layers.close()

    def __enter__(self) -> "LoadedModel":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def load_model(options: LoadOptions, on_status=None, on_progress=None) -> LoadedModel:
    path = resolve_model(options.model, options.allow_download, on_status, on_progress, options.gguf_import)
    config = ModelConfig.from_file(path)
    source = open_source(path, config, options.formats)
    if on_status and hasattr(source, "describe") and not is_default_model(options.model):
        on_status(source.describe())          # a user's file: say how it runs (the embedded model needs no line)
    tokenizer = Tokenizer(path)
    engine = build_engine(source, options, on_status)
    if on_status and engine.on_kernel and not is_default_model(options.model):
        on_status(source.kernel_summary())
    return LoadedModel(path, config, tokenizer, engine.model, engine.layers, engine.plan,
                       stop_token_ids(path, config, tokenizer), engine.global_bytes, engine.source)


def streaming_device_budget(options: LoadOptions, resident_layers: int = 0) -> int:
    """The --gpu-mem at which this model, loaded with `options`, keeps only `resident_layers` decoder
    layers on the device and streams the rest (its layer bytes as stored: packed formats count packed; a GGUF on the
    CPU's kernel in its kernel layer cache's layout, as such a streamed load reads it)."""
    return streaming_budget(_request_for(options, streamed=True), resident_layers)


def plan_for(options: LoadOptions) -> Plan:
    """The plan load_model would make for `options`, without loading any weights (PlanError if none fits)."""
    return make_plan(_request_for(options))


def largest_batch_for(options: LoadOptions, limit: int = 1024) -> int:
    """The most sequences (<= limit) this model, loaded with `options`, can decode together: their KV cache
    slots and the pass workspace fit the device budget beside the ring (0: not one)."""
    return largest_batch(_request_for(options), limit)


def _request_for(options: LoadOptions, streamed: bool = False) -> PlanRequest:
    """The plan request load_model would make for `options`, without loading any weights (`streamed`: as if its
    plan streamed layers)."""
    path = resolve_model(options.model, options.allow_download, gguf_import=options.gguf_import)
    source = open_source(path, ModelConfig.from_file(path), options.formats)
    device = choose_device(options.device)
    _choose_kernel(source, options, device)
    dtype = choose_dtype(options.dtype, device)
    global_bytes = _global_bytes(source, dtype)
    if on_packed_kernel(source, options, device):    # the output matrix packed beside the dense embedding
        global_bytes += source.kernel_head_bytes(dtype)
    request = _plan_request(options, source, source.layout(dtype), global_bytes, device, dtype)
    if not _on_kernel_cache(source, options, device):
        return request
    cached = _plan_request(options, source, kernel_cache.kernel_layout(source), global_bytes, device, dtype)
    return cached if streamed or _streams(request, cached) else request    # as build_engine loads it


def _global_bytes(source: WeightSource, dtype: torch.dtype) -> int:
    """The globals' bytes in `dtype`, from their shapes where the source knows them without decoding (a
    GGUF's embedding is a GB of blocks to decode in a 70B), else from the (lazily mapped) tensors."""
    if hasattr(source, "global_numels"):
        return sum(source.global_numels().values()) * dtype.itemsize
    return sum(t.numel() * dtype.itemsize for t in source.global_tensors().values())


@dataclass(slots=True)
class Engine:
    model: DecoderModel
    layers: StreamingLayers
    plan: Plan
    global_bytes: int
    on_kernel: bool = False         # a GGUF's matrices multiply packed (the CPU's int4 kernel)
    source: WeightSource | None = None   # where streamed layers are read (a GGUF's kernel layer cache, on the kernel)


def on_packed_kernel(source: WeightSource, options: LoadOptions, device: torch.device) -> bool:
    return device.type == "cpu" and options.cpu_kernel != "dense" and hasattr(source, "kernel_layer")


def _choose_kernel(source: WeightSource, options: LoadOptions, device: torch.device) -> None:
    """A GGUF on the CPU with `--cpu-kernel ggml` multiplies through ggml (GgmlMissingError if it is absent); with
    auto where a libggml is found and most of its layers' matrix bytes are of the types ggml repacks."""
    if device.type != "cpu" or not hasattr(source, "use_ggml"):
        return
    if options.cpu_kernel == "ggml" or (options.cpu_kernel == "auto" and source.suits_ggml() and ggml_linear.available()):
        source.use_ggml()


# One packed layer's decode time over its transfer time, by device (is CUDA), for the planner's choice of
# resident form. CPU: None, resident layers stay decoded: Q4_K decodes at 0.7 GB/s of packed bytes on 2
# cores against a 17-20 GB/s RAM copy (bench/results/stream_gguf.json), so a packed resident layer saves a
# few percent of a streamed one's cost and a decoded one saves it all. CUDA: assumed (torch decoding on the
# GPU outruns a 25 GB/s link several times) until the GPU session measures it; at 0.25 a 70B Q4_K_M keeps
# 26 layers packed on 24 GiB instead of 7 decoded.
DECODE_VS_TRANSFER: dict[bool, float | None] = {False: None, True: 0.25}


def build_engine(source: WeightSource, options: LoadOptions, on_status=None) -> Engine:
    """Device and dtype chosen once here; the planner places the layers; the ring streams them."""
    keep_freed_host_memory()
    config = source.config
    device = choose_device(options.device)
    _choose_kernel(source, options, device)
    dtype = choose_dtype(options.dtype, device)
    globals_ = to_device(source.global_tensors(), device, dtype)
    global_bytes = sum(t.numel() * t.element_size() for t in globals_.values())
    on_kernel = on_packed_kernel(source, options, device)
    head = source.kernel_head() if on_kernel else None
    if head is not None:         # replaces a dense lm_head; a tied embedding stays dense for its row lookups
        replaced = globals_.get("lm_head")
        global_bytes += head.nbytes - (replaced.nbytes if replaced is not None else 0)
        globals_["lm_head"] = head
    request = _plan_request(options, source, source.layout(dtype), global_bytes, device, dtype)
    if _on_kernel_cache(source, options, device):
        cached_request = _plan_request(options, source, kernel_cache.kernel_layout(source), global_bytes, device, dtype)
        if _streams(request, cached_request):
            cached = kernel_cache.open_kernel_cache(source, cache_root(), on_status)
            if cached is not None:   # streamed layers read as the kernel multiplies them: planned in that layout
                source, request = cached, cached_request
    plan = make_plan(request)
    layers = build_layers(source, source.layout(dtype), plan, device, dtype, options, on_kernel)
    model = DecoderModel(config, globals_, layers, device, dtype)
    if on_kernel:                # its layers attend in float64: the KV cache holds float64 (layers.py)
        model.cache_dtype = torch.float64
    return Engine(model, layers, plan, global_bytes, on_kernel, source)


def _on_kernel_cache(source: WeightSource, options: LoadOptions, device: torch.device) -> bool:
    """Whether layers this load streams are read from the GGUF's kernel layer cache (weights/kernel_cache.py)."""
    return on_packed_kernel(source, options, device) and kernel_cache.serves(source)


def _streams(request: PlanRequest, cached: PlanRequest) -> bool:
    """Whether a load streams layers: its plan in the GGUF's layout does, or only the kernel cache's layout fits."""
    try:
        return any(tier != "device" for tier in make_plan(request).tier_of)
    except PlanError:
        try:
            make_plan(cached)
            return True
        except PlanError:
            return False


def _plan_request(options: LoadOptions, source: WeightSource, layout: LayerLayout, global_bytes: int,
                  device: torch.device, dtype: torch.dtype) -> PlanRequest:
    # a source that decodes resident layers once (GGUF) keeps them dense, and decodes each streamed one just
    # before its use into one dense workspace, or with a decoder thread ahead into a dense layer per ring slot
    dense_bytes = source.dense_layer_bytes(dtype) if hasattr(source, "dense_layer") else 0
    if on_packed_kernel(source, options, device):   # matrices repacked, not decoded: the kernel's bytes
        dense_bytes = source.kernel_layer_bytes(dtype)
    ahead = options.decode_ahead
    return PlanRequest(
        decode_vs_transfer=DECODE_VS_TRANSFER[device.type == "cuda"],
        config=source.config, layer_bytes=layout.num_bytes, global_bytes=global_bytes,
        resident_layer_bytes=dense_bytes, ring_decode_bytes=dense_bytes if ahead else 0,
        decode_workspace_bytes=0 if ahead else dense_bytes,
        device_budget=options.gpu_mem or default_device_memory(device),
        host_budget=options.ram or default_host_memory(),
        draft_bytes=options.draft_bytes + _self_draft_head_bytes(options, source, device),
        draft_kv_token_bytes=options.draft_kv_token_bytes, max_context=options.max_context,
        max_tree=options.max_pass_tokens,
        dtype_bytes=dtype.itemsize, kv_dtype_bytes=8 if on_packed_kernel(source, options, device) else 0,   # float64
        ring_size=options.ring_size or ring_size_for(device, layout.num_bytes, source.config.num_layers),
        device_is_cpu=device.type == "cpu",
        num_sequences=options.num_sequences, substitute_layer_bytes=options.substitute_layer_bytes,
        prompt_dense_bytes=_prompt_dense_bytes(options, source, device, dtype))


def _self_draft_head_bytes(options: LoadOptions, source: WeightSource, device: torch.device) -> int:
    """A self-draft's 8-bit copy of the output matrix, where it makes one."""
    if not options.substitute_layer_bytes:
        return 0
    packed = on_packed_kernel(source, options, device) and source.kernel_head_bytes(torch.float32) > 0
    return draft_head_copy_bytes((source.config.vocab_size, source.config.hidden_size), packed, device)


def _prompt_dense_bytes(options: LoadOptions, source: WeightSource, device: torch.device, dtype: torch.dtype) -> int:
    """The dense layer long prompt chunks multiply on the int4 kernel, where a pass may hold that many."""
    if not on_packed_kernel(source, options, device) or options.max_pass_tokens < PromptRouting().dense_rows:
        return 0
    return source.config.layer_param_count * dtype.itemsize


def stop_token_ids(path: Path, config: ModelConfig, tokenizer: Tokenizer) -> set[int]:
    """EOS ids from the generation config and model config, plus the chat template's end-of-turn."""
    ids = set(config.eos_token_ids) | tokenizer.end_of_turn_ids()
    generation = path / "generation_config.json"
    if generation.exists():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    return ids
