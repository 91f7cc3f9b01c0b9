"""The remote subcommands: ``serve``, ``push``, ``pull`` and ``ls``. Parsing only; the work is in
:mod:`weightlift.remote.server` and :mod:`weightlift.remote.client`.

``register(subparsers)`` adds them to the main parser (``weightlift.cli`` calls it). A user
mistake raises a weightlift error, which the main CLI prints as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from weightlift.cli import ops
from weightlift.errors import IntegrityError, OptionError, install_hint
from weightlift.progress import terminal
from weightlift.remote.server.config import MIN_FRAME_RATE
from weightlift.remote.token import read_token

if TYPE_CHECKING:  # the client imports sockets and threads: loaded by the commands that use it
    import ssl

    from weightlift.remote.client.client import Client, PushResult

__all__ = ["register", "connection_args", "link", "DEFAULT_PORT", "parse_size", "read_token"]

DEFAULT_PORT = 7733
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from ``"1073741824"``, ``"512M"``, ``"8GiB"`` (binary units); OptionError otherwise."""
    m = _SIZE.match(text)
    if not m:
        raise OptionError(f"size {text!r} is not a number of bytes (e.g. 8589934592, 512M, 8G)")
    unit = (m.group(2) or "").lower()[:1]
    return int(m.group(1)) * _UNITS[unit]


def register(sub: Any) -> None:
    """Add ``serve``, ``push``, ``pull`` and ``ls`` to an argparse subparsers object (``stats`` and
    ``rm``, from :mod:`weightlift.cli.ops`, too)."""
    _register_serve(sub)
    _register_push(sub)
    _register_pull_ls(sub)
    ops.register(sub, connection_args=connection_args, client=_client)


def _register_serve(sub: Any) -> None:
    s = sub.add_parser("serve", help="run a tensor server that receives pushed weights")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need a token)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to bind (default {DEFAULT_PORT}; 0 picks one)")
    s.add_argument("--device", default="cpu", help="where tensors land: cpu or cuda[:N]")
    s.add_argument("--framework", choices=["numpy", "torch"], help="numpy (default on cpu) or torch (always on cuda)")
    s.add_argument("--cache-dir", metavar="DIR", help="keep a content-addressed cache of received tensors here")
    s.add_argument(
        "--cache-max",
        metavar="BYTES",
        help="cap on the disk cache (e.g. 100G, or none); the least recently used entries go first (default: "
        "half the space free for the cache when the server starts)",
    )
    s.add_argument("--token-file", metavar="F", help="clients must prove they hold the token in this file")
    s.add_argument("--insecure", action="store_true", help="allow a non-loopback address without a token")
    s.add_argument("--tls-cert", metavar="F", help="speak TLS with this certificate (PEM; needs --tls-key)")
    s.add_argument("--tls-key", metavar="F", help="the private key of --tls-cert (PEM)")
    s.add_argument(
        "--peer-token-file",
        metavar="F",
        help="the token this server presents to the next server of a relayed push (default: --token-file's)",
    )
    s.add_argument(
        "--peer-tls-ca",
        metavar="F",
        help="speak TLS to the next server of a relayed push, trusting this CA (PEM) for its certificate",
    )
    s.add_argument(
        "--max-memory",
        metavar="BYTES",
        help="cap on bytes allocated for all clients (e.g. 8G; default: 90%% of physical RAM for cpu, the "
        "device's total memory for cuda; each tensor also counts its bookkeeping: see SECURITY.md)",
    )
    s.add_argument(
        "--reserve",
        metavar="BYTES",
        help="fault this much host memory in at start, in the background, so the first push lands in "
        "memory already backed (e.g. 16G; counts against --max-memory; cpu only)",
    )
    s.add_argument(
        "--idle-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="close a connection that sends no request for S seconds (default 300; 0: never)",
    )
    s.add_argument(
        "--io-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="close a connection stalled S seconds inside a message or a reply (default 60; 0: never), and "
        "refuse an in-place commit that READs of its tensors hold up as long, at most 20 s",
    )
    s.add_argument(
        "--max-per-address",
        type=int,
        default=32,
        metavar="N",
        help="connections one peer address may hold at once; the loopback range and an IPv6 /64 "
        "count as one address (default 32)",
    )
    s.add_argument(
        "--min-frame-rate",
        type=int,
        default=MIN_FRAME_RATE,
        metavar="BYTES_PER_S",
        help="a frame of N bytes must arrive within --io-timeout plus N over this rate, so a peer "
        f"trickling bytes cannot hold a connection (default {MIN_FRAME_RATE}; 0: no such deadline)",
    )
    s.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="what the server logs to stderr, one key=value line per event (default info: connections, refusals)",
    )
    s.add_argument(
        "--ready-file",
        metavar="F",
        help="write HOST:PORT to this file once the server listens (a supervisor's readiness check); "
        "removed when the server stops",
    )
    s.add_argument(
        "--metrics",
        metavar="[HOST:]PORT",
        help="serve Prometheus metrics (the server's stats) over HTTP here; HOST defaults to 127.0.0.1 "
        f"(needs the metrics extra: {install_hint('metrics')})",
    )
    s.add_argument(
        "--shard-rules",
        metavar="FILE|NAME",
        help="hold only this rank's slices, taken as REGIONs from sharded senders: a JSON file "
        '({"pattern": placement, ...}, or {"rules": {...}, "fused": {"name": [part sizes]}, "default": ..., '
        '"uneven": ...}) or a name: ' + ", ".join(sorted(SHARD_PRESETS)) + " (needs --rank and --world)",
    )
    s.add_argument("--rank", type=int, metavar="R", help="with --shard-rules: this server's tensor-parallel rank")
    s.add_argument("--world", type=int, metavar="W", help="with --shard-rules: the tensor-parallel degree")
    s.set_defaults(func=_cmd_serve)


