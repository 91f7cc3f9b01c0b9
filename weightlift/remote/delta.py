"""The payload of a DELTA: a tensor encoded against a base of the same dtype and shape, and back.

Both ends of a connection use this module (the client encodes, the server applies); it does no
I/O. A tensor is cut into chunks of ``chunk_bytes`` (a whole number of elements); each chunk is
encoded on its own, so both ends work on as many cores as they have (zstandard and numpy release
the GIL) and an unchanged chunk costs four bytes. The payload::

    head   := chunk_bytes:u32  nchunks:u32           nchunks = ceil(nbytes / chunk_bytes)
    table  := clen:u32 * nchunks                     0: the chunk is its base's bytes
    chunks := one zstd frame per chunk whose clen is not 0, in order

and what a chunk's frame holds, by the DELTA's encoding:

* ``XOR``: the chunk's new bytes XOR its base's (exactly the chunk's length): dense changes, where
  the sign and exponent of most values stay put and compress well;
* ``SPARSE``: ``count:u32``, ``gap:u32 * count`` (the changed elements' indices within the
  chunk as differences: the first from 0, the others from the one before, never 0), then the
  ``count`` new elements: a few changed values, applied in time proportional to them rather
  than to the tensor.

Which one a tensor gets is decided by :func:`choose` from a sample of its elements: SPARSE
where at most :data:`SPARSE_MAX` of them changed, XOR where the sample compresses to at most
:data:`DENSE_RATIO_MAX` of its size, else none (the tensor is sent whole, and the attempt cost
only the sample). Sub-byte dtypes (packed 4-bit and smaller) always travel whole.

Every length in a payload is checked before anything is sized from it (:class:`DeltaError`).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from weightlift.errors import WeightliftError

__all__ = [
    "CHUNK_BYTES",
    "SPARSE_MAX",
    "DENSE_RATIO_MAX",
    "DeltaError",
    "available",
    "choose",
    "encode",
    "apply",
    "payload_bound",
    "copy",
]

CHUNK_BYTES = 4 << 20  # tensor bytes per chunk: enough to compress well, small enough to spread over cores
MAX_CHUNK_BYTES = 64 << 20  # the largest chunk a payload may state (what one worker decompresses at once)
SPARSE_MAX = 0.05  # changed fraction of the sampled elements up to which SPARSE is chosen
DENSE_RATIO_MAX = 0.75  # XOR is chosen where the sample compresses at least this well, else the tensor goes whole
SAMPLE_BLOCKS = 64  # the estimate looks at this many evenly spaced blocks ...
SAMPLE_BLOCK = 4096  # ... of this many bytes
LEVEL = 1  # zstd's fastest standard level: deltas are cut on the sender's critical path

SAME, SPARSE, XOR = 0, 1, 2  # DeltaEncoding values (the protocol's enum; kept numeric here)
_HEAD = struct.Struct("<II")
_U32 = struct.Struct("<I")
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class DeltaError(WeightliftError):
    """A DELTA payload that does not decode against its base (malformed, or lengths that disagree)."""


def available() -> bool:
    """Whether this process can encode and apply deltas (the zstandard package is installed)."""
    try:
        import zstandard  # noqa: F401
    except ImportError:
        return False
    return True


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_local = threading.local()


def _workers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="weightlift-delta")
        return _pool


def _zstd() -> tuple[Any, Any]:
    """This thread's compressor and decompressor (zstandard's objects are not shared between threads)."""
    pair = getattr(_local, "zstd", None)
    if pair is None:
        import zstandard

        pair = _local.zstd = (zstandard.ZstdCompressor(level=LEVEL), zstandard.ZstdDecompressor())
    return pair


def _elements(buf: np.ndarray, item: int) -> np.ndarray:
    """``buf`` (uint8) as one row per element: an unsigned integer where one is that wide."""
    kind = _UINT.get(item)
    return buf.view(kind) if kind is not None else buf.reshape(-1, item)


def payload_bound(nbytes: int, item: int) -> int:
    """The most bytes a payload for a tensor of ``nbytes`` may take: never more than sending it
    whole (a client would send it whole), and the head and table of the smallest chunks."""
    return nbytes + _HEAD.size + _U32.size * (nbytes // max(item, 1) + 1)


def copy(dest: np.ndarray, src: np.ndarray) -> None:
    """``dest[:] = src`` for two uint8 arrays of one length, a chunk per core."""
    jobs = [
        _workers().submit(np.copyto, dest[s : s + CHUNK_BYTES], src[s : s + CHUNK_BYTES])
        for s in range(0, src.nbytes, CHUNK_BYTES)
    ]
    for j in jobs:
        j.result()


# -- choosing and encoding (the client) ------------------------------------------------------------


def _sample(new: np.ndarray, base: np.ndarray, item: int) -> tuple[np.ndarray, np.ndarray]:
    n = new.nbytes
    block = max(item, SAMPLE_BLOCK - SAMPLE_BLOCK % item)
    if n <= SAMPLE_BLOCKS * block:
        return new, base
    step = (n - block) // (SAMPLE_BLOCKS - 1)
    step -= step % item
    starts = [i * step for i in range(SAMPLE_BLOCKS)]
    return (np.concatenate([new[s : s + block] for s in starts]), np.concatenate([base[s : s + block] for s in starts]))


def choose(new: np.ndarray, base: np.ndarray, item: int) -> int | None:
    """The encoding a sample of the tensor suggests (SPARSE or XOR), or None: send it whole.

    ``new`` and ``base`` are the tensor's bytes as uint8 arrays of one length; ``item`` its
    element size in bytes (0 for sub-byte dtypes, which are always sent whole)."""
    if item < 1 or new.nbytes != base.nbytes or new.nbytes == 0 or not available():
        return None
    s_new, s_base = _sample(new, base, item)
    changed = _elements(s_new, item) != _elements(s_base, item)
    if changed.ndim > 1:
        changed = changed.any(axis=1)
    if changed.mean() <= SPARSE_MAX:
        return SPARSE
    packed = _zstd()[0].compress(np.bitwise_xor(s_new, s_base).tobytes())
    return XOR if len(packed) <= DENSE_RATIO_MAX * s_new.nbytes else None


def _encode_chunk(encoding: int, new: np.ndarray, base: np.ndarray, item: int) -> bytes:
    if encoding == XOR:
        x = np.bitwise_xor(new, base)
        return _zstd()[0].compress(x.data) if x.any() else b""
    ne, be = _elements(new, item), _elements(base, item)
    changed = ne != be
    if changed.ndim > 1:
        changed = changed.any(axis=1)
    pos = np.flatnonzero(changed)
    if not len(pos):
        return b""
    vals = np.ascontiguousarray(ne[pos])
    gaps = np.diff(pos, prepend=0).astype("<u4")  # small numbers: they compress far better than positions
    return _zstd()[0].compress(_U32.pack(len(pos)) + gaps.tobytes() + vals.tobytes())


def encode(
    encoding: int, new: np.ndarray, base: np.ndarray, item: int, *, limit: int | None = None
) -> list[bytes] | None:
    """The payload of ``new`` against ``base`` in ``encoding``, as parts to send in order; None
    where it would take more than ``limit`` bytes (default: :data:`DENSE_RATIO_MAX` of the
    tensor), so that the tensor goes whole instead."""
    n = new.nbytes
    limit = int(DENSE_RATIO_MAX * n) if limit is None else limit
    chunk = max(item, CHUNK_BYTES - CHUNK_BYTES % item)
    starts = range(0, n, chunk)
    frames = list(
        _workers().map(lambda s: _encode_chunk(encoding, new[s : s + chunk], base[s : s + chunk], item), starts)
    )
    head = _HEAD.pack(chunk, len(frames)) + b"".join(_U32.pack(len(f)) for f in frames)
    if len(head) + sum(len(f) for f in frames) > limit:
        return None
    return [head, *(f for f in frames if f)]


# -- applying (the server) ---------------------------------------------------------------------------


class Undo:
    """How to take an in-place application back: the elements SPARSE overwrote, or XOR again."""

    def __init__(self) -> None:
        self.steps: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def add(self, step: Callable[[], None]) -> None:
        with self._lock:
            self.steps.append(step)

    def run(self) -> None:
        for step in reversed(self.steps):
            step()
        self.steps = []


def _table(payload: memoryview, nbytes: int, item: int) -> tuple[int, list[tuple[int, int, int]]]:
    """(chunk_bytes, [(chunk start, frame offset, frame length)]) after checking every length."""
    if len(payload) < _HEAD.size:
        raise DeltaError(f"DELTA payload of {len(payload)} bytes has no head")
    chunk, count = _HEAD.unpack_from(payload)
    if chunk < 1 or chunk % max(item, 1) or chunk > MAX_CHUNK_BYTES:
        raise DeltaError(
            f"DELTA chunk size {chunk} is not a whole number of {item}-byte elements up to {MAX_CHUNK_BYTES}"
        )
    if count != -(-nbytes // chunk):
        raise DeltaError(f"DELTA has {count} chunks; {nbytes} bytes in chunks of {chunk} make {-(-nbytes // chunk)}")
    pos = _HEAD.size + _U32.size * count
    if len(payload) < pos:
        raise DeltaError(f"DELTA payload of {len(payload)} bytes is shorter than its table of {count} chunks")
    lengths = struct.unpack_from(f"<{count}I", payload, _HEAD.size)
    if pos + sum(lengths) != len(payload):
        raise DeltaError(
            f"DELTA chunks take {sum(lengths)} bytes; the payload has {len(payload) - pos} after its table"
        )
    out = []
    for i, clen in enumerate(lengths):
        if clen:
            out.append((i * chunk, pos, clen))
        pos += clen
    return chunk, out


def _decompress(frame: memoryview, bound: int) -> bytes:
    import zstandard

    try:
        raw: bytes = _zstd()[1].decompress(frame, max_output_size=bound)
    except zstandard.ZstdError as e:
        raise DeltaError(f"DELTA chunk does not decompress: {e}") from None
    if len(raw) > bound:
        raise DeltaError(f"DELTA chunk decompresses to {len(raw)} bytes, more than its {bound}")
    return raw


def _apply_xor(frame: memoryview, base: np.ndarray, out: np.ndarray) -> None:
    raw = _decompress(frame, base.nbytes)
    if len(raw) != base.nbytes:
        raise DeltaError(f"XOR chunk decompresses to {len(raw)} bytes, not the chunk's {base.nbytes}")
    np.bitwise_xor(base, np.frombuffer(raw, np.uint8), out=out)


def _apply_sparse(
    frame: memoryview, base: np.ndarray, out: np.ndarray, item: int, in_place: bool, undo: Undo | None
) -> None:
    n = base.nbytes // item
    raw = _decompress(frame, _U32.size + n * (_U32.size + item))
    if len(raw) < _U32.size:
        raise DeltaError("SPARSE chunk has no count")
    (count,) = _U32.unpack_from(raw)
    if count > n or len(raw) != _U32.size + count * (_U32.size + item):
        raise DeltaError(f"SPARSE chunk of {len(raw)} bytes does not hold {count} of at most {n} elements")
    gaps = np.frombuffer(raw, "<u4", count, _U32.size)
    if count > 1 and not gaps[1:].all():
        raise DeltaError("SPARSE positions are not strictly increasing within the chunk")
    pos = np.cumsum(gaps, dtype=np.int64)
    if count and pos[-1] >= n:
        raise DeltaError(f"SPARSE position {pos[-1]} lies past the chunk's {n} elements")
    vals = np.frombuffer(raw, np.uint8, count * item, _U32.size * (count + 1))
    dest = _elements(out, item)
    if not in_place:
        np.copyto(out, base)
    elif undo is not None:
        old = dest[pos].copy()
        undo.add(lambda: dest.__setitem__(pos, old))
    dest[pos] = _elements(vals, item)


def apply(
    encoding: int, payload: memoryview, base: np.ndarray, out: np.ndarray, item: int, *, undo: Undo | None = None
) -> None:
    """Write ``base`` with the DELTA ``payload`` applied into ``out`` (both uint8 arrays of the
    tensor's bytes; ``out`` may be ``base`` itself: in place, ``undo`` then learns how to take it
    back). DeltaError for a payload that does not fit the base; in place, a chunk before the
    failing one may have been applied already (``undo`` takes them back)."""
    if encoding == SAME:
        if len(payload):
            raise DeltaError("a SAME delta carries no payload")
        if out is not base:
            np.copyto(out, base)
        return
    if encoding not in (SPARSE, XOR) or item < 1:
        raise DeltaError(f"DELTA encoding {encoding} for {item}-byte elements is not one this server applies")
    nbytes = base.nbytes
    chunk, frames = _table(payload, nbytes, item)

    def one(start: int, offset: int, clen: int) -> None:
        b, o, f = base[start : start + chunk], out[start : start + chunk], payload[offset : offset + clen]
        if encoding == XOR:
            _apply_xor(f, b, o)
            if undo is not None and out is base:
                undo.add(lambda: _apply_xor(f, o, o))
        else:
            _apply_sparse(f, b, o, item, out is base, undo)

    jobs = [_workers().submit(one, *fr) for fr in frames]
    if out is not base:  # the chunks no frame names are the base's bytes
        changed = {s for s, _, _ in frames}
        jobs += [
            _workers().submit(np.copyto, out[s : s + chunk], base[s : s + chunk])
            for s in range(0, nbytes, chunk)
            if s not in changed
        ]
    errors = [e for e in (j.exception() for j in jobs) if e is not None]
    if errors:
        raise errors[0]
