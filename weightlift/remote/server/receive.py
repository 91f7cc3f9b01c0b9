"""Receiving tensors on one connection: ALLOC, WRITE and FILL_FROM_CACHE, until each completes.

Theory of operation. An ALLOC charges the tensor's cost to the store and, unless the tensor may be
filled from memory the server already holds, makes its destination at once
(:mod:`.destinations`): pooled or fresh host memory, or the target's own (a CUDA tensor). Each
WRITE is read from the socket as a stream by the connection's receive path (:mod:`.paths`);
with a disk cache the bytes are hashed as they pass, and so are the bytes of a tensor ALLOCated
with VERIFY (one hash serves both). A FILL_FROM_CACHE fills from memory or the disk cache
(:mod:`.fills`). A tensor whose byte ranges cover it is complete: its cache entry is committed
(proving its digest) and the store publishes it. Errors are kept for the next BARRIER
(:mod:`.outcomes`), whose reply also names the tensors a FILL could not fill (the client sends
their bytes instead) and, when asked, the digests of the verified tensors that completed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import blake3

from weightlift.digest.blake import hash_buffer
from weightlift.errors import CacheError
from weightlift.memory.pool import held_bytes
from weightlift.memory.targets import as_bytes
from weightlift.profile import Profiler
from weightlift.remote.protocol import MAX_DIGESTS, MAX_TENSORS, Alloc, BarrierReply, FillFromCache, WriteHeader
from weightlift.remote.server.cache import CacheWriter, DigestCheck, disk_unusable
from weightlift.remote.server.cache.behind import sealed_since
from weightlift.remote.server.context import Context, RequestError
from weightlift.remote.server.destinations import Destinations
from weightlift.remote.server.device import STAGING_BYTES, Device
from weightlift.remote.server.fills import Fills
from weightlift.remote.server.outcomes import Outcomes
from weightlift.remote.server.paths import PayloadPath
from weightlift.remote.server.pending import MAX_RANGES, Pending, StreamHash
from weightlift.remote.server.store import MemoryFull, Store, entry_cost

__all__ = ["Receiver", "MAX_OPEN_FILES", "RESERVED_NAMES"]

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
        device: Device,
        *,
        path: PayloadPath,
        dests: Destinations,
        drain: Callable[[int], None],
        prof: Profiler,
        frame_end: Callable[[], None] = lambda: None,
    ):
        self.ctx = ctx
        self.store = ctx.store
        self.device = device
        self.path = path
        self.dests = dests
        self.drain = drain
        self.prof = prof
        self.frame_end = frame_end
        self.pending: dict[int, Pending] = {}
        self.outcomes = Outcomes(ctx.store, max_digests=MAX_DIGESTS)
        self.fills = Fills(ctx.store, device, dests, prof)
        self._files: list[CacheWriter] = []  # cache writers made, some still holding a temporary file
        # where a complete tensor goes: the store, or an open update that publishes it at its switch
        self.publish: Callable[..., None] = self.store.publish

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
        p = _charged(self.store, a, pooled=self.device.pooled, ahead=bool(self.pending))
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
            # published (:mod:`.cache_behind`); a target without host views writes it as the
            # bytes pass, while this connection holds fewer than MAX_OPEN_FILES temporary files.
            missing = not cache.has(p.digest, p.nbytes, wait=False)
            if missing and self.device.target.memcpy_ok:
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
        target = self.device.target
        if p.digest is not None and not p.proven and self.store.remembers_digests and target.memcpy_ok:
            # not hashed as it arrived (WRITEs out of order, a cache write that failed): a tensor
            # named by digest is published only with its bytes proven
            if hash_buffer(target.host_view(p.dest)) != p.digest:
                self._mismatch(p)
                return
            p.proven = True
        if p.verify:
            if streamed is None:
                streamed = p.digest if p.proven and p.digest is not None else _hash_dest(p, self.device.target)
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
        return blake3.blake3().digest()
    if target.memcpy_ok:
        return hash_buffer(target.host_view(p.dest))
    import torch

    target.synchronize()  # the uploads into it run on the target's stream: all of them landed first
    flat = p.dest.reshape(-1).view(torch.uint8)
    h = blake3.blake3()
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
