"""Receiving tensors on one connection: ALLOC, WRITE and FILL_FROM_CACHE, until each completes.

Theory of operation. An ALLOC charges the tensor's cost to the store and, unless the tensor may be
filled from memory the server already holds, makes its destination at once: pooled or fresh host
memory, or the target's own (a CUDA tensor). Fresh host memory goes to this connection's
:class:`~weightlift.memory.faulter.Faulter`, whose helper threads fault it in ahead of the bytes.
Each WRITE is read from the socket as a stream: straight into the destination where a plain
memcpy is the right fill (host memory), else through one reused staging buffer into the target's
own fill step; with a disk cache the bytes are hashed as they pass, and so are the bytes of a
tensor ALLOCated with VERIFY (one hash serves both). A tensor whose byte ranges cover it is
complete: its cache entry is committed (proving its digest) and the store publishes it. Errors
are kept for the next BARRIER, whose reply also names the tensors a FILL could not fill (the
client sends their bytes instead) and, when asked, the digests of the verified tensors that
completed.
"""

from __future__ import annotations

import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from typing import Any

import blake3
import numpy as np

from weightlift.digest.blake import PARALLEL_HASH_MIN, byte_view, hash_buffer
from weightlift.errors import CacheError
from weightlift.memory.faulter import Faulter
from weightlift.memory.fresh import policy as fill_policy
from weightlift.memory.pool import POOL_MIN, size_class
from weightlift.memory.targets import CudaTarget, Target, populate, view_as
from weightlift.profile import Profiler
from weightlift.remote.protocol import (
    MAX_DIGESTS,
    MAX_ERRORS,
    MAX_MESSAGE,
    MAX_TENSORS,
    Alloc,
    Barrier,
    BarrierReply,
    FillFromCache,
    WriteHeader,
)
from weightlift.remote.server import legacy
from weightlift.remote.server.cache import CacheWriter, DigestCheck, disk_unusable
from weightlift.remote.server.context import Context, RequestError
from weightlift.remote.server.store import Charge, MemoryFull, entry_cost

__all__ = [
    "Pending",
    "Receiver",
    "StreamHash",
    "HASH_PIECE",
    "FAULT_PIECE",
    "FAULT_WINDOW",
    "MAX_RANGES",
    "STAGING_BYTES",
]

STAGING_BYTES = 8 * 1024 * 1024  # one per connection, for targets that are not host memory
HASH_PIECE = 4 * 1024 * 1024  # received-then-hashed piece: still in the CPU cache when hashed
FAULT_PIECE = 4 * 1024 * 1024  # fresh destination memory is faulted in this much at a time by the helpers ...
FAULT_WINDOW = 64 * 1024 * 1024  # ... at most this far ahead of the bytes received (weightlift.memory.faulter)
MAX_RANGES = 4096  # disjoint byte ranges one pending tensor's WRITEs may leave
MAX_OPEN_FILES = 8  # cache temporary files one connection holds open at once (tensors in flight by digest)
RESERVED_NAMES = frozenset({"__metadata__"})  # names a pulled safetensors file could not hold


class StreamHash:
    """The digest of bytes fed in order, for a tensor ALLOCated with VERIFY that no cache writer
    hashes: the same ``write``, ``commit`` and ``abort`` as one, and ``value`` at the end."""

    def __init__(self, length: int):
        self.length = length
        self._hasher: Any = None
        self.is_open = True

    def write(self, buf: Any) -> None:
        view = byte_view(buf)
        if self._hasher is None:  # as for the cache: threads pay only on large pieces
            big = min(self.length, view.nbytes) >= PARALLEL_HASH_MIN
            self._hasher = blake3.blake3(max_threads=blake3.blake3.AUTO if big else 1)
        self._hasher.update(view)

    def commit(self) -> None:
        self.is_open = False

    def abort(self) -> None:
        self.is_open = False

    @property
    def value(self) -> bytes:
        return (self._hasher or blake3.blake3()).digest()


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


