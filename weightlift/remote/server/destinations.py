"""Making a pending tensor's destination: pooled or fresh host memory, or the target's own.

Fresh host memory that the socket will fill directly goes to this connection's
:class:`~weightlift.memory.faulter.Faulter` at once, so that helper threads fault it in ahead of
the bytes - across tensors, the next tensor's memory while this one's bytes arrive (a client
sends ALLOCs ahead of WRITEs). A tensor allocated while the server was full has part of its
charge deferred; it is charged in full here, before its memory is made.
"""

from __future__ import annotations

import contextlib

from weightlift.memory.faulter import Faulter
from weightlift.memory.fresh import policy as fill_policy
from weightlift.memory.pool import POOL_MIN
from weightlift.memory.targets import view_as
from weightlift.remote.server.context import Context, RequestError
from weightlift.remote.server.device import Device
from weightlift.remote.server.pending import Pending

__all__ = ["Destinations", "FAULT_PIECE", "FAULT_WINDOW"]

# A bf16 or fp8 destination is a numpy array of an ml_dtypes type, and importing ml_dtypes takes
# about half a second: a server pays it when it starts, not inside its first push.
with contextlib.suppress(ImportError):
    import ml_dtypes  # noqa: F401

FAULT_PIECE = 4 * 1024 * 1024  # fresh destination memory is faulted in this much at a time by the helpers ...
FAULT_WINDOW = 64 * 1024 * 1024  # ... at most this far ahead of the bytes received (weightlift.memory.faulter)


class Destinations:
    """One connection's destination maker; ``fault_ahead`` False (the naive path) never starts
    the faulter."""

    def __init__(self, ctx: Context, device: Device, *, fault_ahead: bool):
        self._ctx = ctx
        self._device = device
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
            if self._device.pooled:
                raw, fresh = self._ctx.store.take_host(p.nbytes)
                p.dest = view_as(raw, p.dtype, p.shape, self._ctx.config.framework)
            else:
                p.dest = self._device.target.empty(p.dtype, p.shape)
            # the target's own memory is, as far as anyone here knows, never touched
            p.fresh = fresh or not self._device.pooled
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
            p.charge.grow(p.deferred, p.nbytes if self._device.pooled and p.nbytes >= POOL_MIN else 0)
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
