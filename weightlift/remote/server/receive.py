"""Receiving tensors on one connection: ALLOC, WRITE and FILL_FROM_CACHE, until each completes.

Theory of operation. An ALLOC charges the tensor's cost to the store and, unless the tensor may be
filled from memory the server already holds, makes its destination at once
(:class:`Destinations`): pooled or fresh host memory, or the target's own (a CUDA tensor). Each
WRITE is read from the socket as a stream by the connection's receive path (:class:`PayloadPath`);
with a disk cache the bytes are hashed as they pass, and so are the bytes of a tensor ALLOCated
with VERIFY (one hash serves both). A FILL_FROM_CACHE fills from memory or the disk cache
(:class:`Fills`). A tensor whose byte ranges cover it is complete: its cache entry is committed
(proving its digest) and the store publishes it. Errors are kept for the next BARRIER
(:class:`Outcomes`), whose reply also names the tensors a FILL could not fill (the client sends
their bytes instead) and, when asked, the digests of the verified tensors that completed.

The parts, in the order below:

* :class:`Receiver` - the requests: ALLOC, WRITE, FILL_FROM_CACHE, the barrier.
* :class:`Outcomes` - what the next BARRIER reports: tensors and bytes completed, errors, the
  tensors a FILL could not fill, the digests of verified tensors. A client does not wait for a
  reply per tensor, so everything between two barriers is kept here within fixed bounds
  (MAX_ERRORS messages, MAX_DIGESTS digests, MAX_TENSORS remembered failed ids).
* :class:`Pending` - a tensor in flight: its destination, its charge, which of its bytes have
  arrived; its ``writer`` (a cache writer, a digest check, or a
  :class:`~weightlift.remote.server.cache.hashing.StreamHash` for a tensor ALLOCated with VERIFY)
  is fed the bytes in order as they land (:func:`feed`), so the digest is known when the last
  byte is in.
* :class:`Staging` - one connection's target and its staging buffers, charged to the memory
  account. A host server's connections share one stateless host target; a CUDA server's
  connection makes its own at its first ALLOC, which pins ``PINNED_STAGING`` bytes of host
  memory for its uploads, and a connection that reads device tensors back or fills a target that
  is not host memory keeps one ``STAGING_BYTES`` buffer. Both are charged to max_memory when made
  and given back when the connection ends; the pinned bytes also count against the server-wide
  cap on pinned host memory (``Context.pins``), since on a CUDA server max_memory counts the
  device's memory. The server never tests a target's class: what a target pins it says itself
  (:meth:`~weightlift.memory.targets.Target.pinned_bytes`), and its bytes land through its stager.
* :class:`Destinations` - a pending tensor's memory. Fresh host memory that the socket will fill
  directly goes to this connection's :class:`~weightlift.memory.faulter.Faulter` at once, so
  helper threads fault it in ahead of the bytes (the next tensor's memory while this one's bytes
  arrive: a client sends ALLOCs ahead of WRITEs). A tensor allocated while the server was full
  has part of its charge deferred; it is charged in full before its memory is made.
* :class:`DirectPath` - a WRITE's payload from the socket to its tensor: straight into the
  destination where a plain memcpy is the right fill (host memory), through one reused staging
  buffer into the target's own fill step otherwise (a pinned slot of a CUDA target, uploaded
  asynchronously). A connection picks its :class:`PayloadPath` once, from its server's config.
* :class:`Fills` - a pending tensor named by digest filled without its bytes crossing the wire:
  from memory, a tensor the server holds whose bytes were proven to hash to the digest (the same
  name: the very same memory published again; another name: one copy); from the disk cache, the
  entry read into the destination and checked against the digest as it comes.
* :class:`Regions` - a sharded server's REGIONs on one connection: each box checked and claimed
  in the server's :class:`~weightlift.remote.server.store.Assembly`, its payload received
  straight into the slice where the box is one byte range of it, else staged and scattered; the
  sketch of what landed is added to the tensor's; SKETCH reports the tensors and this
  connection's refusals since the last one.
* :class:`NaivePath` - the naive receive path, kept for A/B runs (``WEIGHTLIFT_LOAD_OPT=0``, the
  benchmark's ``wl.push.legacy`` arm): each WRITE received whole into a fresh, zero-filled buffer
  and then copied into its destination, as before the optimized paths, except that the buffer is
  charged to max_memory while it exists.
"""

from __future__ import annotations

import contextlib
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from weightlift.errors import CacheError
from weightlift.memory.faulter import Faulter
from weightlift.memory.fresh import policy as fill_policy
from weightlift.memory.pool import POOL_MIN, held_bytes
from weightlift.memory.targets import STAGING_SLOT, Target, as_bytes, populate, view_as
from weightlift.profile import Profiler
from weightlift.remote.protocol import (
    MAX_DIGESTS,
    MAX_ERRORS,
    MAX_MESSAGE,
    MAX_SKETCH_BYTES,
    MAX_TENSORS,
    SKETCH_ENTRY_LAYOUT,
    Alloc,
    Barrier,
    BarrierReply,
    Expect,
    FillFromCache,
    Region,
    SketchReply,
    SketchRequest,
    Switch,
    SwitchReply,
    WriteHeader,
)
from weightlift.remote.server.admission import Context, RequestError
from weightlift.remote.server.cache import CacheWriter, DigestCheck, TensorCache, disk_unusable
from weightlift.remote.server.cache.behind import sealed_since
from weightlift.remote.server.cache.hashing import StreamHash, digest_of, piece_hasher
from weightlift.remote.server.cache.read import PARALLEL_READ_MIN, Readers, reader_pool
from weightlift.remote.server.store import Assembly, Charge, MemoryFull, RegionRefused, Store, entry_cost

