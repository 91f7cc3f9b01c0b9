"""Serving what the store holds: READ, LIST, FREE and HAVE, and the frames they go out in.

Replies leave through one connection's :class:`Outbox` (its negotiated minor, the client's frame
limit, and on a protected connection the MAC that seals each frame). A READ of host memory sends
the tensor's own bytes (scatter-gather, no copy); one of device memory goes through the
connection's staging buffer a piece at a time. A READ may name the version it listed: another
version's bytes under the listed dtype and shape would be a silent wrong tensor, so that is
refused (STALE).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from weightlift.memory.targets import as_bytes
from weightlift.remote.protocol import (
    MAX_FRAME,
    MAX_TENSORS,
    Error,
    ErrorCode,
    FrameMac,
    Free,
    FreeReply,
    Have,
    HaveReply,
    ListEntry,
    ListReply,
    ListRequest,
    Message,
    Read,
    ReadReply,
    send,
    verify_usable,
)
from weightlift.remote.server.admission import Context
from weightlift.remote.server.cache.hashing import digest_of, piece_hasher
from weightlift.remote.server.receive import Staging
from weightlift.remote.server.store import MemoryFull, model_key
from weightlift.remote.transport import Stream

__all__ = ["Outbox", "Reads"]


class Outbox:
    """One connection's outgoing frames. ``mac`` is set once the server's AUTH went out on a
    protected connection: every later frame is sealed with it."""

    def __init__(self, stream: Stream, minor: int):
        self.stream = stream
        self.minor = minor  # the negotiated minor, once HELLO is in
        self.max_frame = MAX_FRAME  # the client's frame limit, once HELLO is in
        self.mac: FrameMac | None = None

    def sealed(self, *parts: Any) -> list[Any]:
        """``parts`` (one frame and its payload), with the tag after them on a protected connection."""
        if self.mac is None:
            return list(parts)
        return [*parts, self.mac.seal(parts)]

    def reply(self, msg: Message) -> None:
        self.stream.send_parts(self.sealed(send(msg, minor=self.minor, max_frame=self.max_frame)))


class Reads:
    """The requests that read (or drop) what the store holds, for one connection."""

    def __init__(self, ctx: Context, out: Outbox, staging: Staging):
        self._ctx = ctx
        self._store = ctx.store
        self._out = out
        self._staging = staging
        self.model = ""  # the model the connection's requests name (minor 5)

    def key(self, name: str) -> str | None:
        """Where the store keeps ``name`` of this connection's model; None for a name no model
        holds (one beginning with NUL: named models' keys do)."""
        return None if name.startswith("\x00") else model_key(self.model, name)

    def have(self, msg: Have) -> None:
        cache = self._ctx.cache
        held = tuple(self._store.holds(d) or (cache is not None and cache.has(d)) for d in msg.digests)
        self._out.reply(HaveReply(held))

    def free(self, msg: Free) -> None:
        keys = tuple(k for k in map(self.key, msg.names) if k is not None)
        self._out.reply(FreeReply(self._store.free(keys)))

    def list(self, req: ListRequest) -> None:
        items, more = self._store.listing(req.after, MAX_TENSORS, self.model)
        budget = self._out.max_frame - 64
        entries: list[ListEntry] = []
        for name, e in items:
            size = 23 + len(name.encode()) + 8 * len(e.shape)
            if size > budget:
                break
            budget -= size
            entries.append(ListEntry(name, e.dtype, e.shape, e.nbytes, e.version))
        more = more or len(entries) < len(items)
        self._out.reply(ListReply(tuple(entries), more=more, generation=self._store.generation_of(self.model)))

    def read(self, r: Read) -> None:
        # the whole reply within io_timeout plus its size at min_frame_rate, as a frame coming in
        # has: a peer draining a large reply a byte per I/O timeout cannot hold its connection
        cfg = self._ctx.config
        if cfg.io_timeout is not None and cfg.min_frame_rate is not None:
            self._out.stream.send_within(cfg.io_timeout + r.length / cfg.min_frame_rate)
        try:
            self._read(r)
        finally:
            self._out.stream.send_within(None)

    def _read(self, r: Read) -> None:
        out = self._out
        key = self.key(r.name) or ""  # "": no tensor has that name
        entry = self._store.get(key)
        if entry is None:
            out.reply(Error(ErrorCode.NOT_FOUND, f"no tensor {r.name!r}"))
            return
        if (r.version and r.version != entry.version) or self._switched(r):
            out.reply(Error(ErrorCode.STALE, f"{r.name!r} was replaced since it was listed"))
            return
        if r.offset + r.length > entry.nbytes:
            why = f"READ [{r.offset}, {r.offset + r.length}) runs past the {entry.nbytes} bytes of {r.name!r}"
            out.reply(Error(ErrorCode.LIMIT, why))
            return
        # The digest is stated before the bytes, so it is taken first: of the tensor as it is now,
        # which is what the reply carries (a stored digest could predate a writer in process).
        want_digest = bool(r.flags & Read.FLAG_DIGEST) and verify_usable(out.minor)
        dest = entry.tensor
        if _is_host(dest):
            with self._store.reading(dest):  # an in-place update of it waits until these bytes are out
                if (r.version and self._store.get(key) is not entry) or self._switched(r):  # meanwhile
                    out.reply(Error(ErrorCode.STALE, f"{r.name!r} was replaced since it was listed"))
                    return
                view = as_bytes(dest).data[r.offset : r.offset + r.length]
                digest = digest_of(view) if want_digest else None
                out.stream.send_parts(out.sealed(send(ReadReply(r.length, digest), minor=out.minor), view))
            return
        try:
            staging = self._staging.buffer()
        except MemoryFull as e:
            out.reply(Error(ErrorCode.LIMIT, f"no memory to stage {r.name!r} for reading: {e}"))
            return
        self._read_device(r, dest, staging, want_digest)

    def _switched(self, r: Read) -> bool:
        """Whether the READ names a generation and another set was switched into this model since
        (minor 3)."""
        return bool(r.generation) and r.generation != self._store.generation_of(self.model)

    def _read_device(self, r: Read, dest: Any, staging: np.ndarray, want_digest: bool) -> None:
        """A READ of device memory, through the staging buffer a piece at a time."""
        import torch

        out = self._out
        flat = dest.reshape(-1).view(torch.uint8)
        stage = staging.data
        end = r.offset + r.length
        digest = None
        if want_digest:
            hasher = piece_hasher()
            for pos in range(r.offset, end, len(stage)):
                n = min(len(stage), end - pos)
                torch.from_numpy(staging[:n]).copy_(flat[pos : pos + n])
                hasher.update(stage[:n])
            digest = hasher.digest()
        head = send(ReadReply(r.length, digest), minor=out.minor)
        mac = out.mac
        if mac is not None:
            mac.begin()
            mac.update(head)
        out.stream.send_parts([head])
        for pos in range(r.offset, end, len(stage)):
            n = min(len(stage), end - pos)
            torch.from_numpy(staging[:n]).copy_(flat[pos : pos + n])
            if mac is not None:
                mac.update(stage[:n])
            out.stream.send_parts([stage[:n]])
        if mac is not None:
            out.stream.send_parts([mac.tag()])


def _is_host(dest: Any) -> bool:
    if isinstance(dest, np.ndarray):
        return True
    return getattr(getattr(dest, "device", None), "type", "cpu") == "cpu"
