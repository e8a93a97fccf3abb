"""A GGUF file's header, parsed and validated without reading tensor data: metadata, and every tensor's
type, shape and byte range. gguf.GGUFReader takes seconds on a 100 MB file (it wraps every token string
in numpy views); this reads the header with struct in a fraction of that, and names the file and the
tensor in every error, so a damaged file is refused before anything runs.

    magic "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata:  key (u64 length + utf-8) | value type u32 | value
    tensors:   name | n_dims u32 | ne[n_dims] u64 (fastest-varying first) | ggml type u32 | offset u64
    data:      starts at the next multiple of general.alignment (32); offsets are relative to it
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from offload.weights.ggml_types import QUANT_SIZES, GGMLType, type_name

DEFAULT_ALIGNMENT = 32
SUPPORTED_VERSIONS = (2, 3)
# value type -> struct format of a scalar; 8 is a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


_LENGTH = struct.Struct("<Q")


class CorruptGgufError(ValueError):
    """A GGUF file is truncated, or its header contradicts itself; the message names file and tensor."""


@dataclass(slots=True, frozen=True)
class GgufTensorInfo:
    name: str
    qtype: int                 # ggml type id (not necessarily one this build knows)
    shape: tuple[int, ...]     # torch (row-major) order: the reverse of GGUF's ne[]
    start: int                 # absolute file offset of the first byte

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)

    @property
    def num_bytes(self) -> int | None:
        """Bytes the type and shape need; None for a type the GGML table does not know."""
        try:
            block_size, block_bytes = QUANT_SIZES[GGMLType(self.qtype)]
        except (ValueError, KeyError):
            return None
        numel = int(np.prod(self.shape, dtype=np.int64))
        if not self.shape or self.shape[-1] % block_size:
            return None
        return numel // block_size * block_bytes


@dataclass(slots=True, frozen=True)
class StringArray:
    """A metadata array of strings (a token list), kept as where it lies: read items with `strings_at`."""
    count: int
    offset: int                # absolute file offset of the first string's length


@dataclass(slots=True)
class GgufHeader:
    path: Path
    version: int
    metadata: dict[str, object]           # string arrays as StringArray (token lists hold 100k+ strings)
    tensors: dict[str, GgufTensorInfo]    # in file order
    file_size: int

    def field(self, key: str, default=None):
        value = self.metadata.get(key, default)
        if value is None:
            raise CorruptGgufError(f"{self.path}: GGUF metadata lacks {key!r}")
        return value

    def strings_at(self, key: str, indices: list[int]) -> dict[int, str]:
        """Items `indices` (each within the array) of the string array `key`, read from the file."""
        array = self.field(key)
        if not isinstance(array, StringArray):
            raise CorruptGgufError(f"{self.path}: GGUF metadata {key!r} is not an array of strings")
        if any(not 0 <= i < array.count for i in indices):
            raise CorruptGgufError(f"{self.path}: {key!r} has {array.count} strings, not item {max(indices)}")
        found: dict[int, str] = {}
        with open(self.path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data, self.path)
            cursor.pos, done = array.offset, 0
            for index in sorted(set(indices)):
                cursor.pos = cursor.skip_strings(index - done)
                found[index], done = cursor.string(), index + 1
        return found


class _Cursor:
    def __init__(self, data: mmap.mmap | bytes, path: Path) -> None:
        self.data, self.pos, self.path = data, 0, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise CorruptGgufError(f"{self.path}: the header is truncated (ends at byte {len(self.data)})")
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.take("<Q")
        if self.pos + length > len(self.data):
            raise CorruptGgufError(f"{self.path}: the header is truncated (a string runs past byte {len(self.data)})")
        raw = self.data[self.pos:self.pos + length]
        self.pos += length
        return bytes(raw).decode("utf-8", errors="replace")

    def value(self, value_type: int):
        if value_type in _SCALARS:
            return self.take(_SCALARS[value_type])
        if value_type == 8:
            return self.string()
        if value_type == 9:
            return self._array()
        raise CorruptGgufError(f"{self.path}: metadata value type {value_type} is not a GGUF type (corrupt header)")

    def _array(self):
        item_type, count = self.take("<I"), self.take("<Q")
        if item_type in _NUMPY:
            size = np.dtype(_NUMPY[item_type]).itemsize * count
            if self.pos + size > len(self.data):
                raise CorruptGgufError(f"{self.path}: the header is truncated (an array runs past byte {len(self.data)})")
            values = np.frombuffer(self.data, _NUMPY[item_type], count, self.pos).copy()
            self.pos += size
            return values.tolist() if count <= 64 else values
        if item_type == 8:  # token lists: skipped, read on demand (strings_at)
            array = StringArray(count, self.pos)
            self.pos = self.skip_strings(count)
            return array
        return [self.value(item_type) for _ in range(count)]


    def skip_strings(self, count: int) -> int:
        """The position after `count` strings from here (a tight loop: token lists hold 100k+ strings)."""
        data, pos, length_at = self.data, self.pos, _LENGTH.unpack_from
        try:
            for _ in range(count):
                pos += 8 + length_at(data, pos)[0]
        except struct.error:
            pos = len(data) + 1
        if pos > len(data):
            raise CorruptGgufError(f"{self.path}: the header is truncated (a string array runs past the end)")
        return pos


def read_header(path: str | Path) -> GgufHeader:
    """Parses the header and checks that every tensor's bytes lie inside the file, in order, without
    overlap (a byte size that does not match the type and shape shows up as an overlap or a short file)."""
    path = Path(path)
    with open(path, "rb") as handle:
        size = path.stat().st_size
        if size < 24:
            raise CorruptGgufError(f"{path}: {size} bytes, too short for a GGUF header")
        with mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_READ) as data:
            header = _parse(_Cursor(data, path), size)
    check_tensor_extents(header)
    return header


def _parse(cursor: _Cursor, size: int) -> GgufHeader:
    path = cursor.path
    if bytes(cursor.data[:4]) != b"GGUF":
        raise CorruptGgufError(f"{path}: not a GGUF file (no GGUF magic)")
    cursor.pos = 4
    version = cursor.take("<I")
    if version not in SUPPORTED_VERSIONS:
        raise CorruptGgufError(f"{path}: GGUF version {version} (this build reads versions 2 and 3)")
    num_tensors, num_fields = cursor.take("<Q"), cursor.take("<Q")
    metadata = {}
    for _ in range(num_fields):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.take("<I"))
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        num_dims = cursor.take("<I")
        dims = [cursor.take("<Q") for _ in range(num_dims)]
        infos.append((name, tuple(reversed(dims)), cursor.take("<I"), cursor.take("<Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = {name: GgufTensorInfo(name, qtype, shape, data_start + offset) for name, shape, qtype, offset in infos}
    if len(tensors) != len(infos):
        raise CorruptGgufError(f"{path}: a tensor name appears twice in the header")
    return GgufHeader(path, version, metadata, tensors, size)


def check_tensor_extents(header: GgufHeader) -> None:
    ordered = sorted(header.tensors.values(), key=lambda t: t.start)
    for tensor, following in zip(ordered, ordered[1:] + [None]):
        num_bytes = tensor.num_bytes
        if num_bytes is None:
            continue   # an unknown type or a shape the type cannot hold: refused by whoever reads it
        end = tensor.start + num_bytes
        if end > header.file_size:
            raise CorruptGgufError(f"{header.path}: truncated: tensor {tensor.name!r} ({tensor.type_name} "
                                   f"{list(tensor.shape)}) ends at byte {end}, the file has {header.file_size}")
        if following is not None and end > following.start:
            raise CorruptGgufError(
                f"{header.path}: tensor {tensor.name!r} ({tensor.type_name} {list(tensor.shape)}) needs {num_bytes} "
                f"bytes but tensor {following.name!r} starts {following.start - tensor.start} bytes after it "
                "(its byte size does not match its type and shape)")