__all__ = [
    "Receiver",
    "MAX_OPEN_FILES",
    "RESERVED_NAMES",
    "Outcomes",
    "Pending",
    "feed",
    "MAX_RANGES",
    "Staging",
    "STAGING_BYTES",
    "PINNED_STAGING",
    "Destinations",
    "FAULT_PIECE",
    "FAULT_WINDOW",
    "PayloadPath",
    "DirectPath",
    "Wire",
    "HASH_PIECE",
    "Fills",
    "NaivePath",
    "Regions",
]

MAX_OPEN_FILES = 8  # cache temporary files one connection holds open at once (tensors in flight by digest)
RESERVED_NAMES = frozenset({"__metadata__"})  # names a pulled safetensors file could not hold


class Receiver:
    """Everything one connection has in flight, and what its next BARRIER reports.

    ``path`` receives WRITE payloads (chosen once per connection); ``drain(n)`` reads and
    discards payload bytes nobody keeps; ``frame_end()`` runs once a WRITE's payload is in,
    before any of it counts (the connection checks the frame's MAC there).
    """

    def __init__(
        self,
        ctx: Context,
        staging: Staging,
        *,
        path: PayloadPath,
        dests: Destinations,
        drain: Callable[[int], None],
        prof: Profiler,
        frame_end: Callable[[], None] = lambda: None,
    ):
        self.ctx = ctx
        self.store = ctx.store
        self.staging = staging
        self.path = path
        self.dests = dests
        self.drain = drain
        self.prof = prof
        self.frame_end = frame_end
        self.pending: dict[int, Pending] = {}
        self.outcomes = Outcomes(ctx.store, max_digests=MAX_DIGESTS)
        self.fills = Fills(ctx.store, staging, dests, prof)
        self._files: list[CacheWriter] = []  # cache writers made, some still holding a temporary file
        # where a complete tensor goes: the store, or an open update that publishes it at its switch
        self.publish: Callable[..., None] = self.store.publish
        # with a RELAY: where a complete tensor also goes, proven (name, dtype, shape, host bytes, digest)
        self.forward: Callable[[str, str, tuple[int, ...], Any, bytes | None], None] | None = None

    def _receiving(self) -> None:
        """Tell the cache's writer whether this connection has tensors in flight."""
        if self.ctx.cache is not None:
            self.ctx.cache.behind.receiving(id(self), bool(self.pending))

    def _files_open(self) -> int:
        self._files = [w for w in self._files if w.is_open]
        return len(self._files)

    # -- errors and the barrier ------------------------------------------------------------------

    def guard(self, tid: int, fn: Callable[[Any], None], msg: Any) -> None:
        """Run a request for tensor ``tid``; a failure is kept for the barrier and ``tid`` marked failed."""
        try:
            fn(msg)
        except (RequestError, MemoryFull) as e:
            self.outcomes.error(str(e))
            self.outcomes.mark_failed(tid)

    def barrier(self, flags: int = 0) -> BarrierReply:
        return self.outcomes.barrier(flags)

    def cache_failed(self, e: CacheError) -> None:
        if disk_unusable(e):
            self.ctx.disable_cache(e)

    # -- ALLOC -------------------------------------------------------------------------------------

    def alloc(self, a: Alloc) -> None:
        if a.tensor_id in self.pending:
            raise RequestError(f"tensor id {a.tensor_id} ({a.name!r}) is already in flight")
        if len(self.pending) >= MAX_TENSORS:
            raise RequestError(f"more than {MAX_TENSORS} tensors in flight on one connection")
        if a.name in RESERVED_NAMES:
            raise RequestError(f"{a.name!r} is not a tensor name: safetensors reserves it for the file's metadata")
        if self.ctx.config.slices is not None:  # it holds slices: a whole tensor has no place here
            raise RequestError(f"tensor {a.name!r}: this server holds slices (shard=): send REGIONs, not whole tensors")
        if self.forward is not None and a.digest is None and a.nbytes:
            raise RequestError(f"tensor {a.name!r}: a relayed push names every tensor's digest in its ALLOC")
        p = _charged(self.store, a, pooled=self.staging.pooled, ahead=bool(self.pending))
        # A tensor named by digest may be filled from memory the server already holds: its
        # destination is made when the first byte needs a place, not here.
        if not p.deferred and (a.digest is None or a.nbytes == 0 or not self.store.remembers_digests):
            try:
                self.dests.ensure(p)
            except (RequestError, MemoryFull):
                p.release()
                raise
        self.outcomes.failed.pop(a.tensor_id, None)
        self.pending[a.tensor_id] = p
        self._receiving()
        if p.complete:
            self.dests.ensure(p)
            self._complete(a.tensor_id, p)

    def complete(self, tid: int, p: Pending) -> None:
        """``p`` was filled by other means than its WRITEs (a DELTA applied): publish it."""
        self._complete(tid, p)

    def abandon(self, tid: int, why: str) -> None:
        """Give up on the pending tensor ``tid`` (a DELTA that did not apply), reporting why."""
        p = self.pending.get(tid)
        if p is not None:
            self._abandon(tid, p, why)

    def _abandon(self, tid: int, p: Pending, why: str) -> None:
        """Give up on a pending tensor: free it, report why, and drain its later WRITEs quietly."""
        self.dests.unfault(p)
        del self.pending[tid]
        self._receiving()
        self.outcomes.need.pop(tid, None)
        if p.writer is not None:
            p.writer.abort()
            p.writer = None
        p.release()
        self.outcomes.error(why)
        self.outcomes.mark_failed(tid)

    # -- WRITE ---------------------------------------------------------------------------------------

    def write(self, h: WriteHeader) -> None:
        p = self._writable(h)
        if p is None:
            self.drain(h.length)
            self.frame_end()
            return
        self._choose_writer(p, h)
        try:
            self.path.receive(p, h, self.dests)
        except MemoryFull as e:  # raised before any of the payload was read (the naive path's buffer)
            self._abandon(h.tensor_id, p, str(e))
            self.drain(h.length)
            self.frame_end()
            return
        self.frame_end()  # the frame is proven before any of its bytes count
        self.store.count("bytes_received", h.length)
        self.outcomes.done_bytes += h.length
        p.add(h.offset, h.offset + h.length)
        if p.complete:
            self._complete(h.tensor_id, p)

    def _writable(self, h: WriteHeader) -> Pending | None:
        """The pending tensor ``h`` writes into, its destination made; None (the error kept, the
        tensor abandoned where it cannot go on) when its payload is to be drained."""
        p = self.pending.get(h.tensor_id)
        if p is None or h.offset + h.length > p.nbytes:
            if p is not None:
                self.outcomes.error(
                    f"WRITE [{h.offset}, {h.offset + h.length}) runs past the {p.nbytes} bytes of {p.name!r}"
                )
            elif h.tensor_id not in self.outcomes.failed:  # a failed ALLOC was reported already
                self.outcomes.error(f"WRITE to tensor id {h.tensor_id}, which is not allocated")
            return None
        if not p.can_add(h.offset, h.offset + h.length):
            why = f"tensor {p.name!r}: WRITEs leave more than {MAX_RANGES} separate byte ranges"
            self._abandon(h.tensor_id, p, why)
            return None
        try:
            self.dests.ensure(p)
        except (RequestError, MemoryFull) as e:
            self._abandon(h.tensor_id, p, str(e))
            return None
        return p

    def _choose_writer(self, p: Pending, h: WriteHeader) -> None:
        """Give ``p`` the hash its bytes pass through, at its first WRITE; none out of order."""
        first = p.writer is None and h.offset == 0 and p.hashed == 0
        cache = self.ctx.cache
        if p.digest is not None and cache is not None and first:
            # The bytes of a tensor named by digest are always hashed, to prove them before it is
            # published. Where there is no entry yet, host memory has it written behind, once
            # published (:mod:`~weightlift.remote.server.cache.behind`); a target without host views writes it as the
            # bytes pass, while this connection holds fewer than MAX_OPEN_FILES temporary files.
            missing = not cache.has(p.digest, p.nbytes, wait=False)
            if missing and self.staging.target.memcpy_ok:
                p.behind = not cache.behind.pending(p.digest)
            elif missing and self._files_open() < MAX_OPEN_FILES:
                try:
                    p.writer = cache.writer(p.digest, p.nbytes)
                    self._files.append(p.writer)
                except CacheError as e:
                    self.cache_failed(e)
            if p.writer is None:
                p.writer = DigestCheck(p.digest, p.nbytes, cache.hash_threads)
        elif p.verify and first:
            p.writer = StreamHash(p.nbytes)  # the digest the next barrier reports
        if p.writer is not None and h.offset != p.hashed:  # out of order: cannot hash in one pass
            p.writer.abort()
            p.writer = None

    # -- FILL_FROM_CACHE ------------------------------------------------------------------------------

    def fill(self, f: FillFromCache) -> None:
        p = self.pending.get(f.tensor_id)
        if p is None:
            raise RequestError(f"FILL_FROM_CACHE of tensor id {f.tensor_id}, which is not allocated")
        if p.digest is not None and p.digest != f.digest:
            raise RequestError(f"FILL_FROM_CACHE of {p.name!r} names a digest other than its ALLOC's")
        try:
            if p.dest is None and self.fills.from_memory(p, f.digest):
                self._complete(f.tensor_id, p)
                return
            cache = self.ctx.cache
            if cache is None or not cache.has(f.digest, p.nbytes):
                # nothing cached, or an entry of another size (the client's tensor and the
                # digest disagree): the client sends the bytes; a valid entry stays
                self.outcomes.need[f.tensor_id] = None
                return
            self.dests.ensure(p, fault=False)  # fresh memory: the cache's readers fault it in as they read
            filled = self.fills.from_cache(p, f.digest, cache)  # into a device: through charged staging
        except (RequestError, MemoryFull) as e:  # no memory for it after all: nothing of it stays in flight
            self._abandon(f.tensor_id, p, str(e))
            return
        if not filled:
            p.clear()  # the entry was missing or corrupt and is gone now: ask the client for the bytes
            self.outcomes.need[f.tensor_id] = None
            return
        if p.writer is not None:
            p.writer.abort()
            p.writer = None
        self._complete(f.tensor_id, p)

    # -- completion ---------------------------------------------------------------------------------------

    def _complete(self, tid: int, p: Pending) -> None:
        self.dests.unfault(p)
        del self.pending[tid]
        self._receiving()
        self.outcomes.need.pop(tid, None)  # the bytes came after all: the client need not send them again
        proven, streamed = self._close_writer(p)
        if not proven:
            return
        target = self.staging.target
        relayed = self.forward is not None
        if p.digest is not None and not p.proven and (self.store.remembers_digests or relayed) and target.memcpy_ok:
            # not hashed as it arrived (WRITEs out of order, a cache write that failed): a tensor
            # named by digest is published only with its bytes proven
            if digest_of(target.host_view(p.dest)) != p.digest:
                self._mismatch(p)
                return
            p.proven = True
        if p.verify:
            if streamed is None:
                streamed = p.digest if p.proven and p.digest is not None else _hash_dest(p, self.staging.target)
            self.outcomes.add_verified(tid, streamed)
        dest = target.finish(p.dest)
        if p.charge is None or p.deferred:
            raise AssertionError(f"tensor {p.name!r} completed without a charge")
        cache = self.ctx.cache
        old = self.store.get(p.name)
        if cache is not None and old is not None and old.tensor is not dest:
            cache.behind.drop(old.tensor)  # replaced: an old version's entry is not worth its memory
        del old
        # Read from the publish until its entry's job is queued: an in-place switch of this memory
        # (another client's, once it is visible) waits, then drops the job before it changes a
        # byte. Switched in between, the job would write the new bytes unhashed under p.digest.
        with self.store.reading(dest):
            # a verified tensor's digest is of the bytes stored: the base a later DELTA names
            self.publish(p.name, p.dtype, p.shape, p.nbytes, dest, p.charge, p.digest if p.proven else streamed)
            p.charge = None
            if p.behind and p.proven and cache is not None and p.digest is not None:
                sealed = sealed_since(self.store, p.name, dest, staged=self.publish != self.store.publish)
                if sealed is not None:  # not replaced already by another connection
                    cache.behind.on_error = self.cache_failed
                    cache.behind.submit(p.digest, dest, target.host_view(dest), sealed)
        if self.forward is not None and (p.proven or p.digest is None):
            self.forward(p.name, p.dtype, p.shape, target.host_view(dest), p.digest)
        self.outcomes.done_tensors += 1
        self.prof.count(tensors=1, nbytes=p.nbytes)

    def _close_writer(self, p: Pending) -> tuple[bool, bytes | None]:
        """Finish ``p``'s hash: (False where the bytes that arrived do not match the client's
        digest: the tensor failed, its error kept), and the digest a StreamHash took, or None."""
        if p.writer is None:
            return True, None
        writer, p.writer = p.writer, None
        if p.hashed != p.nbytes:
            writer.abort()
        elif isinstance(writer, StreamHash):
            if p.digest is not None and writer.value != p.digest:  # named by digest: held to it, cache or none
                self._mismatch(p)
                return False, None
            p.proven = p.digest is not None
            return True, writer.value
        else:
            try:
                writer.commit()
                p.proven = True  # the bytes that arrived hash to the digest
            except CacheError as e:
                if not isinstance(e.__cause__, OSError):  # the bytes that arrived are not the bytes the client hashed
                    self._mismatch(p)
                    return False, None
                self.cache_failed(e)
        return True, None

    def _mismatch(self, p: Pending) -> None:
        p.release()
        self.outcomes.error(f"tensor {p.name!r}: the bytes received do not match the digest the client sent")

    def close(self) -> None:
        """The connection ends: stop the faulter (nothing writes into freed memory), drop what is in flight."""
        self.dests.close()  # waits for the pieces in progress
        self.fills.close()
        for p in self.pending.values():
            self.dests.unfault(p)
            if p.writer is not None:
                p.writer.abort()
            p.release()
        self.pending.clear()
        self._receiving()


