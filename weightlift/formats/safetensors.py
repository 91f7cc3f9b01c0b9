"""safetensors: an 8-byte little-endian header length, a JSON header, then the data region.

The header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` with
offsets relative to the start of the data region, plus an optional ``__metadata__`` of string
pairs. Everything a loader relies on is checked before any data is read, and the rules are
the reference implementation's (``safetensors`` on crates.io, which the Python package wraps):

* the header length is at most MAX_HEADER_SIZE and lies inside the file;
* the header is UTF-8 JSON as serde_json reads it: no byte-order mark, no UTF-16 or UTF-32, no
  NaN or Infinity, no number beyond a double's range, no lone UTF-16 surrogate in a ``\\u``
  escape, nesting at most MAX_JSON_DEPTH deep;
* ``__metadata__``, if present and not null, maps strings to strings, and appears once;
* an entry has each of its three fields once, a known dtype, and a shape and offsets of
  unsigned 64-bit integers; the element count times the dtype's width, in whole bytes, is the
  length the offsets span; fields the format does not define are ignored;
* sorted by offset, the tensors tile the data region exactly: the first begins at 0, each
  begins where the one before ends, the last ends at the end of the file. No gaps, no overlaps,
  nothing after the last tensor (empty tensors take no room and may share an offset).

Where we refuse more than the reference, on purpose:

* a tensor name, or a key inside ``__metadata__``, that appears twice. The reference keeps the
  last of them, other JSON readers keep the first: a file that means different things to
  different readers is refused. Repeats inside fields nobody reads are accepted, as there;
* shapes of more than MAX_DIMS dimensions (numpy's own limit) and shapes whose non-zero
  dimensions multiply past :data:`~weightlift.formats.MAX_EXTENT`, such as ``[0, 2**62]``: the
  reference parser accepts those, but a load could not return them (the safetensors package's
  own numpy loader fails on both with a ValueError).
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from typing import Any

from weightlift.dtypes import byte_length
from weightlift.errors import FormatError
from weightlift.formats import TensorInfo, check_extent, check_layout

__all__ = ["MAX_HEADER_SIZE", "MAX_JSON_DEPTH", "PREFIX_SIZE", "header_length", "parse_header", "build_header"]

MAX_HEADER_SIZE = 100_000_000  # the reference implementation's limit: decimal, not 100 MiB
MAX_JSON_DEPTH = 127  # the deepest nesting of objects and arrays serde_json reads
PREFIX_SIZE = 8
MAX_DIMS = 64  # numpy's limit on dimensions
_FIELDS = frozenset({"dtype", "shape", "data_offsets"})
_U64 = 1 << 64  # dimensions and offsets are u64 (usize) in the reference


def header_length(prefix: bytes, *, file: str, file_size: int) -> int:
    """The JSON header's length from the file's first 8 bytes, checked against the file size."""
    if len(prefix) < PREFIX_SIZE or file_size < PREFIX_SIZE:
        raise FormatError(f"file is {file_size} bytes, too short for a safetensors header", file=file)
    n: int = struct.unpack("<Q", prefix[:PREFIX_SIZE])[0]
    if n > MAX_HEADER_SIZE:
        raise FormatError(f"header length {n} exceeds the limit of {MAX_HEADER_SIZE} bytes", file=file)
    if PREFIX_SIZE + n > file_size:
        raise FormatError(f"header length {n} runs past the end of the {file_size}-byte file", file=file)
    return n


def parse_header(header: bytes, *, file: str, file_size: int) -> tuple[list[TensorInfo], dict[str, str]]:
    """Parse a JSON header (without its 8-byte prefix) into tensors in file order and metadata."""
    data_start = PREFIX_SIZE + len(header)
    obj = _loads(header, file=file)
    if not isinstance(obj, dict):
        raise FormatError("header is not a JSON object", file=file)
    for key in obj.dups if type(obj) is _Repeats else ():
        if key == "__metadata__":
            raise FormatError("__metadata__ appears twice", file=file)
        raise FormatError("tensor name appears twice in the header", file=file, tensor=key)
    metadata: dict[str, str] = {}
    tensors: list[TensorInfo] = []
    for name, entry in obj.items():
        if _lone_surrogate(name):
            raise FormatError("the name holds a lone UTF-16 surrogate", file=file, tensor=name)
        if name == "__metadata__":
            metadata = _metadata(entry, file=file)
            continue
        tensors.append(_tensor(name, entry, file=file, data_start=data_start))
    check_layout(tensors, file=file, data_start=data_start, file_size=file_size)
    _check_tiling(tensors, file=file, data_start=data_start, file_size=file_size)
    tensors.sort(key=lambda t: (t.offset, t.name))
    return tensors, metadata


class _Repeats(dict[str, Any]):
    """A JSON object in which some keys appeared more than once (the last value kept)."""

    __slots__ = ("dups",)
    dups: tuple[str, ...]


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    out = _Repeats(obj)
    out.dups = tuple(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
    return out


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _float(text: str) -> float:
    f = float(text)
    if not math.isfinite(f):
        raise ValueError(f"number {text[:32]} is out of range")
    return f


def _int(text: str) -> int | float:
    # serde_json reads -0 as a float, which no shape or offset may be
    return -0.0 if text == "-0" else int(text)


def _number(v: int) -> None:
    # serde_json reads an integer that fits neither u64 nor i64 as a double, and refuses it
    # past a double's range
    if not -(1 << 63) <= v < (1 << 64):
        try:
            float(v)
        except OverflowError:
            raise ValueError(f"integer of {len(str(v))} digits is out of range") from None


def _loads(header: bytes, *, file: str) -> Any:
    try:
        # Decoding first, strictly: json.loads on bytes would skip a BOM and sniff UTF-16/32.
        text = str(header, "utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"header is not valid UTF-8: {e}", file=file) from None
    # Integers beyond 64 bits are checked where they are allowed at all (_unread); -0 can only
    # be seen while parsing, and looking for it first spares most headers a call per integer.
    parse_int = _int if "-0" in text else None
    try:
        return json.loads(
            text, object_pairs_hook=_object, parse_constant=_constant, parse_int=parse_int, parse_float=_float
        )
    except (ValueError, RecursionError) as e:
        raise FormatError(f"header is not valid JSON: {type(e).__name__}: {e}", file=file) from None


def _lone_surrogate(s: str) -> bool:
    """Whether ``s`` holds a lone surrogate, which only a ``\\uD800``-style escape makes."""
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _text(s: str, *, file: str, what: str, tensor: str | None = None) -> None:
    if _lone_surrogate(s):
        # repr() shows the surrogate as an escape, so the message itself stays printable
        raise FormatError(f"{what} holds a lone UTF-16 surrogate: {s!r}", file=file, tensor=tensor)


def _metadata(entry: Any, *, file: str) -> dict[str, str]:
    if entry is None:  # the reference reads a null __metadata__ as none at all
        return {}
    if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
        raise FormatError("__metadata__ must map strings to strings", file=file)
    for key in entry.dups if type(entry) is _Repeats else ():
        raise FormatError(f"__metadata__ key {key!r} appears twice", file=file)
    for k, v in entry.items():
        _text(k, file=file, what="__metadata__ key")
        _text(v, file=file, what=f"__metadata__ value of {k!r}")
    return dict(entry)


def _unread(value: Any, depth: int, *, file: str, name: str) -> None:
    """Check a field the format does not define as the reference does: depth and escapes only."""
    if isinstance(value, str):
        _text(value, file=file, what="a string", tensor=name)
        return
    if type(value) is int:
        try:
            _number(value)
        except ValueError as e:
            raise FormatError(f"header is not valid JSON: {e}", file=file, tensor=name) from None
        return
    if not isinstance(value, (list, dict)):
        return
    if depth > MAX_JSON_DEPTH:
        raise FormatError(f"header nests deeper than {MAX_JSON_DEPTH} levels", file=file, tensor=name)
    if isinstance(value, dict):
        for k, v in value.items():
            _text(k, file=file, what="a key", tensor=name)
            _unread(v, depth + 1, file=file, name=name)
    else:
        for v in value:
            _unread(v, depth + 1, file=file, name=name)


def _tensor(name: str, entry: Any, *, file: str, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise FormatError("entry is not an object", file=file, tensor=name)
    if type(entry) is _Repeats:
        twice = sorted(_FIELDS.intersection(entry.dups))
        if twice:
            raise FormatError(f"entry has {', '.join(twice)} twice", file=file, tensor=name)
    if len(entry) != 3 or "dtype" not in entry or "shape" not in entry or "data_offsets" not in entry:
        missing = _FIELDS - entry.keys()
        if missing:
            raise FormatError(f"entry lacks {', '.join(sorted(missing))}", file=file, tensor=name)
        for key, value in entry.items():
            if key not in _FIELDS:
                _text(key, file=file, what="a field name", tensor=name)
                _unread(value, 3, file=file, name=name)
    dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise FormatError("dtype is not a string", file=file, tensor=name)
    if not isinstance(shape, list) or not all(type(s) is int and 0 <= s < _U64 for s in shape):
        raise FormatError(f"shape {shape!r} is not a list of non-negative integers below 2**64", file=file, tensor=name)
    if len(shape) > MAX_DIMS:
        raise FormatError(f"shape has {len(shape)} dimensions, more than numpy's {MAX_DIMS}", file=file, tensor=name)
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(type(o) is int and 0 <= o < _U64 for o in offs)
        or offs[1] < offs[0]
    ):
        raise FormatError(f"data_offsets {offs!r} is not a [begin, end] pair", file=file, tensor=name)
    if 0 in shape:  # otherwise the length checked below bounds the shape
        check_extent(tuple(shape), file=file, tensor=name)
    expected = byte_length(dtype, tuple(shape), file=file, tensor=name)
    if offs[1] - offs[0] != expected:
        raise FormatError(
            f"{dtype} {tuple(shape)} needs {expected} bytes but data_offsets span {offs[1] - offs[0]}",
            file=file,
            tensor=name,
        )
    return TensorInfo(name, dtype, tuple(shape), file, data_start + offs[0], expected)


def _check_tiling(tensors: list[TensorInfo], *, file: str, data_start: int, file_size: int) -> None:
    """The tensors, in offset order, cover the data region exactly: no gap, no overlap, no tail."""
    pos, before = data_start, None
    for t in sorted(tensors, key=lambda t: (t.offset, t.end)):
        if t.offset < pos:
            msg = f"data_offsets begin at {t.offset - data_start}, inside tensor {before!r}, which ends at {pos - data_start}"
            raise FormatError(f"bytes overlap: {msg}", file=file, tensor=t.name)
        if t.offset > pos:
            where = "the data region's start" if before is None else f"the end of tensor {before!r}"
            msg = (
                f"data_offsets begin at {t.offset - data_start}, leaving a gap of {t.offset - pos} bytes after {where}"
            )
            raise FormatError(msg, file=file, tensor=t.name)
        pos, before = t.end, t.name
    if pos != file_size:
        what = "the header, which describes no bytes" if before is None else f"the last tensor, {before!r}"
        n = file_size - pos
        raise FormatError(
            f"{n} {'byte follows' if n == 1 else 'bytes follow'} {what}: the file must end where its data does",
            file=file,
        )


def build_header(
    entries: list[tuple[str, str, tuple[int, ...], int]],
    metadata: dict[str, str] | None = None,
    *,
    file: str | None = None,
) -> tuple[bytes, list[int]]:
    """The 8-byte prefix and padded JSON header for tensors laid back to back in this order.

    ``entries`` are (name, dtype, shape, nbytes). Returns the header bytes and the offset of each
    tensor relative to the data region. Writers (pull, the demo) use this; it is the inverse of
    :func:`parse_header`. A header over :data:`MAX_HEADER_SIZE` is refused (FormatError naming
    ``file``), as :func:`header_length` and the reference reader refuse it: no file that could
    not be opened again is written.
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
    if len(raw) > MAX_HEADER_SIZE:
        raise FormatError(
            f"the header of {len(entries)} tensors would be {len(raw)} bytes, which exceeds the limit of "
            f"{MAX_HEADER_SIZE} bytes that safetensors readers accept; nothing written",
            file=file,
        )
    return struct.pack("<Q", len(raw)) + raw, offsets
