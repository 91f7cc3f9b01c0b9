"""The naive receive path, kept apart for A/B runs (``WEIGHTLIFT_LOAD_OPT=0``).

Before the optimized paths a WRITE was received whole into a fresh, zero-filled buffer and then
copied into its destination. The benchmark's ``wl.push.legacy`` arm compares against it, so it
stays as it was, with one difference: the buffer is charged to max_memory while it exists, so
the naive path cannot hold memory the account does not see. A connection takes this path only
when its server's config says ``naive``: it picks its path once, when it starts.
"""

from __future__ import annotations

from weightlift.remote.protocol import WriteHeader
from weightlift.remote.server.destinations import Destinations
from weightlift.remote.server.paths import Wire
from weightlift.remote.server.pending import Pending

__all__ = ["NaivePath"]


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
                wire.device.target.write(p.dest, h.offset, buf)
            del buf
        finally:
            charge.release()
