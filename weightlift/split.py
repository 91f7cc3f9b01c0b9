"""Split loads: the local part of a checkpoint into memory while the remote parts are pushed.

A model split across machines needs its local layers loaded and its remote layers pushed to
tensor servers; done one after the other, time to ready is the sum of the two. Here each
remote part is pushed by a client on its own thread while the calling thread loads the local
part, so time to ready is the slower of the halves, not their sum. Both read the same files;
the page cache serves whichever comes second.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from weightlift.checkpoint import Checkpoint, Select, matcher, open_checkpoint
from weightlift.errors import NotFoundError, OptionError
from weightlift.local.loader import load_local
from weightlift.options import LoadOptions

if TYPE_CHECKING:
    import ssl

__all__ = ["SplitResult", "parse_remote", "split_load"]


@dataclass
class SplitResult:
    """The local tensors, what each remote push reported, and the one time to ready."""

    local: dict[str, Any]
    remote: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0


def parse_remote(specs: list[str]) -> dict[str, list[str]]:
    """``["host:port=glob", ...]`` -> ``{"host:port": [globs]}`` (repeat an address to add globs)."""
    out: dict[str, list[str]] = {}
    for s in specs:
        addr, sep, sel = s.partition("=")
        if not sep or not sel or ":" not in addr:
            raise OptionError(f"--remote {s!r}: expected HOST:PORT=SELECT")
        out.setdefault(addr, []).append(sel)
    return out


def split_load(
    path: str | os.PathLike[str] | Checkpoint, opts: LoadOptions, *, tls: ssl.SSLContext | None = None
) -> SplitResult:
    """Load what no remote selection (``opts.remote``) takes, and push each remote selection, at
    the same time; the pushes use ``opts.token``, ``opts.streams`` and ``tls`` (a client TLS
    context, for servers that speak TLS), the local load the rest."""
    from weightlift.remote.client import Client
    from weightlift.remote.client.servers import Pushes

    remote: Mapping[str, Select] = opts.remote or {}
    token, streams = opts.token, opts.streams
    ck: Checkpoint = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    chosen = ck.select(opts.select)
    remote_sets: dict[str, list[str]] = {}
    taken: set[str] = set()
    for addr, sel in remote.items():
        names = [t.name for t in chosen if matcher(sel)(t.name)] if sel is not None else [t.name for t in chosen]
        if not names:
            raise NotFoundError(f"remote selection for {addr} matches no tensor", file=ck.path)
        remote_sets[addr] = names
        taken.update(names)
    local_names = [t.name for t in chosen if t.name not in taken]
    t0 = time.perf_counter()
    pushes = Pushes(  # exact names: a name may hold glob characters
        ck,
        {addr: frozenset(names) for addr, names in remote_sets.items()},
        connect=lambda addr: Client(addr, token=token, streams=streams, tls=tls),
    )
    try:
        here = replace(opts, select=frozenset(local_names), remote=None, token=None, streams=1)
        local = load_local(ck, here) if local_names else {}
    finally:
        pushes.join()
    if pushes.errors:
        raise next(iter(pushes.errors.values()))
    reports = {addr: res.as_dict() for addr, res in pushes.results.items()}
    return SplitResult(local, reports, time.perf_counter() - t0)
