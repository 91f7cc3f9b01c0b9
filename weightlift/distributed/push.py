"""Pushing independent selections of one checkpoint to several tensor servers at once.

Each server gets its own :class:`~weightlift.remote.client.Client` on its own thread; the checkpoint
is opened once and shared, and the page cache serves every reader after the first. Time to
ready is the slowest push, not the sum. The source's uplink carries every byte once per
server, so for many receivers of the same weights a broadcast over a process group
(:func:`~.fanout.broadcast_load`) scales better; this is for different selections, or servers
outside any group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightlift.checkpoint import Checkpoint, Select, open_checkpoint
from weightlift.errors import OptionError, PushError, WeightliftError

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
    per server; returns ``{address: PushResult}`` once every push has landed. The same as
    ``Client(first).push(path, select=..., to={the others})``.

    Every push runs to its end even if another fails; then a failure raises :class:`PushError`
    (a :class:`~weightlift.errors.WeightliftError`), which holds each error and each result.
    """
    from weightlift.remote.client.client import Client

    if not targets:
        raise OptionError("push_many needs at least one target")
    ck = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    for sel in targets.values():
        ck.select(sel)  # a selection that matches nothing fails here, before any connection
    items = list(targets.items())
    unreachable: dict[str, BaseException] = {}
    # the first server that answers carries the others' pushes (Client.push(to=...)); one that
    # does not is reported with the rest, never silently skipped
    for i, (addr, sel) in enumerate(items):
        try:
            client = Client(addr, token=token, streams=streams, timeout=timeout)
        except WeightliftError as e:
            unreachable[addr if isinstance(addr, str) else f"{addr[0]}:{addr[1]}"] = e
            continue
        with client:
            try:
                results = client.push(ck, select=sel, to=dict(items[i + 1 :]))
            except PushError as e:
                raise PushError({**unreachable, **e.errors}, e.results) from None
        if unreachable:
            raise PushError(unreachable, results)
        return results
    raise PushError(unreachable, {})
