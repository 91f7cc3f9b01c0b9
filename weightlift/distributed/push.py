"""Pushing independent selections of one checkpoint to several tensor servers at once.

Each server gets its own :class:`~weightlift.remote.client.Client` on its own thread
(:class:`~weightlift.remote.client.servers.Pushes`, the one way weightlift pushes to several
servers); the checkpoint is opened once and shared, and the page cache serves every reader after
the first. Time to ready is the slowest push, not the sum. The source's uplink carries every
byte once per server, so for many receivers of the same weights a broadcast over a process group
(:func:`~.fanout.broadcast_load`) scales better; this is for different selections, or servers
outside any group.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from weightlift.checkpoint import Checkpoint, Select
from weightlift.errors import OptionError, PushError

if TYPE_CHECKING:  # the client imports sockets and threads: loaded when a push is made
    from weightlift.remote.client.client import Client
    from weightlift.remote.client.job import PushResult
    from weightlift.remote.client.servers import Address

__all__ = ["push_many", "PushError"]


def push_many(
    path: str | os.PathLike[str] | Checkpoint,
    targets: Mapping[Address, Select],
    *,
    token: str | bytes | None = None,
    streams: int = 1,
    timeout: float | None = 30.0,
) -> dict[str, PushResult]:
    """Push ``{address: select}`` (``"host:port"`` or ``(host, port)``) in parallel, one thread
    per server; returns ``{address: PushResult}`` once every push has landed. The same as
    ``Client(first).push(path, select=..., to={the others})``.

    Every push runs to its end even if another fails, a server that cannot be reached included;
    then a failure raises :class:`PushError` (a :class:`~weightlift.errors.WeightliftError`),
    which holds each error and each result.
    """
    from weightlift.remote.client.client import Client
    from weightlift.remote.client.servers import push_each

    if not targets:
        raise OptionError("push_many needs at least one target")

    def connect(address: Address) -> Client:
        return Client(address, token=token, streams=streams, timeout=timeout)

    return push_each(path, targets, connect=connect)
