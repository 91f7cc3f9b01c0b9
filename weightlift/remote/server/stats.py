"""Observation: what a server holds and has done, as one read-only value (:meth:`Server.stats`),
and the Prometheus endpoint that exports it.

Operators and tests read this instead of the server's internals. It is also a read-only mapping
of its field names to their values, so ``stats["bytes_received"]`` and ``dict(stats)`` (for a
JSON report) work as they did when the counters were a plain dictionary.

:func:`serve_metrics` serves a Prometheus ``/metrics`` endpoint over :meth:`Server.stats` (``serve --metrics``).

The collector reads the server's stats when scraped, so nothing is counted on the push path and
nothing is counted twice. ``prometheus_client`` is imported here only, when the endpoint is
asked for (the ``metrics`` extra). The endpoint carries counts, never names or secrets; it binds
127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["ServerStats", "COUNTERS", "serve_metrics"]


@dataclass(frozen=True)
class ServerStats(Mapping[str, int]):
    """A snapshot of a server (each figure read under its own lock, not all at one instant).

    Counters since start: ``connections`` accepted, ``tensors`` completed, ``bytes_received``
    (payload bytes over the wire), ``cache_hits`` and ``bytes_from_cache`` (filled from the
    disk cache), ``memory_hits`` and ``bytes_from_memory`` (filled from tensors the server
    already held), ``errors`` reported, ``pooled`` (tensors placed in reused memory instead of
    fresh), ``evicted`` (connections evicted from their handshake slot), ``pushes_committed``
    (checkpoints and updates made visible whole), ``pushes_refused`` (those a limit refused part
    of), ``pushes_rolled_back`` (dropped unseen: refused, aborted, their client or the server
    gone), ``stats_requests`` (STATS answered), ``removes`` (models removed).

    State now: ``tensors_held`` and ``bytes_held`` (complete tensors and their data bytes),
    ``memory_used`` of ``max_memory`` (every charge: tensors, in flight or held, frame buffers,
    staging), ``pool_idle_bytes`` (touched host memory kept for reuse, counted against the
    limit too), ``reserve_faulted`` of ``reserve_bytes``, ``open_connections`` (connections
    being served), ``handshakes`` of ``max_handshakes`` and ``ready`` of ``max_connections``
    (slots in use), ``max_per_address``, ``models`` (models holding tensors, the default one
    included).
    """

    connections: int
    tensors: int
    bytes_received: int
    bytes_from_cache: int
    cache_hits: int
    memory_hits: int
    bytes_from_memory: int
    errors: int
    pooled: int
    evicted: int
    pushes_committed: int
    pushes_refused: int
    pushes_rolled_back: int
    stats_requests: int
    removes: int
    tensors_held: int
    bytes_held: int
    memory_used: int
    max_memory: int
    pool_idle_bytes: int
    reserve_faulted: int
    reserve_bytes: int
    open_connections: int
    handshakes: int
    max_handshakes: int
    ready: int
    max_connections: int
    max_per_address: int
    models: int

    def __getitem__(self, key: str) -> int:
        if key not in _NAMES:
            raise KeyError(key)
        value: int = getattr(self, key)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(_NAMES)

    def __len__(self) -> int:
        return len(_NAMES)


_NAMES: tuple[str, ...] = tuple(f.name for f in fields(ServerStats))


# counters since start; every other stat is a gauge (state now)
COUNTERS = frozenset(
    {"connections", "tensors", "bytes_received", "bytes_from_cache", "cache_hits", "memory_hits"}
    | {"bytes_from_memory", "errors", "evicted"}
    | {"pushes_committed", "pushes_refused", "pushes_rolled_back", "stats_requests", "removes"}
)


class _Collector:
    def __init__(self, stats: Callable[[], Mapping[str, int]]):
        self._stats = stats

    def describe(self) -> list[Any]:
        return []  # the names come from the stats themselves, at scrape time

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, value in self._stats().items():
            metric = f"weightlift_server_{name}"
            doc = f"weightlift server stat {name!r} (see ServerStats)"
            family = CounterMetricFamily if name in COUNTERS else GaugeMetricFamily
            yield family(metric, doc, value=value)


def serve_metrics(stats: Callable[[], Mapping[str, int]], host: str, port: int) -> tuple[Any, int]:
    """Serve ``/metrics`` on ``host:port`` in a daemon thread; (the HTTP server, its port)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(stats))
    httpd, _thread = start_http_server(port, addr=host, registry=registry)
    return httpd, httpd.server_address[1]
