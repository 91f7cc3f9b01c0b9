"""Pushing independent selections of one checkpoint to several tensor servers at once.

Each server gets its own :class:`~weightlift.remote.client.Client` on its own thread; the checkpoint
is opened once and shared, and the page cache serves every reader after the first. Time to
ready is the slowest push, not the sum. The source's uplink carries every byte once per
server, so for many receivers of the same weights a broadcast over a process group
(:func:`~.fanout.broadcast_load`) scales better; this is for different selections, or servers
outside any group.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from weightlift.checkpoint import Checkpoint, Select, open_checkpoint
from weightlift.errors import OptionError, PushError

__all__ = ["push_many", "PushError"]


def push_many(
    path: Any,
    targets: Mapping[Any, Select],
    *,
    token: str | bytes | None = None,
    streams: int = 1,
    timeout: float | None = 30.0,
) -> dict[str, Any]:
    """Push ``{address: select}`` (``"host:port"`` or ``(host, port)``) in parallel, one thread
    per server; returns ``{address: PushResult}`` once every push has landed.

    Every push runs to its end even if another fails; then a failure raises :class:`PushError`
    (a :class:`~weightlift.errors.WeightliftError`), which holds each error and each result.
    """
    from weightlift.remote.client.client import Client

    if not targets:
        raise OptionError("push_many needs at least one target")
    ck = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    for sel in targets.values():
        ck.select(sel)  # a selection that matches nothing fails here, before any connection
    results: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}
    lock = threading.Lock()

    def push(addr: Any, sel: Select) -> None:
        key = addr if isinstance(addr, str) else f"{addr[0]}:{addr[1]}"
        try:
            with Client(addr, token=token, streams=streams, timeout=timeout) as c:
                res = c.push(ck, select=sel)
            with lock:
                results[key] = res
        except Exception as e:  # noqa: BLE001 - gathered and raised in the caller's thread
            with lock:
                errors[key] = e

    threads = [threading.Thread(target=push, args=(a, s), name=f"wl-push-{a}", daemon=True) for a, s in targets.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise PushError(errors, results)
    return results
