"""The command line: parses arguments and calls the library; nothing else lives here.

A user mistake (missing file, bad checkpoint, bad option) prints one line naming the file and
the problem and exits with status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from weightlift.errors import IntegrityError, WeightliftError

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # one line, like every other user mistake, instead of argparse's usage dump
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _add_select(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--select",
        action="append",
        metavar="PATTERN",
        help="tensor names to take: a glob, or re:<regex>; repeat for several",
    )


def _cmd_inspect(a: argparse.Namespace) -> int:
    from weightlift.checkpoint import open_checkpoint

    ck = open_checkpoint(a.path)
    tensors = ck.select(a.select)
    if a.json:
        print(
            json.dumps(
                {
                    "path": ck.path,
                    "format": ck.format,
                    "files": ck.files,
                    "tensors": [
                        {
                            "name": t.name,
                            "dtype": t.dtype,
                            "shape": list(t.shape),
                            "file": t.file,
                            "offset": t.offset,
                            "length": t.length,
                        }
                        for t in tensors
                    ],
                    "total_bytes": sum(t.length for t in tensors),
                    "metadata": {k: v for k, v in ck.metadata.items() if _jsonable(v)},
                },
                indent=1,
            )
        )
        return 0
    names = [_shown(t.name) for t in tensors]
    w = max([len(n) for n in names] + [4])
    print(f"{'name':<{w}}  {'dtype':<8} {'shape':<22} {'offset':>14} {'bytes':>14}")
    for t, name in zip(tensors, names, strict=False):
        print(f"{name:<{w}}  {t.dtype:<8} {str(list(t.shape)):<22} {t.offset:>14} {t.length:>14}")
    total = sum(t.length for t in tensors)
    print(
        f"{len(tensors)} tensors, {total:,} bytes ({total / 2**30:.3f} GiB) in {len(ck.files)} file(s), format {ck.format}"
    )
    return 0


def _shown(name: str) -> str:
    """A tensor name as one row of text: control characters (a newline, a terminal escape) and
    characters stdout cannot encode are shown as escapes, so a hostile name can neither break
    the table nor the terminal."""
    if not name.isprintable():
        name = "".join(c if c.isprintable() else repr(c)[1:-1] for c in name)
    enc = getattr(sys.stdout, "encoding", None) or "utf-8"
    try:
        return name.encode(enc, "backslashreplace").decode(enc)
    except LookupError:
        return name.encode("ascii", "backslashreplace").decode("ascii")


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return len(json.dumps(v)) < 4096
    except (TypeError, ValueError):
        return False


#: What a load imports on first use, which the CLI imports before the load's clock starts.
_HEAVY = ("torch", "ml_dtypes")


def _import_first(a: argparse.Namespace) -> tuple[list[str], float]:
    """Import what the load would import on first use, and time it apart from the load: torch
    for torch tensors, ml_dtypes for bfloat16 or float8 arrays. Resolving each dtype the load
    will hand out (the checkpoint's, the cast's) imports exactly what it needs. Returns the
    modules imported here and the seconds it took; a checkpoint in a store is not opened twice
    (its dtypes import what they need inside the load)."""
    from weightlift.checkpoint import open_checkpoint
    from weightlift.dtypes import numpy_dtype, torch_dtype
    from weightlift.sources import is_url

    as_torch = a.framework == "torch" or a.device != "cpu"
    names = set() if is_url(a.path) else {t.dtype for t in open_checkpoint(a.path).select(a.select)}
    names |= {a.dtype.upper()} if a.dtype else set()
    before = [m for m in _HEAVY if m not in sys.modules]
    t0 = time.perf_counter()
    try:
        if as_torch:
            import torch  # noqa: F401
        for name in sorted(names):
            try:
                torch_dtype(name) if as_torch else numpy_dtype(name)
            except WeightliftError:  # not a dtype the load takes: the load says so
                pass
    except ImportError:  # torch is not installed: the load says what to do
        pass
    return [m for m in before if m in sys.modules], time.perf_counter() - t0


def _cmd_load(a: argparse.Namespace) -> int:
    from weightlift.api import load
    from weightlift.profile import Profiler

    imported, import_seconds = _import_first(a)
    prof = Profiler(enabled=True, trace=bool(a.trace)) if (a.profile or a.trace) else None
    report: dict[str, Any] = {}
    kwargs = dict(
        device=a.device,
        framework=a.framework,
        dtype=a.dtype,
        copy=not a.no_copy,
        page_cache=a.page_cache,
        threads=a.threads,
        dequantize=a.dequantize,
        profile=prof,
        report=report,
    )
    if a.verify or a.manifest:
        kwargs["verify"] = True
        kwargs["manifest"] = a.manifest
    try:
        if a.remote:
            _split_load(a, kwargs)
        else:
            load(a.path, select=a.select, **kwargs)
    except IntegrityError as e:  # the load ran; its bytes are not the ones checked against: exit 1, as verify does
        print(f"weightlift: {e}", file=sys.stderr)
        return 1
    if prof is not None and a.trace:
        prof.write_trace(a.trace)
    report["imported"], report["import_seconds"] = imported, import_seconds
    if a.json:
        print(json.dumps(report, indent=1))
        return 0
    if imported:  # not the load's time: said apart
        print(f"imported {', '.join(imported)} in {import_seconds:.2f} s (before the load, not in its time)")
    src = report.get("source")
    where = (
        f"{src['requests']} ranged reads on {src['connections']} connections"
        if src
        else f"{report['resident_before'] * 100:.0f} % of the file was resident before the load"
    )
    print(
        f"loaded {report['tensors']} tensors, {report['bytes']:,} bytes in {report['seconds']:.3f} s "
        f"({report['bytes'] / max(report['seconds'], 1e-9) / 1e9:.2f} GB/s) to {a.device}/{a.framework}; {where}"
    )
    if "verify" in report:  # what the landed bytes were checked against, in one line
        print(report["verify"])
    for addr, r in report.get("remote", {}).items():
        print(f"pushed {r['tensors']} tensors, {r['bytes']:,} bytes to {addr} in {r['seconds']:.3f} s")
    if prof is not None:
        print(prof.format())
    return 0


def _split_load(a: argparse.Namespace, kwargs: dict[str, Any]) -> None:
    """``load --remote``: :func:`weightlift.load`'s split kind, reaching the servers as every client
    command does (token, TLS)."""
    from weightlift.api import kind_for
    from weightlift.cli.remote import link
    from weightlift.options import LoadOptions
    from weightlift.split import parse_remote, split_load

    token, tls = link(a)
    opts = LoadOptions(select=a.select, remote=parse_remote(a.remote), token=token, **kwargs)
    kind_for(opts)  # what a split load does not take (--verify, ...) is refused as load refuses it
    res = split_load(a.path, opts, tls=tls)
    if opts.report is not None:
        opts.report["remote"] = res.remote
        opts.report["seconds"] = res.seconds


def _cmd_manifest(a: argparse.Namespace) -> int:
    from weightlift.digest.published import default_manifest_path, make_manifest
    from weightlift.digest.sidecar import write_atomic
    from weightlift.sources import is_url

    m = make_manifest(a.path, select=a.select, sketch=a.sketch)
    if a.output == "-":
        sys.stdout.write(m.to_json())
        return 0
    out = a.output or default_manifest_path(a.path)
    try:
        if is_url(out):  # published beside the checkpoint, in its store
            from weightlift.sources.objects import Objects

            Objects(out).put(out, m.to_json().encode())
        else:
            write_atomic(out, m.to_json().encode())
    except WeightliftError:  # the store's, already saying what failed (some are OSErrors too)
        raise
    except OSError as e:
        from weightlift.errors import FileError

        raise FileError(f"cannot write manifest: {e.strerror or e}", file=out, errno=e.errno) from None
    total = sum(e.length for e in m.entries)
    print(f"{len(m.entries)} tensors, {total:,} bytes; manifest digest {m.digest}; written to {out}")
    return 0


def _cmd_verify(a: argparse.Namespace) -> int:
    from weightlift.checkpoint import open_checkpoint
    from weightlift.digest.published import default_manifest_path, find_published, read_manifest, verify_checkpoint

    ck = open_checkpoint(a.path)
    # where every verify looks: beside the checkpoint's file, then in its folder or prefix
    path = a.manifest or find_published(ck) or default_manifest_path(a.path)
    m = read_manifest(path)
    differ = verify_checkpoint(ck, m, select=a.select)
    if a.json:
        print(json.dumps({"manifest": path, "digest": m.digest, "ok": not differ, "differ": differ}, indent=1))
    else:
        for d in differ:
            print(f"differs: {_shown(d)}")
        print(f"{'FAILED' if differ else 'OK'}: {len(differ)} tensor(s) differ from {path} (digest {m.digest})")
    return 1 if differ else 0


def _cmd_demo(a: argparse.Namespace) -> int:
    from weightlift.cli.demo import run_demo

    out = run_demo(rounds=a.rounds, push=not a.no_push, progress=not a.json)
    if a.json:
        print(json.dumps(out, indent=1, default=str))
    return 0


#: What a checkpoint argument takes, said once for every command that reads one.
PATH_HELP = (
    "the checkpoint: a .safetensors or .gguf file, a shard index, a folder holding one, or an "
    "s3:// or https:// URL of one"
)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="weightlift", description="Model weights from disk or another machine into memory, fast.")
    p.add_argument("--version", action="version", version=f"weightlift {_version()}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    d = sub.add_parser("demo", help="make (once) and load a ~1 GiB synthetic checkpoint; compare with safetensors")
    d.add_argument("--rounds", type=int, default=3, help="timed rounds of each step (default 3)")
    d.add_argument("--no-push", action="store_true", help="skip the push to a loopback tensor server")
    d.add_argument("--json", action="store_true", help="print the figures as JSON")
    d.set_defaults(func=_cmd_demo)

    i = sub.add_parser("inspect", help="list a checkpoint's tensors without reading data")
    i.add_argument("path", help=PATH_HELP)
    _add_select(i)
    i.add_argument("--json", action="store_true", help="print the tensors as JSON")
    i.set_defaults(func=_cmd_inspect)

    ld = sub.add_parser("load", help="load a checkpoint into memory and report the time to ready")
    ld.add_argument("path", help=PATH_HELP)
    ld.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ld.add_argument(
        "--framework", default="numpy", choices=["numpy", "torch"], help="numpy arrays (default) or torch tensors"
    )
    _add_select(ld)
    ld.add_argument("--dtype", help="cast floating-point tensors on load (e.g. F16, BF16, F32)")
    ld.add_argument("--no-copy", action="store_true", help="host only: read-only views of the mapping")
    ld.add_argument("--page-cache", choices=["keep", "evict"], help="override the page-cache policy")
    ld.add_argument("--threads", type=int, help="reader threads (default: chosen for the storage)")
    ld.add_argument(
        "--dequantize",
        action="store_true",
        help="GGUF: decode quantized tensors to float32; F32, F16 and BF16 keep their type (add --dtype F32)",
    )
    ld.add_argument(
        "--remote",
        action="append",
        metavar="HOST:PORT=SELECT",
        help="split load: push the tensors matching SELECT to the server at HOST:PORT at the same time",
    )
    from weightlift.cli import remote

    remote.connection_args(ld)  # for --remote's servers
    ld.add_argument("--profile", action="store_true", help="report the load by phase")
    ld.add_argument("--trace", metavar="FILE", help="write a Chrome trace of the load")
    ld.add_argument(
        "--verify",
        action="store_true",
        help="hash the landed bytes as they land and compare with --manifest, else the published manifest "
        "beside PATH, else (said so) only with the files as they are now",
    )
    ld.add_argument("--manifest", metavar="FILE", help="with --verify: the published manifest to compare with")
    ld.add_argument("--json", action="store_true", help="print the figures and profile as JSON")
    ld.set_defaults(func=_cmd_load)

    mf = sub.add_parser("manifest", help="write a checkpoint's manifest: per tensor dtype, shape, bytes, BLAKE3")
    mf.add_argument("path", help=PATH_HELP)
    _add_select(mf)
    mf.add_argument("-o", "--output", metavar="FILE", help="where to write it ('-': stdout; default: beside PATH)")
    mf.add_argument(
        "--sketch",
        action="store_true",
        help="add each tensor's linear sketch, which a sharded copy is checked against without a gather",
    )
    mf.set_defaults(func=_cmd_manifest)

    vf = sub.add_parser("verify", help="hash a checkpoint afresh and compare with its manifest; exit 1 if any differs")
    vf.add_argument("path", help=PATH_HELP)
    _add_select(vf)
    vf.add_argument(
        "--manifest",
        metavar="FILE",
        help="the manifest (default: the one published beside PATH, as `manifest` writes it)",
    )
    vf.add_argument("--json", action="store_true", help="print the result as JSON")
    vf.set_defaults(func=_cmd_verify)

    from weightlift.cli import check

    remote.register(sub)
    _register_bench(sub)
    check.register(sub)
    return p


def _register_bench(sub: Any) -> None:
    from weightlift.benchmark import command

    p = sub.add_parser(
        "bench",
        help="time to ready of weightlift and its peers, fresh process per run",
        description=command.DESCRIPTION,
        epilog=command.epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_arguments(p, default_runs=command.USER_RUNS, default_settle=command.USER_SETTLE_S)
    p.set_defaults(func=command.command)


def _version() -> str:
    from weightlift import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # `weightlift` alone: what it can do, not an error
        parser.print_help()
        return 2
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except WeightliftError as e:
        sys.stderr.write(f"weightlift: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("weightlift: interrupted\n")
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
