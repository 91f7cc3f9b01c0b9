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

import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from _common import CLI, add_run_arguments, checkpoint, netns, parser, push_between, write_json

ARMS = ("push", "push.verify")


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    add_run_arguments(p, size_mib=768, runs=5, settle=5.0, per=" per rate")
    p.add_argument("--rates", default="none,4gbit,2gbit", help="link caps, tc notation; none: no cap")
    args = p.parse_args(argv)

    helpers = netns("verify_link")
    if helpers is None:
        return 2
    from weightlift.benchmark.harness import ensure_bytecode, round_order
    from weightlift.benchmark.stats import summarize

    ensure_bytecode()
    path = checkpoint(args)
    subprocess.run([*CLI, "manifest", path, "-o", "-"], check=True, capture_output=True)  # the sidecar
    import weightlift as wl

    size = wl.open(path).nbytes
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    print(f"checkpoint: {path} ({size / 1e6:.0f} MB), {args.runs} rounds, settle {args.settle:g} s", flush=True)
    result: dict[str, Any] = {"path": path, "bytes": size, "runs": args.runs, "rates": {}}
    with helpers.Net() as net, tempfile.TemporaryDirectory():
        for k, rate in enumerate(rates):
            ends = net.pair(f"10.241.{k}", rate=None if rate == "none" else rate)
            times: dict[str, list[float]] = {a: [] for a in ARMS}
            for rnd in range(args.runs):
                for arm in round_order(list(ARMS), rnd):
                    time.sleep(args.settle)
                    verify = ("--verify",) if arm == "push.verify" else ()
                    r = push_between(net, ends, path, size, args.timeout, serve=("--insecure",), push=verify)
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
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
