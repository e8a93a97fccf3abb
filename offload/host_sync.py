"""What makes the host wait for the device: reads of tensor values into Python, blocking copies between
host and device, and ops whose output shape depends on the data. Counted here (with torch ops in all),
and avoided for host->device sends (`send`).

On a GPU every such read waits for all queued work (a CUDA sync), so a decoding step's count is a cost
that timings on a CPU never show. `count_host_syncs(device)` counts, while it is open, the syncs that
tensors on `device` cause:
  - "cuda": reads of CUDA tensors (item, tolist, bool, int, float, index, numpy), blocking copies
    between host and device (either way: PyTorch waits for the stream after a non_blocking=False copy),
    data-dependent shapes (nonzero, boolean masks, masked_select, unique, repeat_interleave without
    output_size) and torch.equal on CUDA tensors; reads of host tensors cost nothing and are not counted.
    Explicit torch.cuda.synchronize() calls count too ("synchronize"); waits on one event or stream
    (the streaming ring's copies) do not. The CUDA sync debug mode's warnings are counted beside, as a
    cross-check (`sync_warnings`).
  - "cpu": host and device are one, so every tensor counts as if it were on the device: every read,
    every blocking move that names a device (.to(device), .cpu(), torch.tensor(..., device=)), every
    data-dependent shape. An upper bound of what the same code makes a GPU wait for (host bookkeeping
    included; explicit torch.cuda.synchronize() calls excluded) that runs anywhere: the tests guard it.
"""
from __future__ import annotations

import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
READS = {torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__bool__: "bool",
         torch.Tensor.__int__: "int", torch.Tensor.__float__: "float", torch.Tensor.__index__: "index",
         torch.Tensor.numpy: "numpy"}
DATA_SHAPED = {aten.nonzero.default: "nonzero", aten.masked_select.default: "masked_select",
               aten.equal.default: "equal", aten.is_nonzero.default: "bool",
               aten._unique2.default: "unique", aten.unique_dim.default: "unique",
               aten.unique_consecutive.default: "unique", aten._unique.default: "unique"}
MASK_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                aten._index_put_impl_.default}
COPIES = {aten._to_copy.default, aten.copy_.default}
MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.tensor, torch.as_tensor}
HOST = torch.device("cpu")
_SKIPPED_FILES = (str(Path(torch.__file__).parent), __file__)


@dataclass(slots=True)
class SyncCounts:
    reads: Counter = field(default_factory=Counter)     # kind -> host syncs of that kind
    num_torch_ops: int = 0                               # aten ops dispatched (~ kernels launched)
    sites: Counter = field(default_factory=Counter)     # "file:line kind" -> syncs (when traced)
    sync_warnings: int | None = None                     # CUDA sync debug mode warnings (None: not on CUDA)

    @property
    def num_host_syncs(self) -> int:
        return sum(self.reads.values())

    def minus(self, other: SyncCounts) -> SyncCounts:
        """What this count holds beyond `other` (e.g. a run less its prefill-only twin)."""
        warned = None if self.sync_warnings is None else self.sync_warnings - (other.sync_warnings or 0)
        return SyncCounts(self.reads - other.reads, self.num_torch_ops - other.num_torch_ops,
                          self.sites - other.sites, warned)

    def report(self, num_steps: int = 1) -> dict:
        """Per step (over `num_steps`), rounded: host syncs by kind and in all, torch ops."""
        steps = max(num_steps, 1)
        row = {"host_reads_per_step": round(self.num_host_syncs / steps, 2),
               "torch_ops_per_step": round(self.num_torch_ops / steps, 1),
               "host_reads_by_kind": {kind: round(n / steps, 2) for kind, n in sorted(self.reads.items())}}
        if self.sync_warnings is not None:
            row["sync_warnings_per_step"] = round(self.sync_warnings / steps, 2)
        return row


class _Counting:
    """The state both modes share: what is watched and where a read is in progress."""

    def __init__(self, device_type: str, counts: SyncCounts, trace: bool) -> None:
        self.device_type, self.counts, self.trace = device_type, counts, trace
        self.in_read = 0

    def watched(self, value) -> bool:
        return isinstance(value, torch.Tensor) and value.device.type == self.device_type

    def is_sync_copy(self, source: torch.device, target: torch.device, non_blocking: bool) -> bool:
        """A blocking copy across the link; on the CPU, any blocking move that names a device."""
        if non_blocking:
            return False
        if self.device_type == "cpu":
            return True
        return source.type != target.type and self.device_type in (source.type, target.type)

    def add(self, kind: str) -> None:
        self.counts.reads[kind] += 1
        if self.trace:
            self.counts.sites[f"{_caller()} {kind}"] += 1


class _ReadMode(TorchFunctionMode):
    """Reads and moves, seen as the Python methods they are called through."""

    def __init__(self, state: _Counting) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self._kind(func, args, kwargs)
        if kind is None:
            return func(*args, **kwargs)
        self.state.add(kind)
        self.state.in_read += 1        # the aten ops under it (a scalar read, a copy) are this one sync
        try:
            return func(*args, **kwargs)
        finally:
            self.state.in_read -= 1

    def _kind(self, func, args, kwargs) -> str | None:
        if func in READS:
            return READS[func] if args and self.state.watched(args[0]) else None
        if func in MOVES:
            source, target, non_blocking = _move(func, args, kwargs)
            return "copy" if target is not None and self.state.is_sync_copy(source, target, non_blocking) else None
        return None


