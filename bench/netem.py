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

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the namespace helpers live with the tests: tests/net/netns.py

MIB = 1 << 20
CLI = [sys.executable, "-m", "weightlift.cli"]


def _token(folder: Path) -> str:
    path = folder / "netem-token"
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return str(path)


def one_push(net: Any, ends: list[tuple[str, str, str]], path: str, streams: int, token: str, timeout: float) -> dict:
    (ns_client, _, _), (ns_server, _, addr) = ends
    server, to = net.serve(ns_server, addr, "--token-file", token)
    try:
        t0 = time.perf_counter()
        r = net.run(
            ns_client,
            [*CLI, "push", path, "--to", to, "--token-file", token, "--streams", str(streams), "--json"],
            timeout=timeout,
        )
        wall = time.perf_counter() - t0
        if r.returncode:
            raise RuntimeError(f"push failed: {r.stderr[-2000:]}")
        res = json.loads(r.stdout)
        return {"seconds": res["seconds"], "wall": wall, "bytes": res["bytes"], "tensors": res["tensors"]}
    finally:
        server.kill()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=256, help="synthetic checkpoint size (default 256)")
    p.add_argument("--path", help="a checkpoint to push instead of the synthetic one")
    p.add_argument("--delays", default="0,10,50", help="one-way delays in ms (default 0,10,50)")
    p.add_argument("--streams", default="1,2,4", help="stream counts (default 1,2,4)")
    p.add_argument("--loss", type=float, default=0.0, help="fraction of packets dropped (default 0)")
    p.add_argument("--reorder", type=float, default=0.0, help="fraction of packets sent ahead (default 0)")
    p.add_argument("--runs", type=int, default=3, help="counted rounds (default 3)")
    p.add_argument("--settle", type=float, default=1.0, help="seconds of pause before every run (default 1)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help="32 MiB, delays 0 and 10 ms, one round")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    args = p.parse_args(argv)

    from tests.net.netns import Net, has_netem, unavailable
    from weightlift.benchmark.harness import round_order, synthetic_checkpoint
    from weightlift.benchmark.stats import summarize

    reason = unavailable()
    if reason:
        print(f"netem benchmark skipped: {reason}", file=sys.stderr)
        return 2
    if args.quick:
        args.size_mib, args.delays, args.runs = 32, "0,10", 1
    delays = [float(x) for x in args.delays.split(",")]
    counts = [int(x) for x in args.streams.split(",")]
    path = args.path or synthetic_checkpoint(args.size_mib * MIB)
    import weightlift as wl

    ck = wl.open(path)
    size = ck.nbytes
    link = "tc netem" if has_netem() else "user-space link (tests/net/impair.py, MTU 9000)"
    print(
        f"checkpoint: {path} ({size / 1e6:.0f} MB, {len(ck.tensors)} tensors), {args.runs} round(s), "
        f"link: {link}, loss {args.loss}, reorder {args.reorder}",
        flush=True,
    )
    times: dict[str, list[float]] = {}
    walls: dict[str, list[float]] = {}
    with Net() as net, tempfile.TemporaryDirectory() as tmp:
        token = _token(Path(tmp))
        for k, delay in enumerate(delays):
            ends = net.impaired_pair(delay_ms=delay, loss=args.loss, reorder=args.reorder, seed=k, subnet=f"10.240.{k}")
            for rnd in range(args.runs):
                for n in round_order(counts, rnd):
                    time.sleep(args.settle)
                    r = one_push(net, ends, path, n, token, args.timeout)
                    if r["bytes"] != size:
                        raise RuntimeError(f"pushed {r['bytes']} bytes of {size}")
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
