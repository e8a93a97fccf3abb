"""The planner: one memory knob per tier decides what stays on the device, what streams from RAM,
and what streams from disk. Works from config.json alone (no weights needed)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from offload.byte_units import format_bytes
from offload.cache_sizes import draft_cache_tokens, kv_cache_bytes, kv_cache_tokens, workspace_bytes
from offload.model.config import ModelConfig

class PlanError(ValueError):
    """The model cannot run within the given budgets; the message names the minimum."""


@dataclass(slots=True)
class PlanRequest:
    config: ModelConfig
    layer_bytes: int               # one decoder layer, packed, in its streamed format
    global_bytes: int              # embeddings, final norm, LM head
    device_budget: int
    host_budget: int
    draft_bytes: int = 0
    draft_kv_token_bytes: int = 0  # the draft's KV cache per cached token (it caches what the target does)
    max_context: int = 4096
    max_tree: int = 1              # most tokens a single pass processes (tree budget or prefill chunk)
    dtype_bytes: int = 2
    ring_size: int = 2
    device_is_cpu: bool = False    # the CPU's math attention materialises the score matrix
    resident_layer_bytes: int = 0  # one layer kept on the device, when it differs from layer_bytes (decoded once)
    ring_decode_bytes: int = 0     # a ring slot's dense layer, where a decoder thread decodes ahead into each slot
    # one dense layer that every layer decoded just before its use writes, in turn (SpQR; GGUF's streamed and
    # resident packed layers): needed while anything streams, or while resident layers are decoded at use
    decode_workspace_bytes: int = 0
    num_sequences: int = 1         # sequences decoded together: a KV cache slot of max_context tokens each
    # A source that can decode resident layers once (resident_layer_bytes > layer_bytes) may instead keep
    # them packed and decode each at every use, into one shared dense workspace: more layers fit on the
    # device, each costs a decode per pass. decode_vs_transfer: one layer's decode time over the time its
    # packed bytes take to stream (make_plan's only speed input); None: never kept packed.
    decode_vs_transfer: float | None = None
    resident_packed: bool = False  # make_plan's choice: device layers of a decode-once source kept packed
    kv_dtype_bytes: int = 0        # the KV cache's element (0: dtype_bytes; 8: float64, a CPU run on the int4 kernel)
    # A self-draft (spec/self_draft.py) keeps a low-bit substitute of every streamed layer on the device: each
    # layer that streams costs these bytes there, so resident layers and substitutes share the device budget.
    substitute_layer_bytes: int = 0
    # one layer decoded dense for long prompt chunks on the CPU's int4 kernel (offload/weights/row_split.py), where
    # a pass may hold that many prompt rows
    prompt_dense_bytes: int = 0

    @property
    def device_layer_bytes(self) -> int:
        return self.resident_layer_bytes or self.layer_bytes

    @property
    def kv_bytes(self) -> int:
        return self.kv_dtype_bytes or self.dtype_bytes

    @property
    def ring_slot_bytes(self) -> int:
        return self.layer_bytes + self.ring_decode_bytes

    def __post_init__(self) -> None:
        for name in ("layer_bytes", "device_budget", "host_budget", "max_context", "max_tree", "ring_size",
                     "num_sequences"):
            if getattr(self, name) <= 0:
                raise ValueError(f"plan {name} must be positive, got {getattr(self, name)}")
        if self.decode_vs_transfer is not None and not self.decode_vs_transfer >= 0:
            raise ValueError(f"plan decode_vs_transfer must be >= 0, got {self.decode_vs_transfer}")

    @property
    def can_keep_resident_packed(self) -> bool:
        return self.decode_vs_transfer is not None and self.resident_layer_bytes > self.layer_bytes


@dataclass(slots=True)
class PlanItem:
    component: str
    tier: str          # device | ram | disk
    num_bytes: int


@dataclass(slots=True)
class Plan:
    request: PlanRequest
    tier_of: list[str]                  # per decoder layer
    items: list[PlanItem] = field(default_factory=list)

    def bytes_in(self, tier: str) -> int:
        return sum(item.num_bytes for item in self.items if item.tier == tier)

    def streamed_bytes(self, tier: str) -> int:
        return self.tier_of.count(tier) * self.request.layer_bytes

    @property
    def ring_size(self) -> int:
        return self.request.ring_size if any(t != "device" for t in self.tier_of) else 0

    def predicted_transfer_seconds(self, bandwidth: dict[str, float]) -> float:
        """Per pass: RAM layers over the host->device link; disk layers are read then copied (serially)."""
        ram = self.streamed_bytes("ram") / bandwidth["ram"]
        disk = self.streamed_bytes("disk") * (1 / bandwidth["disk"] + 1 / bandwidth["ram"])
        return ram + disk

    def as_dict(self) -> dict:
        return {"items": [{"component": i.component, "tier": i.tier, "bytes": i.num_bytes} for i in self.items],
                "layers": {t: self.tier_of.count(t) for t in ("device", "ram", "disk")},
                "ring_size": self.ring_size, "device_bytes": self.bytes_in("device"),
                "ram_bytes": self.bytes_in("ram"), "disk_bytes": self.bytes_in("disk")}


def _fixed_items(request: PlanRequest, streams: bool = True) -> list[PlanItem]:
    """What never streams: globals, draft, KV cache, workspaces (the decode workspace only where some layer
    is decoded at its use: `streams`, or resident layers not decoded once)."""
    cfg = request.config
    fixed = [PlanItem("embeddings, final norm, LM head", "device", request.global_bytes),
             PlanItem(_kv_label(request), "device", kv_cache_bytes(cfg, kv_cache_tokens(request), request.kv_bytes)),
             PlanItem(f"activation workspace ({request.max_tree} tokens per pass)", "device",
                      workspace_bytes(request))]
    if request.draft_kv_token_bytes:
        fixed.insert(1, PlanItem("draft KV cache", "device", request.draft_kv_token_bytes * draft_cache_tokens(request)))
    if request.draft_bytes:
        fixed.insert(1, PlanItem("draft model", "device", request.draft_bytes))
    if request.decode_workspace_bytes and (streams or not request.resident_layer_bytes):
        fixed.append(PlanItem("decode workspace (1 dense layer)", "device", request.decode_workspace_bytes))
    if request.prompt_dense_bytes:
        fixed.append(PlanItem("long prompts' dense layer", "device", request.prompt_dense_bytes))
    return fixed


def _kv_label(request: PlanRequest) -> str:
    rows = f"{request.max_context} context" + (" + self-draft tree" if request.substitute_layer_bytes else "")
    if request.num_sequences == 1:
        return f"KV cache ({rows})"
    return f"KV cache ({request.num_sequences} sequences x {rows})"


def with_batch(plan: Plan, num_sequences: int) -> Plan:
    """The same placement for a smaller batch than it was made for (auto's pick on the measured pass time):
    what never streams counted for `num_sequences`, the layers where they are."""
    if not 1 <= num_sequences <= plan.request.num_sequences:
        raise ValueError(f"a plan for {plan.request.num_sequences} sequences cannot hold {num_sequences}")
    request = replace(plan.request, num_sequences=num_sequences)
    streams = any(t != "device" for t in plan.tier_of)
    items = _fixed_items(request, streams)
    if streams:
        items.append(PlanItem(f"ring buffers ({request.ring_size} x 1 layer)", "device",
                              request.ring_size * request.ring_slot_bytes))
    return Plan(request, plan.tier_of, items + _layer_items(plan.tier_of, request))


def largest_batch(request: PlanRequest, limit: int = 1024) -> int:
    """The most sequences (<= limit) whose KV cache slots and pass workspace fit the device budget beside
    the ring (0: not even one)."""
    def fits(num_sequences: int) -> bool:
        trial = replace(request, num_sequences=num_sequences)
        return sum(i.num_bytes for i in _fixed_items(trial)) + _ring_bytes(trial) <= request.device_budget

    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def _ring_bytes(request: PlanRequest) -> int:
    all_layers = request.config.num_layers * request.device_layer_bytes
    fixed = sum(i.num_bytes for i in _fixed_items(request))
    return 0 if fixed + all_layers <= request.device_budget else request.ring_size * request.ring_slot_bytes


def beside_layers_bytes(request: PlanRequest) -> int:
    """What never streams plus the ring: the device bytes a plan that streams spends beside decoder layers and
    substitutes (a self-draft's tree rows in the KV cache included)."""
    return sum(item.num_bytes for item in _fixed_items(request)) + request.ring_size * request.ring_slot_bytes


def streaming_budget(request: PlanRequest, resident_layers: int = 0) -> int:
    """The device budget that holds what never streams, the ring, `resident_layers` decoder layers and
    half a layer of slack: every other layer streams."""
    fixed = sum(item.num_bytes for item in _fixed_items(request))
    substitutes = (request.config.num_layers - resident_layers) * request.substitute_layer_bytes
    return (fixed + request.ring_size * request.ring_slot_bytes + resident_layers * request.device_layer_bytes
            + substitutes + request.layer_bytes // 2)


def make_plan(request: PlanRequest) -> Plan:
    """Layers on the device first, then RAM, then disk. A source that decodes resident layers once gets
    whichever resident form (decoded once, or packed and decoded at each use) costs less per pass."""
    plan = _make_plan(request)
    if not request.can_keep_resident_packed or all(t == "device" for t in plan.tier_of):
        return plan
    packed_request = replace(request, resident_layer_bytes=0, decode_workspace_bytes=request.resident_layer_bytes,
                             resident_packed=True)
    # (the dense workspace every resident packed layer decodes into, one for all of them and the streamed ones)
    try:
        packed = _make_plan(packed_request)
    except PlanError:
        return plan
    return packed if _pass_cost(packed) < _pass_cost(plan) else plan


def _pass_cost(plan: Plan) -> float:
    """A pass in units of one layer's packed transfer: each streamed layer moves and decodes, each resident
    packed layer decodes, a resident decoded layer costs nothing (compute is the same in every plan)."""
    request = plan.request
    streamed = sum(t != "device" for t in plan.tier_of)
    decoded_per_pass = len(plan.tier_of) - (plan.tier_of.count("device") if request.resident_layer_bytes else 0)
    return streamed + decoded_per_pass * request.decode_vs_transfer


def _make_plan(request: PlanRequest) -> Plan:
    cfg = request.config
    resident_only = _fixed_items(request, streams=False)
    all_layers = cfg.num_layers * request.device_layer_bytes
    if sum(item.num_bytes for item in resident_only) + all_layers <= request.device_budget:
        tier_of = ["device"] * cfg.num_layers
        return Plan(request, tier_of, resident_only + _layer_items(tier_of, request))
    fixed = _fixed_items(request)
    fixed_bytes = sum(item.num_bytes for item in fixed)
    ring = request.ring_size * request.ring_slot_bytes
    if fixed_bytes + ring > request.device_budget and request.num_sequences > 1:
        largest = largest_batch(request, request.num_sequences)
        raise PlanError(
            f"a batch of {request.num_sequences} sequences does not fit the device budget "
            f"{format_bytes(request.device_budget)} ({format_bytes(fixed_bytes + ring)} needed); the largest that "
            f"fits is {largest} (--batch-size {largest}, or lower --context, or raise --gpu-mem)")
    if fixed_bytes + ring > request.device_budget:
        raise PlanError(
            f"the device budget {format_bytes(request.device_budget)} is too small: at least "
            f"{format_bytes(fixed_bytes + ring)} is needed ({format_bytes(fixed_bytes)} resident + "
            f"{request.ring_size} x {format_bytes(request.ring_slot_bytes)} ring buffers); raise --gpu-mem "
            f"or lower --context / --budget")
    num_device = _num_device_layers(request, request.device_budget - fixed_bytes - ring)
    num_ram = min(request.host_budget // request.layer_bytes, cfg.num_layers - num_device)
    tier_of = ["device"] * num_device + ["ram"] * num_ram + ["disk"] * (cfg.num_layers - num_device - num_ram)
    items = fixed + [PlanItem(f"ring buffers ({request.ring_size} x 1 layer)", "device", ring)]
    items += _layer_items(tier_of, request)
    return Plan(request, tier_of, items)


def _num_device_layers(request: PlanRequest, room: int) -> int:
    """Resident layers in `room` bytes; with substitutes, n layers + (L - n) substitutes must fit."""
    num_layers, layer, substitute = request.config.num_layers, request.device_layer_bytes, request.substitute_layer_bytes
    if not substitute:
        return min(room // layer, num_layers)
    if substitute >= layer:
        raise PlanError(f"a self-draft substitute ({format_bytes(substitute)}) is no smaller than the resident layer it "
                        f"would replace ({format_bytes(layer)}): keeping layers resident costs less; use fewer bits "
                        f"(--draft-bits) or another draft")
    room -= num_layers * substitute
    if room < 0:
        raise PlanError(f"the self-draft's substitutes ({num_layers} x {format_bytes(substitute)}) do not fit the "
                        f"device budget {format_bytes(request.device_budget)} beside what never streams; use fewer "
                        f"bits (--draft-bits), another draft, or raise --gpu-mem")
    return min(room // max(layer - substitute, 1), num_layers)


def _layer_items(tier_of: list[str], request: PlanRequest) -> list[PlanItem]:
    items = _substitute_items(tier_of, request)
    start = 0
    for index in range(1, len(tier_of) + 1):
        if index == len(tier_of) or tier_of[index] != tier_of[start]:
            where = f"streamed {tier_of[start]}" if tier_of[start] != "device" else "device"
            if tier_of[start] == "device" and request.resident_layer_bytes:
                where += ", decoded once"
            elif tier_of[start] == "device" and request.resident_packed:
                where += ", packed: decoded at each use"
            layer_bytes = request.device_layer_bytes if tier_of[start] == "device" else request.layer_bytes
            items.append(PlanItem(f"decoder layers {start}-{index - 1} ({where})",
                                  tier_of[start], (index - start) * layer_bytes))
            start = index
    return items


def _substitute_items(tier_of: list[str], request: PlanRequest) -> list[PlanItem]:
    num_streamed = sum(tier != "device" for tier in tier_of)
    if not request.substitute_layer_bytes or not num_streamed:
        return []
    return [PlanItem(f"self-draft substitutes ({num_streamed} streamed layers)", "device",
                     num_streamed * request.substitute_layer_bytes)]


def request_from_config(config: ModelConfig, dtype_bytes: int, device_budget: int, host_budget: int,
                        draft: ModelConfig | None = None, max_context: int = 4096, max_tree: int = 2048,
                        ring_size: int = 2, device_is_cpu: bool = False,
                        weight_bits: float | None = None) -> PlanRequest:
    """A plan request from config.json alone: byte counts derived from parameter counts. `weight_bits`:
    the decoder layers' stored bits per parameter when packed (e.g. SpQR), else the dtype's."""
    draft_bytes, draft_kv = 0, 0
    if draft is not None:
        draft_bytes = (draft.global_param_count + draft.num_layers * draft.layer_param_count) * dtype_bytes
        draft_kv = kv_cache_bytes(draft, 1, dtype_bytes)
    layer_bytes = config.layer_param_count * (weight_bits / 8 if weight_bits else dtype_bytes)
    return PlanRequest(config, int(layer_bytes), config.global_param_count * dtype_bytes,
                       device_budget, host_budget, draft_bytes, draft_kv, max_context, max_tree, dtype_bytes,
                       ring_size, device_is_cpu)