#: Named --shard-rules: vLLM's tensor parallelism of a Hugging Face Llama-style checkpoint (q, k, v,
#: gate and up column-parallel, o and down row-parallel, vocabulary-parallel embeddings and head).
SHARD_PRESETS: dict[str, dict[str, Any]] = {
    "llama": {
        "rules": {
            "*.q_proj.*": "colwise",
            "*.k_proj.*": "colwise",
            "*.v_proj.*": "colwise",
            "*.gate_proj.*": "colwise",
            "*.up_proj.*": "colwise",
            "*.o_proj.*": "rowwise",
            "*.down_proj.*": "rowwise",
            "*embed_tokens*": "colwise",
            "lm_head*": "colwise",
        }
    },
}


def _shard_options(a: argparse.Namespace) -> dict[str, Any]:
    """``shard=`` and ``fused=`` for the server from --shard-rules, --rank and --world."""
    if a.shard_rules is None:
        if a.rank is not None or a.world is not None:
            raise OptionError("--rank and --world go with --shard-rules")
        return {}
    if a.rank is None or a.world is None:
        raise OptionError("--shard-rules needs --rank and --world")
    from weightlift.distributed.shard import Shard

    spec: Any = SHARD_PRESETS.get(a.shard_rules)
    if spec is None:
        try:
            spec = json.loads(Path(a.shard_rules).read_text())
        except FileNotFoundError:
            raise OptionError(
                f"--shard-rules {a.shard_rules!r}: no such file, nor one of {sorted(SHARD_PRESETS)}"
            ) from None
        except (OSError, ValueError) as e:
            raise OptionError(f"--shard-rules {a.shard_rules!r}: not a readable JSON file: {e}") from None
    if not isinstance(spec, dict):
        raise OptionError(f"--shard-rules {a.shard_rules!r}: expected a JSON object")
    if "rules" not in spec:
        spec = {"rules": spec}
    unknown = set(spec) - {"rules", "fused", "default", "uneven"}
    if unknown:
        raise OptionError(f"--shard-rules {a.shard_rules!r}: unknown keys {sorted(unknown)}")
    shard = Shard(
        spec["rules"], rank=a.rank, world=a.world, default=spec.get("default"), uneven=spec.get("uneven", "chunk")
    )
    return {"shard": shard, "fused": spec.get("fused")}


def connection_args(p: Any) -> None:
    """How every client subcommand (push, pull, ls, load --remote, check --from) reaches a server
    that wants a token or speaks TLS; :func:`link` reads them back."""
    p.add_argument("--token-file", metavar="F", help="prove to the server that we hold the token in this file")
    p.add_argument("--tls", action="store_true", help="speak TLS to a server started with --tls-cert")
    p.add_argument("--tls-ca", metavar="F", help="trust this CA (PEM) for the server's certificate (implies --tls)")


def link(a: argparse.Namespace) -> tuple[bytes | None, ssl.SSLContext | None]:
    """The token and the client TLS context (None: plain TCP) that :func:`connection_args` asked for."""
    tls = None
    if a.tls or a.tls_ca:
        from weightlift.remote.transport import client_tls_context

        tls = client_tls_context(a.tls_ca)
    return read_token(a.token_file), tls


