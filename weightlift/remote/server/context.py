"""What a connection may know of its server: the settings, the store, the disk cache, the reports.

A connection is given this object instead of the :class:`~weightlift.remote.server.Server`
itself, so the seam between them is these fields and nothing private: the settings are one
frozen :class:`~weightlift.remote.server.config.ServerConfig`, tensors and memory change only
through the store, and the disk cache can only be switched off.
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

from weightlift.errors import CacheError
from weightlift.memory.targets import Target, make_target
from weightlift.remote.server.cache import TensorCache
from weightlift.remote.server.config import ServerConfig
from weightlift.remote.server.store import MemoryFull, Store

__all__ = ["Context", "RequestError", "PinBudget", "MAX_PINNED"]

#: Host memory all of a server's connections together may pin for their staging (a CUDA
#: connection pins two 64 MiB upload slots): 16 such connections at once. Pinned memory cannot be
#: paged out, and on a CUDA server max_memory counts the device, so this bounds the host's share.
MAX_PINNED = 16 * 128 * 1024 * 1024


class RequestError(Exception):
    """A request failed; its message is reported at the next barrier."""


class PinBudget:
    """The server-wide count of pinned host bytes, capped at ``limit``. Thread-safe."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Count ``n`` more pinned bytes; MemoryFull (from the store's tree) if they do not fit."""
        with self._lock:
            if self.used + n > self.limit:
                raise MemoryFull(
                    f"{n} bytes of pinned host staging would exceed the {self.limit}-byte cap on pinned "
                    f"host memory ({self.used} pinned by other connections)"
                )
            self.used += n

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


class Context:
    """``host_target`` is the target connections to host memory share; None: each connection
    makes its own with ``new_target`` (a CUDA target, at its first ALLOC). ``new_target``
    defaults to the config's device and framework."""

    def __init__(
        self,
        config: ServerConfig,
        store: Store,
        cache: TensorCache | None,
        *,
        host_target: Target | None,
        new_target: Callable[[], Target] | None = None,
    ):
        self.config = config
        self.store = store
        self.cache = cache
        self.host_target = host_target
        self.new_target = new_target or (lambda: make_target(config.device, config.framework))
        self.reports: deque[dict[str, Any]] = deque(maxlen=64)  # profiles of recently closed connections
        self.pins = PinBudget(MAX_PINNED)
        self._lock = threading.Lock()

    @property
    def pooled(self) -> bool:
        """Whether tensors land in the store's pooled host memory (a host target with memcpy fills)."""
        return self.store.pool is not None

    def disable_cache(self, exc: CacheError) -> None:
        """Stop using the disk cache (the disk is full or failing); warns once."""
        with self._lock:
            was, self.cache = self.cache, None
        if was is not None:
            warnings.warn(f"tensor cache disabled: {exc}", RuntimeWarning, stacklevel=3)
