#!/usr/bin/env python3
"""What ``push --verify`` costs once there is a link between the two ends.

Over loopback on a small machine the client, the server and the server's hash share the same
cores, so every byte hashed is a byte not copied: the worst case for verification (the
benchmark harness's ``wl.push.verify`` arm, bench/RESULTS.md). Between two machines the wire
is the slower part and the receiver's cores wait on it; the hash can run in that wait. This
benchmark measures that case on one machine: two network namespaces joined by a veth pair
whose sending side is capped by a token bucket (``tc tbf``; ``--rates``, ``none`` for no cap),
a fresh ``weightlift serve`` in one, ``weightlift push`` and ``weightlift push --verify`` in the
other, interleaved in a seeded shuffled order per round, with a pause before each run. The
checkpoint's sidecar manifest is written once beforehand (``weightlift manifest``), as a
publisher's is, so the verified push hashes nothing on the client. The figure is the push's own
seconds (connect to the last acknowledgement; for ``--verify``, to the compared digests). The
ratio is per round, verified over plain, then the median. Needs root; run from the repository
root.

    python bench/verify_link.py --size-mib 768 --rates none,4gbit,2gbit --runs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the namespace helpers live with the tests: tests/net/netns.py

MIB = 1 << 20
CLI = [sys.executable, "-m", "weightlift.cli"]
ARMS = ("push", "push.verify")


def one_push(net: Any, ends: list[tuple[str, str, str]], path: str, verify: bool, timeout: float) -> dict[str, Any]:
    (ns_client, _, _), (ns_server, _, addr) = ends
    server, to = net.serve(ns_server, addr, "--insecure")
    try:
        cmd = [*CLI, "push", path, "--to", to, "--json"] + (["--verify"] if verify else [])
        r = net.run(ns_client, cmd, timeout=timeout)
        if r.returncode:
            raise RuntimeError(f"push failed ({r.returncode}): {r.stderr[-2000:]}")
        res = json.loads(r.stdout)
        return {"seconds": res["seconds"], "bytes": res["bytes"]}
    finally:
        server.kill()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=768, help="synthetic checkpoint size (default 768)")
    p.add_argument("--path", help="a checkpoint to push instead of the synthetic one")
    p.add_argument("--rates", default="none,4gbit,2gbit", help="link caps, tc notation; none: no cap")
    p.add_argument("--runs", type=int, default=5, help="counted rounds per rate (default 5)")
    p.add_argument("--settle", type=float, default=5.0, help="seconds of pause before every run (default 5)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    args = p.parse_args(argv)

    from tests.net.netns import Net, unavailable
    from weightlift.benchmark.harness import ensure_bytecode, round_order, synthetic_checkpoint
    from weightlift.benchmark.stats import summarize

    reason = unavailable()
    if reason:
        print(f"verify_link benchmark skipped: {reason}", file=sys.stderr)
        return 2
    ensure_bytecode()
    path = args.path or synthetic_checkpoint(args.size_mib * MIB)
    subprocess.run([*CLI, "manifest", path, "-o", "-"], check=True, capture_output=True)  # the sidecar
    import weightlift as wl

    size = wl.open(path).nbytes
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    print(f"checkpoint: {path} ({size / 1e6:.0f} MB), {args.runs} rounds, settle {args.settle:g} s", flush=True)
    result: dict[str, Any] = {"path": path, "bytes": size, "runs": args.runs, "rates": {}}
    with Net() as net, tempfile.TemporaryDirectory():
        for k, rate in enumerate(rates):
            ends = net.pair(f"10.241.{k}", rate=None if rate == "none" else rate)
            times: dict[str, list[float]] = {a: [] for a in ARMS}
            for rnd in range(args.runs):
                for arm in round_order(list(ARMS), rnd):
                    time.sleep(args.settle)
                    r = one_push(net, ends, path, arm == "push.verify", args.timeout)
                    if r["bytes"] != size:
                        raise RuntimeError(f"pushed {r['bytes']} bytes of {size}")
                    times[arm].append(r["seconds"])
                    print(f"  rate {rate}, round {rnd}, {arm}: {r['seconds']:.3f} s", flush=True)
            ratios = [v / p for v, p in zip(times["push.verify"], times["push"], strict=False)]
            result["rates"][rate] = {
                "seconds": times,
                "summary": {a: summarize(times[a]) for a in ARMS},
                "ratio": statistics.median(ratios),
                "ratios": ratios,
            }
    print(
        f"\n{'link':>8s} {'push s':>8s} {'MB/s':>6s} {'--verify s':>10s} {'verified/plain':>15s} {'(per-round range)':>18s}"
    )
    for rate, r in result["rates"].items():
        pm, vm = r["summary"]["push"]["median"], r["summary"]["push.verify"]["median"]
        lo, hi = min(r["ratios"]), max(r["ratios"])
        print(f"{rate:>8s} {pm:8.3f} {size / pm / 1e6:6.0f} {vm:10.3f} {r['ratio']:14.2f}x {lo:8.2f}-{hi:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
