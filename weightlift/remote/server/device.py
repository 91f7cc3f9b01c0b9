"""One connection's destination maker and its staging buffers, charged to the memory account.

A host server's connections share one stateless host target. A CUDA server's connection makes
its own target at its first ALLOC; that target pins ``PINNED_STAGING`` bytes of host memory for
its uploads, and a connection that reads device tensors back or fills a target that is not host
memory keeps one ``STAGING_BYTES`` buffer. Both are charged to max_memory when made and given
back when the connection ends, so a connection cannot hold memory the account does not see. The
pinned bytes also count against the server-wide cap on pinned host memory (``Context.pins``,
:data:`~weightlift.remote.server.context.MAX_PINNED`), since on a CUDA server max_memory counts
the device's memory, not the host's.

The server never tests a target's class: what a target pins it says itself
(:meth:`~weightlift.memory.targets.Target.pinned_bytes`), and its bytes land through its stager.
"""

from __future__ import annotations

import numpy as np

from weightlift.memory.targets import STAGING_SLOT, Target
from weightlift.remote.server.context import Context
from weightlift.remote.server.store import Charge

__all__ = ["Device", "STAGING_BYTES", "PINNED_STAGING"]

STAGING_BYTES = 8 * 1024 * 1024  # one per connection, for targets that are not host memory
PINNED_STAGING = 2 * STAGING_SLOT  # what a default CUDA target pins: two upload slots of STAGING_SLOT


class Device:
    """Where one connection's tensors go: ``target`` (made, and charged, on first use) and the
    connection's reused staging buffer (:meth:`staging`). MemoryFull when a charge does not fit."""

    def __init__(self, ctx: Context):
        self._ctx = ctx
        self._target: Target | None = ctx.host_target
        self._staging: np.ndarray | None = None
        self._charges: list[Charge] = []
        self._pinned = 0

    @property
    def target(self) -> Target:
        if self._target is None:
            target = self._ctx.new_target()
            pinned = target.pinned_bytes()
            if pinned:
                self._ctx.pins.take(pinned)  # the host's cap first: max_memory may count the device
                try:
                    self._charges.append(self._ctx.store.charge(pinned))
                except BaseException:
                    self._ctx.pins.give(pinned)
                    raise
                self._pinned = pinned
            self._target = target
        return self._target

    @property
    def pooled(self) -> bool:
        """Whether this connection's tensors land in the server's pooled host memory (checked
        without making a CUDA target)."""
        return self._ctx.pooled and self._target is self._ctx.host_target

    def staging(self) -> np.ndarray:
        """The connection's staging buffer (reused, never zero-filled)."""
        if self._staging is None:
            self._charges.append(self._ctx.store.charge(STAGING_BYTES))
            self._staging = np.empty(STAGING_BYTES, dtype=np.uint8)
        return self._staging

    def close(self) -> None:
        """The connection ended: its staging memory goes back to the account."""
        for c in self._charges:
            c.release()
        self._charges.clear()
        if self._pinned:
            self._ctx.pins.give(self._pinned)
            self._pinned = 0
