"""A validating, memory-mapping safetensors reader: tensors are zero-copy views of the mapped file."""
from __future__ import annotations

import contextlib
import math
import json
import mmap
import os
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from offload.weights.disk_errors import naming

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024


class CorruptCheckpointError(ValueError):
    """A weights file is truncated or its header is inconsistent."""


@dataclass(slots=True, frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def num_bytes(self) -> int:
        return self.end - self.start


class SafetensorsFile:
    """One `.safetensors` file: header parsed and checked at open, data memory-mapped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.entries, self.metadata = read_header(self.path)
        with open(self.path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            self._map = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) if size else None

    def tensor(self, name: str) -> Tensor:
        """A view into the mapped file (copy-on-write mapping: no copy unless written)."""
        entry = self.entries[name]
        if entry.num_bytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        buffer = memoryview(self._map)[entry.start:entry.end]
        return torch.frombuffer(buffer, dtype=entry.dtype).view(entry.shape)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()


def read_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Parses and validates the header; every error names the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CorruptCheckpointError(f"{path}: file is {size} bytes, too short for a safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise CorruptCheckpointError(
                    f"{path}: header length {header_len} exceeds the file size {size} (truncated or not safetensors)")
            header = json.loads(handle.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorruptCheckpointError(f"{path}: header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: header is not a JSON object")
    data_start = 8 + header_len
    metadata = header.pop("__metadata__", None) or {}
    entries = {name: _entry(path, name, raw, data_start, size) for name, raw in header.items()}
    return entries, metadata


def _entry(path: Path, name: str, raw: dict, data_start: int, file_size: int) -> TensorEntry:
    try:
        dtype = DTYPES[raw["dtype"]]
        shape = tuple(int(d) for d in raw["shape"])
        begin, end = (int(x) for x in raw["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise CorruptCheckpointError(f"{path}: tensor {name!r} has a malformed header entry {raw!r}") from None
    expected = dtype.itemsize * math.prod(shape)
    if end - begin != expected or begin < 0:
        raise CorruptCheckpointError(
            f"{path}: tensor {name!r} spans {end - begin} bytes but shape {shape} {raw['dtype']} needs {expected}")
    if data_start + end > file_size:
        raise CorruptCheckpointError(
            f"{path}: tensor {name!r} ends at byte {data_start + end} beyond the file size {file_size} (truncated)")
    return TensorEntry(name, dtype, shape, data_start + begin, data_start + end)





def _temp_beside(path: Path) -> Path:
    """A temp name beside `path` that no other writer of the same file uses (two processes may build one cache)."""
    return path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def write_safetensors(path: str | Path, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> None:
    """Writes tensors (any order) atomically: a temp file renamed into place."""
    path = Path(path)
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        num_bytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + num_bytes]}
        offset += num_bytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    tmp = _temp_beside(path)
    try:
        with open(tmp, "wb") as out:
            out.write(struct.pack("<Q", len(encoded)))
            out.write(encoded)
            for tensor in tensors.values():
                out.write(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except OSError as err:      # a full disk: no temp file left behind, and the error names the file meant
        tmp.unlink(missing_ok=True)
        raise naming(err, path)


class SafetensorsStreamWriter:
    """Writes one safetensors file whose tensors are declared up front (name -> dtype, shape): the header
    is written first, then the tensors' bytes are appended in declaration order as they are produced, so
    only the chunk being written need be in memory. Atomic like `write_safetensors`: a temp file is
    fsynced and renamed into place by `close()`; leaving the `with` block on an error removes it."""

    def __init__(self, path: str | Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, align: int = 8) -> None:
        self.path = Path(path)
        self._tmp = _temp_beside(self.path)
        header, self._ends = _stream_header(specs, metadata, align)
        self._names = list(specs)
        self._dtypes = [dtype for dtype, _ in specs.values()]
        self._index = 0   # the tensor whose bytes come next
        self._offset = 0  # data bytes written so far
        self._file = open(self._tmp, "wb")
        self._file.write(header)
        self._skip_filled()

    def append(self, chunk: Tensor) -> None:
        """Appends the next bytes of the tensor being filled; `chunk` has its dtype, any shape."""
        if chunk.numel() == 0:
            return
        if self._index >= len(self._names):
            raise ValueError(f"{self.path}: every declared tensor is already written")
        name, dtype = self._names[self._index], self._dtypes[self._index]
        if chunk.dtype != dtype:
            raise ValueError(f"{self.path}: tensor {name!r} is declared {dtype}, got a {chunk.dtype} chunk")
        data = chunk.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        if self._offset + data.nbytes > self._ends[self._index]:
            raise ValueError(f"{self.path}: chunk of {data.nbytes} bytes overruns tensor {name!r}")
        try:
            self._file.write(data)
        except OSError as err:
            raise naming(err, self.path)
        self._offset += data.nbytes
        self._skip_filled()

    def _skip_filled(self) -> None:
        while self._index < len(self._names) and self._offset == self._ends[self._index]:
            self._index += 1

    def close(self) -> None:
        if self._index < len(self._names):
            self.abort()
            raise ValueError(f"{self.path}: tensor {self._names[self._index]!r} was not fully written")
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self.path)
        except OSError as err:
            self.abort()
            raise naming(err, self.path)

    def abort(self) -> None:
        """Removes the temp file. Closing flushes what is buffered, which fails again on a full disk: the
        error already on its way says why, so that second one is dropped."""
        with contextlib.suppress(OSError):
            self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "SafetensorsStreamWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _stream_header(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                   metadata: dict[str, str] | None, align: int = 8) -> tuple[bytes, list[int]]:
    """The encoded header (length prefix included, padded with spaces so the data starts on an `align`-byte
    boundary of the file; 8 as `write_safetensors` pads it) and each tensor's end offset within the data section."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    ends, offset = [], 0
    for name, (dtype, shape) in specs.items():
        num_bytes = math.prod(tuple(shape)) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + num_bytes]}
        offset += num_bytes
        ends.append(offset)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(len(encoded) + 8) % align)
    return struct.pack("<Q", len(encoded)) + encoded, ends
