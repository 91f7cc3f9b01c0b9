#!/usr/bin/env python3
"""Is the pause between runs long enough? The same arms in two opposite orders, same medians.

Runs the arms with every round in the given order, then with every round reversed (each run in
a fresh process, ``--settle`` seconds before each), and prints each arm's median in both and
their ratio. With too short a pause, an arm that follows one which freed a lot of memory gets
that memory still backed by the host and looks faster: the ratios then stray from 1 by more
than the runs' own spread, and which arm "wins" can flip with the order.

    python bench/order_check.py --arms wl.numpy,safetensors.numpy,limit.copy --settle 20 --runs 4
"""

from __future__ import annotations

import argparse
import json
import sys

from suite import run_benchmark

from weightlift.benchmark.harness import default_checkpoint


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", help="checkpoint (default: the 768 MiB synthetic one)")
    p.add_argument("--arms", default="wl.numpy,safetensors.numpy,limit.copy")
    p.add_argument("--settle", type=float, default=20.0, help="pause before every run, seconds (default 20)")
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--size-gib", type=float, default=0.75)
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    path = a.path or default_checkpoint(quick=False, size=int(a.size_gib * (1 << 30)))
    out = {}
    for order in ("forward", "reverse"):
        print(f"-- {order}: {a.arms}, {a.runs} runs, {a.settle:g} s pause", file=sys.stderr, flush=True)
        out[order] = run_benchmark(
            path,
            arms=a.arms,
            runs=a.runs,
            warmup=1,
            baselines=(),
            profile_round=False,
            settle=a.settle,
            order=order,
            log=lambda s: print(s, file=sys.stderr, flush=True),
        )
    print(f"settle {a.settle:g} s, {a.runs} runs per order; load s medians (IQR)")
    print(f"{'arm':<20} {'forward':>16} {'reverse':>16} {'rev/fwd':>8}")
    rows = {}
    for name in out["forward"]["arms"]:
        f, r = out["forward"]["arms"][name], out["reverse"]["arms"][name]
        if f["status"] != "ok" or r["status"] != "ok":
            print(f"{name:<20} {f['status']}: {f['reason']}")
            continue
        fm, rm = f["load"]["median"], r["load"]["median"]
        rows[name] = {"forward": f["load"], "reverse": r["load"], "ratio": rm / fm}
        print(f"{name:<20} {fm:>8.3f} ({f['load']['iqr']:.3f}) {rm:>8.3f} ({r['load']['iqr']:.3f}) {rm / fm:>8.2f}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump({"settle_s": a.settle, "runs": a.runs, "arms": a.arms, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