def _hash_dest(p: Pending, target: Any) -> bytes:
    """The digest of ``p``'s destination, hashed in one pass after the fact: for the tensors
    not hashed as they arrived (written out of order, or empty)."""
    if p.nbytes == 0:
        return piece_hasher().digest()
    if target.memcpy_ok:
        return digest_of(target.host_view(p.dest))
    import torch

    target.synchronize()  # the uploads into it run on the target's stream: all of them landed first
    flat = p.dest.reshape(-1).view(torch.uint8)
    h = piece_hasher()
    for pos in range(0, p.nbytes, STAGING_BYTES):  # a slice at a time: bounded host staging
        h.update(as_bytes(flat[pos : pos + STAGING_BYTES]).data)
    return h.digest()


def _charged(store: Store, a: Alloc, *, pooled: bool, ahead: bool) -> Pending:
    """The tensor ``a`` allocates, charged: whole (in host memory the pages it holds, see
    :func:`~weightlift.memory.pool.held_bytes`), or, when that does not fit and the connection
    has others in flight (``ahead``), its bookkeeping now and its data at its first byte. A client allocates ahead of its writes: an earlier
    tensor still arriving may be about to make the room (a weight update near the limit), and
    if it does not, the tensor fails at its first byte. Nothing is held without a charge."""
    data = held_bytes(a.nbytes) if pooled else a.nbytes
    cost = entry_cost(a.name, data, len(a.shape))
    try:
        return Pending(a, cost, store.charge(cost, a.nbytes if pooled else 0), 0)
    except MemoryFull:
        if not ahead or not a.nbytes:
            raise
        return Pending(a, cost, store.charge(cost - data), data)


