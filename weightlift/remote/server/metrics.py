"""A Prometheus ``/metrics`` endpoint over :meth:`Server.stats` (``serve --metrics``).

The collector reads the server's stats when scraped, so nothing is counted on the push path and
nothing is counted twice. ``prometheus_client`` is imported here only, when the endpoint is
asked for (the ``metrics`` extra). The endpoint carries counts, never names or secrets; it binds
127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["COUNTERS", "serve_metrics"]

# counters since start; every other stat is a gauge (state now)
COUNTERS = frozenset(
    {"connections", "tensors", "bytes_received", "bytes_from_cache", "cache_hits", "memory_hits"}
    | {"bytes_from_memory", "errors", "evicted"}
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
