"""GGUF: a little-endian header of metadata and tensor descriptions, then an aligned data region.

Layout (v2 and v3 are the same; v1 used 32-bit counts and is refused)::

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x      (string key, u32 value_type, value)
    n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32)  <- data_start; tensor offsets count from here

A string is a u64 byte length and UTF-8 bytes; an array is a u32 element type, a u64 count and
the elements back to back (arrays may nest). ``ne`` lists dimensions fastest-first, so the numpy
shape is its reverse. Quantized types store blocks of ``block_size`` elements in ``type_size``
bytes (``gguf.constants.GGML_QUANT_SIZES``), so a row's length must be a whole number of blocks.

The parser reads only what it is given, through a cursor that checks every read against the
buffer first, so a truncated or hostile file always ends in a FormatError. Counts and lengths
are checked against named limits and against the bytes left before anything is allocated, and
numeric arrays (tokenizer scores, token types) are decoded by numpy in one call. Nothing here
touches the data region: ``TensorInfo`` says where each tensor lies and how to view its bytes.

What a load returns: the plain types (F32, F16, BF16, F64, I8, I16, I32, I64) in their own
dtype, BF16 as bfloat16 (``ml_dtypes.bfloat16``, ``torch.bfloat16``) like a safetensors BF16
tensor; quantized types as their raw blocks (uint8 rows of ``extra["raw_shape"]``), or as
float32 with ``load(..., dequantize=True)``. F16 and BF16 are not quantized (ggml's
``ggml_is_quantized`` says the same), so that leaves them as they are; ``dtype="F32"`` casts
them too. (The :func:`dequantize` function here decodes BF16 and F16 all the same.)

What differs from ``gguf.GGUFReader`` (gguf-py), on purpose. It accepts, and this parser
refuses with a FormatError:

1. big-endian files (the reader byte-swaps them; nothing here or in ggml's loaders reads them);
2. a header that runs past the end of the buffer or file: the reader's reads are numpy slices
   that come back short, so a truncated last value is read as a shorter one;
3. counts that cannot fit in the bytes left (checked before anything is allocated);
4. more than :data:`MAX_TENSORS` tensors or :data:`MAX_KV` key/values, a string over
   :data:`MAX_STRING` bytes, an array over :data:`MAX_ARRAY` elements, arrays nested deeper than
   :data:`MAX_NESTING` (the reader has no limits);
5. more than :data:`MAX_DIMS` dimensions (``GGML_MAX_DIMS``; ggml refuses them too);
6. a tensor offset that is not a multiple of the alignment (ggml's loader refuses it, and a
   load views each tensor in place as its type);
7. tensors whose bytes overlap (a load or a verified hash assumes each byte is one tensor's);
8. an element count past 2**63 (the reader's ``np.prod`` wraps around in uint64, and it then
   fails with numpy's ValueError);
9. a shape whose non-zero dimensions multiply past :data:`~weightlift.formats.MAX_EXTENT`,
   even one that holds no element, since a load may view or cast it as 8-byte items (the reader
   fails on most of them with numpy's ValueError, and a load would fail the same way).

Where the reader fails with an error of Python's or numpy's (bad magic, v1 or unknown
versions, unknown value or ggml types, a general.alignment that is not a uint32 power of two,
duplicate keys or tensor names, keys or names that are not UTF-8, rows that are not whole
blocks, tensor bytes past the end of the file), this parser raises a FormatError naming the
file and the tensor. Two things are represented differently, not refused: a string value that
is not UTF-8 is kept with ``surrogateescape`` (the reader keeps the bytes and fails when asked
for the text), and a load returns BF16 as bfloat16 (see above). Like the reader, a tensor of no
elements may name any offset, even one past the end of the file.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType, Keys

from weightlift.errors import FormatError, OptionError
from weightlift.formats import TensorInfo, check_extent, check_layout

__all__ = [
    "GGUFHeader",
    "Split",
    "Truncated",
    "parse_gguf",
    "split_of",
    "split_name",
    "split_parts",
    "numpy_dtype_and_shape",
    "dequantize",
    "MAGIC",
    "VERSIONS",
    "MAX_TENSORS",
    "MAX_KV",
    "MAX_STRING",
    "MAX_ARRAY",
    "MAX_DIMS",
    "MAX_NESTING",
    "MAX_SPLITS",
    "SPLIT_NO",
    "SPLIT_COUNT",
    "SPLIT_TENSORS",
]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_TENSORS = 1 << 20  # far above any real model (a large MoE has a few thousand)
MAX_KV = 1 << 20
MAX_STRING = 1 << 28  # one string: chat templates run to tens of KiB, nothing near this
MAX_ARRAY = 1 << 28  # one array's elements: vocabularies and merges are under a million
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 8  # arrays of arrays: the format allows them, nothing real nests deeply
_MAX_ELEMENTS = (1 << 63) - 1  # ggml keeps element counts in int64
_WINDOW = 1 << 20  # bytes copied at a time when decoding string arrays

_ALIGNMENT_KEY = "general.alignment"

SPLIT_NO = Keys.Split.LLM_KV_SPLIT_NO
SPLIT_COUNT = Keys.Split.LLM_KV_SPLIT_COUNT
SPLIT_TENSORS = Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT
MAX_SPLITS = (1 << 16) - 1  # llama.cpp keeps split.count in a u16
# llama_split_path's "%s-%05d-of-%05d.gguf"; the numbers are 1-based, split.no 0-based
_SPLIT_NAME = re.compile(r"(.+)-([0-9]{5})-of-([0-9]{5})\.gguf")

# The little-endian struct format and numpy dtype of each fixed-size value type.
_SCALARS: dict[int, tuple[str, str]] = {
    GGUFValueType.UINT8: ("<B", "<u1"),
    GGUFValueType.INT8: ("<b", "<i1"),
    GGUFValueType.UINT16: ("<H", "<u2"),
    GGUFValueType.INT16: ("<h", "<i2"),
    GGUFValueType.UINT32: ("<I", "<u4"),
    GGUFValueType.INT32: ("<i", "<i4"),
    GGUFValueType.FLOAT32: ("<f", "<f4"),
    GGUFValueType.BOOL: ("<?", "<u1"),
    GGUFValueType.UINT64: ("<Q", "<u8"),
    GGUFValueType.INT64: ("<q", "<i8"),
    GGUFValueType.FLOAT64: ("<d", "<f8"),
}
# The fewest bytes one array element of a type can take, to bound counts before reading them.
_MIN_SIZE = {t: struct.calcsize(f) for t, (f, _) in _SCALARS.items()}
_MIN_SIZE |= {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
_STRUCTS = {t: struct.Struct(f) for t, (f, _) in _SCALARS.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")

# ggml types that GGUFReader presents as typed arrays, and their little-endian numpy dtypes.
# BF16 is plain too, but numpy has no bfloat16, so GGUFReader presents it as rows of raw bytes,
# like the quantized types, and so does ``numpy_dtype_and_shape``. The ggml names of all the
# plain types (F32, F16, BF16, F64, I8, I16, I32, I64) are also their safetensors names, so
# ``dtype`` is the ggml name, and a load views BF16 as bfloat16 through it.
_NUMPY: dict[int, str] = {
    GGMLQuantizationType.F32: "<f4",
    GGMLQuantizationType.F16: "<f2",
    GGMLQuantizationType.F64: "<f8",
    GGMLQuantizationType.I8: "<i1",
    GGMLQuantizationType.I16: "<i2",
    GGMLQuantizationType.I32: "<i4",
    GGMLQuantizationType.I64: "<i8",
}


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """A parsed GGUF header: metadata in file order and the tensors it describes, in file order."""

    version: int
    alignment: int
    data_start: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]


class Truncated(FormatError):
    """The buffer ends where the header goes on inside the file: a prefix too short, not a broken
    file. ``needed`` is the fewest bytes from the file's start that would get the parse past
    this point (it may stop again further on); any other FormatError is the file's for sure."""

    def __init__(self, message: str, *, file: str, needed: int):
        super().__init__(message, file=file)
        self.needed = needed


