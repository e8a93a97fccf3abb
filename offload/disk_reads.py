"""Reading a layer's tensors from its files in few, large requests.

A layer's tensors lie close together in a checkpoint (a GGUF's blocks, or a safetensors file's entries,
which are sorted by name); reading them tensor by tensor issues many small synchronous requests, each
a disk round trip once the page cache is cold. Here the tensors are grouped into file runs (nearby
tensors of one file, small gaps read and thrown away), and each run is read by one of two readers:

- buffered: one `preadv` per run, scattered straight into the tensors' places in the target buffer;
- direct (O_DIRECT): the run read by DMA, bypassing the page cache, either in aligned chunks into a
  bounce buffer and copied into place (`read`), or whole, straight into a span buffer where the layer's
  runs lie end to end, each extended to whole aligned blocks (`read_span`: no copy at all; the ring then
  uses views into it). No page-cache work: on a CPU that computes while it reads (two cores), the kernel's
  page-cache bookkeeping of a cold read took a core from the compute, and a buffered read of a large run
  crawls through the kernel's readahead (docs/streaming.md, "Disk reads").
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAX_GAP_BYTES = 1 << 20          # a gap this small between two tensors is read rather than skipped
DIRECT_ALIGN = 4096              # O_DIRECT offsets, lengths and addresses (a 512- or 4096-byte device)
BOUNCE_BYTES = 32 << 20          # the direct reader's chunk: one request, then one copy


@dataclass(frozen=True, slots=True)
class Piece:
    """One tensor's bytes: `num_bytes` at absolute file offset `start`, landing in `name`'s view."""
    name: str
    start: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class FileRun:
    """Bytes [start, end) of one file holding `pieces` (sorted, non-overlapping) and small gaps."""
    path: Path
    start: int
    end: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True, slots=True)
class SpanPlan:
    """A layer's runs laid end to end in a span buffer, each from its first aligned block to its last:
    `places` holds each tensor's byte offset in that buffer; the buffer needs `num_bytes`."""
    runs: tuple[FileRun, ...]
    places: dict[str, int]
    num_bytes: int


def span_plan(runs: list[FileRun]) -> SpanPlan:
    places, position = {}, 0
    for run in runs:
        first = run.start - run.start % DIRECT_ALIGN
        for piece in run.pieces:
            places[piece.name] = position + piece.start - first
        position += aligned_up(run.end) - first
    return SpanPlan(tuple(runs), places, position)


