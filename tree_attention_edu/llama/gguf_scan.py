"""A bounded walk over a GGUF file's header, before `gguf.GGUFReader` sees it.

**Untrusted input.** A GGUF file is parsed here first (`scan`): every length, count,
dimension, type and offset is checked against the file's size and against fixed limits, so
a truncated or hostile file fails with a ValueError that names the file and the field, in
time and memory proportional to the file, before anything is allocated.

The header, in order: the magic `GGUF`, the version, the tensor and metadata counts; each
metadata entry (a key, a value type, a value); each tensor's name, dimensions, ggml type and
offset; then, aligned to `general.alignment`, the tensors' data.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np

from .paths import StrPath, check_path

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_KEYS = 1 << 16  # metadata entries; llama.cpp writes a few dozen
MAX_TENSORS = 1 << 20
MAX_ARRAY_ITEMS = 1 << 23  # all metadata arrays together (Gemma's 262k-token vocabulary x 3)
MAX_NAME = 1 << 16  # bytes of a key or tensor name
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40

# GGUFValueType: numpy scalar of the fixed-size ones, 8 = string, 9 = array.
_SCALARS = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
STRING_TYPE, ARRAY_TYPE = 8, 9
INT_TYPES, FLOAT_TYPES, BOOL_TYPE = {0, 1, 2, 3, 4, 5, 10, 11}, {6, 12}, 7
"""GGUF's value types (`GGUFValueType`) that the metadata readers tell apart."""

TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
"""The tensor types the loader dequantises (llama.cpp's usual types for Llama weights)."""

Metadata = dict[str, tuple[int, Any]]
"""A GGUF file's metadata: key -> (GGUF value type, value)."""


class TensorEntry(NamedTuple):
    """One tensor of a GGUF file: its ggml `type` name, numpy `shape` (`[out, in]`), and
    where its bytes lie (`offset` from the start of the file, `nbytes`)."""

    type: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def not_gguf(file: Path, field: str, problem: str) -> ValueError:
    """The error for a file this loader cannot read: it names the file and the field."""
    return ValueError(
        f"`{file.name}` ({str(file.parent)!r}): {field}: {problem}; it is not a "
        f"GGUF file this loader can read (re-download or re-convert it)."
    )