@dataclass(frozen=True, slots=True)
class Split:
    """One file's place in a split model: split ``no`` (0-based) of ``count``, which hold
    ``tensors`` tensors in all."""

    no: int
    count: int
    tensors: int


def split_of(metadata: dict[str, Any], *, file: str) -> Split | None:
    """The split keys of a file's metadata; None for a model in one file (no ``split.count``, or 1).

    Like llama.cpp, a ``split.count`` over 1 requires ``split.no`` and ``split.tensors.count``;
    both writers (gguf-split, gguf-py) put all three in every split, and each must be an integer
    in range (FormatError naming the key otherwise). llama.cpp also wants their exact integer types
    (u16, u16, i32); any integer type is taken here.
    """
    if SPLIT_COUNT not in metadata:
        return None
    count = _split_key(metadata, SPLIT_COUNT, 1, MAX_SPLITS, file=file)
    if count == 1:
        return None
    no = _split_key(metadata, SPLIT_NO, 0, count - 1, file=file)
    return Split(no, count, _split_key(metadata, SPLIT_TENSORS, 0, MAX_SPLITS * MAX_TENSORS, file=file))


def _split_key(metadata: dict[str, Any], key: str, low: int, high: int, *, file: str) -> int:
    v = metadata.get(key)
    if type(v) is not int or not low <= v <= high:
        got = "is missing" if v is None else f"is {v!r}"
        raise FormatError(f"{key} {got}, not an integer from {low} to {high}", file=file)
    return v