# -- what the next barrier reports -----------------------------------------------------------------


class Outcomes:
    """One connection's results since its last barrier; ``failed`` remembers (oldest first) the
    ids whose ALLOC failed, so that their WRITEs are drained without a second error."""

    def __init__(self, store: Store, *, max_digests: int = MAX_DIGESTS):
        self._store = store
        self._max_digests = max_digests
        self.failed: dict[int, None] = {}
        self.errors: list[str] = []
        self.dropped_errors = 0
        self.need: dict[int, None] = {}  # pending ids a FILL_FROM_CACHE could not fill, in order
        self.done_tensors = 0
        self.done_bytes = 0
        # (id, digest) of verified tensors completed since the last barrier, at most MAX_DIGESTS
        self.verified: list[tuple[int, bytes]] = []
        self.verified_dropped = 0

    def error(self, text: str) -> None:
        """Keep an error for the next barrier; past MAX_ERRORS only count it."""
        self._store.count("errors")
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(text[:MAX_MESSAGE])  # the wire cuts it there anyway
        else:
            self.dropped_errors += 1

    def mark_failed(self, tid: int) -> None:
        self.failed.pop(tid, None)
        self.failed[tid] = None
        if len(self.failed) > MAX_TENSORS:  # forget the oldest: at worst one more "not allocated" error
            del self.failed[next(iter(self.failed))]

    def add_verified(self, tid: int, digest: bytes) -> None:
        if len(self.verified) < self._max_digests:
            self.verified.append((tid, digest))
        else:
            self.verified_dropped += 1

    def barrier(self, flags: int = 0) -> BarrierReply:
        """The reply to BARRIER: what completed and failed since the last one, what to resend, and
        (``flags`` asking for them) the digests of the verified tensors that completed."""
        if self.verified_dropped:
            self.error(
                f"{self.verified_dropped} verified tensors completed past the {self._max_digests} one barrier"
                " reports: their digests are lost (send BARRIER more often)"
            )
        errors = self.errors
        if self.dropped_errors:
            errors = errors[: MAX_ERRORS - 1] + [f"... and {self.dropped_errors + 1} more errors"]
        digests = tuple(self.verified) if flags & Barrier.FLAG_DIGESTS else ()
        reply = BarrierReply(self.done_tensors, self.done_bytes, tuple(errors), tuple(self.need), digests)
        self.errors, self.need, self.verified = [], {}, []
        self.dropped_errors = self.done_tensors = self.done_bytes = self.verified_dropped = 0
        return reply


