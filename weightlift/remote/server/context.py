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
from weightlift.remote.server.store import Store

__all__ = ["Context", "RequestError"]


class RequestError(Exception):
    """A request failed; its message is reported at the next barrier."""


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