def split_name(prefix: str, no: int, count: int) -> str:
    """The file name of split ``no`` (0-based) of ``count``, as llama.cpp's ``llama_split_path``."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def split_parts(name: str) -> tuple[str, int, int] | None:
    """``(prefix, no, count)`` of a split's file name (``no`` 0-based); None for other names."""
    m = _SPLIT_NAME.fullmatch(name)
    if m is None or int(m[2]) < 1:
        return None
    return m[1], int(m[2]) - 1, int(m[3])


class _Cursor:
    """Reads little-endian values from a buffer, never past its end."""

    __slots__ = ("mv", "pos", "file", "file_size")

    def __init__(self, mv: memoryview, *, file: str, file_size: int):
        self.mv, self.pos, self.file, self.file_size = mv, 0, file, file_size

    def need(self, n: int, what: str) -> int:
        """Step over the next ``n`` bytes; their start, or FormatError if they are not all there."""
        start = self.pos
        self.check(n, what)
        self.pos = start + n
        return start

    def check(self, n: int, what: str) -> None:
        end = self.pos + n
        if end > len(self.mv):
            if end > self.file_size:
                raise FormatError(
                    f"header runs past the end of the file reading {what} at byte {self.pos}", file=self.file
                )
            msg = f"header runs past the end of the {len(self.mv)}-byte buffer reading {what} at byte {self.pos}"
            raise Truncated(msg, file=self.file, needed=end)

    def count(self, what: str, limit: int, min_size: int) -> int:
        """A u64 count, checked against ``limit`` and, at ``min_size`` bytes each, the bytes left.

        Checking before the items are read keeps a hostile count from allocating anything.
        """
        n: int = self.unpack(_U64, what)
        if n > limit:
            raise FormatError(f"{what} {n} exceeds the limit of {limit}", file=self.file)
        self.check(n * min_size, f"{n} items of {what}")
        return n

    def unpack(self, s: struct.Struct, what: str) -> Any:
        return s.unpack_from(self.mv, self.need(s.size, what))[0]

    def string(self, what: str, *, strict: bool = False) -> str:
        n = self.unpack(_U64, f"{what} length")
        if n > MAX_STRING:
            raise FormatError(f"{what} length {n} exceeds the limit of {MAX_STRING} bytes", file=self.file)
        raw = self.mv[self.need(n, what) : self.pos]
        try:
            # Keys and names must be real text; values keep any bytes (surrogateescape is lossless).
            return str(raw, "utf-8", "strict" if strict else "surrogateescape")
        except UnicodeDecodeError:
            raise FormatError(f"{what} at byte {self.pos - n} is not valid UTF-8", file=self.file) from None

    def value_type(self, what: str) -> int:
        t: int = self.unpack(_U32, what)
        if t not in _SCALARS and t not in (GGUFValueType.STRING, GGUFValueType.ARRAY):
            raise FormatError(f"unknown value type {t} for {what} at byte {self.pos - 4}", file=self.file)
        return t

    def value(self, t: int, what: str, depth: int = 0) -> Any:
        if t == GGUFValueType.STRING:
            return self.string(what)
        if t != GGUFValueType.ARRAY:
            return self.unpack(_STRUCTS[t], what)
        if depth >= MAX_NESTING:
            raise FormatError(f"{what} nests arrays deeper than {MAX_NESTING}", file=self.file)
        et = self.value_type(f"{what} element type")
        n = self.count(f"{what} length", MAX_ARRAY, _MIN_SIZE.get(et, 1))
        if et in _SCALARS:
            dt = np.dtype(_SCALARS[et][1])
            start = self.need(n * dt.itemsize, what)
            arr = np.frombuffer(self.mv, dtype=dt, count=n, offset=start)
            return (arr != 0).tolist() if et == GGUFValueType.BOOL else arr.tolist()
        if et == GGUFValueType.STRING:
            return self.strings(n, what)
        return [self.value(et, what, depth + 1) for _ in range(n)]

    def strings(self, n: int, what: str) -> list[str]:
        """``n`` strings back to back, as in vocabularies and merges.

        These run to hundreds of thousands of strings, so the loop reads from a window copied
        out of the buffer a MiB at a time (slicing bytes is cheaper than slicing a memoryview)
        and leaves any fault to ``string`` to describe.
        """
        mv, size, unpack = self.mv, len(self.mv), _U64.unpack_from
        out: list[str] = []
        append = out.append
        base, win, p = self.pos, b"", 0
        for _ in range(n):
            if p + 8 > len(win):
                base, p = base + p, 0
                win = bytes(mv[base : base + _WINDOW])
                if len(win) < 8:
                    break
            (k,) = unpack(win, p)
            if p + 8 + k > len(win):
                if k > MAX_STRING or base + p + 8 + k > size:
                    break
                base, p = base + p, 0
                win = bytes(mv[base : base + max(_WINDOW, 8 + k)])
            p += 8 + k
            append(win[p - k : p].decode("utf-8", "surrogateescape"))
        self.pos = base + p
        if len(out) < n:
            self.string(what)  # raises: truncated, or over the limit
            raise AssertionError("unreachable: string() accepted what the fast path refused")
        return out