def _move(func, args, kwargs) -> tuple[torch.device, torch.device | None, bool]:
    """(source device, target device or None when none is named, non_blocking) of a move call."""
    if func is torch.tensor or func is torch.as_tensor:
        data, target = args[0] if args else kwargs.get("data"), kwargs.get("device")
        source = data.device if isinstance(data, torch.Tensor) else HOST
        return source, None if target is None else torch.device(target), False
    source = args[0].device
    if func is torch.Tensor.cpu:
        return source, HOST, False
    if func is torch.Tensor.cuda:
        return source, torch.device("cuda"), bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
    named, positional = {k: v for k, v in kwargs.items() if k != "copy"}, args[1:]
    try:
        target, _, non_blocking, _ = torch._C._nn._parse_to(*positional, **named)
    except RuntimeError:             # a positional `copy` (the last argument), which _parse_to refuses
        target, _, non_blocking, _ = torch._C._nn._parse_to(*positional[:-1], **named)
    return source, target, non_blocking


class _OpMode(TorchDispatchMode):
    def __init__(self, state: _Counting) -> None:
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.state.counts.num_torch_ops += 1
        kind = None if self.state.in_read else self._sync_kind(func, args, kwargs)
        if kind:
            self.state.add(kind)
        return func(*args, **kwargs)

    def _sync_kind(self, func, args, kwargs) -> str | None:
        watched = self.state.watched
        if func in COPIES:         # copies not called as a move (a setitem from the host...); CUDA only
            is_copy_ = func is aten.copy_.default
            source, target = (args[1], args[0].device) if is_copy_ else (args[0], kwargs.get("device") or args[0].device)
            non_blocking = args[2] if is_copy_ and len(args) > 2 else kwargs.get("non_blocking", False)
            is_cross = torch.device(target).type != source.device.type
            return "copy" if is_cross and self.state.is_sync_copy(source.device, torch.device(target),
                                                                  non_blocking) else None
        if not args or not watched(args[0]):
            return None
        if func in DATA_SHAPED:
            return DATA_SHAPED[func]
        if func in MASK_INDEXED:
            indices = [i for i in args[1] if i is not None]
            if any(i.dtype in (torch.bool, torch.uint8) for i in indices):
                return "mask_index"
            if any(i.device.type != args[0].device.type for i in indices):
                return "copy"                   # the host's indices go down to the device first
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            return "repeat_interleave"
        if func is aten._local_scalar_dense.default:
            return "scalar"                     # a read inside torch's own code
        return None


@contextmanager
def count_host_syncs(device: torch.device | str | None = None, trace: bool = False) -> Iterator[SyncCounts]:
    """Counts host syncs caused by tensors on `device` (default: CUDA where there is one, else the CPU)
    and torch ops while open -> the SyncCounts, filled in as the block runs. trace: also count by call
    site (the first frame outside torch), to find where reads come from."""
    device_type = torch.device(device).type if device is not None else \
        ("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = device_type == "cuda" and torch.cuda.is_available()
    counts = SyncCounts(sync_warnings=0 if on_cuda else None)
    state = _Counting(device_type, counts, trace)
    with _sync_warnings(counts, on_cuda), _synchronize_calls(state, on_cuda), _ReadMode(state), _OpMode(state):
        yield counts


def count_steps(decode: Callable[[int], int], answer_tokens: int,
                device: torch.device | str | None = None) -> tuple[SyncCounts, int]:
    """What the steps of an answer alone make the host wait for: `decode(max_new_tokens)` decodes an answer
    from scratch and returns its number of steps; an answer of `answer_tokens` is counted, less a one-token
    answer (the prefill and its token, no step) -> (counts, steps)."""
    counted = []
    for max_new_tokens in (1, answer_tokens):
        with count_host_syncs(device) as counts:
            num_steps = decode(max_new_tokens)
        counted.append(counts)
    return counted[1].minus(counted[0]), num_steps


@contextmanager
def _synchronize_calls(state: _Counting, enabled: bool) -> Iterator[None]:
    """On CUDA: torch.cuda.synchronize() calls counted too (no mode sees them), as kind "synchronize"."""
    if not enabled:
        yield
        return
    synchronize = torch.cuda.synchronize

    def counted(device=None) -> None:
        state.add("synchronize")
        synchronize(device)

    torch.cuda.synchronize = counted
    try:
        yield
    finally:
        torch.cuda.synchronize = synchronize


@contextmanager
def _sync_warnings(counts: SyncCounts, enabled: bool) -> Iterator[None]:
    """On CUDA: the sync debug mode on ("warn") for the block, its warnings counted into `counts`."""
    if not enabled:
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    is_sync = ["synchroniz" in str(w.message) for w in caught]
    counts.sync_warnings = sum(is_sync)
    for warning, counted in zip(caught, is_sync):
        if not counted:       # others are shown as they would have been
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED_FILES):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


def send(tensor: Tensor, device: torch.device) -> Tensor:
    """`tensor` on `device`. A host tensor bound for a GPU goes pinned and asynchronously: the host does
    not wait for the queued work (a blocking copy would; PyTorch's caching host allocator keeps the pinned
    block until the copy has run). On the same device: the tensor itself."""
    if tensor.device.type == device.type and device.index in (None, tensor.device.index):
        return tensor
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
