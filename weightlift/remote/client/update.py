"""A weight update: tensors from memory sent as what changed, switched in at once, proven.

Theory of operation. A push from memory to a server of protocol minor 3 is an update: UPDATE,
then each tensor, a BARRIER, and COMMIT, whose reply states the set digest of what the server
holds now; the client compares it with its own (:func:`~weightlift.digest.setdigest.set_digest`
over the names and digests it sent), so a successful update is proven equal, byte for byte, to
the tensors given. Until COMMIT nothing is visible; a client that dies before it leaves the
server's tensors as they were.

Each tensor goes the cheapest way the client knows of:

* with a base (the version the server should hold: :class:`Bases`, or ``base=`` of the push) of
  the same dtype and shape and a server with the DELTA flag: a DELTA, unless a sample of the
  changes (:func:`weightlift.remote.delta.choose`) says the tensor is better sent whole; a
  tensor that equals its base costs a DELTA of no payload;
* otherwise whole, from its own memory (ALLOC and WRITE, or FILL where a caching server has it).

A DELTA the server cannot apply (its tensor is not that base any more) comes back in the
BARRIER reply's need list, and the tensor is sent whole in the same update.

An update always verifies: the server hashes each tensor as it lands (or as a DELTA's result)
and the client compares every digest, as ``verify=True`` does for a file, besides the set digest.

Base memory. The client must hold the base bytes to diff against. ``Client(keep_base=True)``
keeps a host copy of every tensor each update pushed, with its digest, as the next update's base
(memory: one more copy of the pushed tensors). A tensor sent against its kept copy is read once:
the scan that hashes it and finds its changes also writes them into the copy, so the copy is the
new version afterwards without a copy of the tensor and the base is never hashed again. A tensor
sent whole is copied into its kept copy after the update. ``push(tensors, base=previous)``
instead uses tensors the caller still holds (no copy kept, never written), hashed once per push
to name them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from weightlift.digest.blake import hash_buffer
from weightlift.digest.setdigest import set_digest
from weightlift.dtypes import item_size
from weightlift.env import cpus
from weightlift.errors import IntegrityError, RemoteProtocolError
from weightlift.remote import delta as codec
from weightlift.remote.client.memory import host_bytes, memory_tensors
from weightlift.remote.client.push import Plan, Pusher
from weightlift.remote.protocol import Commit, CommitReply, Delta, DeltaEncoding, Update, planes_usable

__all__ = ["Bases", "Base", "UpdateSpec", "UpdatePusher"]


@dataclass
class Base:
    """The version of a tensor the server holds: its layout, digest and bytes (uint8)."""

    dtype: str
    shape: tuple[int, ...]
    digest: bytes
    data: np.ndarray


class Bases:
    """The last version of each tensor this client pushed to its server, kept as the next base."""

    def __init__(self) -> None:
        self._by_name: dict[str, Base] = {}

    def get(self, name: str) -> Base | None:
        return self._by_name.get(name)

    @property
    def nbytes(self) -> int:
        """Host memory the kept copies take."""
        return sum(b.data.nbytes for b in self._by_name.values())

    def record(self, name: str, dtype: str, shape: tuple[int, ...], digest: bytes, data: np.ndarray) -> None:
        """Keep a copy of ``data`` as ``name``'s base (into the old copy's memory where it fits;
        nothing to copy where the update's scan refreshed it already)."""
        old = self._by_name.get(name)
        if old is not None and old.digest == digest and old.data.nbytes == data.nbytes:
            old.dtype, old.shape = dtype, shape
            return
        if old is None or old.data.nbytes != data.nbytes:
            old = self._by_name[name] = Base(dtype, shape, digest, np.empty(data.nbytes, np.uint8))
        codec.copy(old.data, data)  # at memory speed, on every core
        old.dtype, old.shape, old.digest = dtype, shape, digest

    def forget(self) -> None:
        self._by_name.clear()


def given_bases(base: Mapping[str, Any]) -> dict[str, Base]:
    """``push(base=...)``: the caller's previous tensors, hashed to name them."""
    out = {}
    for t in memory_tensors(base):
        data = host_bytes(t)
        out[t.name] = Base(t.dtype, t.shape, hash_buffer(data), data)
    return out


@dataclass
class UpdateSpec:
    """What one update needs besides its tensors: the bases, whether DELTAs are applied in place,
    and the digests the client proves the result with (filled as it goes)."""

    bases: Bases | dict[str, Base]
    in_place: bool = False
    delta: bool = True  # the server applies DELTAs
    digests: dict[str, bytes] = field(default_factory=dict)
    root: bytes | None = None  # the server's set digest, once committed
    generation: int = 0

    @property
    def kept(self) -> bool:
        """The bases are the client's own copies (refreshed in place), not the caller's tensors."""
        return isinstance(self.bases, Bases)

    def base_of(self, p: Plan) -> Base | None:
        """The base ``p`` is sent against as a DELTA, if any: of its dtype and shape, whole bytes."""
        base = self.bases.get(p.info.name)
        if not self.delta or base is None or (base.dtype, base.shape) != (p.dtype, p.shape):
            return None
        return base if item_size(p.dtype) and base.data.nbytes == p.info.length else None

    def scanned(self, plans: list[Plan]) -> set[str]:
        """The names of the tensors the update hashes itself (as it scans them)."""
        return {p.info.name for p in plans if self.base_of(p) is not None}


#: The most threads that scan tensors against their bases (hash, compare, encode) ahead of the
#: sender. The sender mostly waits on the socket and the compression runs on the codec's workers;
#: fewer scan threads leave cores idle while one tensor's scan, a sequential pass, holds up the
#: sends, also on a machine whose cores the server shares.
MAX_SCAN_THREADS = 4
#: Tensor bytes scanned ahead of the one being sent (at least one tensor): what bounds the
#: payloads held at once.
SCAN_AHEAD_BYTES = 256 << 20


def scan_threads() -> int:
    """Scan threads for an update: one per core this process may run on
    (:func:`weightlift.env.cpus`, read at each update), at most :data:`MAX_SCAN_THREADS`."""
    return max(1, min(MAX_SCAN_THREADS, cpus()))


class Scanned(NamedTuple):
    """A tensor scanned against its base: the payload (None: send it whole), its digest, and
    the base digest the payload is encoded against."""

    encoding: int | None
    parts: list[bytes] | None
    digest: bytes
    base: bytes


class UpdatePusher(Pusher):
    """A :class:`~weightlift.remote.client.push.Pusher` that wraps its tensors in UPDATE and
    COMMIT and sends each it has a base for as a DELTA.

    The tensors with a base are scanned (:func:`weightlift.remote.delta.scan`: hashed, compared
    and encoded in one pass) on :func:`scan_threads` threads, in order and a few ahead, while
    this thread sends the ones scanned before; a kept base is refreshed by the same pass."""

    spec: UpdateSpec
    #: tensors of an in-place update sent whole after their DELTA was answered "need"
    resent_in_place = 0

    def run(self, plans: list[Plan]) -> None:
        self.settled = False
        self._command(Update(Update.FLAG_IN_PLACE if self.spec.in_place else 0))
        todo = [p for p in plans if self.spec.base_of(p) is not None]
        whole = [p for p in plans if self.spec.base_of(p) is None]
        with ThreadPoolExecutor(scan_threads(), thread_name_prefix="weightlift-scan") as pool:
            ahead: deque[tuple[Plan, Future[Scanned]]] = deque()
            ahead_bytes = 0
            try:
                for p in todo:
                    while ahead and ahead_bytes + p.info.length > SCAN_AHEAD_BYTES:
                        q, fut = ahead.popleft()
                        ahead_bytes -= q.info.length
                        self._sent_scanned(q, fut.result(), whole)
                    ahead.append((p, pool.submit(self._scan, p)))
                    ahead_bytes += p.info.length
                while ahead:
                    q, fut = ahead.popleft()
                    self._sent_scanned(q, fut.result(), whole)
            finally:
                for _, fut in ahead:
                    fut.cancel()
        super().run(whole)  # ends with the BARRIER that answers every DELTA too
        for p in whole:  # hashed beside the sends: only a DELTA waits for its digest
            self.spec.digests[p.info.name] = self._digest(p)
        self._commit()

    def _digest(self, p: Plan) -> bytes:
        fut = self.hashing.all.get(p.info.name)
        return fut.result() if fut is not None else hash_buffer(host_bytes(p.info))

    def _scan(self, p: Plan) -> Scanned:
        """On a scan thread: ``p`` against its base, in one pass (a kept base becomes ``p``)."""
        t = p.info
        base = self.spec.base_of(p)
        assert base is not None
        item = item_size(p.dtype)
        new, was = host_bytes(t), base.digest
        with self.prof.phase("stage", t.length, name="delta " + t.name, background=True):
            encoding = codec.choose(new, base.data, item, planes=planes_usable(self.conn.minor))
            parts, digest = codec.scan(encoding, new, base.data, item, update=self.spec.kept)
        if self.spec.kept:
            base.digest = digest  # the kept copy holds the new bytes now
        self.tally.add(hashed=t.length)
        return Scanned(encoding, parts, digest, was)

    def _sent_scanned(self, p: Plan, s: Scanned, whole: list[Plan]) -> None:
        """Send ``p`` as its scan says: a DELTA (SAME where nothing changed), else later, whole."""
        name = p.info.name
        self.spec.digests[name] = s.digest
        done: Future[bytes] = Future()
        done.set_result(s.digest)
        self.hashing.all[name] = done  # what the server's reported digest is compared with
        if s.digest == s.base:
            self._send_delta(p, DeltaEncoding.SAME, s.base, s.digest, [])
        elif s.encoding is None or s.parts is None:
            whole.append(p)
        else:
            self._send_delta(p, DeltaEncoding(s.encoding), s.base, s.digest, s.parts)

    def _send_delta(self, p: Plan, encoding: DeltaEncoding, base: bytes, digest: bytes, parts: list[bytes]) -> None:
        t = p.info
        tid = self._new_id(p)
        length = sum(len(x) for x in parts)
        verify = not self.spec.in_place  # in place: proven by the set digest only
        head = self.conn.frame(Delta(tid, t.name, p.dtype, p.shape, t.length, encoding, base, digest, length, verify))
        tag = b""
        if self.conn.protected and length:
            mac = self.conn.mac_out
            assert mac is not None
            for x in parts[:-1]:
                mac.update(x)
            tag = self.conn.payload_tag(parts[-1])
        with self.prof.phase("wire", length, name=t.name):
            self.conn.send(head, *parts, tag)
        self.filled[tid] = p  # the BARRIER reply may ask for it whole
        self.delta_ids.add(tid)
        self.since_barrier += 1
        if verify:
            self.unverified[tid] = p
        self.prof.count(tensors=1, calls=1, nbytes=length)
        self.tally.add(tensors=1, bytes=t.length, sent=length, deltas=1)

    def _completed(self, tid: int, p: Plan) -> None:
        if self.spec.in_place and tid in self.delta_ids:
            # sent whole after its in-place DELTA was answered "need": the allocation is the
            # DELTA's, made with no digest due in the BARRIER; the set digest proves it, as it
            # proves the DELTAs (expecting a digest here failed a sound update as a mismatch)
            self.since_barrier += 1
            self.resent_in_place += 1
            return
        super()._completed(tid, p)

    def _commit(self) -> None:
        with self.prof.timed("COMMIT"):
            self.conn.send(self.conn.frame(Commit()))
            reply: CommitReply = self.conn.expect(CommitReply)
        self.settled = True
        if not reply.ok:
            raise RemoteProtocolError(f"server: {reply.message}")
        want = set_digest(self.spec.digests)
        if reply.root != want:
            raise IntegrityError(
                f"update: the server's set digest {reply.root.hex()[:16]} is not the client's {want.hex()[:16]}"
                + (f" ({reply.message})" if reply.message else "")
            )
        if self.verify and self.spec.in_place:  # each DELTA kept for the switch is proven by the set digest
            self.tally.add(verified=self.tally.deltas + self.resent_in_place)
        self.spec.root, self.spec.generation = reply.root, reply.generation