# -- a tensor in flight ----------------------------------------------------------------------------


MAX_RANGES = 4096  # disjoint byte ranges one pending tensor's WRITEs may leave


class Pending:
    """A tensor being filled by one connection: its destination and which bytes have arrived.

    The arrived bytes are kept as sorted, disjoint, non-touching ranges ``[starts[i], ends[i])``;
    a WRITE merges in with two binary searches, so a tensor written in many pieces in any order
    costs O(log n) per WRITE plus the ranges it joins, never a rebuild of the list.
    """

    __slots__ = (
        "name",
        "dtype",
        "shape",
        "nbytes",
        "cost",
        "charge",
        "deferred",
        "dest",
        "digest",
        "starts",
        "ends",
        "writer",
        "hashed",
        "proven",
        "verify",
        "behind",
        "fresh",
    )

    def __init__(self, a: Alloc, cost: int, charge: Charge, deferred: int = 0):
        self.name, self.dtype, self.shape, self.nbytes = a.name, a.dtype, a.shape, a.nbytes
        self.cost = cost
        self.charge: Charge | None = charge  # None once released or published
        self.deferred = deferred  # data bytes not charged yet (allocated while the server was full)
        self.dest: Any = None
        self.digest = a.digest
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.writer: Any = None
        self.hashed = 0
        self.proven = False  # the bytes in dest are known to hash to digest
        self.verify = a.verify  # report the digest of what was stored at the next barrier
        self.behind = False  # its cache entry is to be written behind, from memory, once published
        self.fresh = False  # dest is memory never touched (its pages need faulting in), not reused

    def _span(self, begin: int, end: int) -> tuple[int, int]:
        # Ranges i..j-1 overlap or touch [begin, end): those before i end before it begins,
        # those from j on start after it ends.
        i = bisect_left(self.ends, begin)
        return i, bisect_right(self.starts, end, lo=i)

    def can_add(self, begin: int, end: int) -> bool:
        """Whether adding [begin, end) keeps the ranges within MAX_RANGES."""
        if begin == end or len(self.starts) < MAX_RANGES:
            return True
        i, j = self._span(begin, end)
        return i < j

    def add(self, begin: int, end: int) -> None:
        if begin == end:
            return
        i, j = self._span(begin, end)
        if i < j:
            begin, end = min(begin, self.starts[i]), max(end, self.ends[j - 1])
        self.starts[i:j] = [begin]
        self.ends[i:j] = [end]

    def clear(self) -> None:
        self.starts, self.ends = [], []

    def fill(self) -> None:
        self.starts, self.ends = [0], [self.nbytes]

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.starts, self.ends, strict=False))

    @property
    def complete(self) -> bool:
        return self.nbytes == 0 or (len(self.starts) == 1 and self.starts[0] == 0 and self.ends[0] == self.nbytes)

    def release(self) -> None:
        """Give the tensor's charge back (it will not complete)."""
        if self.charge is not None:
            self.charge.release()
            self.charge = None


def feed(p: Pending, chunk: memoryview, prof: Profiler, on_cache_error: Callable[[CacheError], None]) -> None:
    """Feed bytes that just landed to ``p``'s writer, if it has one; a cache writer that fails is
    dropped (``on_cache_error`` decides whether the cache goes too) and the tensor goes on."""
    if p.writer is None:
        return
    with prof.phase("hash", len(chunk), name=p.name):
        try:
            p.writer.write(chunk)
            p.hashed += len(chunk)
        except CacheError as e:
            p.writer = None
            on_cache_error(e)


# -- a connection's target and its staging ---------------------------------------------------------


STAGING_BYTES = 8 * 1024 * 1024  # one per connection, for targets that are not host memory
PINNED_STAGING = 2 * STAGING_SLOT  # what a default CUDA target pins: two upload slots of STAGING_SLOT


class Staging:
    """Where one connection's tensors go: ``target`` (made, and charged, on first use) and the
    connection's reused staging buffer (:meth:`buffer`). MemoryFull when a charge does not fit."""

    def __init__(self, ctx: Context):
        self._ctx = ctx
        self._target: Target | None = ctx.host_target
        self._buffer: np.ndarray | None = None
        self._charges: list[Charge] = []
        self._pinned = 0

    @property
    def target(self) -> Target:
        if self._target is None:
            target = self._ctx.new_target()
            pinned = target.pinned_bytes()
            if pinned:
                self._ctx.pins.take(pinned)  # the host's cap first: max_memory may count the device
                try:
                    self._charges.append(self._ctx.store.charge(pinned))
                except BaseException:
                    self._ctx.pins.give(pinned)
                    raise
                self._pinned = pinned
            self._target = target
        return self._target

    @property
    def pooled(self) -> bool:
        """Whether this connection's tensors land in the server's pooled host memory (checked
        without making a CUDA target)."""
        return self._ctx.pooled and self._target is self._ctx.host_target

    def buffer(self) -> np.ndarray:
        """The connection's staging buffer (reused, never zero-filled)."""
        if self._buffer is None:
            self._charges.append(self._ctx.store.charge(STAGING_BYTES))
            self._buffer = np.empty(STAGING_BYTES, dtype=np.uint8)
        return self._buffer

    def close(self) -> None:
        """The connection ended: its staging memory goes back to the account."""
        for c in self._charges:
            c.release()
        self._charges.clear()
        if self._pinned:
            self._ctx.pins.give(self._pinned)
            self._pinned = 0


