"""The naive push (``WEIGHTLIFT_LOAD_OPT=0``), kept as the other arm of A/B runs.

Every tensor of at least the hash threshold (:data:`~weightlift.digest.blake.NAIVE_HASH_THRESHOLD`
by default) is hashed inline whatever the server, asked about with HAVE when the server keeps a
cache, copied with its headers into a fresh zero-filled buffer, sent, and answered by a BARRIER
round trip of its own. What the optimised :class:`~weightlift.remote.client.push.Pusher` avoids
is exactly what this one pays, so the two can be compared on the same wire.
"""

from __future__ import annotations

from weightlift.digest.blake import hash_buffer
from weightlift.disk.source import mapped
from weightlift.remote.client.push import Plan, Pusher
from weightlift.remote.protocol import WriteHeader

__all__ = ["NaivePusher"]


class NaivePusher(Pusher):
    """Pushes one tensor at a time: hash inline, stage a copy, send, BARRIER."""

    def run(self, plans: list[Plan]) -> None:
        self.settled = not plans
        for p in plans:
            self._push_one(p)

    def _push_one(self, p: Plan) -> None:
        self.settled = False
        t = p.info
        view = mapped(t.file).view(t.offset, t.length)
        digest = None
        if t.length >= max(self.threshold, 1):
            with self.prof.phase("hash", t.length, name=t.name):
                digest = hash_buffer(view, max_threads=1)
            self.tally.add(hashed=t.length)
        if digest is not None and self.conn.cache and self._have([digest])[0]:
            self._fill(p, digest)
        else:
            tid = self._new_id(p)
            head = self._alloc_frame(tid, p, digest if self.conn.cache else None)
            if t.length:
                head += self.conn.frame(WriteHeader(tid, 0, t.length))
            with self.prof.phase("stage", t.length, name=t.name):
                buf = bytearray(len(head) + t.length)  # zero-filled, then copied into: the staging cost
                buf[: len(head)] = head
                buf[len(head) :] = view
            with self.prof.phase("wire", t.length, name=t.name):
                self.conn.send(buf, self.conn.payload_tag(view) if t.length else b"")
            self._completed(tid, p)
            self.prof.count(tensors=1, calls=2, nbytes=t.length)
            self.tally.add(tensors=1, bytes=t.length, sent=t.length)
        self._barrier()  # one round trip per tensor