def parse_gguf(buf: Any, *, file: str, file_size: int) -> GGUFHeader:
    """Parse the GGUF header at the start of ``buf`` (bytes-like, at least the whole header).

    ``file_size`` is the size of the whole file, against which every tensor is checked; ``buf``
    may be the whole file (a memoryview of an mmap is never copied) or just a prefix of it. A
    prefix that ends inside the header raises :class:`Truncated`, saying how much more is needed;
    every other FormatError holds whatever follows.
    """
    try:
        mv = memoryview(buf)
        if not mv.c_contiguous:
            raise TypeError("the buffer is not contiguous")
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")
    except TypeError as e:
        raise OptionError(f"cannot read a GGUF header from {type(buf).__name__}: {e}") from None
    cur = _Cursor(mv, file=file, file_size=file_size)
    if bytes(mv[cur.need(4, "the magic") : 4]) != MAGIC:
        raise FormatError(f"not a GGUF file (magic {bytes(mv[:4])!r}, expected {MAGIC!r})", file=file)
    version = cur.unpack(_U32, "the version")
    if version not in VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in VERSIONS or swapped == 1:
            raise FormatError(f"big-endian GGUF (v{swapped}) is not supported", file=file)
        if version == 1:
            raise FormatError("GGUF v1 is not supported (it predates 64-bit counts); convert it to v3", file=file)
        raise FormatError(f"unknown GGUF version {version} (supported: {VERSIONS})", file=file)
    n_tensors = cur.count("the tensor count", MAX_TENSORS, 0)
    n_kv = cur.count("the metadata count", MAX_KV, 0)
    # The smallest key/value is a string and a type and a byte; the smallest tensor record is
    # a string, a dimension count, a type and an offset.
    cur.check(n_kv * 13 + n_tensors * 24, f"{n_kv} key/values and {n_tensors} tensor records")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("a metadata key", strict=True)
        if key in metadata:
            raise FormatError(f"metadata key {key!r} appears twice", file=file)
        vtype = cur.value_type(f"the type of {key!r}")
        if key == _ALIGNMENT_KEY and vtype != GGUFValueType.UINT32:
            # ggml reads the alignment as a u32 and nothing else.
            raise FormatError(f"{_ALIGNMENT_KEY} has value type {vtype}, not uint32", file=file)
        metadata[key] = cur.value(vtype, repr(key))
    alignment = metadata.get(_ALIGNMENT_KEY, GGUF_DEFAULT_ALIGNMENT)
    if alignment <= 0 or alignment & (alignment - 1):
        raise FormatError(f"alignment {alignment} is not a power of two", file=file)

    records = [_tensor_record(cur) for _ in range(n_tensors)]
    data_start = -(-cur.pos // alignment) * alignment
    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    for name, ne, ggml_type, rel in records:
        if name in seen:
            raise FormatError("tensor name appears twice", file=file, tensor=name)
        seen.add(name)
        tensors.append(_tensor_info(name, ne, ggml_type, rel, file=file, data_start=data_start, alignment=alignment))
    check_layout(tensors, file=file, data_start=data_start, file_size=file_size, empty_anywhere=True)
    return GGUFHeader(version, alignment, data_start, metadata, tensors)


def _tensor_record(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string("a tensor name", strict=True)
    n_dims = cur.unpack(_U32, f"the dimension count of {name!r}")
    if n_dims > MAX_DIMS:
        raise FormatError(f"{n_dims} dimensions exceed the limit of {MAX_DIMS}", file=cur.file, tensor=name)
    start = cur.need(8 * n_dims, f"the dimensions of {name!r}")
    ne = struct.unpack_from(f"<{n_dims}Q", cur.mv, start)
    ggml_type = cur.unpack(_U32, f"the type of {name!r}")
    rel = cur.unpack(_U64, f"the offset of {name!r}")
    return name, ne, ggml_type, rel


def _tensor_info(
    name: str, ne: tuple[int, ...], ggml_type: int, rel: int, *, file: str, data_start: int, alignment: int
) -> TensorInfo:
    try:
        qtype = GGMLQuantizationType(ggml_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise FormatError(f"unknown ggml type {ggml_type}", file=file, tensor=name) from None
    n = 1
    for d in ne:
        n *= d
    if n > _MAX_ELEMENTS:
        raise FormatError(f"dimensions {list(ne)} hold more than 2**63 elements", file=file, tensor=name)
    check_extent(tuple(reversed(ne)), file=file, tensor=name)
    ne0 = ne[0] if ne else 1
    if ne0 % block:
        msg = f"row length {ne0} is not a multiple of the {qtype.name} block size {block}"
        raise FormatError(msg, file=file, tensor=name)
    if rel % alignment:
        raise FormatError(f"offset {rel} is not a multiple of the alignment {alignment}", file=file, tensor=name)
    shape = tuple(reversed(ne))
    raw_shape = shape if qtype in _NUMPY else (*shape[:-1], ne0 // block * type_size)
    return TensorInfo(
        name=name,
        dtype=qtype.name,
        shape=shape,
        file=file,
        offset=data_start + rel,
        length=n // block * type_size,
        ggml_type=int(qtype),
        alignment=alignment,
        extra={"raw_shape": raw_shape},
    )


def numpy_dtype_and_shape(t: TensorInfo) -> tuple[np.dtype, tuple[int, ...]]:
    """The dtype and shape under which GGUFReader presents this tensor's bytes.

    Plain types: their numpy dtype and the logical shape. BF16 and quantized types: uint8 and
    ``extra["raw_shape"]`` (rows of raw bytes); ``dequantize`` turns those into float32. (This
    is GGUFReader's view; a load returns BF16 tensors as bfloat16, see the module docstring.)
    """
    if t.ggml_type is None:
        raise OptionError(f"tensor {t.name!r} is not from a GGUF file")
    if t.ggml_type in _NUMPY:
        return np.dtype(_NUMPY[t.ggml_type]), t.shape
    return np.dtype(np.uint8), tuple(t.extra["raw_shape"])


def dequantize(raw: np.ndarray, ggml_type: int, *, file: str | None = None, tensor: str | None = None) -> np.ndarray:
    """Decode a tensor's raw bytes (as ``numpy_dtype_and_shape`` views them) to float32.

    Quantized types and BF16 go through ``gguf.quants.dequantize``; plain types are cast. An
    F32 tensor comes back as a view of ``raw`` when it already is float32. ``file`` and
    ``tensor`` name the tensor in the OptionError for a type the gguf package cannot decode.
    """
    where = "".join(f"{part}: " for part in (file, None if tensor is None else f"tensor {tensor!r}") if part)
    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise OptionError(f"{where}unknown ggml type {ggml_type}") from None
    raw = np.ascontiguousarray(raw)
    if qtype in _NUMPY:
        return raw.view(_NUMPY[qtype]).astype(np.float32, copy=False)
    from gguf.quants import dequantize as _dequantize

    try:
        return np.asarray(_dequantize(raw.view(np.uint8), qtype), dtype=np.float32)
    except NotImplementedError:
        raise OptionError(
            f"{where}the gguf package cannot dequantize {qtype.name}; load it without dequantize to get its raw blocks"
        ) from None
    except ValueError as e:
        raise OptionError(f"{where}raw bytes of shape {raw.shape} are not whole {qtype.name} rows: {e}") from None