# -- destinations ----------------------------------------------------------------------------------


# A bf16 or fp8 destination is a numpy array of an ml_dtypes type, and importing ml_dtypes takes
# about half a second: a server pays it when it starts, not inside its first push.
with contextlib.suppress(ImportError):
    import ml_dtypes  # noqa: F401

FAULT_PIECE = 4 * 1024 * 1024  # fresh destination memory is faulted in this much at a time by the helpers ...
FAULT_WINDOW = 64 * 1024 * 1024  # ... at most this far ahead of the bytes received (weightlift.memory.faulter)


class Destinations:
    """One connection's destination maker; ``fault_ahead`` False (the naive path) never starts
    the faulter."""

    def __init__(self, ctx: Context, staging: Staging, *, fault_ahead: bool):
        self._ctx = ctx
        self._staging = staging
        self._fault_ahead = fault_ahead
        self.piece, self.window = FAULT_PIECE, FAULT_WINDOW  # as they are when the connection starts
        self.faulter: Faulter | None = None  # made at the first fresh destination

    def ready(self, p: Pending, begin: int, end: int) -> bool:
        """Whether ``p``'s bytes [begin, end) need no faulting in: reused memory (a weight
        update landing in the pool's touched pages), or pages the faulter has reached."""
        return not p.fresh or (self.faulter is not None and self.faulter.ready(p, begin, end))

    def ensure(self, p: Pending, *, fault: bool = True) -> None:
        """Give ``p`` its destination (RequestError, or MemoryFull for a deferred charge)."""
        if p.dest is not None:
            return
        self.charge(p)
        fresh = False
        try:
            if self._staging.pooled:
                raw, fresh = self._ctx.store.take_host(p.nbytes)
                p.dest = view_as(raw, p.dtype, p.shape, self._ctx.config.framework)
            else:
                p.dest = self._staging.target.empty(p.dtype, p.shape)
            # the target's own memory is, as far as anyone here knows, never touched
            p.fresh = fresh or not self._staging.pooled
        except Exception as e:  # ENOMEM from mmap, numpy on an absurd shape, torch out of memory, no device
            raise RequestError(
                f"cannot allocate {p.name!r} ({p.dtype} {p.shape}, {p.nbytes} bytes): {type(e).__name__}: {e}"
            ) from None
        if fresh and fault and self._fault_ahead and fill_policy().helpers > 0:
            if self.faulter is None:
                self.faulter = Faulter(threads=fill_policy().helpers, piece=self.piece, window=self.window)
            self.faulter.add(p, raw)

    def charge(self, p: Pending) -> None:
        """Count the data of a tensor allocated while the server was full against max_memory now."""
        if p.deferred and p.charge is not None:
            p.charge.grow(p.deferred, p.nbytes if self._staging.pooled and p.nbytes >= POOL_MIN else 0)
            p.deferred = 0

    def unfault(self, p: Pending) -> None:
        """Stop faulting ``p``'s memory in (waiting for a piece in progress): before the memory
        is freed or filled by anything but the direct receive."""
        if self.faulter is not None:
            self.faulter.cancel(p)

    def close(self) -> None:
        """Stop the faulter, waiting for the pieces in progress (nothing writes into freed memory)."""
        if self.faulter is not None:
            self.faulter.close()


# -- the receive paths: a WRITE's payload from the socket to its tensor ----------------------------


HASH_PIECE = 4 * 1024 * 1024  # received-then-hashed piece: still in the CPU cache when hashed


class Wire:
    """What a receive path needs of its connection: ``payload(view)`` fills ``view`` with the
    next payload bytes from the socket; ``on_cache_error`` hears of a cache writer that failed."""

    def __init__(
        self,
        payload: Callable[[memoryview], None],
        staging: Staging,
        store: Store,
        prof: Profiler,
        on_cache_error: Callable[[CacheError], None],
    ):
        self.payload = payload
        self.staging = staging
        self.store = store
        self.prof = prof
        self.on_cache_error = on_cache_error

    def receive(self, view: memoryview, name: str) -> None:
        with self.prof.phase("wire", len(view), name=name):
            self.payload(view)

    def feed(self, p: Pending, chunk: memoryview) -> None:
        feed(p, chunk, self.prof, self.on_cache_error)


class PayloadPath(Protocol):
    """One way to receive a WRITE's payload into its pending tensor (its destination made)."""

    #: whether fresh destinations are faulted in ahead of the bytes by helper threads
    fault_ahead: bool

    def receive(self, p: Pending, h: WriteHeader, dests: Destinations) -> None: ...


