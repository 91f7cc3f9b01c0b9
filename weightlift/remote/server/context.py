"""What a connection may know of its server: settings, the store, the disk cache, the reports.

A connection is given this object instead of the :class:`~weightlift.remote.server.Server`
itself, so the seam between them is these fields and nothing private: settings are read-only,
tensors and memory change only through the store, and the disk cache can only be switched off.
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from weightlift.errors import CacheError
from weightlift.memory.targets import Target
from weightlift.remote.server.cache import TensorCache
from weightlift.remote.server.store import Store

__all__ = ["Context", "RequestError"]


class RequestError(Exception):
    """A request failed; its message is reported at the next barrier."""


@dataclass
class Context:
    device: str
    framework: str
    host_target: Target | None  # shared by connections to host memory; None: each makes its own (CUDA)
    token: bytes | None
    minor: int  # the newest minor version this server speaks
    handshake_timeout: float
    idle_timeout: float | None  # seconds a READY connection may wait between requests; None: no limit
    io_timeout: float | None  # seconds one receive inside a frame, or one send, may wait; None: no limit
    min_frame_rate: int | None  # bytes per second a frame must arrive at, beyond io_timeout; None: no floor
    opt: bool  # False: WEIGHTLIFT_LOAD_OPT=0, the naive receive paths
    profile: bool | None
    store: Store
    cache: TensorCache | None
    reports: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=64))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def max_memory(self) -> int:
        return self.store.max_memory

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
