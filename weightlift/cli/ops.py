"""The operator's subcommands of a running tensor server: ``stats`` and ``rm``.

:func:`register` adds them to the main parser, given how every client subcommand takes its
connection options and makes its client (``weightlift.cli.remote`` calls it), so they reach the
server as the others do (``--token-file``, ``--tls``, ``--tls-ca``). They need a server of
protocol minor 5; an older one is answered with one line saying so, never a traceback.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from weightlift.errors import OptionError

__all__ = ["register"]

ClientOf = Callable[[argparse.Namespace, str], Any]  # (parsed arguments, address) -> a connected Client


def register(sub: Any, *, connection_args: Callable[[Any], None], client: ClientOf) -> None:
    """Add ``stats`` and ``rm`` to an argparse subparsers object; ``connection_args(parser)`` adds
    the connection options, ``client(args, address)`` connects as they say."""
    _connection_args = connection_args
    st = sub.add_parser("stats", help="what a running tensor server holds and has done (its counters and models)")
    st.add_argument("address", metavar="HOST:PORT", help="the tensor server to ask")
    st.add_argument("--model", metavar="NAME", help="only this model's line ('' for the default model)")
    _connection_args(st)
    st.add_argument("--json", action="store_true", help="print the figures and models as JSON")
    st.set_defaults(func=_cmd_stats, client=client)

    rm = sub.add_parser("rm", help="drop a model (or some of its tensors) from a running tensor server")
    rm.add_argument("address", metavar="HOST:PORT", help="the tensor server")
    rm.add_argument(
        "--model",
        metavar="NAME",
        help="the model to drop, or whose tensors --tensor names (default: the default model)",
    )
    rm.add_argument(
        "--tensor", dest="names", action="append", metavar="NAME", help="drop only this tensor of the model; repeat"
    )
    rm.add_argument("--all", action="store_true", help="with no --model: drop every tensor of the default model")
    _connection_args(rm)
    rm.set_defaults(func=_cmd_rm, client=client)


# what each figure means, for the table (ServerStats' docstring says the same at more length)
_FIGURES = {
    "connections": "connections accepted since start",
    "tensors": "tensors completed since start",
    "bytes_received": "payload bytes received since start",
    "bytes_from_cache": "bytes filled from the disk cache",
    "cache_hits": "tensors filled from the disk cache",
    "memory_hits": "tensors filled from memory already held",
    "bytes_from_memory": "bytes filled from memory already held",
    "errors": "errors reported to clients",
    "pooled": "tensors placed in reused memory",
    "evicted": "connections evicted from a handshake slot",
    "pushes_committed": "pushes made visible whole",
    "pushes_refused": "pushes a limit refused part of (none of it shown)",
    "pushes_rolled_back": "pushes dropped unseen (refused, aborted, client or server gone)",
    "stats_requests": "STATS requests answered",
    "removes": "models removed",
    "tensors_held": "complete tensors held now",
    "bytes_held": "their data bytes",
    "memory_used": "bytes charged against max_memory",
    "max_memory": "the memory limit",
    "pool_idle_bytes": "reusable host memory kept idle (counted in memory_used's limit)",
    "reserve_faulted": "bytes of the reserve faulted in",
    "reserve_bytes": "bytes reserved at start",
    "open_connections": "connections being served now",
    "handshakes": "connections in their handshake",
    "max_handshakes": "handshake slots",
    "ready": "authenticated connections",
    "max_connections": "slots for them",
    "max_per_address": "connections one peer address may hold",
    "models": "models held (the default one included)",
}


def _cmd_stats(a: argparse.Namespace) -> int:
    from weightlift.remote.client.connection import printable  # model names are the server's text

    with a.client(a, a.address) as c:
        report = c.stats()
    models = report.models if a.model is None else tuple(m for m in report.models if m.name == a.model)
    if a.model is not None and not models:
        raise OptionError(f"{a.address} lists no model {a.model!r}")
    if a.json:
        out = report.as_dict()
        out["models"] = [m for m in out["models"] if a.model is None or m["name"] == a.model]
        print(json.dumps(out, indent=1))
        return 0
    if a.model is None:
        w = max(len(k) for k in report.figures)
        for key, value in report.figures.items():
            what = _FIGURES.get(key, "")
            print(f"{key:<{w}}  {value:>16,}  {what}".rstrip())
        print()
    names = [printable(m.name) if m.name else "(default)" for m in models]
    w = max([len(n) for n in names] + [5])
    print(f"{'model':<{w}}  {'tensors':>8} {'bytes':>16}  state")
    for name, m in zip(names, models, strict=True):
        print(f"{name:<{w}}  {m.tensors:>8} {m.nbytes:>16,}  {'push in flight' if m.pushing else 'ready'}")
    if report.models_total > len(report.models):
        print(f"... and {report.models_total - len(report.models)} more models not listed")
    return 0


def _cmd_rm(a: argparse.Namespace) -> int:
    if a.model is None and not a.names and not a.all:
        raise OptionError("rm: name what to drop: --model NAME, --tensor NAME, or --all for the default model")
    model = a.model or ""
    where = f"model {model!r}" if model else "the default model"
    with a.client(a, a.address) as c:
        if a.names:
            freed = c.free(a.names, model=model)
            print(f"removed {freed} of {len(a.names)} tensors of {where} on {a.address}")
        else:
            freed = c.remove(model)
            print(f"removed {where} ({freed} tensors) from {a.address}")
    return 0
