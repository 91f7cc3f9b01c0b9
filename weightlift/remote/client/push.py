"""One push job on one connection: ALLOCs ahead of WRITEs, payloads straight from the mapping,
HAVE for tensors the server may already hold, and one BARRIER at the end.

See :mod:`weightlift.remote.client.job` for the theory of operation; :class:`Pusher` is the
sender of one connection, :class:`Hashing` the digests computed beside it, :class:`Tally` what
the senders of one push did, :func:`balance` the split of a push over several connections.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import Counter, deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, NamedTuple

from weightlift.digest.blake import DigestPool, hash_buffer
from weightlift.digest.sidecar import hash_tensors
from weightlift.disk.source import mapped
from weightlift.dtypes import CODES, byte_length
from weightlift.errors import (
    RemoteProtocolError,
    WeightliftError,
)
from weightlift.formats import TensorInfo
from weightlift.profile import Profiler
from weightlift.remote.client.connection import Connection, printable
from weightlift.remote.client.memory import host_bytes, is_memory
from weightlift.remote.protocol import (
    MAX_DIGESTS,
    Alloc,
    Barrier,
    BarrierReply,
    FillFromCache,
    Have,
    HaveReply,
    Message,
    WriteHeader,
)
from weightlift.sources import is_url

__all__ = [
    "Plan",
    "wire_form",
    "Tally",
    "ProgressCallback",
    "Hashing",
    "balance",
    "Pusher",
    "ALLOC_AHEAD_BYTES",
    "ALLOC_AHEAD_TENSORS",
    "HAVE_BATCH",
    "SENDFILE_MIN",
]

SENDFILE_MIN = 1 << 20  # below this a header and payload go out in one sendmsg
HAVE_BATCH = 4096
# ALLOCs run this far ahead of the WRITEs (bytes, tensors): a server faults a tensor's fresh
# memory in as soon as it is allocated, so it can do the next tensors' while this one arrives.
# Half the server's fault-ahead window (weightlift.remote.server.FAULT_WINDOW): what is allocated
# ahead never takes all of it from the tensor being received.
ALLOC_AHEAD_BYTES = 32 << 20
ALLOC_AHEAD_TENSORS = 64


class Plan(NamedTuple):
    info: TensorInfo
    dtype: str
    shape: tuple[int, ...]


def wire_form(t: TensorInfo) -> Plan:
    """The dtype and shape a tensor travels as: its own, or raw bytes for types the wire lacks."""
    if t.dtype in CODES:
        try:
            if byte_length(t.dtype, t.shape) == t.length:
                return Plan(t, t.dtype, t.shape)
        except WeightliftError:
            pass
    return Plan(t, "U8", (t.length,))  # GGUF quantized blocks: pushed as their raw bytes


#: A push's or a pull's progress callback: ``(bytes done, bytes in all)``, after each tensor.
ProgressCallback = Callable[[int, int], None]


class Tally:
    """What the senders of one push did, counted under one lock; ``progress(bytes, total)`` is
    told each time the bytes on the server grow (a tensor sent or filled from the cache)."""

    def __init__(self, total: int = 0, progress: ProgressCallback | None = None) -> None:
        self.lock = threading.Lock()
        self.tensors = self.bytes = self.sent = self.hashed = self.cached = self.verified = self.deltas = 0
        self.differ: list[str] = []  # verified tensors whose server digest is not the file's
        self.total, self.progress = total, progress

    def mismatch(self, what: str) -> None:
        with self.lock:
            self.differ.append(what)

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)
            if self.progress is not None and kw.get("bytes", 0) > 0:  # a resend takes its bytes back first
                self.progress(self.bytes, self.total)


class Hashing:
    """Digests of the large tensors of one push (asked about with HAVE), and with ``verify`` of
    every tensor (compared with what the server reports): from the files' manifests, else
    hashed on a pool while the sender sends.

    Counts the bytes it actually hashes: :func:`hash_tensors` asks for a tensor's bytes only
    when the manifest lacks its digest.
    """

    def __init__(
        self,
        plans: list[Plan],
        *,
        threshold: int,
        prof: Profiler,
        enabled: bool,
        verify: bool = False,
        expected: Mapping[str, bytes] | None = None,
    ):
        self.futures: dict[str, Future[bytes]] = {}  # the tensors to ask the cache about
        self.all: dict[str, Future[bytes]] = {}  # every tensor hashed, the above included
        self.hashed_bytes = 0
        self._pool: DigestPool | None = None
        # a tensor in a store has no sidecar, and hashing it first would read it twice: never asked about
        chosen = (
            [p.info for p in plans if p.info.length >= max(threshold, 1) and not is_url(p.info.file)] if enabled else []
        )
        wanted = [p.info for p in plans] if verify else chosen
        # Digests given (a published manifest) are what the server must report: not hashed here.
        # Those asked about are the files' own all the same: a caching server fills a tensor with
        # whatever it holds under the digest asked about, so a manifest's digest would choose the
        # bytes that land instead of checking them (one giving another tensor's would land that).
        known = {t.name: _done(expected[t.name]) for t in wanted if expected and t.name in expected}
        asked = {t.name for t in chosen}
        wanted = [t for t in wanted if t.name not in known or t.name in asked]
        # A relayed tensor carries the digest its origin sent: asked about and ALLOCated with that
        # one, never hashed here, so the next hop proves the bytes against the origin's digest
        # and not against whatever a relay would compute over what it holds.
        carried = {p.info.name: _done(p.info.extra["relayed"]) for p in plans if p.info.extra.get("relayed")}
        if carried:
            chosen = [p.info for p in plans if p.info.name in carried]
            wanted = [t for t in wanted if t.name not in carried]
            known.update(carried)
        if wanted:
            self._pool = DigestPool(max(1, min(4, (os.cpu_count() or 2) // 2)), profiler=prof)
            files = not any(is_memory(t) for t in wanted)  # tensors in memory have no sidecar
            self.all = hash_tensors(wanted, view=self._view, pool=self._pool, threshold=0, manifests=files)
        self.futures = {t.name: carried[t.name] if t.name in carried else self.all[t.name] for t in chosen}
        self.all.update(known)
        self.published = set(known)  # names whose digest a published manifest gave

    def _view(self, t: TensorInfo) -> Any:
        self.hashed_bytes += t.length
        if is_memory(t):
            return host_bytes(t)
        return mapped(t.file).view(t.offset, t.length)

    def carry(self, plans: list[Plan]) -> None:
        """Relayed tensors handed over after the push began: the digests they carry, as above;
        an empty tensor, which carries none, the digest of no bytes."""
        for p in plans:
            digest = p.info.extra.get("relayed")
            if digest is None and p.info.length == 0:
                self.all[p.info.name] = _done(hash_buffer(b""))
            elif digest is not None:
                self.futures[p.info.name] = self.all[p.info.name] = _done(digest)

    def close(self, *, ok: bool) -> None:
        """After a push: wait for the workers (they save the manifests), or cancel on failure."""
        if self._pool is not None:
            self._pool.close(wait=ok)


def _done(digest: bytes) -> Future[bytes]:
    f: Future[bytes] = Future()
    f.set_result(digest)
    return f


def balance(plans: list[Plan], n: int) -> list[list[Plan]]:
    """Split into ``n`` groups of about equal bytes; each group keeps file order."""
    if n == 1:
        return [plans]
    groups: list[list[Plan]] = [[] for _ in range(n)]
    load = [0] * n
    for p in sorted(plans, key=lambda p: -p.info.length):
        i = load.index(min(load))
        groups[i].append(p)
        load[i] += p.info.length
    for g in groups:
        g.sort(key=lambda p: (p.info.file, p.info.offset))
    return groups


class Pusher:
    """Pushes one group of tensors over one connection."""

    def __init__(
        self,
        conn: Connection,
        *,
        prof: Profiler,
        tally: Tally,
        hashing: Hashing,
        threshold: int,
        verify: bool = False,
    ):
        self.conn, self.prof, self.tally, self.hashing = conn, prof, tally, hashing
        self.threshold = threshold
        self.verify = verify
        self.unverified: dict[int, Plan] = {}  # completed on the wire, no digest reported yet
        self.since_barrier = 0  # tensors whose last frame went out since the last BARRIER
        self.sent: dict[int, Plan] = {}
        # tensors FILLed from the server's cache since the last BARRIER: the only ones its reply
        # may ask for again (each once), so a server cannot make this push send more than it holds
        self.filled: dict[int, Plan] = {}
        self.delta_ids: set[int] = set()  # those of them sent as a DELTA (the rest FILLed)
        self.ahead: dict[int, int] = {}  # tensors ALLOCated ahead of their WRITE: id(plan) -> tensor id
        self.ahead_bytes = 0
        self.settled = True  # False while frames are out that no BARRIER reply has answered

    def run(self, plans: list[Plan]) -> None:
        self.send(plans)
        self._barrier()

    def finish(self) -> None:
        """The BARRIER that ends a push whose tensors went out by :meth:`send`."""
        self._barrier()

    def send(self, plans: list[Plan]) -> None:
        """Every tensor of ``plans`` on the wire, without the BARRIER that ends a push: a relay
        sends each batch as it is handed over, so the link never waits on an acknowledgment."""
        if plans:
            self.settled = False
        futures = self.hashing.futures
        small = deque(p for p in plans if p.info.name not in futures)
        large = deque(p for p in plans if p.info.name in futures)
        # a verifying push asks for digests at least every MAX_DIGESTS tensors (what one reply holds)
        batch = MAX_DIGESTS // 2 if self.verify else HAVE_BATCH
        while small or large:
            ready: list[Plan] = []
            while large and futures[large[0].info.name].done() and len(ready) < batch:
                ready.append(large.popleft())
            if ready:
                self._large(ready)
            elif small:
                self._send(small.popleft(), None, upcoming=small)
            else:
                futures[large[0].info.name].result()  # nothing else to send: wait for this hash
            if self.verify and self.since_barrier >= MAX_DIGESTS // 2:
                self._barrier(last=False)

    def _large(self, plans: list[Plan]) -> None:
        digests = [self.hashing.futures[p.info.name].result() for p in plans]
        # a server without a cache holds nothing to fill from (a relayed push names every digest
        # all the same); HAVE would only wait for what was sent before it to be received
        have = self._have(digests) if self.conn.cache else (False,) * len(digests)
        for p, d, h in zip(plans, digests, have, strict=False):
            if h:
                self._fill(p, d)
            else:
                self._send(p, d)

    def _fill(self, p: Plan, digest: bytes) -> None:
        """ALLOC and FILL_FROM_CACHE: the server takes the bytes from its own cache."""
        tid = self._alloc(p, digest)
        self._command(FillFromCache(tid, digest))
        self.filled[tid] = p
        self._completed(tid, p)
        self.prof.count(tensors=1)
        self.tally.add(tensors=1, bytes=p.info.length, cached=1)

    def _completed(self, tid: int, p: Plan) -> None:
        """The last frame of tensor ``tid`` went out: with verify, its digest is due."""
        self.since_barrier += 1
        if self.verify:
            self.unverified[tid] = p

    def _have(self, digests: list[bytes]) -> tuple[bool, ...]:
        with self.prof.timed("HAVE"):
            self.conn.send(self.conn.frame(Have(tuple(digests))))
            reply: HaveReply = self.conn.expect(HaveReply)
        if len(reply.have) != len(digests):
            raise RemoteProtocolError(f"HAVE asked about {len(digests)} digests; the reply has {len(reply.have)}")
        return reply.have

    def _new_id(self, p: Plan) -> int:
        self.settled = False
        tid = self.conn.next_id
        self.conn.next_id = (tid + 1) & 0xFFFFFFFF
        self.sent[tid] = p
        return tid

    def _alloc_ahead(self, upcoming: deque[Plan]) -> bytes:
        """ALLOC frames for the next tensors without a digest, up to the ALLOC_AHEAD limits."""
        frames = []
        for q in itertools.islice(upcoming, ALLOC_AHEAD_TENSORS):
            if id(q) in self.ahead:
                continue  # counted in ahead_bytes already
            if self.ahead_bytes + q.info.length > ALLOC_AHEAD_BYTES:
                break
            if q.info.length:
                tid = self._new_id(q)
                frames.append(self._alloc_frame(tid, q, None))
                self.ahead[id(q)] = tid
                self.ahead_bytes += q.info.length
        return b"".join(frames)

    def _alloc_frame(self, tid: int, p: Plan, digest: bytes | None) -> bytes:
        return self.conn.frame(Alloc(tid, p.info.name, p.dtype, p.shape, p.info.length, digest, self.verify))

    def _alloc(self, p: Plan, digest: bytes | None) -> int:
        tid = self._new_id(p)
        self._command(Alloc(tid, p.info.name, p.dtype, p.shape, p.info.length, digest, self.verify))
        return tid

    def _command(self, msg: Message) -> None:
        self.conn.send(self.conn.frame(msg))
        self.prof.count(calls=1)

    def _send(self, p: Plan, digest: bytes | None, tid: int | None = None, upcoming: deque[Plan] | None = None) -> None:
        """ALLOC (unless resending or ALLOCated ahead) and WRITE with the payload, in one send
        where possible; with ``upcoming``, the ALLOCs of the next tensors go out ahead, first."""
        t = p.info
        head = b""
        self.settled = False
        if tid is None and id(p) in self.ahead:
            tid = self.ahead.pop(id(p))
            self.ahead_bytes -= t.length
        if tid is None:
            tid = self._new_id(p)
            head = self._alloc_frame(tid, p, digest)
        if upcoming:
            head += self._alloc_ahead(upcoming)
        if t.length == 0:  # complete at ALLOC: a WRITE would name a tensor no longer in flight
            self.conn.send(head)
            self._completed(tid, p)
            self.prof.count(tensors=1, calls=1)
            self.tally.add(tensors=1)
            return
        if is_url(t.file):
            self._send_from_store(head, tid, t)
            self._completed(tid, p)
            self.tally.add(tensors=1, bytes=t.length, sent=t.length)
            return
        head += self.conn.frame(WriteHeader(tid, 0, t.length))
        with self.prof.phase("wire", t.length, name=t.name):
            if is_memory(t):  # the tensor's own memory, handed to sendmsg after the headers
                data = host_bytes(t).data
                self.conn.send(head, data, self.conn.payload_tag(data))
                self._completed(tid, p)
                self.prof.count(tensors=1, calls=2, nbytes=t.length)
                self.tally.add(tensors=1, bytes=t.length, sent=t.length)
                return
            m = mapped(t.file)
            # on a protected connection the WRITE's tag covers the payload: hashed from the mapping
            # (which also brings its pages in for sendfile), sent right after it
            tag = self.conn.payload_tag(m.view(t.offset, t.length)) if self.conn.protected else b""
            if t.length >= SENDFILE_MIN:
                self.conn.send(head)
                self.conn.sendfile(m.fileno(), t.offset, t.length)
                if tag:
                    self.conn.send(tag)
            else:
                self.conn.send(head, m.view(t.offset, t.length), tag)
        self._completed(tid, p)
        self.prof.count(tensors=1, calls=2, nbytes=t.length)
        self.tally.add(tensors=1, bytes=t.length, sent=t.length)

    def _send_from_store(self, head: bytes, tid: int, t: TensorInfo) -> None:
        """A tensor in an object store: one WRITE per part, each part read from the store just
        ahead of its send (never the whole tensor in memory, never on local disk)."""
        from weightlift.sources.stream import pieces

        for off, view in pieces(t):
            with self.prof.phase("wire", len(view), name=t.name):
                frame = self.conn.frame(WriteHeader(tid, off, len(view)))
                tag = self.conn.payload_tag(view) if self.conn.protected else b""
                self.conn.send(head + frame, view, tag)
            head = b""
            self.prof.count(calls=1, nbytes=len(view))
        self.prof.count(tensors=1)

    def _check(self, digests: tuple[tuple[int, bytes], ...]) -> None:
        """Compare the digests the server reports with the files' (from the manifest or hashed)."""
        for tid, got in digests:
            p = self.unverified.pop(tid, None)
            if p is None:
                raise RemoteProtocolError(f"server reports a digest for tensor id {tid}, which is not due")
            want = self.hashing.all[p.info.name].result()
            if got != want:
                where = "published" if p.info.name in self.hashing.published else "file"
                self.tally.mismatch(f"{p.info.name!r} (server {got.hex()[:16]}, {where} {want.hex()[:16]})")
            else:
                self.tally.add(verified=1)

    def _barrier(self, *, last: bool = True) -> None:
        flags = Barrier.FLAG_DIGESTS if self.verify else 0
        for _ in range(3):
            with self.prof.timed("BARRIER"):
                self.conn.send(self.conn.frame(Barrier(flags)))
                self.since_barrier = 0
                reply: BarrierReply = self.conn.expect(BarrierReply)
            if reply.digests and not self.verify:
                raise RemoteProtocolError("server reports digests this client did not ask for")
            self._check(reply.digests)
            again = self._again(reply.need)
            if reply.errors:
                self.settled = not again  # in step with the server, nothing left allocated
                raise RemoteProtocolError("server: " + "; ".join(printable(e) for e in reply.errors))
            if not again:
                self.settled = True
                if last and self.unverified:  # completed, yet the server stated no digest
                    for q in self.unverified.values():
                        self.tally.mismatch(f"{q.info.name!r} (the server reported no digest)")
                    self.unverified.clear()
                return
            for tid, p in again:  # a cache entry failed its check, or a DELTA's base is not there: send the bytes
                if tid in self.delta_ids:
                    self.tally.add(tensors=-1, bytes=-p.info.length, deltas=-1)
                else:
                    self.tally.add(tensors=-1, bytes=-p.info.length, cached=-1)
                self._send(p, None, tid)
            self.delta_ids.clear()
        raise RemoteProtocolError("server keeps asking for tensors again")

    def _again(self, need: tuple[int, ...]) -> list[tuple[int, Plan]]:
        """The tensors a BARRIER reply asks for again: each must be one this push filled from
        the server's cache since the last BARRIER, and named once; the rest filled are settled."""
        filled, self.filled = self.filled, {}
        if len(set(need)) != len(need):
            tid, times = Counter(need).most_common(1)[0]
            raise RemoteProtocolError(f"server asks for tensor id {tid} {times} times in one reply")
        again = []
        for tid in need:
            p = filled.get(tid)
            if p is None:
                why = "this client never sent" if tid not in self.sent else "it was not asked to fill from its cache"
                raise RemoteProtocolError(f"server asks again for tensor id {tid}, which {why}")
            again.append((tid, p))
        return again
