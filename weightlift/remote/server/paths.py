"""How a WRITE's payload goes from the socket to its tensor: the receive paths.

A connection picks one :class:`PayloadPath` when it starts, from its server's config: the
:class:`DirectPath`, which reads each payload straight into the destination where a plain memcpy
is the right fill (host memory) and through one reused staging buffer into the target's own
fill step otherwise (a pinned slot of a CUDA target, uploaded asynchronously); or, for A/B runs
(``WEIGHTLIFT_LOAD_OPT=0``), the naive path of :mod:`.legacy`. Either way the bytes are fed to
the tensor's hash as they land (:func:`~.pending.feed`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from weightlift.errors import CacheError
from weightlift.memory.targets import populate
from weightlift.profile import Profiler
from weightlift.remote.protocol import WriteHeader
from weightlift.remote.server.destinations import Destinations
from weightlift.remote.server.device import Device
from weightlift.remote.server.pending import Pending, feed
from weightlift.remote.server.store import Store

__all__ = ["PayloadPath", "DirectPath", "Wire", "HASH_PIECE"]

HASH_PIECE = 4 * 1024 * 1024  # received-then-hashed piece: still in the CPU cache when hashed


class Wire:
    """What a receive path needs of its connection: ``payload(view)`` fills ``view`` with the
    next payload bytes from the socket; ``on_cache_error`` hears of a cache writer that failed."""

    def __init__(
        self,
        payload: Callable[[memoryview], None],
        device: Device,
        store: Store,
        prof: Profiler,
        on_cache_error: Callable[[CacheError], None],
    ):
        self.payload = payload
        self.device = device
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
        if self._wire.device.target.memcpy_ok:
            self._direct(p, h, dests)
        else:
            self._staged(p, h)

    def _direct(self, p: Pending, h: WriteHeader, dests: Destinations) -> None:
        wire = self._wire
        dest = wire.device.target.host_view(p.dest)
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
        stager = wire.device.target.stager(wire.device.staging)
        pos = 0
        while pos < h.length:
            buf = stager.take(h.length - pos)
            chunk = buf.data
            wire.receive(chunk, p.name)
            wire.feed(p, chunk)
            with wire.prof.phase("device", len(buf), name=p.name):
                stager.land(p.dest, h.offset + pos)
            pos += len(buf)
