"""What the standalone bench scripts share: their command-line face, the JSON they write, and one
push between two network namespaces.

    from _common import MIB, parser, add_run_arguments, write_json   # with bench/ on sys.path

Nothing here imports weightlift or torch at import time: a script's ``--help`` stays instant,
and a script that puts the repository root on the path (``netns``) does so before either loads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
CLI = [sys.executable, "-m", "weightlift.cli"]


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser whose help is the script's docstring, as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_run_arguments(
    p: argparse.ArgumentParser, *, size_mib: int, runs: int, settle: float, verb: str = "push", per: str = ""
) -> None:
    """The options of a script that times rounds of runs on one checkpoint: its size or path, the
    rounds (``per`` says what a round is counted for), the pause before each run, a run's time
    limit and the JSON file."""
    p.add_argument("--size-mib", type=int, default=size_mib, help=f"synthetic checkpoint size (default {size_mib})")
    p.add_argument("--path", help=f"a checkpoint to {verb} instead of the synthetic one")
    p.add_argument("--runs", type=int, default=runs, help=f"counted rounds{per} (default {runs})")
    p.add_argument(
        "--settle", type=float, default=settle, help=f"seconds of pause before every run (default {settle:g})"
    )
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")


def checkpoint(args: argparse.Namespace) -> str:
    """``--path``, or the synthetic checkpoint of ``--size-mib`` (written once, then reused)."""
    from weightlift.benchmark.harness import synthetic_checkpoint

    return args.path or synthetic_checkpoint(args.size_mib * MIB)


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Every figure of the run, to ``path`` when one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def table_main(doc: str | None, argv: list[str] | None, **defaults: Any) -> int:
    """The program of a script that runs the research arm table (bench/suite.py) with its own
    default arms, quick arms, baseline and size."""
    from suite import add_arguments, command

    p = parser(doc)
    add_arguments(p, **defaults)
    return command(p.parse_args(argv))


def netns(benchmark: str) -> Any | None:
    """The namespace helpers (tests/net/netns.py, with the repository root put on the path), or
    None, said on stderr, where this machine cannot make namespaces."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import tests.net.netns as helpers

    reason = helpers.unavailable()
    if reason:
        print(f"{benchmark} benchmark skipped: {reason}", file=sys.stderr)
        return None
    return helpers


def push_between(
    net: Any,
    ends: list[tuple[str, str, str]],
    path: str,
    nbytes: int,
    timeout: float,
    *,
    serve: tuple[str, ...] = (),
    push: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A fresh ``weightlift serve`` (with ``serve`` options) in the second namespace of ``ends``
    and one ``weightlift push --json`` (with ``push`` options) to it from the first; the push's
    JSON report, and ``wall``, the client's time from start to exit. The server's start-up is not
    counted. RuntimeError when the push fails or moves other than ``nbytes``."""
    (ns_client, _, _), (ns_server, _, addr) = ends
    server, to = net.serve(ns_server, addr, *serve)
    try:
        t0 = time.perf_counter()
        r = net.run(ns_client, [*CLI, "push", path, "--to", to, *push, "--json"], timeout=timeout)
        wall = time.perf_counter() - t0
        if r.returncode:
            raise RuntimeError(f"push failed ({r.returncode}): {r.stderr[-2000:]}")
        res = json.loads(r.stdout)
    finally:
        server.kill()
        server.wait()
    if res["bytes"] != nbytes:
        raise RuntimeError(f"pushed {res['bytes']} bytes of {nbytes}")
    return {**res, "wall": wall}