class DirectPath:
    """Straight into host memory, or through the staging buffer into the target's fill."""

    fault_ahead = True

    def __init__(self, wire: Wire):
        self._wire = wire

    def receive(self, p: Pending, h: WriteHeader, dests: Destinations) -> None:
        if self._wire.staging.target.memcpy_ok:
            self._direct(p, h, dests)
        else:
            self._staged(p, h)

    def _direct(self, p: Pending, h: WriteHeader, dests: Destinations) -> None:
        wire = self._wire
        dest = wire.staging.target.host_view(p.dest)
        # Fresh memory is faulted in ahead of the socket by the faulter's helpers; a piece they
        # have not reached is faulted here first or by recv_into itself, whichever this
        # machine's fill policy found faster (weightlift.memory.fresh). Pieces end on
        # the boundaries of the faulter's pieces.
        step = HASH_PIECE if p.writer is not None else dests.piece
        pos, end = h.offset, h.offset + h.length
        while pos < end:
            stop = min(end, (pos // step + 1) * step)
            piece = dest[pos:stop]
            with wire.prof.phase("stage", name="fault-in " + p.name):
                if not dests.ready(p, pos, stop):
                    populate(piece)
            wire.receive(piece, p.name)
            wire.feed(p, piece)
            pos = stop

    def _staged(self, p: Pending, h: WriteHeader) -> None:
        # through the target's stager: a CUDA target's pinned slots, filled by the receive and
        # uploaded asynchronously; else the connection's one staging buffer, made when first used
        wire = self._wire
        stager = wire.staging.target.stager(wire.staging.buffer)
        pos = 0
        while pos < h.length:
            buf = stager.take(h.length - pos)
            chunk = buf.data
            wire.receive(chunk, p.name)
            wire.feed(p, chunk)
            with wire.prof.phase("device", len(buf), name=p.name):
                stager.land(p.dest, h.offset + pos)
            pos += len(buf)


# -- fills from memory or the disk cache -----------------------------------------------------------


class Fills:
    """One connection's fills: ``from_memory`` and ``from_cache`` fill ``p`` and say whether they could."""

    def __init__(self, store: Store, staging: Staging, dests: Destinations, prof: Profiler):
        self._store = store
        self._staging = staging
        self._dests = dests
        self._prof = prof
        self._readers: Readers | None = None  # made at the first cache read large enough to share

    def close(self) -> None:
        """The connection ends: its reader threads go (no read is in progress)."""
        if self._readers is not None:
            self._readers.close()
            self._readers = None

    def from_memory(self, p: Pending, digest: bytes) -> bool:
        """Fill ``p`` from a tensor the server holds whose bytes were proven to hash to
        ``digest``. An entry handed out writable (see :meth:`Store.tensors`) is hashed again
        first: a reader may have written into it since. One nobody could write into still holds
        the bytes it was proven to hold."""
        store, prof = self._store, self._prof
        if not store.remembers_digests or not self._staging.pooled:
            return False  # host memory only (and no device is touched to find out)
        target = self._staging.target
        for name, e in store.candidates(p.name, digest):
            if e.digest != digest or e.nbytes != p.nbytes:
                continue
            src = np.frombuffer(target.host_view(e.tensor), dtype=np.uint8)
            sealed = not e.exposed  # nobody outside the server could have written into it
            if not sealed:
                with prof.phase("hash", p.nbytes, name="verify " + p.name):
                    ok = digest_of(src) == digest
                if not ok:  # written since it arrived: no longer proof of anything
                    store.distrust(name, e, digest)
                    continue
            if name == p.name and e.dtype == p.dtype and e.shape == p.shape:
                self._dests.charge(p)
                p.dest = e.tensor  # already there: publish the same memory again
            else:
                self._dests.ensure(p, fault=False)
                # read as a READ reads: an in-place switch of that memory waits for the copy, and
                # one that came after the entry was chosen made it another entry (other bytes)
                with store.reading(e.tensor), prof.phase("stage", p.nbytes, name="copy " + p.name):
                    if store.get(name) is not e:
                        continue
                    dst = np.frombuffer(target.host_view(p.dest), dtype=np.uint8)
                    dst[:] = src  # a user-space copy faults fresh pages itself as cheaply as anything
                if not sealed and digest_of(dst) != digest:  # the source changed under the copy: prove what landed
                    continue
            p.fill()
            p.proven = True
            store.count("memory_hits")
            store.count("bytes_from_memory", p.nbytes)
            return True
        return False

    def from_cache(self, p: Pending, digest: bytes, cache: TensorCache) -> bool:
        """Fill ``p`` (its destination made) from the cache entry of ``digest``; False when the
        entry was missing or corrupt (it is gone now: the client sends the bytes). The readers
        fault fresh memory in themselves."""
        # A destination made at ALLOC went to the faulter, whose helpers write into the pages
        # they fault: it leaves the faulter (running pieces waited for) before any byte lands,
        # or a helper could overwrite bytes already read and hashed.
        self._dests.unfault(p)
        target = self._staging.target
        with self._prof.phase("read", p.nbytes, name=p.name):
            try:
                if target.memcpy_ok:
                    dest = target.host_view(p.dest)

                    def before(begin: int, end: int) -> None:
                        # fresh pages are faulted in by whichever reader fills them, just before
                        # its preadv (where the fill policy says that beats faulting inside it)
                        populate(dest[begin:end])

                    if self._readers is None and p.nbytes >= PARALLEL_READ_MIN:
                        self._readers = reader_pool()
                    cache.read_into(digest, dest, before=before if p.fresh else None, readers=self._readers)
                else:
                    cache.read_into_target(
                        digest,
                        p.nbytes,
                        lambda off, chunk: target.write(p.dest, off, chunk),
                        self._staging.buffer().data,
                    )
            except CacheError:
                return False
        self._store.count("cache_hits")
        self._store.count("bytes_from_cache", p.nbytes)
        p.fill()
        p.proven = True  # read_into verified the entry against this digest
        return True


# -- the naive receive path, for A/B runs (WEIGHTLIFT_LOAD_OPT=0) ----------------------------------


class NaivePath:
    """Each WRITE into a fresh buffer (charged while it lives), hashed, then written into place."""

    fault_ahead = False

    def __init__(self, wire: Wire):
        self._wire = wire

    def receive(self, p: Pending, h: WriteHeader, dests: Destinations) -> None:
        """MemoryFull, before any byte is read, when the buffer does not fit under max_memory."""
        wire = self._wire
        charge = wire.store.charge(h.length)
        try:
            buf = bytearray(h.length)  # a fresh, zero-filled buffer per message, as the naive path did
            wire.receive(memoryview(buf), p.name)
            wire.feed(p, memoryview(buf))
            with wire.prof.phase("stage", h.length, name=p.name):
                wire.staging.target.write(p.dest, h.offset, buf)
            del buf
        finally:
            charge.release()


def _unplaced(model: str, names: tuple[str, ...]) -> str | None:
    """Why REGIONs (or an EXPECT) of ``names`` cannot go into the assembly, which keeps the
    default model's tensors under their own names (None: they can). A named model's would land
    in the default one; a name beginning with NUL would land in another model's namespace."""
    if model:
        return f'model {model!r}: REGIONs fill the default model only (MODEL "" first)'
    bad = next((n for n in names if n.startswith("\x00")), None)
    return None if bad is None else f"tensor {bad!r}: a tensor name cannot begin with NUL"


class Regions:
    """One connection's REGIONs into the server's shared :class:`~.store.Assembly` (None: the
    server holds no slices, and every REGION is refused). Refusals wait for the next SKETCH."""

    def __init__(
        self,
        assembly: Assembly | None,
        store: Store,
        payload: Callable[[memoryview], None],
        drain: Callable[[int], None],
        frame_end: Callable[[], None],
    ):
        self.assembly, self.store = assembly, store
        self._payload, self._drain, self._frame_end = payload, drain, frame_end
        self.errors: list[str] = []
        self.dropped = 0

    def _refuse(self, m: Region, why: str) -> None:
        self._error(why)
        self._drain(m.length)
        self._frame_end()

    def region(self, m: Region, model: str = "") -> None:
        a = self.assembly
        if a is None:
            self._refuse(m, f"tensor {m.name!r}: this server holds no slices (started without shard=)")
            return
        why = _unplaced(model, (m.name,))
        if why is not None:
            self._refuse(m, why)
            return
        box = tuple(zip(m.start, m.stop, strict=True))
        try:
            b, dest = a.claim(m.name, m.dtype, m.shape, box, id(self))
        except RegionRefused as e:
            self._refuse(m, str(e))
            return
        charge = None
        if m.length and not dest.flags.c_contiguous:  # staged whole, then scattered: charged as WRITE's staging
            try:
                charge = self.store.charge(m.length)
            except MemoryFull as e:
                a.release(m.name, b, box)
                self._refuse(m, f"tensor {m.name!r}: staging a box of {m.length} bytes: {e}")
                return
        try:
            try:
                if m.length and dest.flags.c_contiguous:  # one byte range of the slice: straight in
                    flat = dest.reshape(-1).view(np.uint8)
                    self._payload(flat.data)
                    landed = dest
                else:
                    staged = np.empty(m.length, np.uint8)
                    if m.length:
                        self._payload(staged.data)
                    landed = staged.view(dest.dtype).reshape(dest.shape)
                self._frame_end()  # the frame is proven before any of its bytes count
            except BaseException:
                a.release(m.name, b, box)
                raise
            if landed is not dest:
                dest[...] = landed
            sketch = a.slices.sketch(landed, m.shape, box, m.name) if m.length else 0
        finally:
            if charge is not None:
                charge.release()  # the staged copy is dropped as this returns
        self.store.count("bytes_received", m.length)
        a.landed(m.name, b, m.length, sketch)

    def close(self) -> None:
        """The connection closed: what it alone was building is abandoned (:meth:`Assembly.leave`)."""
        if self.assembly is not None:
            self.assembly.leave(id(self))

    def _error(self, why: str) -> None:
        self.store.count("errors")
        if len(self.errors) < MAX_ERRORS - 1:
            self.errors.append(why[:MAX_MESSAGE])
        else:
            self.dropped += 1

    def expect(self, m: Expect, model: str = "") -> None:
        if self.assembly is None:
            self._error("EXPECT: this server holds no slices (started without shard=)")
            return
        why = _unplaced(model, m.names)
        if why is not None:
            self._error(f"EXPECT: {why}")
            return
        try:
            self.assembly.expect(m.names, id(self), hold=bool(m.flags & Expect.FLAG_HOLD), set_id=m.set_id)
        except RegionRefused as e:
            self._error(str(e))

    def switch(self, m: Switch) -> SwitchReply:
        """SWITCH: the held set switched in (or dropped, ABORT) at once, or why not, nothing changed."""
        if self.assembly is None:
            return SwitchReply(False, message="SWITCH: this server holds no slices (started without shard=)")
        try:
            tensors, generation = self.assembly.switch(m.set_id, abort=bool(m.flags & Switch.FLAG_ABORT))
        except RegionRefused as e:
            return SwitchReply(False, message=str(e)[:MAX_MESSAGE])
        return SwitchReply(True, tensors, generation)

    def sketch(self, m: SketchRequest) -> SketchReply:
        entries = []
        room = MAX_SKETCH_BYTES  # the reply stays within every client's frame limit
        a = self.assembly
        for e in a.status(m.names) if a is not None else ():
            room -= SKETCH_ENTRY_LAYOUT.size + 2 + len(e.name.encode("utf-8", "surrogatepass"))
            if room < 0:
                break
            entries.append(a.resketch(e) if a is not None and m.flags & SketchRequest.FLAG_RECOMPUTE else e)
        errors, self.errors = self.errors, []
        if self.dropped:
            errors.append(f"and {self.dropped} more refused regions")
            self.dropped = 0
        state, set_id = a.set_state() if a is not None else (SketchReply.SET_NONE, 0)
        return SketchReply(tuple(entries), tuple(errors), state, set_id)
