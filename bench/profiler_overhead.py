#!/usr/bin/env python3
"""Profiler cost: loads with the profiler off against the same work with no profiler code.

Arms, each in fresh processes, interleaved, compared on ``load_s`` (load call to every page
touched; interpreter start and imports excluded), run i against run i of ``loop.plain``:

* loop.plain - a preadv loop (16 MiB calls into fresh arrays, as the loader makes) with no
  profiler code at all: the "before".
* loop.off - the same loop with an ``if prof.enabled:`` check around every call, profiler off.
* loop.on - the same loop recording every call.
* wl.numpy / wl.numpy.profiled - weightlift.load with the profiler off / on.

It also times one ``if prof.enabled:`` check here and multiplies it by the checks a load makes
(from the profiled round's call count) for the predicted cost of the off path.

    python bench/profiler_overhead.py --json profiler-overhead.json
    python bench/profiler_overhead.py --quick
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit

from suite import run_benchmark

from weightlift.benchmark.report import format_table
from weightlift.benchmark.stats import paired_ratio
from weightlift.benchmark.synthetic import GIB
from weightlift.profile import Profiler

ARMS = "loop.plain,loop.off,loop.on,wl.numpy,wl.numpy.profiled"
CHECKS_PER_CALL = 2  # one before and one after each timed call


def check_ns() -> float:
    """Nanoseconds one ``if prof.enabled:`` costs with the profiler off (best of 5)."""
    prof = Profiler(enabled=False)
    n = 1_000_000
    body = timeit.repeat("if prof.enabled: pass", globals={"prof": prof}, number=n, repeat=5)
    empty = timeit.repeat("pass", number=n, repeat=5)
    return max(0.0, (min(body) - min(empty)) / n * 1e9)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", help="checkpoint (default: a synthetic one of --size-gib)")
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--cold", action="store_true")
    p.add_argument("--quick", action="store_true", help="256 MiB, 3 runs")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    size = int((0.25 if a.quick else a.size_gib) * GIB)
    res = run_benchmark(
        a.path,
        arms=ARMS,
        cold=a.cold,
        runs=3 if a.quick else a.runs,
        size=size,
        baseline="loop.plain",
        baselines=(),
        profile_round=True,
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    arms = res["arms"]
    per_check = check_ns()
    calls = (arms["wl.numpy"].get("profile") or {}).get("calls") or 0
    load_off = arms["wl.numpy"]["load"]["median"]
    predicted = calls * CHECKS_PER_CALL * per_check / 1e9
    over = {
        "check_ns": per_check,
        "load_calls": calls,
        "predicted_off_cost_s": predicted,
        "predicted_off_fraction": predicted / load_off if load_off else None,
        # time over plain's, run by run (the table's speed-ups read the other way)
        "loop_off_vs_plain": paired_ratio(arms["loop.off"]["load_s"], arms["loop.plain"]["load_s"])["median"],
        "loop_on_vs_plain": paired_ratio(arms["loop.on"]["load_s"], arms["loop.plain"]["load_s"])["median"],
        "loop_plain_load_iqr_s": arms["loop.plain"]["load"]["iqr"],
        "loop_plain_load_median_s": arms["loop.plain"]["load"]["median"],
        "wl_on_vs_off": paired_ratio(arms["wl.numpy.profiled"]["load_s"], arms["wl.numpy"]["load_s"])["median"],
    }
    res["overhead"] = over
    print(format_table(res))

    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}x"

    print("profiler overhead (paired load_s ratios, median):")
    print(
        f"  loop, profiler off vs no profiler code: {x(over['loop_off_vs_plain'])} "
        f"(run-to-run IQR of the plain loop: {over['loop_plain_load_iqr_s'] or 0:.4f} s "
        f"of {over['loop_plain_load_median_s'] or 0:.4f} s)"
    )
    print(f"  loop, profiler on vs no profiler code:  {x(over['loop_on_vs_plain'])}")
    print(f"  weightlift.load, profiler on vs off:    {x(over['wl_on_vs_off'])}")
    frac = over["predicted_off_fraction"]
    print(
        f"  one off check: {per_check:.1f} ns; {calls} calls x {CHECKS_PER_CALL} checks = "
        f"{predicted * 1e6:.1f} us per load" + (f" ({100 * frac:.4f} % of it)" if frac is not None else "")
    )
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {a.json}")
    return 0 if all(arms[n]["status"] == "ok" for n in ARMS.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
