"""The payload of a DELTA: a tensor encoded against a base of the same dtype and shape, and back.

Both ends of a connection use this module (the client encodes, the server applies); it does no
I/O. A tensor is cut into chunks of ``chunk_bytes`` (a whole number of elements); each chunk is
encoded on its own (zstandard and numpy release the GIL) and an unchanged chunk costs four bytes. The payload::

    head   := chunk_bytes:u32  nchunks:u32           nchunks = ceil(nbytes / chunk_bytes)
                                                     chunk_bytes >= min(MIN_CHUNK_BYTES, nbytes)
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

The passes. A sender calls :func:`scan`: one pass over the new bytes and the base, a
:data:`BLOCK_BYTES` block at a time, that hashes the new bytes (the digest the DELTA names),
finds the changes (compared as 64-bit words, only the words that differ looked at element by
element) and, for a base the sender keeps, writes them into it, all while the block is in cache.
A receiver calls :func:`apply_hashed`: base, changes and the hash of the result, again a block
at a time, into fresh memory or in place. Both run on the calling thread (a digest is one
sequential pass): a sender scans several tensors on several threads, ahead of its sends.
:func:`encode` and :func:`apply` do the same without the hash, a chunk per core.

Every length in a payload is checked before anything is sized from it (:class:`DeltaError`).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import blake3
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
    "scan",
    "apply",
    "apply_hashed",
    "payload_bound",
    "scratch_bound",
    "copy",
]

CHUNK_BYTES = 4 << 20  # tensor bytes per chunk: enough to compress well, small enough to spread over cores
BLOCK_BYTES = 256 << 10  # bytes compared, changed and hashed at once: they stay in a core's cache between passes
MAX_CHUNK_BYTES = 64 << 20  # the largest chunk a payload may state (what one worker decompresses at once)
# the smallest chunk a payload may state, unless it is the whole tensor: a chunk costs a table
# entry and a zstd call, so that tiny chunks would make a small payload cost the server much CPU
# and bookkeeping. The encoder's chunks are CHUNK_BYTES less a part of an element, never smaller.
MIN_CHUNK_BYTES = 64 << 10
SPARSE_MAX = 0.05  # changed fraction of the sampled elements up to which SPARSE is chosen
DENSE_RATIO_MAX = 0.75  # XOR is chosen where the sample compresses at least this well, else the tensor goes whole
SAMPLE_BLOCKS = 64  # the estimate looks at this many evenly spaced blocks ...
SAMPLE_BLOCK = 1024  # ... of this many bytes (64 KiB in all: a small part of a tensor worth a delta)
COMPRESS_AHEAD = 8  # chunks of one scan waiting for (or in) compression at once
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


def payload_bound(nbytes: int) -> int:
    """The most bytes a payload for a tensor of ``nbytes`` may take: never more than sending it
    whole (a client would send it whole), and the head and table of the smallest chunks."""
    return nbytes + _HEAD.size + _U32.size * (nbytes // MIN_CHUNK_BYTES + 1)


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


def _changes(new: np.ndarray, base: np.ndarray, item: int, update: bool) -> tuple[np.ndarray, np.ndarray]:
    """The elements of ``new`` that differ from ``base`` in one block (in cache): their
    indices and their new values; with ``update``, ``base`` takes the new values.

    Where elements tile 64-bit words, the block is compared a word at a time and only the
    words that differ are looked at element by element: at a few percent of changes that is
    one pass over each input and no temporary of the block's size but a bool per word."""
    n = new.nbytes
    whole = n - n % 8 if 8 % item == 0 else 0
    where: list[np.ndarray] = []
    values: list[np.ndarray] = []
    if whole:
        a, b = new[:whole].view(np.uint64), base[:whole].view(np.uint64)
        words = np.flatnonzero(a != b)
        if len(words):
            aw = a[words]
            if item == 8:
                where.append(words)
                values.append(aw)
            else:
                shift = (8 // item).bit_length() - 1  # elements per word: 2, 4 or 8
                j = np.flatnonzero((aw ^ b[words]).view(_UINT[item]))
                where.append((words[j >> shift] << shift) | (j & ((1 << shift) - 1)))
                values.append(aw.view(_UINT[item])[j])
            if update:
                b[words] = aw
    if whole < n:
        ne, be = _elements(new[whole:], item), _elements(base[whole:], item)
        rest = ne != be
        if rest.ndim > 1:
            rest = rest.any(axis=1)
        pos = np.flatnonzero(rest)
        vals = ne[pos]
        if update:
            be[pos] = vals
        where.append(pos + whole // item)
        values.append(vals.reshape(-1).view(np.uint8) if vals.ndim > 1 else vals)
    if len(where) == 1:
        return where[0], values[0]
    if not where:
        return np.empty(0, np.int64), np.empty(0, np.uint8)
    return np.concatenate(where), np.concatenate([v.view(np.uint8) for v in values])


def _block(item: int) -> int:
    return max(item, BLOCK_BYTES - BLOCK_BYTES % item)


def _sparse_body(new: np.ndarray, base: np.ndarray, item: int, hasher: Any, update: bool) -> bytes | None:
    """A SPARSE chunk before compression (None: unchanged), block by block: each block hashed
    (``hasher``), compared and, with ``update``, its changed elements written into ``base``
    while it is in cache."""
    block = _block(item)
    where, values = [], []
    for o in range(0, new.nbytes, block):
        nb, bb = new[o : o + block], base[o : o + block]
        if hasher is not None:
            hasher.update(nb)
        pos, vals = _changes(nb, bb, item, update)
        if len(pos):
            where.append(pos + o // item)
            values.append(vals)
    if not where:
        return None
    pos = np.concatenate(where)
    gaps = np.diff(pos, prepend=0).astype("<u4")  # small numbers: they compress far better than positions
    return b"".join([_U32.pack(len(pos)), gaps.tobytes(), *(v.tobytes() for v in values)])


def _xor_body(new: np.ndarray, base: np.ndarray, item: int, hasher: Any, update: bool) -> np.ndarray | None:
    """An XOR chunk before compression (None: unchanged), hashed and refreshed as SPARSE's."""
    block = _block(item)
    x = np.empty(new.nbytes, np.uint8)
    for o in range(0, new.nbytes, block):
        nb, bb = new[o : o + block], base[o : o + block]
        if hasher is not None:
            hasher.update(nb)
        np.bitwise_xor(nb, bb, out=x[o : o + block])
        if update:
            np.copyto(bb, nb)
    return x if x.any() else None


def _compress(body: Any) -> bytes:
    """A chunk's frame: its body compressed (any thread: each has its own compressor)."""
    return b"" if body is None else bytes(_zstd()[0].compress(body))


def _whole_pass(new: np.ndarray, base: np.ndarray, hasher: Any, update: bool) -> None:
    """No frame: only hash ``new`` and, with ``update``, copy it into ``base``, block by block."""
    for o in range(0, new.nbytes, BLOCK_BYTES):
        nb = new[o : o + BLOCK_BYTES]
        if hasher is not None:
            hasher.update(nb)
        if update:
            np.copyto(base[o : o + BLOCK_BYTES], nb)


_BODIES: dict[int, Callable[[np.ndarray, np.ndarray, int, Any, bool], Any]] = {SPARSE: _sparse_body, XOR: _xor_body}


def _chunk_size(item: int) -> int:
    return max(item, CHUNK_BYTES - CHUNK_BYTES % item)


def _payload(frames: list[bytes], chunk: int) -> list[bytes]:
    head = _HEAD.pack(chunk, len(frames)) + b"".join(_U32.pack(len(f)) for f in frames)
    return [head, *(f for f in frames if f)]


def encode(
    encoding: int, new: np.ndarray, base: np.ndarray, item: int, *, limit: int | None = None
) -> list[bytes] | None:
    """The payload of ``new`` against ``base`` in ``encoding``, as parts to send in order; None
    where it would take more than ``limit`` bytes (default: :data:`DENSE_RATIO_MAX` of the
    tensor), so that the tensor goes whole instead. Its chunks are encoded on every core."""
    n = new.nbytes
    limit = int(DENSE_RATIO_MAX * n) if limit is None else limit
    chunk = _chunk_size(item)
    body = _BODIES[encoding]
    frames = list(
        _workers().map(
            lambda s: _compress(body(new[s : s + chunk], base[s : s + chunk], item, None, False)), range(0, n, chunk)
        )
    )
    parts = _payload(frames, chunk)
    return parts if sum(len(p) for p in parts) <= limit else None


def scan(
    encoding: int | None,
    new: np.ndarray,
    base: np.ndarray,
    item: int,
    *,
    limit: int | None = None,
    update: bool = False,
) -> tuple[list[bytes] | None, bytes]:
    """One pass over ``new`` and ``base``: the payload (as :func:`encode`; None where
    ``encoding`` is None or the payload passes ``limit``) and the BLAKE3 digest of ``new``.

    ``update``: ``base`` becomes ``new`` on the way, its changed elements written while they are
    in cache (a kept base refreshed for the next update without a copy of the tensor). The pass
    runs on the calling thread (a tensor's digest is one sequential pass; callers scan several
    tensors on several threads); each chunk's compression goes to the codec's workers meanwhile."""
    n = new.nbytes
    limit = int(DENSE_RATIO_MAX * n) if limit is None else limit
    chunk = _chunk_size(max(item, 1))
    hasher = blake3.blake3(max_threads=1)
    frames: list[Future[bytes]] = []
    for s in range(0, n, chunk):
        nb, bb = new[s : s + chunk], base[s : s + chunk]
        if encoding is None:
            _whole_pass(nb, bb, hasher, update)
            continue
        if len(frames) >= COMPRESS_AHEAD:
            frames[-COMPRESS_AHEAD].result()  # bounds the bodies held waiting for a worker
        frames.append(_workers().submit(_compress, _BODIES[encoding](nb, bb, item, hasher, update)))
    digest = hasher.digest()
    if encoding is None:
        return None, digest
    parts = _payload([f.result() for f in frames], chunk)
    return (parts if sum(len(p) for p in parts) <= limit else None), digest


# -- applying (the server) ---------------------------------------------------------------------------


class Undo:
    """How to take an in-place application back: the elements SPARSE overwrote, or XOR again.
    ``nbytes``: the memory its steps keep (SPARSE's old elements and their positions)."""

    def __init__(self) -> None:
        self.steps: list[Callable[[], None]] = []
        self.nbytes = 0
        self._lock = threading.Lock()

    def add(self, step: Callable[[], None], nbytes: int = 0) -> None:
        with self._lock:
            self.steps.append(step)
            self.nbytes += nbytes

    def run(self) -> None:
        for step in reversed(self.steps):
            step()
        self.steps = []
        self.nbytes = 0


def scratch_bound(encoding: int, payload: memoryview, nbytes: int, item: int) -> int:
    """The most memory :func:`apply_hashed` takes besides its inputs and its output while it
    applies ``payload`` to a tensor of ``nbytes`` (it works a chunk at a time): one chunk's
    decompressed frame and, for SPARSE, the changes' positions and one block's indices. What an
    in-place application keeps to be undone comes on top (:attr:`Undo.nbytes`). 0 for a payload
    refused from its head. A server charges it before it applies."""
    if encoding not in (SPARSE, XOR) or item < 1 or len(payload) < _HEAD.size:
        return 0
    chunk = min(_HEAD.unpack_from(payload)[0], MAX_CHUNK_BYTES, nbytes)
    if encoding == XOR:
        return chunk
    n = chunk // item
    return _sparse_raw_bound(n, item) + _U32.size * n + 8 * (_block(item) // item + 1)


def _sparse_raw_bound(n: int, item: int) -> int:
    """The most bytes a SPARSE frame of a chunk of ``n`` elements may decompress to."""
    return _U32.size + n * (_U32.size + item)


def _table(payload: memoryview, nbytes: int, item: int) -> tuple[int, list[tuple[int, int, int]]]:
    """(chunk_bytes, [(chunk start, frame offset, frame length)]) after checking every length.

    The chunk size is checked before anything is sized from the count, and the table is read
    as one array: a payload never makes the server build one object per entry it states."""
    if len(payload) < _HEAD.size:
        raise DeltaError(f"DELTA payload of {len(payload)} bytes has no head")
    chunk, count = _HEAD.unpack_from(payload)
    if chunk < 1 or chunk % max(item, 1) or chunk > MAX_CHUNK_BYTES:
        raise DeltaError(
            f"DELTA chunk size {chunk} is not a whole number of {item}-byte elements up to {MAX_CHUNK_BYTES}"
        )
    if chunk < min(MIN_CHUNK_BYTES, nbytes):
        raise DeltaError(
            f"DELTA chunk size {chunk} is below {MIN_CHUNK_BYTES} bytes and not the whole tensor of {nbytes}"
        )
    if count != -(-nbytes // chunk):
        raise DeltaError(f"DELTA has {count} chunks; {nbytes} bytes in chunks of {chunk} make {-(-nbytes // chunk)}")
    pos = _HEAD.size + _U32.size * count
    if len(payload) < pos:
        raise DeltaError(f"DELTA payload of {len(payload)} bytes is shorter than its table of {count} chunks")
    lengths = np.frombuffer(payload, "<u4", count, _HEAD.size).astype(np.int64)
    total = int(lengths.sum())
    if pos + total != len(payload):
        raise DeltaError(f"DELTA chunks take {total} bytes; the payload has {len(payload) - pos} after its table")
    offsets = pos + np.cumsum(lengths) - lengths
    named = np.flatnonzero(lengths)
    return chunk, list(zip((named * chunk).tolist(), offsets[named].tolist(), lengths[named].tolist(), strict=True))


def _decompress(frame: memoryview, bound: int) -> bytes:
    """The frame's bytes, at most ``bound`` of them. zstd allocates the size a frame's header
    states and ignores ``max_output_size`` then: that size is checked first, so that a small
    hostile frame cannot make the server allocate and fill gigabytes."""
    import zstandard

    try:
        stated = zstandard.frame_content_size(frame)  # -1: not stated, bounded by max_output_size
        if stated > bound:
            raise DeltaError(f"DELTA chunk states {stated} bytes, more than its {bound}")
        raw: bytes = _zstd()[1].decompress(frame, max_output_size=bound)
    except zstandard.ZstdError as e:
        raise DeltaError(f"DELTA chunk does not decompress: {e}") from None
    if len(raw) > bound:
        raise DeltaError(f"DELTA chunk decompresses to {len(raw)} bytes, more than its {bound}")
    return raw


def _apply_xor(frame: memoryview, base: np.ndarray, out: np.ndarray, hasher: Any = None) -> None:
    raw = _decompress(frame, base.nbytes)
    if len(raw) != base.nbytes:
        raise DeltaError(f"XOR chunk decompresses to {len(raw)} bytes, not the chunk's {base.nbytes}")
    x = np.frombuffer(raw, np.uint8)
    if hasher is None:
        np.bitwise_xor(base, x, out=out)
        return
    for o in range(0, base.nbytes, BLOCK_BYTES):
        ob = out[o : o + BLOCK_BYTES]
        np.bitwise_xor(base[o : o + BLOCK_BYTES], x[o : o + BLOCK_BYTES], out=ob)
        hasher.update(ob)


def _sparse_decode(frame: memoryview, nbytes: int, item: int) -> tuple[np.ndarray, np.ndarray]:
    """A SPARSE chunk's (element positions, new elements), every length and position checked."""
    n = nbytes // item
    raw = _decompress(frame, _sparse_raw_bound(n, item))
    if len(raw) < _U32.size:
        raise DeltaError("SPARSE chunk has no count")
    (count,) = _U32.unpack_from(raw)
    if count > n or len(raw) != _sparse_raw_bound(count, item):
        raise DeltaError(f"SPARSE chunk of {len(raw)} bytes does not hold {count} of at most {n} elements")
    gaps = np.frombuffer(raw, "<u4", count, _U32.size)
    if count > 1 and not gaps[1:].all():
        raise DeltaError("SPARSE positions are not strictly increasing within the chunk")
    last = int(gaps.sum(dtype=np.uint64))
    if count and last >= n:
        raise DeltaError(f"SPARSE position {last} lies past the chunk's {n} elements")
    # four bytes a position, exact: every partial sum is at most the last, below n (< 2**32)
    pos = np.cumsum(gaps, dtype=np.uint32)
    return pos, _elements(np.frombuffer(raw, np.uint8, count * item, _U32.size * (count + 1)), item)


def _apply_sparse(
    frame: memoryview,
    base: np.ndarray,
    out: np.ndarray,
    item: int,
    in_place: bool,
    undo: Undo | None,
    hasher: Any = None,
) -> None:
    """The chunk's changes over ``base`` into ``out`` (the same memory where ``in_place``); with
    ``hasher``, block by block: copied, changed and hashed while the block is in cache."""
    pos, vals = _sparse_decode(frame, base.nbytes, item)
    dest = _elements(out, item)
    if in_place and undo is not None:
        old = dest[pos]  # a copy already (an index array)
        undo.add(lambda: dest.__setitem__(pos, old), pos.nbytes + old.nbytes)
    if hasher is None:
        if not in_place:
            np.copyto(out, base)
        dest[pos] = vals
        return
    block = _block(item)
    per = block // item
    # the needles in the positions' own dtype: mixed ones would make searchsorted copy them wider
    cuts = np.searchsorted(pos, (np.arange(1, -(-base.nbytes // block) + 1) * per).astype(pos.dtype))
    lo = 0
    for k, o in enumerate(range(0, base.nbytes, block)):
        ob = out[o : o + block]
        if not in_place:
            np.copyto(ob, base[o : o + block])
        hi = int(cuts[k])
        if hi > lo:
            _elements(ob, item)[pos[lo:hi] - k * per] = vals[lo:hi]
        hasher.update(ob)
        lo = hi


def _check_encoding(encoding: int, payload: memoryview, item: int) -> None:
    if encoding == SAME and len(payload):
        raise DeltaError("a SAME delta carries no payload")
    if encoding not in (SAME, SPARSE, XOR) or item < 1:
        raise DeltaError(f"DELTA encoding {encoding} for {item}-byte elements is not one this server applies")


def apply(
    encoding: int, payload: memoryview, base: np.ndarray, out: np.ndarray, item: int, *, undo: Undo | None = None
) -> None:
    """Write ``base`` with the DELTA ``payload`` applied into ``out`` (both uint8 arrays of the
    tensor's bytes; ``out`` may be ``base`` itself: in place, ``undo`` then learns how to take it
    back), a chunk per core. DeltaError for a payload that does not fit the base; in place, a
    chunk before the failing one may have been applied already (``undo`` takes them back)."""
    _check_encoding(encoding, payload, item)
    if encoding == SAME:
        if out is not base:
            np.copyto(out, base)
        return
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


def apply_hashed(
    encoding: int, payload: memoryview, base: np.ndarray, out: np.ndarray, item: int, *, undo: Undo | None = None
) -> bytes:
    """:func:`apply` in one pass that also hashes the result: the BLAKE3 digest of ``out``.

    Block by block, each block of the result is hashed right after it is written, while it is in
    cache (no second pass over the tensor to prove it). On the calling thread: the digest is one
    sequential pass, and a server applies several tensors' DELTAs on several connections."""
    _check_encoding(encoding, payload, item)
    hasher = blake3.blake3(max_threads=1)
    nbytes = base.nbytes
    if encoding == SAME:
        _whole_pass(base, out, hasher, out is not base)
        return hasher.digest()
    chunk, frames = _table(payload, nbytes, item)
    named = {s: (offset, clen) for s, offset, clen in frames}
    for s in range(0, nbytes, chunk):
        b, o = base[s : s + chunk], out[s : s + chunk]
        frame = named.get(s)
        if frame is None:  # the base's bytes
            _whole_pass(b, o, hasher, out is not base)
            continue
        f = payload[frame[0] : frame[0] + frame[1]]
        if encoding == XOR:
            _apply_xor(f, b, o, hasher)
            if undo is not None and out is base:
                undo.add(lambda f=f, o=o: _apply_xor(f, o, o))  # type: ignore[misc]
        else:
            _apply_sparse(f, b, o, item, out is base, undo, hasher)
    return hasher.digest()