def aligned_up(offset: int) -> int:
    return -(-offset // DIRECT_ALIGN) * DIRECT_ALIGN


def plan_runs(spans: dict[str, tuple[Path, int, int]], max_gap: int = MAX_GAP_BYTES) -> list[FileRun]:
    """name -> (file, start, num_bytes) -> the fewest runs that cover them with gaps <= max_gap."""
    runs: list[FileRun] = []
    order = sorted(spans.items(), key=lambda item: (str(item[1][0]), item[1][1]))
    for name, (path, start, num_bytes) in order:
        piece = Piece(name, start, num_bytes)
        last = runs[-1] if runs else None
        if last is not None and last.path == path and last.end <= start <= last.end + max_gap:
            runs[-1] = FileRun(path, last.start, start + num_bytes, last.pieces + (piece,))
        else:
            runs.append(FileRun(path, start, start + num_bytes, (piece,)))
    return runs


def as_bytes(array: np.ndarray) -> np.ndarray:
    """A contiguous array (a tensor's `.numpy()`) as its writable bytes, uint8 [nbytes]."""
    return array.reshape(-1).view(np.uint8)


def read_full(fd: int, views: list[memoryview], offset: int, path: Path) -> int:
    """preadv until every view is filled or the file ends; the bytes read."""
    done, total = 0, sum(len(v) for v in views)
    while done < total:
        count = os.preadv(fd, _remaining(views, done), offset + done)
        if count <= 0:
            return done
        done += count
    return done


def _remaining(views: list[memoryview], done: int) -> list[memoryview]:
    for i, view in enumerate(views):
        if done < len(view):
            return [view[done:], *views[i + 1:]]
        done -= len(view)
    return []


def aligned_buffer(num_bytes: int) -> np.ndarray:
    """uint8 [num_bytes] starting at a DIRECT_ALIGN boundary (O_DIRECT reads land in it)."""
    raw = np.empty(num_bytes + DIRECT_ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % DIRECT_ALIGN
    return raw[skip:skip + num_bytes]


class _OpenFiles:
    """A reader's file descriptors, one per file, opened with `flags` at first use."""

    def __init__(self, flags: int) -> None:
        self._flags, self._fds = flags, {}

    def _open(self, path: Path) -> int:
        return self._fds.get(path) or self._fds.setdefault(path, os.open(path, self._flags))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class BufferedReader(_OpenFiles):
    """Each run in one preadv (through the page cache), scattered into the targets."""

    def __init__(self) -> None:
        super().__init__(os.O_RDONLY)
        self._scratch = memoryview(bytearray(MAX_GAP_BYTES))

    def read(self, run: FileRun, targets: dict[str, np.ndarray]) -> None:
        views, position = [], run.start
        for piece in run.pieces:
            if piece.start > position:
                views.append(self._scratch[:piece.start - position])
            views.append(memoryview(targets[piece.name][:piece.num_bytes]))
            position = piece.start + piece.num_bytes
        count = read_full(self._open(run.path), views, run.start, run.path)
        if count < run.end - run.start:
            raise OSError(f"{run.path}: {count} of {run.end - run.start} bytes at offset {run.start} "
                          f"(file truncated?)")


class DirectReader(_OpenFiles):
    """Each run in aligned O_DIRECT chunks into one bounce buffer, each chunk then copied into place, or
    whole into a span buffer. `supported(path)` is False where the file system refuses O_DIRECT (tmpfs,
    some network mounts)."""

    def __init__(self, bounce_bytes: int = BOUNCE_BYTES) -> None:
        super().__init__(os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        self._bounce_bytes, self._bounce_buffer = bounce_bytes, None

    @staticmethod
    def supported(path: Path) -> bool:
        if not hasattr(os, "O_DIRECT"):
            return False
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        except OSError as err:
            if err.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return False
            raise
        return True

    def read(self, run: FileRun, targets: dict[str, np.ndarray]) -> None:
        fd = self._open(run.path)
        chunk_start = run.start - run.start % DIRECT_ALIGN
        while chunk_start < run.end:
            wanted = min(len(self._bounce), aligned_up(run.end - chunk_start))
            count = read_full(fd, [memoryview(self._bounce[:wanted])], chunk_start, run.path)
            chunk_end = chunk_start + count
            if chunk_end < min(run.end, chunk_start + wanted):
                raise OSError(f"{run.path}: read ended at offset {chunk_end} of {run.end} (file truncated?)")
            self._scatter(run, targets, chunk_start, chunk_end)
            chunk_start += wanted

    @property
    def _bounce(self) -> np.ndarray:
        """Allocated at the first chunked read (a ring whose layers all read whole never needs it)."""
        if self._bounce_buffer is None:
            self._bounce_buffer = aligned_buffer(self._bounce_bytes)
        return self._bounce_buffer

    def read_span(self, plan: SpanPlan, buffer: np.ndarray) -> None:
        """Every run of `plan` by O_DIRECT straight into its place in `buffer` (aligned, >= plan.num_bytes)."""
        position = 0
        for run in plan.runs:
            fd = self._open(run.path)
            first = run.start - run.start % DIRECT_ALIGN
            extent = aligned_up(run.end) - first
            count = read_full(fd, [memoryview(buffer[position:position + extent])], first, run.path)
            if count < run.end - first:
                raise OSError(f"{run.path}: read ended at offset {first + count} of {run.end} (file truncated?)")
            position += extent

    def _scatter(self, run: FileRun, targets: dict[str, np.ndarray], chunk_start: int, chunk_end: int) -> None:
        for piece in run.pieces:
            low, high = max(piece.start, chunk_start), min(piece.start + piece.num_bytes, chunk_end)
            if low < high:
                into = targets[piece.name][low - piece.start:high - piece.start]
                np.copyto(into, self._bounce[low - chunk_start:high - chunk_start])
