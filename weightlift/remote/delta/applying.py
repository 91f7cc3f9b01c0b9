"""Applying a DELTA (the receiver's side of :mod:`weightlift.remote.delta`): the payload's table
checked, each chunk's frame decoded onto its base, into fresh memory or in place, and the result
hashed.

Threads. :func:`apply_hashed` hands a tensor's chunks to the codec's worker pool (one thread per
core this process may run on, shared by all its connections) and hashes the result on the
calling thread, chunk after chunk in order, each as soon as it is applied. The digest is one
sequential pass (the BLAKE3 binding offers no subtree values to combine), but decoding a chunk
(zstd, the XOR or the scatter, and the copy of the base into fresh memory) costs a few times
hashing it, so one hashing thread keeps pace with several decoding ones. At most
:data:`APPLY_AHEAD` chunks are out at once: that bounds the decoded frames held (what
:func:`scratch_bound` charges) and keeps the chunks waiting for the hash in the last-level
cache. A tensor of one chunk, or a process pinned to one core, is applied and hashed on the
calling thread, a block at a time while it is in the core's cache (no hand-off). An error in
any chunk waits for the chunks still being applied before it is raised: afterwards nothing
writes into the output, and an in-place application's :class:`Undo` holds every chunk that
was applied.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

import blake3
import numpy as np

from weightlift.remote.delta.chunks import (
    HEAD,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    PLANES,
    SAME,
    SPARSE,
    U32,
    XOR,
    DeltaError,
    block_size,
    cores,
    elements,
    join_planes,
    whole_pass,
    workers,
    zstd,
)

__all__ = ["APPLY_AHEAD", "Undo", "apply", "apply_hashed", "check", "scratch_bound"]

# chunks of one application out to the workers at once: enough to keep every core decoding while
# one thread hashes, few enough that they wait for the hash in the last-level cache
APPLY_AHEAD = min(8, cores() + 1)


class Undo:
    """How to take an in-place application back: the elements SPARSE overwrote, or XOR (PLANES)
    again. ``nbytes``: the memory its steps keep (SPARSE's old elements and their positions) and
    the most one step takes while it runs (a frame decoded again), each part passed to
    ``reserve`` (a server's charge; it raises where the memory is not there) before it is taken."""

    def __init__(self, reserve: Callable[[int], None] | None = None) -> None:
        self.steps: list[Callable[[], None]] = []
        self.nbytes = 0
        self._reserve = reserve
        self._lock = threading.Lock()
        self._running = 0  # the most one step takes while it runs, counted in nbytes

    def keep(self, nbytes: int) -> None:
        """Count (and charge) ``nbytes`` that a step about to be taken will keep."""
        with self._lock:
            if self._reserve is not None:
                self._reserve(nbytes)
            self.nbytes += nbytes

    def running(self, nbytes: int) -> None:
        """Count (and charge) ``nbytes`` that a step about to be taken needs while it runs: the
        steps run one at a time, so only the most any one needs."""
        with self._lock:
            more = nbytes - self._running
            if more <= 0:
                return
            if self._reserve is not None:
                self._reserve(more)
            self._running = nbytes
            self.nbytes += more

    def add(self, step: Callable[[], None]) -> None:
        with self._lock:
            self.steps.append(step)

    def run(self) -> None:
        """Take every step back, the last first. One that raises (a frame decoded again without
        memory for it) does not stop the others; the first error is raised once all have run."""
        error: BaseException | None = None
        for step in reversed(self.steps):
            try:
                step()
            except BaseException as e:  # raised below, after the other steps
                error = error or e
        self.steps = []
        self.nbytes = self._running = 0
        if error is not None:
            raise error


def _in_flight(nbytes: int, chunk: int) -> int:
    """Chunks of one tensor :func:`apply_hashed` decodes at once."""
    return max(1, min(-(-nbytes // chunk), APPLY_AHEAD))


def scratch_bound(encoding: int, payload: memoryview, nbytes: int, item: int) -> int:
    """The most memory :func:`apply_hashed` takes besides its inputs and its output while it
    applies ``payload`` to a tensor of ``nbytes``: per chunk being applied (at most
    :data:`APPLY_AHEAD` at once), its decompressed frame and, for PLANES, one block to join its
    planes in, for SPARSE, the changes' positions and one block's indices. What an in-place
    application keeps to be undone comes on top (:attr:`Undo.nbytes`). 0 for a payload refused
    from its head. A server charges it before it applies."""
    if encoding not in (SPARSE, XOR, PLANES) or item < 1 or len(payload) < HEAD.size:
        return 0
    stated = HEAD.unpack_from(payload)[0]
    chunk = min(stated, MAX_CHUNK_BYTES, nbytes)
    times = _in_flight(nbytes, max(stated, 1))
    if encoding == XOR:
        return chunk * times
    if encoding == PLANES:
        return (chunk + min(block_size(item), chunk)) * times
    n = chunk // item
    return times * (_sparse_raw_bound(n, item) + U32.size * n + 8 * (block_size(item) // item + 1))


def _sparse_raw_bound(n: int, item: int) -> int:
    """The most bytes a SPARSE frame of a chunk of ``n`` elements may decompress to."""
    return U32.size + n * (U32.size + item)


def _table(payload: memoryview, nbytes: int, item: int) -> tuple[int, list[tuple[int, int, int]]]:
    """(chunk_bytes, [(chunk start, frame offset, frame length)]) after checking every length.

    The chunk size is checked before anything is sized from the count, and the table is read
    as one array: a payload never makes the server build one object per entry it states."""
    if len(payload) < HEAD.size:
        raise DeltaError(f"DELTA payload of {len(payload)} bytes has no head")
    chunk, count = HEAD.unpack_from(payload)
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
    pos = HEAD.size + U32.size * count
    if len(payload) < pos:
        raise DeltaError(f"DELTA payload of {len(payload)} bytes is shorter than its table of {count} chunks")
    lengths = np.frombuffer(payload, "<u4", count, HEAD.size).astype(np.int64)
    total = int(lengths.sum())
    if pos + total != len(payload):
        raise DeltaError(f"DELTA chunks take {total} bytes; the payload has {len(payload) - pos} after its table")
    offsets = pos + np.cumsum(lengths) - lengths
    named = np.flatnonzero(lengths)
    return chunk, list(zip((named * chunk).tolist(), offsets[named].tolist(), lengths[named].tolist(), strict=True))


def _decompress(frame: memoryview, bound: int) -> bytes:
    """The frame's bytes, at most ``bound`` of them. zstd allocates the size a frame's header
    states and ignores ``max_output_size`` then: that size is checked first, so that a small
    hostile frame cannot make the server allocate and fill gigabytes. A frame must state it:
    one that does not is decoded through a window buffer as large as its header names (up to
    128 MiB), beside the output, and that buffer stays in the thread's decompressor after."""
    import zstandard

    try:
        stated = zstandard.frame_content_size(frame)  # -1: not stated
        if stated < 0:
            raise DeltaError("DELTA chunk does not state its decompressed size in its frame header")
        if stated > bound:
            raise DeltaError(f"DELTA chunk states {stated} bytes, more than its {bound}")
        raw: bytes = zstd()[1].decompress(frame, max_output_size=bound)
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
    step = block_size(1)
    for o in range(0, base.nbytes, step):
        ob = out[o : o + step]
        np.bitwise_xor(base[o : o + step], x[o : o + step], out=ob)
        hasher.update(ob)


def _apply_planes(frame: memoryview, base: np.ndarray, out: np.ndarray, item: int, hasher: Any = None) -> None:
    """A PLANES chunk over ``base`` into ``out`` (which may be ``base``): a block at a time, its
    elements joined from the planes into a block of scratch, XORed onto the base and hashed."""
    n = base.nbytes
    if n % item:
        raise DeltaError(f"PLANES chunk of {n} bytes is not a whole number of {item}-byte elements")
    raw = _decompress(frame, n)
    if len(raw) != n:
        raise DeltaError(f"PLANES chunk decompresses to {len(raw)} bytes, not the chunk's {n}")
    planes = np.frombuffer(raw, np.uint8).reshape(item, n // item)
    block = block_size(item)
    x = np.empty(min(block, n), np.uint8)
    for o in range(0, n, block):
        ob = out[o : o + block]
        xb = x[: ob.nbytes]
        join_planes(planes, o // item, xb, item)
        np.bitwise_xor(base[o : o + block], xb, out=ob)
        if hasher is not None:
            hasher.update(ob)


def _sparse_decode(frame: memoryview, nbytes: int, item: int) -> tuple[np.ndarray, np.ndarray]:
    """A SPARSE chunk's (element positions, new elements), every length and position checked."""
    n = nbytes // item
    raw = _decompress(frame, _sparse_raw_bound(n, item))
    if len(raw) < U32.size:
        raise DeltaError("SPARSE chunk has no count")
    (count,) = U32.unpack_from(raw)
    if count > n or len(raw) != _sparse_raw_bound(count, item):
        raise DeltaError(f"SPARSE chunk of {len(raw)} bytes does not hold {count} of at most {n} elements")
    gaps = np.frombuffer(raw, "<u4", count, U32.size)
    if count > 1 and not gaps[1:].all():
        raise DeltaError("SPARSE positions are not strictly increasing within the chunk")
    last = int(gaps.sum(dtype=np.uint64))
    if count and last >= n:
        raise DeltaError(f"SPARSE position {last} lies past the chunk's {n} elements")
    # four bytes a position, exact: every partial sum is at most the last, below n (< 2**32)
    pos = np.cumsum(gaps, dtype=np.uint32)
    return pos, elements(np.frombuffer(raw, np.uint8, count * item, U32.size * (count + 1)), item)


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
    _scatter(pos, vals, base, out, item, in_place, undo, hasher)


def _scatter(
    pos: np.ndarray,
    vals: np.ndarray,
    base: np.ndarray,
    out: np.ndarray,
    item: int,
    in_place: bool,
    undo: Undo | None,
    hasher: Any,
) -> None:
    """A decoded SPARSE chunk applied (:func:`_apply_sparse`)."""
    dest = elements(out, item)
    if in_place and undo is not None:
        undo.keep(pos.nbytes + len(pos) * item)  # charged before the old elements are copied out
        old = dest[pos]  # a copy already (an index array)
        undo.add(lambda: dest.__setitem__(pos, old))
    if hasher is None:
        if not in_place:
            np.copyto(out, base)
        dest[pos] = vals
        return
    block = block_size(item)
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
            elements(ob, item)[pos[lo:hi] - k * per] = vals[lo:hi]
        hasher.update(ob)
        lo = hi


def check(encoding: int, payload: memoryview, nbytes: int, item: int) -> None:
    """DeltaError where ``payload`` cannot be a DELTA in ``encoding`` of a tensor of ``nbytes``
    in ``item``-byte elements: an encoding not applied to such elements, or a head or chunk
    table that does not fit; nothing is decompressed. A server checks this as the DELTA arrives,
    before it keeps one to apply in place at the switch."""
    _check_encoding(encoding, payload, item)
    if encoding != SAME:
        _table(payload, nbytes, item)


def _check_encoding(encoding: int, payload: memoryview, item: int) -> None:
    if encoding == SAME and len(payload):
        raise DeltaError("a SAME delta carries no payload")
    if encoding not in (SAME, SPARSE, XOR, PLANES) or item < (2 if encoding == PLANES else 1):
        name = {SAME: "SAME", SPARSE: "SPARSE", XOR: "XOR", PLANES: "PLANES"}.get(encoding, str(encoding))
        raise DeltaError(f"DELTA encoding {name} for {item}-byte elements is not one this server applies")


def _chunk_applier(
    encoding: int,
    payload: memoryview,
    base: np.ndarray,
    out: np.ndarray,
    item: int,
    undo: Undo | None,
    chunk: int,
    frames: list[tuple[int, int, int]],
) -> Callable[[int, Any], None]:
    """``one(start, hasher)``: the chunk at ``start`` applied (and hashed, with a hasher)."""
    named = {s: (offset, clen) for s, offset, clen in frames}
    in_place = out is base

    def one(s: int, hasher: Any) -> None:
        b, o = base[s : s + chunk], out[s : s + chunk]
        frame = named.get(s)
        if frame is None:  # the base's bytes
            whole_pass(b, o, hasher, not in_place)
            return
        f = payload[frame[0] : frame[0] + frame[1]]
        if encoding == XOR:
            if undo is not None and in_place:  # XOR again: the frame decoded again, charged before it changes
                undo.running(b.nbytes)
            _apply_xor(f, b, o, hasher)
            if undo is not None and in_place:
                undo.add(lambda: _apply_xor(f, o, o))
        elif encoding == PLANES:
            if undo is not None and in_place:  # as XOR, and a block to join the planes in
                undo.running(b.nbytes + min(block_size(item), b.nbytes))
            _apply_planes(f, b, o, item, hasher)
            if undo is not None and in_place:
                undo.add(lambda: _apply_planes(f, o, o, item))
        else:
            _apply_sparse(f, b, o, item, in_place, undo, hasher)

    return one


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
    chunk, frames = _table(payload, base.nbytes, item)
    one = _chunk_applier(encoding, payload, base, out, item, undo, chunk, frames)
    starts = [s for s, _, _ in frames] if out is base else range(0, base.nbytes, chunk)
    jobs = [workers().submit(one, s, None) for s in starts]
    errors = [e for e in (j.exception() for j in jobs) if e is not None]
    if errors:
        raise errors[0]


def _in_order(starts: range, work: Callable[[int], Any], done: Callable[[int, Any], object], ahead: int) -> None:
    """``work(start)`` on the codec's workers, at most ``ahead`` at once, and ``done(start, what
    work returned)`` on this thread in the order of ``starts``, each as soon as its work is
    finished. On an error, the work not started is cancelled and the work running waited for,
    then the error raised."""
    jobs: deque[tuple[int, Future[Any]]] = deque()

    def finish() -> None:  # the finished work's result dies here: no more than ``ahead`` are held
        t, j = jobs.popleft()
        done(t, j.result())

    try:
        for s in starts:
            if len(jobs) >= ahead:
                finish()
            jobs.append((s, workers().submit(work, s)))
        while jobs:
            finish()
    except BaseException:
        for _, j in jobs:
            j.cancel()
        wait([j for _, j in jobs])
        raise


def apply_hashed(
    encoding: int, payload: memoryview, base: np.ndarray, out: np.ndarray, item: int, *, undo: Undo | None = None
) -> bytes:
    """:func:`apply` that also hashes the result: the BLAKE3 digest of ``out``.

    The chunks are applied on the codec's workers and hashed on this thread in order, each
    right after it is written, while it is in the last-level cache (no second pass over the
    tensor from memory to prove it). SPARSE into fresh memory is only decoded on the workers:
    the copy of the base and the few changes cost about what the hash does, and this thread
    does all three a block at a time while the block is in the core's cache. A tensor of one
    chunk, or a process that may run on one core only, applies and hashes here, a block at a
    time. On an error nothing writes into ``out`` any more once it is raised; in place,
    ``undo`` takes back every chunk applied."""
    _check_encoding(encoding, payload, item)
    hasher: Any = blake3.blake3(max_threads=1)
    nbytes = base.nbytes
    if encoding == SAME:
        whole_pass(base, out, hasher, out is not base)
        return hasher.digest()
    chunk, frames = _table(payload, nbytes, item)
    one = _chunk_applier(encoding, payload, base, out, item, undo, chunk, frames)
    starts = range(0, nbytes, chunk)
    if len(starts) == 1 or cores() == 1:  # nothing to share out: every pass in cache, on this thread
        for s in starts:
            one(s, hasher)
        return hasher.digest()
    in_place, named = out is base, {s: (offset, clen) for s, offset, clen in frames}
    decode_only = encoding == SPARSE and not in_place

    def work(s: int) -> Any:
        if decode_only and s in named:  # the copy and the few changes are cheap: done in cache below
            offset, clen = named[s]
            return _sparse_decode(payload[offset : offset + clen], min(chunk, nbytes - s), item)
        if s in named or not in_place:  # an unchanged chunk in place: nothing to write
            one(s, None)
        return None

    def done(s: int, decoded: Any) -> None:
        if decoded is None:
            hasher.update(out[s : s + chunk])
        else:
            pos, vals = decoded
            _scatter(pos, vals, base[s : s + chunk], out[s : s + chunk], item, False, None, hasher)

    _in_order(starts, work, done, _in_flight(nbytes, chunk))
    return hasher.digest()