class Receiver:
    """Everything one connection has in flight, and what its next BARRIER reports.

    ``payload(view)`` fills ``view`` with the next payload bytes of the current frame from the
    socket; ``scratch`` is the connection's buffer for payloads nobody keeps; ``target()`` and
    ``staging()`` are the connection's destination maker and its reused staging buffer;
    ``pooled()`` says whether its tensors land in the store's pooled host memory;
    ``frame_end()`` runs once a WRITE's payload is in, before any of it counts (the connection
    checks the frame's MAC there).
    """

    def __init__(
        self,
        ctx: Context,
        *,
        payload: Callable[[memoryview], None],
        scratch: memoryview,
        target: Callable[[], Target],
        pooled: Callable[[], bool],
        staging: Callable[[], memoryview],
        prof: Profiler,
        frame_end: Callable[[], None] = lambda: None,
    ):
        self.ctx = ctx
        self.store = ctx.store
        self.payload = payload
        self._scratch = scratch
        self._target = target
        self._pooled = pooled
        self._staging = staging
        self.prof = prof
        self.frame_end = frame_end
        self.pending: dict[int, Pending] = {}
        self.failed: dict[int, None] = {}  # ids whose ALLOC failed (oldest first): their WRITEs are drained quietly
        self.errors: list[str] = []
        self.dropped_errors = 0
        self.need: dict[int, None] = {}  # pending ids a FILL_FROM_CACHE could not fill, in order
        self.done_tensors = 0
        self.done_bytes = 0
        # (id, digest) of verified tensors completed since the last barrier, at most MAX_DIGESTS
        self.verified: list[tuple[int, bytes]] = []
        self.verified_dropped = 0
        self._faulter: Faulter | None = None  # made at the first fresh destination
        self._files: list[CacheWriter] = []  # cache writers made, some still holding a temporary file

    def _files_open(self) -> int:
        self._files = [w for w in self._files if w.is_open]
        return len(self._files)

    def _wire(self, view: memoryview, name: str) -> None:
        if self.prof.enabled:
            t0 = time.perf_counter_ns()
            self.payload(view)
            self.prof.record("wire", t0, time.perf_counter_ns(), len(view), name=name)
        else:
            self.payload(view)

    def drain(self, n: int) -> None:
        """Read and discard ``n`` payload bytes (a WRITE nobody will keep)."""
        while n:
            chunk = self._scratch[: min(n, len(self._scratch))]
            self.payload(chunk)
            n -= len(chunk)

    @property
    def target(self) -> Target:
        return self._target()

    # -- errors and the barrier ------------------------------------------------------------------

    def guard(self, tid: int, fn: Callable[[Any], None], msg: Any) -> None:
        """Run a request for tensor ``tid``; a failure is kept for the barrier and ``tid`` marked failed."""
        try:
            fn(msg)
        except (RequestError, MemoryFull) as e:
            self.error(str(e))
            self._mark_failed(tid)

    def _mark_failed(self, tid: int) -> None:
        self.failed.pop(tid, None)
        self.failed[tid] = None
        if len(self.failed) > MAX_TENSORS:  # forget the oldest: at worst one more "not allocated" error
            del self.failed[next(iter(self.failed))]

    def error(self, text: str) -> None:
        """Keep an error for the next barrier; past MAX_ERRORS only count it."""
        self.store.count("errors")
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(text[:MAX_MESSAGE])  # the wire cuts it there anyway
        else:
            self.dropped_errors += 1

    def barrier(self, flags: int = 0) -> BarrierReply:
        """The reply to BARRIER: what completed and failed since the last one, what to resend, and
        (``flags`` asking for them) the digests of the verified tensors that completed."""
        if self.verified_dropped:
            self.error(
                f"{self.verified_dropped} verified tensors completed past the {MAX_DIGESTS} one barrier"
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

    # -- ALLOC -------------------------------------------------------------------------------------

    def alloc(self, a: Alloc) -> None:
        if a.tensor_id in self.pending:
            raise RequestError(f"tensor id {a.tensor_id} ({a.name!r}) is already in flight")
        if len(self.pending) >= MAX_TENSORS:
            raise RequestError(f"more than {MAX_TENSORS} tensors in flight on one connection")
        if a.name in RESERVED_NAMES:
            raise RequestError(f"{a.name!r} is not a tensor name: safetensors reserves it for the file's metadata")
        pooled = self._pooled() and a.nbytes >= POOL_MIN
        data = size_class(a.nbytes) if pooled else a.nbytes  # a pooled tensor holds whole huge pages
        cost = entry_cost(a.name, data, len(a.shape))
        try:
            charge = self.store.charge(cost, a.nbytes if pooled else 0)
            deferred = 0
        except MemoryFull:
            # A client allocates ahead of its writes: while an earlier tensor of this connection
            # is still arriving, its old version may be about to make the room (a weight update
            # near the limit). Its bookkeeping is charged now, its data at its first byte, and
            # it fails there. Nothing a client allocates is ever held without a charge.
            if not self.pending or not a.nbytes:
                raise
            charge = self.store.charge(cost - data)
            deferred = data
        p = Pending(a, cost, charge, deferred)
        # A tensor named by digest may be filled from memory the server already holds: its
        # destination is made when the first byte needs a place, not here.
        if not deferred and (a.digest is None or a.nbytes == 0 or not self.store.remembers_digests):
            try:
                self._ensure_dest(p)
            except (RequestError, MemoryFull):
                p.release()
                raise
        self.failed.pop(a.tensor_id, None)
        self.pending[a.tensor_id] = p
        if p.complete:
            self._ensure_dest(p)
            self._complete(a.tensor_id, p)

    def _ensure_dest(self, p: Pending, *, fault: bool = True) -> None:
        """Give ``p`` its destination: pooled or fresh host memory, or the target's own.

        Fresh host memory that the socket will fill directly goes to this connection's faulter
        at once, so that it is faulted in ahead of the bytes - across tensors, the next
        tensor's memory while this one's bytes arrive (a client sends ALLOCs ahead of WRITEs).
        """
        if p.dest is not None:
            return
        self._charge(p)
        fresh = False
        try:
            if self._pooled():
                raw, fresh = self.store.take_host(p.nbytes)
                p.dest = view_as(raw, p.dtype, p.shape, self.ctx.framework)
            else:
                p.dest = self.target.empty(p.dtype, p.shape)
        except Exception as e:  # ENOMEM from mmap, numpy on an absurd shape, torch out of memory, no device
            raise RequestError(
                f"cannot allocate {p.name!r} ({p.dtype} {p.shape}, {p.nbytes} bytes): {type(e).__name__}: {e}"
            ) from None
        if fresh and fault and self.ctx.opt and fill_policy().helpers > 0:
            if self._faulter is None:
                self._faulter = Faulter(threads=fill_policy().helpers, piece=FAULT_PIECE, window=FAULT_WINDOW)
            self._faulter.add(p, raw)

    def _charge(self, p: Pending) -> None:
        """Count the data of a tensor allocated while the server was full against max_memory now."""
        if p.deferred and p.charge is not None:
            p.charge.grow(p.deferred, p.nbytes if self._pooled() and p.nbytes >= POOL_MIN else 0)
            p.deferred = 0

    def _unfault(self, p: Pending) -> None:
        """Stop faulting ``p``'s memory in (waiting for a piece in progress): before the memory
        is freed or filled by anything but :meth:`_receive_direct`."""
        if self._faulter is not None:
            self._faulter.cancel(p)

    def _abandon(self, tid: int, p: Pending, why: str) -> None:
        """Give up on a pending tensor: free it, report why, and drain its later WRITEs quietly."""
        self._unfault(p)
        del self.pending[tid]
        self.need.pop(tid, None)
        if p.writer is not None:
            p.writer.abort()
            p.writer = None
        p.release()
        self.error(why)
        self._mark_failed(tid)

    # -- WRITE ---------------------------------------------------------------------------------------

    def write(self, h: WriteHeader) -> None:
        p = self.pending.get(h.tensor_id)
        if p is None or h.offset + h.length > p.nbytes:
            if p is not None:
                self.error(f"WRITE [{h.offset}, {h.offset + h.length}) runs past the {p.nbytes} bytes of {p.name!r}")
            elif h.tensor_id not in self.failed:  # a failed ALLOC was reported already
                self.error(f"WRITE to tensor id {h.tensor_id}, which is not allocated")
            self.drain(h.length)
            self.frame_end()
            return
        if not p.can_add(h.offset, h.offset + h.length):
            self._abandon(
                h.tensor_id, p, f"tensor {p.name!r}: WRITEs leave more than {MAX_RANGES} separate byte ranges"
            )
            self.drain(h.length)
            self.frame_end()
            return
        try:
            self._ensure_dest(p)
        except (RequestError, MemoryFull) as e:
            self._abandon(h.tensor_id, p, str(e))
            self.drain(h.length)
            self.frame_end()
            return
        cache = self.ctx.cache
        if p.digest is not None and cache is not None and p.writer is None and h.offset == 0 and p.hashed == 0:
            # The bytes of a tensor named by digest are always hashed, to prove them before it is
            # published; into a new cache entry where there is none yet and this connection
            # holds fewer than MAX_OPEN_FILES temporary files, else only hashed.
            if not cache.has(p.digest, p.nbytes) and self._files_open() < MAX_OPEN_FILES:
                try:
                    p.writer = cache.writer(p.digest, p.nbytes)
                    self._files.append(p.writer)
                except CacheError as e:
                    self._cache_failed(e)
            if p.writer is None:
                p.writer = DigestCheck(p.digest, p.nbytes, cache.hash_threads)
        elif p.verify and p.writer is None and h.offset == 0 and p.hashed == 0:
            p.writer = StreamHash(p.nbytes)  # the digest the next barrier reports
        if p.writer is not None and h.offset != p.hashed:  # out of order: cannot hash in one pass
            p.writer.abort()
            p.writer = None
        if not self.ctx.opt:
            legacy.receive_naive(self, p, h)
        elif self.target.memcpy_ok:
            self._receive_direct(p, h)
        else:
            self._receive_staged(p, h)
        self.frame_end()  # the frame is proven before any of its bytes count
        self.store.count("bytes_received", h.length)
        self.done_bytes += h.length
        p.add(h.offset, h.offset + h.length)
        if p.complete:
            self._complete(h.tensor_id, p)

    def hash(self, p: Pending, chunk: memoryview) -> None:
        """Feed received bytes to ``p``'s cache writer, if it has one."""
        if p.writer is None:
            return
        t0 = time.perf_counter_ns() if self.prof.enabled else 0
        try:
            p.writer.write(chunk)
            p.hashed += len(chunk)
        except CacheError as e:
            p.writer = None
            self._cache_failed(e)
        if self.prof.enabled:
            self.prof.record("hash", t0, time.perf_counter_ns(), len(chunk), name=p.name)

    def _receive_direct(self, p: Pending, h: WriteHeader) -> None:
        dest = self.target.host_view(p.dest)
        # Fresh memory is faulted in ahead of the socket by the faulter's helpers (see
        # _ensure_dest); a piece they have not reached is faulted here first or by recv_into
        # itself, whichever this machine's fill policy found faster (weightlift.memory.fresh).
        # Pieces end on FAULT_PIECE boundaries of the tensor, the faulter's pieces.
        step = HASH_PIECE if p.writer is not None else FAULT_PIECE
        pos, end = h.offset, h.offset + h.length
        while pos < end:
            stop = min(end, (pos // step + 1) * step)
            piece = dest[pos:stop]
            t0 = time.perf_counter_ns() if self.prof.enabled else 0
            if self._faulter is None or not self._faulter.ready(p, pos, stop):
                populate(piece)
            if self.prof.enabled:
                self.prof.record("stage", t0, time.perf_counter_ns(), 0, name="fault-in " + p.name)
            self._wire(piece, p.name)
            self.hash(p, piece)
            pos = stop

    def _receive_staged(self, p: Pending, h: WriteHeader) -> None:
        target = self.target
        stage = self._staging()
        flat = None
        cuda = target if isinstance(target, CudaTarget) and target.dtype is None else None
        if cuda is not None:
            import torch

            flat = p.dest.reshape(-1).view(torch.uint8)
        pos = 0
        while pos < h.length:
            off = h.offset + pos
            if cuda is not None:  # receive straight into the target's pinned slot, then upload async
                slot, buf = cuda.slot()
                n = min(len(buf), h.length - pos)
                chunk = buf.data[:n]
            else:
                n = min(len(stage), h.length - pos)
                chunk = stage[:n]
            self._wire(chunk, p.name)
            self.hash(p, chunk)
            t0 = time.perf_counter_ns() if self.prof.enabled else 0
            if cuda is not None and flat is not None:
                cuda.upload(slot, flat[off : off + n], n)
            else:
                target.write(p.dest, off, chunk)
            if self.prof.enabled:
                self.prof.record("device", t0, time.perf_counter_ns(), n, name=p.name)
            pos += n

    # -- FILL_FROM_CACHE ------------------------------------------------------------------------------

    def fill(self, f: FillFromCache) -> None:
        p = self.pending.get(f.tensor_id)
        if p is None:
            raise RequestError(f"FILL_FROM_CACHE of tensor id {f.tensor_id}, which is not allocated")
        if p.digest is not None and p.digest != f.digest:
            raise RequestError(f"FILL_FROM_CACHE of {p.name!r} names a digest other than its ALLOC's")
        try:
            if p.dest is None and self._fill_from_memory(p, f.digest):
                self._complete(f.tensor_id, p)
                return
            cache = self.ctx.cache
            if cache is None or not cache.has(f.digest, p.nbytes):
                # nothing cached, or an entry of another size (the client's tensor and the
                # digest disagree): the client sends the bytes; a valid entry stays
                self.need[f.tensor_id] = None
                return
            self._ensure_dest(p)  # fresh memory: the helpers fault it in ahead of the reads below
        except (RequestError, MemoryFull) as e:  # no memory for it after all: nothing of it stays in flight
            self._abandon(f.tensor_id, p, str(e))
            return
        t0 = time.perf_counter_ns() if self.prof.enabled else 0
        try:
            if self.target.memcpy_ok:
                dest = self.target.host_view(p.dest)

                def before(begin: int, end: int) -> None:
                    # as for recv_into: fresh pages faulted inside readinto cost more
                    if self._faulter is None or not self._faulter.ready(p, begin, end):
                        populate(dest[begin:end])

                cache.read_into(f.digest, dest, before=before)
            else:
                cache.read_into_target(
                    f.digest, p.nbytes, lambda off, chunk: self.target.write(p.dest, off, chunk), self._staging()
                )
        except CacheError:
            # The entry was missing or corrupt and is gone now: ask the client for the bytes.
            p.clear()
            self.need[f.tensor_id] = None
            return
        if self.prof.enabled:
            self.prof.record("read", t0, time.perf_counter_ns(), p.nbytes, name=p.name)
        self.store.count("cache_hits")
        self.store.count("bytes_from_cache", p.nbytes)
        p.fill()
        p.proven = True  # read_into verified the entry against this digest
        if p.writer is not None:
            p.writer.abort()
            p.writer = None
        self._complete(f.tensor_id, p)

    def _fill_from_memory(self, p: Pending, digest: bytes) -> bool:
        """Fill ``p`` from a tensor the server holds whose bytes were proven to hash to
        ``digest``: the same name (a second push of unchanged weights keeps the very same
        memory, no copy) or another name (one copy). An entry handed out writable (see
        :meth:`Store.tensors`) is hashed again first: a reader may have written into it since.
        One nobody could write into still holds the bytes it was proven to hold."""
        if not self.store.remembers_digests or not self._pooled():
            return False  # host memory only (and no device is touched to find out)
        for name, e in self.store.candidates(p.name, digest):
            if e.digest != digest or e.nbytes != p.nbytes:
                continue
            src = np.frombuffer(self.target.host_view(e.tensor), dtype=np.uint8)
            sealed = not e.exposed  # nobody outside the server could have written into it
            ok = True
            if not sealed:
                t0 = time.perf_counter_ns() if self.prof.enabled else 0
                ok = hash_buffer(src) == digest
                if self.prof.enabled:
                    self.prof.record("hash", t0, time.perf_counter_ns(), p.nbytes, name="verify " + p.name)
            if not ok:  # written since it arrived: no longer proof of anything
                self.store.distrust(name, e, digest)
                continue
            if name == p.name and e.dtype == p.dtype and e.shape == p.shape:
                self._charge(p)
                p.dest = e.tensor  # already there: publish the same memory again
            else:
                self._ensure_dest(p, fault=False)
                t0 = time.perf_counter_ns() if self.prof.enabled else 0
                dst = np.frombuffer(self.target.host_view(p.dest), dtype=np.uint8)
                dst[:] = src  # a user-space copy faults fresh pages itself as cheaply as anything
                if self.prof.enabled:
                    self.prof.record("stage", t0, time.perf_counter_ns(), p.nbytes, name="copy " + p.name)
                if not sealed and hash_buffer(dst) != digest:  # the source changed under the copy: prove what landed
                    continue
            p.fill()
            p.proven = True
            self.store.count("memory_hits")
            self.store.count("bytes_from_memory", p.nbytes)
            return True
        return False

    def _cache_failed(self, e: CacheError) -> None:
        if disk_unusable(e):
            self.ctx.disable_cache(e)

    # -- completion ---------------------------------------------------------------------------------------

    def _complete(self, tid: int, p: Pending) -> None:
        self._unfault(p)
        del self.pending[tid]
        self.need.pop(tid, None)  # the bytes came after all: the client need not send them again
        streamed: bytes | None = None  # the digest of the bytes as they arrived, where one was taken
        if p.writer is not None:
            writer, p.writer = p.writer, None
            if p.hashed != p.nbytes:
                writer.abort()
            elif isinstance(writer, StreamHash):
                streamed = writer.value
            else:
                try:
                    writer.commit()
                    p.proven = True  # the bytes that arrived hash to the digest
                except CacheError as e:
                    if not isinstance(e.__cause__, OSError):
                        # The bytes that arrived are not the bytes the client hashed.
                        p.release()
                        self.error(f"tensor {p.name!r}: the bytes received do not match the digest the client sent")
                        return
                    self._cache_failed(e)
        if p.digest is not None and not p.proven and self.store.remembers_digests and self.target.memcpy_ok:
            # not hashed as it arrived (WRITEs out of order, a cache write that failed): a tensor
            # named by digest is published only with its bytes proven
            if hash_buffer(self.target.host_view(p.dest)) != p.digest:
                p.release()
                self.error(f"tensor {p.name!r}: the bytes received do not match the digest the client sent")
                return
            p.proven = True
        if p.verify:
            if streamed is None:
                streamed = p.digest if p.proven and p.digest is not None else self._hash_dest(p)
            if len(self.verified) < MAX_DIGESTS:
                self.verified.append((tid, streamed))
            else:
                self.verified_dropped += 1
        dest = self.target.finish(p.dest)
        if p.charge is None or p.deferred:
            raise AssertionError(f"tensor {p.name!r} completed without a charge")
        self.store.publish(p.name, p.dtype, p.shape, p.nbytes, dest, p.charge, p.digest if p.proven else None)
        p.charge = None
        self.done_tensors += 1
        if self.prof.enabled:
            self.prof.count(tensors=1, nbytes=p.nbytes)

    def _hash_dest(self, p: Pending) -> bytes:
        """The digest of ``p``'s destination, hashed in one pass after the fact: for the tensors
        not hashed as they arrived (written out of order, or empty)."""
        if p.nbytes == 0:
            return blake3.blake3().digest()
        if self.target.memcpy_ok:
            return hash_buffer(self.target.host_view(p.dest))
        import torch

        flat = p.dest.reshape(-1).view(torch.uint8)
        h = blake3.blake3()
        for pos in range(0, p.nbytes, STAGING_BYTES):
            h.update(flat[pos : pos + STAGING_BYTES].cpu().numpy())
        return h.digest()

    def close(self) -> None:
        """The connection ends: stop the faulter (nothing writes into freed memory), drop what is in flight."""
        if self._faulter is not None:
            self._faulter.close()  # waits for the pieces in progress
        for p in self.pending.values():
            self._unfault(p)
            if p.writer is not None:
                p.writer.abort()
            p.release()
        self.pending.clear()