def _register_push(sub: Any) -> None:
    from weightlift.cli.main import PATH_HELP

    p = sub.add_parser("push", help="send a checkpoint's tensors to a tensor server")
    p.add_argument("path", help=PATH_HELP)
    p.add_argument("--to", required=True, metavar="HOST:PORT", help="the tensor server to push to")
    p.add_argument("--select", action="append", metavar="PATTERN", help="a glob, or re:<regex>; repeat for several")
    p.add_argument("--streams", type=int, default=1, help="connections to spread the tensors over")
    p.add_argument("--model", metavar="NAME", help="push into this model on the server (default: the default model)")
    connection_args(p)
    p.add_argument(
        "--verify",
        action="store_true",
        help="the server reports the digest of every tensor it stored; exit 1 naming each one that differs from "
        "--manifest, else the published manifest beside PATH, else (said so) the file as it is now",
    )
    p.add_argument(
        "--manifest",
        metavar="FILE",
        help="implies --verify: the published manifest (path or URL) whose digests the server must report",
    )
    p.add_argument("--json", action="store_true", help="print the result and profile as JSON")
    p.add_argument("--profile", action="store_true", help="print where the time went")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace of the push")
    p.set_defaults(func=_cmd_push)


def _register_pull_ls(sub: Any) -> None:
    g = sub.add_parser("pull", help="save everything a tensor server holds as a .safetensors file")
    g.add_argument("--from", dest="source", required=True, metavar="HOST:PORT", help="the tensor server to pull from")
    g.add_argument("-o", "--output", required=True, metavar="FILE.safetensors", help="the file to write")
    g.add_argument("--model", metavar="NAME", help="pull this model (default: the default model)")
    connection_args(g)
    g.add_argument(
        "--verify",
        action="store_true",
        help="the server states each tensor's digest; keep the file only if every tensor arrived as stated",
    )
    g.set_defaults(func=_cmd_pull)

    ls = sub.add_parser("ls", help="list the tensors a tensor server holds")
    ls.add_argument("--from", dest="source", required=True, metavar="HOST:PORT", help="the tensor server to list")
    ls.add_argument("--model", metavar="NAME", help="list this model (default: the default model)")
    connection_args(ls)
    ls.add_argument("--json", action="store_true", help="print the list as JSON")
    ls.set_defaults(func=_cmd_ls)


def _cache_cap(text: str | None) -> int | Literal["auto"] | None:
    if text is None:
        return "auto"
    return None if text.lower() == "none" else parse_size(text)