def scan(path: StrPath) -> tuple[Metadata, dict[str, TensorEntry]]:
    """Parse a GGUF file's header with every size checked: `(metadata, tensors)`.

    `metadata` maps each key to its value type and value (numbers, bools, strings; arrays
    as lists, except arrays of more than 64 items, kept as `("array", element type,
    count)`); `tensors` maps each tensor name to its `TensorEntry`. Raises a ValueError
    naming the file and the field for anything malformed: bad magic or version, a count or
    length that runs past the end, an unknown value or tensor type, absurd dimensions, a
    tensor whose bytes lie outside the file. Reads only the header; time and memory are
    bounded by its size.
    """
    file = _check_file(path)
    size = file.stat().st_size
    with open(file, "rb") as f:
        n_tensors, n_keys = _read_counts(file, f.read(24), size)
        reader = _Cursor(file, f, size, 24)
        metadata = _read_metadata(reader, n_keys)
        alignment = _alignment(file, metadata)
        infos = _read_tensor_infos(reader, n_tensors)
        data_start = -(-reader.pos // alignment) * alignment
    tensors = {}
    for name, dims, raw_type, offset in infos:
        tensors[name] = _tensor_entry(
            file, size, data_start, alignment, name, dims, raw_type, offset
        )
    return metadata, tensors


def _check_file(path: StrPath) -> Path:
    file = check_path(path, "path", "a .gguf file")
    if not file.is_file():
        raise ValueError(
            f"`path` {str(file)!r} is not a file; a GGUF checkpoint is one "
            f"*.gguf file (`tree-attention-edu fetch-model` fetches one)."
        )
    return file


def _read_counts(file: Path, head: bytes, size: int) -> tuple[int, int]:
    """`(n_tensors, n_keys)` from the first 24 bytes, after the magic and the version."""
    if len(head) < 24 or head[:4] != MAGIC:
        raise not_gguf(
            file,
            "header",
            f"the file ({size} bytes) does not start with the GGUF magic and counts",
        )
    version, n_tensors, n_keys = struct.unpack_from("<IQQ", head, 4)
    if version not in VERSIONS:
        raise not_gguf(
            file,
            "GGUF.version",
            f"version {version} (big-endian files read as a "
            f"huge number); this loader reads little-endian "
            f"versions {VERSIONS}",
        )
    # Each entry takes at least 13 (key) or 24 (tensor) bytes, so a count the file cannot
    # hold is refused before any loop runs over it.
    if n_keys > min(MAX_KEYS, size // 13):
        raise not_gguf(file, "GGUF.kv_count", f"{n_keys} metadata entries in {size} bytes")
    if n_tensors > min(MAX_TENSORS, size // 24):
        raise not_gguf(file, "GGUF.tensor_count", f"{n_tensors} tensors in {size} bytes")
    return n_tensors, n_keys


def _read_metadata(reader: _Cursor, n_keys: int) -> Metadata:
    """Every metadata entry; the arrays' items count against `MAX_ARRAY_ITEMS` together."""
    metadata: Metadata = {}
    items = 0
    for i in range(n_keys):
        key = reader.string(f"metadata entry {i}: its key", MAX_NAME)
        if key in metadata:
            raise not_gguf(reader.file, key, "appears twice")
        vtype = reader.unpack("<I", key)[0]
        if vtype == ARRAY_TYPE:
            value, items = _read_array(reader, key, items)
        else:
            value = _read_value(reader, key, vtype)
        metadata[key] = (vtype, value)
    return metadata


def _read_array(reader: _Cursor, key: str, items: int) -> tuple[Any, int]:
    """An array value, and the count of array items read so far (`items` before it)."""
    etype, count = reader.unpack("<IQ", key)
    items += count
    if items > MAX_ARRAY_ITEMS:
        raise not_gguf(
            reader.file, key, f"arrays of {items} items in all, more than {MAX_ARRAY_ITEMS}"
        )
    if etype in _SCALARS:
        width = np.dtype(_SCALARS[etype]).itemsize
        data = reader.take(width * count, key)
        value: Any = (
            np.frombuffer(data, _SCALARS[etype]).tolist()
            if count <= 64
            else ("array", etype, count)
        )
    elif etype == STRING_TYPE:
        strings = [reader.string(f"{key}[{j}]") for j in range(count)]
        value = strings if count <= 64 else ("array", etype, count)
    else:
        raise not_gguf(
            reader.file,
            key,
            f"an array of value type {etype}, which GGUF does not "
            f"define for arrays (nested arrays are not read)",
        )
    return value, items


def _read_value(reader: _Cursor, key: str, vtype: int) -> Any:
    """A string or fixed-size value of type `vtype`."""
    if vtype == STRING_TYPE:
        return reader.string(key)
    if vtype in _SCALARS:
        width = np.dtype(_SCALARS[vtype]).itemsize
        value = np.frombuffer(reader.take(width, key), _SCALARS[vtype])[0].item()
        return bool(value) if vtype == BOOL_TYPE else value
    raise not_gguf(reader.file, key, f"value type {vtype}, which GGUF does not define")


def _alignment(file: Path, metadata: Metadata) -> int:
    """`general.alignment` (32 by default): a uint32 power of two."""
    alignment = metadata.get("general.alignment", (4, 32))
    if alignment[0] != 4 or alignment[1] == 0 or alignment[1] & (alignment[1] - 1):
        raise not_gguf(file, "general.alignment", f"{alignment[1]!r} is not a uint32 power of two")
    return alignment[1]


def _read_tensor_infos(
    reader: _Cursor, n_tensors: int
) -> list[tuple[str, tuple[int, ...], int, int]]:
    """Each tensor's `(name, dims, raw type, offset)` as the header lists them."""
    infos, seen = [], set()
    for i in range(n_tensors):
        name = reader.string(f"tensor {i}: its name", MAX_NAME)
        n_dims = reader.unpack("<I", name)[0]
        if not 1 <= n_dims <= MAX_DIMS:
            raise not_gguf(
                reader.file, name, f"{n_dims} dimensions; ggml tensors have 1 to {MAX_DIMS}"
            )
        dims = reader.unpack(f"<{n_dims}Q", name)
        raw_type, offset = reader.unpack("<IQ", name)
        if name in seen:
            raise not_gguf(reader.file, name, "appears twice")
        seen.add(name)
        infos.append((name, dims, raw_type, offset))
    return infos


def _tensor_entry(
    file: Path,
    size: int,
    data_start: int,
    alignment: int,
    name: str,
    dims: tuple[int, ...],
    raw_type: int,
    offset: int,
) -> TensorEntry:
    """One tensor's entry: its type read, its dimensions and bytes checked against the file."""
    import gguf

    try:
        type_name = gguf.GGMLQuantizationType(raw_type).name
    except ValueError:
        type_name = f"{raw_type} (unknown)"
    if type_name not in TYPES:
        raise not_gguf(
            file,
            name,
            f"tensor type {type_name}, which the loader does not "
            f"dequantise; it reads {', '.join(TYPES)}",
        )
    if min(dims) < 1 or math.prod(dims) > MAX_ELEMENTS:
        raise not_gguf(
            file,
            name,
            f"dimensions {list(dims)}: each must be >= 1 and the product at most {MAX_ELEMENTS}",
        )
    block, block_bytes = _block(type_name)
    if dims[0] % block:
        raise not_gguf(
            file,
            name,
            f"a row of {dims[0]} values, not a whole number of {type_name} blocks of {block}",
        )
    nbytes = math.prod(dims) // block * block_bytes
    start = data_start + offset
    if offset % alignment or start + nbytes > size:
        raise not_gguf(
            file,
            name,
            f"its {nbytes} bytes at offset {offset} of the data "
            f"(from byte {data_start}) lie outside the file's {size} "
            f"bytes or off its {alignment}-byte alignment "
            f"(a truncated file?)",
        )
    return TensorEntry(type_name, tuple(reversed(dims)), start, nbytes)


def _block(type_name: str) -> tuple[int, int]:
    """(elements per block, bytes per block) of a ggml type."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]


class _Cursor:
    """Reads the header from a file, refusing any length that would run past its end."""

    def __init__(self, file: Path, f: IO[bytes], size: int, pos: int):
        self.file, self.f, self.size, self.pos = file, f, size, pos

    def take(self, n: int, field: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise not_gguf(
                self.file,
                field,
                f"{n} bytes at byte {self.pos} run past the end of "
                f"the file ({self.size} bytes; truncated?)",
            )
        data = self.f.read(n)
        self.pos += n
        return data

    def unpack(self, fmt: str, field: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), field))

    def string(self, field: str, limit: int | None = None) -> str:
        """A length-prefixed UTF-8 string; `limit` caps its length (keys and names)."""
        n = self.unpack("<Q", field)[0]
        if limit is not None and n > limit:
            raise not_gguf(self.file, field, f"a name of {n} bytes, more than {limit}")
        try:
            return self.take(n, field).decode("utf-8")
        except UnicodeDecodeError as err:
            raise not_gguf(self.file, field, f"a string that is not UTF-8 ({err.reason})") from None
