#!/usr/bin/env python3
"""Pushes over a link with latency: does ``weightlift push --streams N`` pay off once the link is slow?

For each one-way delay (default 0, 10 and 50 ms), two network namespaces are joined by a link
that delays the packets of the push (``tc netem`` where the kernel has it, else the user-space
link of ``tests/net/impair.py``, which caps a link near 250 MB/s on a small machine), with
optional loss and reordering. Each run starts a fresh ``weightlift serve`` in one namespace
(its start-up is not counted) and a fresh ``weightlift push --streams N --json`` in the other;
the figure is the push's own seconds (connect to every tensor acknowledged: time to ready on
the server). Streams are interleaved in a seeded shuffled order per round; medians of the runs.
Needs root (namespaces); run from the repository root.

    python bench/netem.py --size-mib 256 --runs 3 --json netem.json
    python bench/netem.py --quick
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import add_run_arguments, checkpoint, netns, parser, push_between, write_json


def _token(folder: Path) -> str:
    path = folder / "netem-token"
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    add_run_arguments(p, size_mib=256, runs=3, settle=1.0)
    p.add_argument("--delays", default="0,10,50", help="one-way delays in ms (default 0,10,50)")
    p.add_argument("--streams", default="1,2,4", help="stream counts (default 1,2,4)")
    p.add_argument("--loss", type=float, default=0.0, help="fraction of packets dropped (default 0)")
    p.add_argument("--reorder", type=float, default=0.0, help="fraction of packets sent ahead (default 0)")
    p.add_argument("--quick", action="store_true", help="32 MiB, delays 0 and 10 ms, one round")
    args = p.parse_args(argv)

    helpers = netns("netem")
    if helpers is None:
        return 2
    from weightlift.benchmark.harness import round_order
    from weightlift.benchmark.stats import summarize

    if args.quick:
        args.size_mib, args.delays, args.runs = 32, "0,10", 1
    delays = [float(x) for x in args.delays.split(",")]
    counts = [int(x) for x in args.streams.split(",")]
    path = checkpoint(args)
    import weightlift as wl

    ck = wl.open(path)
    size = ck.nbytes
    link = "tc netem" if helpers.has_netem() else "user-space link (tests/net/impair.py, MTU 9000)"
    print(
        f"checkpoint: {path} ({size / 1e6:.0f} MB, {len(ck.tensors)} tensors), {args.runs} round(s), "
        f"link: {link}, loss {args.loss}, reorder {args.reorder}",
        flush=True,
    )
    times: dict[str, list[float]] = {}
    walls: dict[str, list[float]] = {}
    with helpers.Net() as net, tempfile.TemporaryDirectory() as tmp:
        auth = ("--token-file", _token(Path(tmp)))
        for k, delay in enumerate(delays):
            ends = net.impaired_pair(delay_ms=delay, loss=args.loss, reorder=args.reorder, seed=k, subnet=f"10.240.{k}")
            for rnd in range(args.runs):
                for n in round_order(counts, rnd):
                    time.sleep(args.settle)
                    r = push_between(net, ends, path, size, args.timeout, serve=auth, push=(*auth, "--streams", str(n)))
                    arm = f"{delay:g}ms.s{n}"
                    times.setdefault(arm, []).append(r["seconds"])
                    walls.setdefault(arm, []).append(r["wall"])
                    print(f"  delay {delay:g} ms, streams {n}, round {rnd}: {r['seconds']:.3f} s", flush=True)

    result: dict[str, Any] = {
        "path": path,
        "bytes": size,
        "tensors": len(ck.tensors),
        "link": link,
        "loss": args.loss,
        "reorder": args.reorder,
        "runs": args.runs,
        "arms": {},
    }
    print(f"\n{'delay ms':>8s} {'streams':>7s} {'median s':>9s} {'min-max s':>14s} {'MB/s':>7s} {'vs 1 stream':>11s}")
    for delay in delays:
        base = summarize(times[f"{delay:g}ms.s{counts[0]}"])["median"]
        for n in counts:
            arm = f"{delay:g}ms.s{n}"
            s = summarize(times[arm])
            result["arms"][arm] = {"delay_ms": delay, "streams": n, "seconds": times[arm], "wall": walls[arm], **s}
            med = s["median"]
            print(
                f"{delay:8g} {n:7d} {med:9.3f} {s['min']:6.3f}-{s['max']:6.3f} {size / med / 1e6:7.0f} "
                f"{base / med:10.2f}x"
            )
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
