"""safetensors: an 8-byte little-endian header length, a JSON header, then the data region.

The header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` with
offsets relative to the start of the data region, plus an optional ``__metadata__`` of string
pairs. We check everything a loader relies on before any data is read: the header length
against the file size and MAX_HEADER_SIZE, the JSON's structure, a known dtype, shape times
itemsize equal to the byte length, every range inside the file, and no two ranges overlapping.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from ..dtypes import byte_length
from ..errors import FormatError
from . import TensorInfo, check_layout

__all__ = ["MAX_HEADER_SIZE", "PREFIX_SIZE", "header_length", "parse_header", "build_header"]

MAX_HEADER_SIZE = 100 * 1024 * 1024  # the safetensors reference implementation's own limit
PREFIX_SIZE = 8
MAX_DIMS = 64


def header_length(prefix: bytes, *, file: str, file_size: int) -> int:
    """The JSON header's length from the file's first 8 bytes, checked against the file size."""
    if len(prefix) < PREFIX_SIZE or file_size < PREFIX_SIZE:
        raise FormatError(f"file is {file_size} bytes, too short for a safetensors header", file=file)
    (n,) = struct.unpack("<Q", prefix[:PREFIX_SIZE])
    if n > MAX_HEADER_SIZE:
        raise FormatError(f"header length {n} exceeds the limit of {MAX_HEADER_SIZE} bytes", file=file)
    if PREFIX_SIZE + n > file_size:
        raise FormatError(f"header length {n} runs past the end of the {file_size}-byte file", file=file)
    return n


def parse_header(
    header: bytes, *, file: str, file_size: int
) -> tuple[list[TensorInfo], dict[str, str]]:
    """Parse a JSON header (without its 8-byte prefix) into tensors in file order and metadata."""
    data_start = PREFIX_SIZE + len(header)
    try:
        obj = json.loads(header)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"header is not valid JSON: {type(e).__name__}: {e}", file=file) from None
    if not isinstance(obj, dict):
        raise FormatError("header is not a JSON object", file=file)
    metadata: dict[str, str] = {}
    tensors: list[TensorInfo] = []
    for name, entry in obj.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in entry.items()
            ):
                raise FormatError("__metadata__ must map strings to strings", file=file)
            metadata = dict(entry)
            continue
        tensors.append(_tensor(name, entry, file=file, data_start=data_start))
    check_layout(tensors, file=file, data_start=data_start, file_size=file_size)
    tensors.sort(key=lambda t: (t.offset, t.name))
    return tensors, metadata


def _tensor(name: str, entry: Any, *, file: str, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise FormatError("entry is not an object", file=file, tensor=name)
    missing = {"dtype", "shape", "data_offsets"} - entry.keys()
    if missing:
        raise FormatError(f"entry lacks {', '.join(sorted(missing))}", file=file, tensor=name)
    dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise FormatError("dtype is not a string", file=file, tensor=name)
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(type(s) is int and s >= 0 for s in shape)
    ):
        raise FormatError(f"shape {shape!r} is not a list of non-negative integers", file=file, tensor=name)
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(type(o) is int and o >= 0 for o in offs)
        or offs[1] < offs[0]
    ):
        raise FormatError(f"data_offsets {offs!r} is not a [begin, end] pair", file=file, tensor=name)
    expected = byte_length(dtype, tuple(shape), file=file, tensor=name)
    if offs[1] - offs[0] != expected:
        raise FormatError(
            f"{dtype} {tuple(shape)} needs {expected} bytes but data_offsets span {offs[1] - offs[0]}",
            file=file,
            tensor=name,
        )
    return TensorInfo(name, dtype, tuple(shape), file, data_start + offs[0], expected)


def build_header(
    entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[int]]:
    """The 8-byte prefix and padded JSON header for tensors laid back to back in this order.

    ``entries`` are (name, dtype, shape, nbytes). Returns the header bytes and the offset of each
    tensor relative to the data region. Writers (pull, the demo) use this; it is the inverse of
    :func:`parse_header`.
    """
    obj: dict[str, Any] = {}
    if metadata:
        obj["__metadata__"] = dict(metadata)
    offsets = []
    pos = 0
    for name, dtype, shape, nbytes in entries:
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        offsets.append(pos)
        pos += nbytes
    raw = json.dumps(obj, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + PREFIX_SIZE) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets
