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
(memory: one more copy of the pushed tensors, refreshed in place, so no allocation after the
first). ``push(tensors, base=previous)`` instead uses tensors the caller still holds (no copy
kept), hashed once per push to name them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from weightlift.digest.blake import hash_buffer
from weightlift.digest.setdigest import set_digest
from weightlift.dtypes import dtype_info
from weightlift.errors import IntegrityError, RemoteProtocolError
from weightlift.remote import delta as codec
from weightlift.remote.client.memory import host_bytes, memory_tensors
from weightlift.remote.client.push import Plan, Pusher
from weightlift.remote.protocol import Commit, CommitReply, Delta, DeltaEncoding, Update

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
        """Keep a copy of ``data`` as ``name``'s base (into the old copy's memory where it fits)."""
        old = self._by_name.get(name)
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


class UpdatePusher(Pusher):
    """A :class:`~weightlift.remote.client.push.Pusher` that wraps its tensors in UPDATE and
    COMMIT and sends each it has a base for as a DELTA."""

    spec: UpdateSpec

    def run(self, plans: list[Plan]) -> None:
        self.settled = False
        self._command(Update(Update.FLAG_IN_PLACE if self.spec.in_place else 0))
        whole = [p for p in plans if not self._delta(p)]
        super().run(whole)  # ends with the BARRIER that answers every DELTA too
        for p in whole:  # hashed beside the sends: only a DELTA waits for its digest
            self.spec.digests[p.info.name] = self._digest(p)
        self._commit()

    def _digest(self, p: Plan) -> bytes:
        fut = self.hashing.all.get(p.info.name)
        return fut.result() if fut is not None else hash_buffer(host_bytes(p.info))

    def _delta(self, p: Plan) -> bool:
        """Send ``p`` as a DELTA if that pays; False: it goes whole."""
        t = p.info
        base = self.spec.bases.get(t.name)
        if not self.spec.delta or base is None or (base.dtype, base.shape) != (p.dtype, p.shape):
            return False
        bits = dtype_info(p.dtype).bits
        item = bits // 8 if bits % 8 == 0 else 0
        new = host_bytes(t)
        # encoded while the hashing pool takes the tensor's digest, which is waited for after
        with self.prof.phase("stage", t.length, name="delta " + t.name):
            encoding = codec.choose(new, base.data, item)
            parts = codec.encode(encoding, new, base.data, item) if encoding is not None else None
        digest = self.spec.digests[t.name] = self._digest(p)
        if digest == base.digest:
            self._send_delta(p, DeltaEncoding.SAME, base.digest, digest, [])
            return True
        if encoding is None or parts is None:
            return False
        self._send_delta(p, DeltaEncoding(encoding), base.digest, digest, parts)
        return True

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
        self.spec.root, self.spec.generation = reply.root, reply.generation