class _Terminated(BaseException):
    """SIGTERM: a supervisor's ordinary stop, answered with a clean close and exit status 0."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s", "%Y-%m-%dT%H:%M:%S")
    )
    for name in ("weightlift.server", "weightlift.remote.server"):
        logger = logging.getLogger(name)
        logger.setLevel(level.upper())
        logger.addHandler(handler)
        logger.propagate = False


def _start_metrics(server: Any, where: str) -> None:
    host, _, port = where.rpartition(":")
    if not port.isdigit():
        raise OptionError(f"--metrics {where!r} is not [HOST:]PORT")
    try:
        from weightlift.remote.server.stats import serve_metrics

        _, bound = serve_metrics(server.stats, host or "127.0.0.1", int(port))
    except ImportError:
        raise OptionError(f"--metrics needs prometheus_client: {install_hint('metrics')}") from None
    except OSError as e:
        raise OptionError(f"--metrics {where}: cannot bind: {e.strerror or e}") from None
    print(f"weightlift: metrics on http://{host or '127.0.0.1'}:{bound}/metrics", flush=True)


def _cmd_serve(a: argparse.Namespace) -> int:
    from weightlift.remote.server.server import Server
    from weightlift.remote.transport import client_tls_context, server_tls_context

    framework = a.framework or ("numpy" if a.device == "cpu" else "torch")
    if (a.tls_cert is None) != (a.tls_key is None):
        raise OptionError("--tls-cert and --tls-key go together")
    tls = server_tls_context(a.tls_cert, a.tls_key) if a.tls_cert is not None else None
    server = Server(
        a.host,
        a.port,
        device=a.device,
        framework=framework,
        cache_dir=a.cache_dir,
        cache_max_bytes=_cache_cap(a.cache_max),
        token=read_token(a.token_file),
        insecure=a.insecure,
        max_memory=parse_size(a.max_memory) if a.max_memory is not None else None,
        reserve=parse_size(a.reserve) if a.reserve is not None else 0,
        idle_timeout=a.idle_timeout or None,
        io_timeout=a.io_timeout or None,
        max_per_address=a.max_per_address,
        min_frame_rate=a.min_frame_rate or None,
        tls=tls,
        **_shard_options(a),
        peer_token=read_token(a.peer_token_file),
        peer_tls=client_tls_context(a.peer_tls_ca) if a.peer_tls_ca is not None else None,
    )
    host, port = server.bind()
    if a.metrics:
        _start_metrics(server, a.metrics)
    cache = f", cache {a.cache_dir}" if a.cache_dir else ""
    auth = ", token required" if a.token_file else ""
    auth += ", TLS" if tls is not None else ""
    auth += f", slices of rank {a.rank} of {a.world}" if a.shard_rules else ""
    print(f"weightlift: serving on {host}:{port} (device {a.device}, {framework}{cache}{auth})", flush=True)
    _setup_logging(a.log_level)
    # SIGTERM closes the server as Ctrl-C does (a push in flight is dropped, never published; the
    # cache entries still queued are written) but is a clean stop: exit status 0
    signal.signal(signal.SIGTERM, _on_sigterm)
    if a.ready_file:
        Path(a.ready_file).write_text(f"{host}:{port}\n")
    try:
        server.serve_forever()
    except _Terminated:
        logging.getLogger("weightlift.server").info("event=stop reason=SIGTERM")
    finally:
        server.close()
        if a.ready_file:
            Path(a.ready_file).unlink(missing_ok=True)
    return 0


def _client(a: argparse.Namespace, address: str, **kw: Any) -> Client:
    from weightlift.remote.client.client import Client

    token, tls = link(a)
    return Client(address, token=token, tls=tls, **kw)


def _cmd_push(a: argparse.Namespace) -> int:
    from weightlift.profile import Profiler

    if a.streams < 1:
        raise OptionError(f"--streams must be at least 1, got {a.streams}")
    want = a.profile or a.json or a.trace
    prof = Profiler(enabled=True, trace=bool(a.trace)) if want else None
    verify = a.verify or a.manifest is not None
    bar = terminal(f"pushing to {a.to}", enabled=not a.json)
    with _client(a, a.to, streams=a.streams, profile=prof) as c:
        try:
            result = c.push(a.path, select=a.select, verify=verify, manifest=a.manifest, progress=bar, model=a.model)
        except IntegrityError as e:  # the push ran; its bytes are wrong: exit 1, as verify does
            print(f"weightlift: {e}", file=sys.stderr)
            return 1
    if a.trace:
        prof.write_trace(a.trace)  # type: ignore[union-attr]
    if a.json:
        print(json.dumps(result.as_dict(), indent=1))
        return 0
    rate = result.bytes / result.seconds / 1e9 if result.seconds > 0 else 0.0
    print(
        f"pushed {result.tensors} tensors, {result.bytes:,} bytes to {a.to} in {result.seconds:.3f} s ({rate:.2f} GB/s); "
        f"{result.bytes_sent:,} bytes sent, {result.bytes_hashed:,} hashed, {result.cached} from the server's cache"
        + (_verified(result) if verify else "")
    )
    if a.profile and prof is not None:
        print(prof.format())
    return 0


def _verified(result: PushResult) -> str:
    """What the server's digests were checked against; "verified" only against a published manifest."""
    if result.manifest is not None:
        return f"; {result.verified} verified on the server against the published manifest {result.manifest}"
    return (
        f"; {result.verified} checked on the server against the files as they are now "
        "(no published manifest: not proof that they are what was published)"
    )


def _cmd_pull(a: argparse.Namespace) -> int:
    with _client(a, a.source) as c:
        try:
            entries = c.pull(a.output, verify=a.verify, progress=terminal(f"pulling from {a.source}"), model=a.model)
        except IntegrityError as e:
            print(f"weightlift: {e}", file=sys.stderr)
            return 1
    total = sum(e.nbytes for e in entries)
    # the server's stated digests are of what it holds, not published ones
    verified = ", every tensor equal to what the server holds (its stated BLAKE3)" if a.verify else ""
    print(f"pulled {len(entries)} tensors, {total:,} bytes from {a.source} into {a.output}{verified}")
    return 0


def _cmd_ls(a: argparse.Namespace) -> int:
    from weightlift.remote.client.connection import printable  # names are the server's text

    with _client(a, a.source) as c:
        entries = c.list(model=a.model)
    if a.json:
        print(
            json.dumps(
                [{"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "nbytes": e.nbytes} for e in entries],
                indent=1,
            )
        )
        return 0
    names = [printable(e.name) for e in entries]
    w = max([len(n) for n in names] + [4])
    print(f"{'name':<{w}}  {'dtype':<8} {'shape':<22} {'bytes':>14}")
    for name, e in zip(names, entries, strict=False):
        print(f"{name:<{w}}  {e.dtype:<8} {str(list(e.shape)):<22} {e.nbytes:>14}")
    total = sum(e.nbytes for e in entries)
    print(f"{len(entries)} tensors, {total:,} bytes on {a.source}", file=sys.stdout)
    return 0
