"""Benchmark harness: time to ready per arm, in fresh processes, interleaved, with baselines.

The argparse front end that ``weightlift bench`` and the bench/ scripts share: :func:`add_arguments`
adds the options, :func:`command` runs :func:`~.suite.run_benchmark` on the parsed arguments with
an arm table (the package's own, or a research bench's) and prints the table; ``--calibrate-memory``
times the ways of filling fresh memory instead (:mod:`weightlift.memory.fresh`).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from weightlift.benchmark.harness import QUICK_SETTLE_S, SETTLE_S
from weightlift.benchmark.report import format_table, legend
from weightlift.benchmark.suite import PACKAGE, ArmTable, run_benchmark
from weightlift.benchmark.synthetic import GIB, MIB

__all__ = ["DESCRIPTION", "USER_RUNS", "USER_SETTLE_S", "add_arguments", "command", "epilog"]

DESCRIPTION = (
    "Time weightlift against safetensors and against floors (the simplest code that does the same "
    "work: a copy or read of the file into fresh memory, raw loopback TCP) on your checkpoint. "
    "Every run is a fresh process, the arms take turns, and the table gives medians with their "
    "spread. It says up front how long it will take: a few minutes on a small checkpoint; "
    "--quick is a first look in about two minutes."
)


def epilog() -> str:
    """The columns of the table, for ``--help``."""
    return "columns of the table (the same legend is printed under it):\n" + legend()


# `weightlift bench` without --quick: every arm, in a few minutes on a small checkpoint. The
# pause is the short one; the table says so and how to ask for the published 20 s.
USER_RUNS = 3
USER_SETTLE_S = QUICK_SETTLE_S


def add_arguments(
    p: Any,
    *,
    default_arms: str | None = None,
    quick_arms: str | None = None,
    default_baseline: str | None = None,
    default_size_gib: float | None = None,
    default_runs: int = 5,
    default_settle: float = SETTLE_S,
) -> None:
    """The options shared by ``weightlift bench`` and the bench/ scripts.

    ``quick_arms`` replaces ``default_arms`` under ``--quick`` unless ``--arms`` was given.
    ``default_runs`` and ``default_settle`` are what a run without ``--quick``, ``--runs`` or
    ``--settle`` takes: the bench/ scripts keep the published 5 runs and 20 s pause,
    ``weightlift bench`` takes a run of a few minutes (:data:`USER_RUNS`, :data:`USER_SETTLE_S`).
    """
    p.set_defaults(
        arms_default=default_arms, quick_arms=quick_arms, runs_default=default_runs, settle_default=default_settle
    )
    p.add_argument("path", nargs="?", help="checkpoint (default: the demo checkpoint, or a synthetic one)")
    p.add_argument(
        "--quick", action="store_true", help="a first look: 256 MiB synthetic checkpoint, 3 runs, 6 arms, 3 s pauses"
    )
    p.add_argument("--cold", action="store_true", help="evict the files before every run and check with mincore")
    p.add_argument("--runs", type=int, help=f"counted runs per arm (default {default_runs}; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted rounds first (default 1)")
    p.add_argument(
        "--arms", default=default_arms, help="comma list of arms, or the groups local, remote, all (see --list)"
    )
    p.add_argument(
        "--baseline", default=default_baseline, help="arm the speed-ups are taken against (default safetensors.numpy)"
    )
    p.add_argument(
        "--size-gib",
        type=float,
        help="size of the synthetic checkpoint when no PATH is given"
        + (f" (default {default_size_gib:g}; 0.25 with --quick)" if default_size_gib else ""),
    )
    p.set_defaults(size_gib_default=default_size_gib)
    p.add_argument("--no-baselines", action="store_true", help="skip the copy/read/TCP/H2D baselines")
    p.add_argument("--no-profile", action="store_true", help="skip the extra profiled round of weightlift arms")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    p.add_argument(
        "--settle",
        type=float,
        metavar="SECONDS",
        help=f"pause before every run, so no arm inherits memory the one before it freed "
        f"(default {default_settle:g}; {QUICK_SETTLE_S:g} with --quick; bench/RESULTS.md's tables: "
        f"{SETTLE_S:g}, the pause after which arm order stopped changing the medians there)",
    )
    p.add_argument(
        "--order",
        choices=("shuffle", "forward", "reverse"),
        default="shuffle",
        help="arm order per round: a seeded shuffle (default), or as given / reversed in every "
        "round (run both to check that the pause is long enough: same medians either way)",
    )
    p.add_argument(
        "--calibrate-memory",
        action="store_true",
        help="time the ways of filling fresh memory on this machine, in fresh processes, and "
        "remember the fastest for weightlift's loads and servers (weightlift.memory.fresh)",
    )
    p.add_argument("--json", metavar="FILE", help="write the full result as JSON")
    p.add_argument("--png", metavar="FILE", help="draw time to ready and weightlift's phases (matplotlib)")
    p.add_argument("--list", action="store_true", help="list the arms and baselines, then exit")


def command(args: Any, *, table: ArmTable = PACKAGE) -> int:
    """Run the benchmark for parsed arguments; prints the table. 0 if any arm ran."""
    if args.list:
        for name, spec in table.specs.items():
            print(f"{name:<18} {spec.kind:<9} {spec.description}")
        return 0
    if getattr(args, "calibrate_memory", False):
        return _calibrate_command(args)
    gib = args.size_gib or (None if args.quick else getattr(args, "size_gib_default", None))
    size = int(gib * GIB) if gib else None
    arms = args.arms
    if args.quick and arms == getattr(args, "arms_default", None) and getattr(args, "quick_arms", None):
        arms = args.quick_arms
    runs, settle = args.runs, args.settle
    if not args.quick:
        runs = runs or getattr(args, "runs_default", None)
        settle = getattr(args, "settle_default", None) if settle is None else settle
    result = run_benchmark(
        args.path,
        arms=arms,
        quick=args.quick,
        cold=args.cold,
        runs=runs,
        warmup=args.warmup,
        baseline=args.baseline,
        size=size,
        baselines=() if args.no_baselines else None,
        timeout=args.timeout,
        profile_round=not args.no_profile,
        settle=settle,
        json_path=args.json,
        png_path=args.png,
        order=args.order,
        log=lambda s: print(s, file=sys.stderr, flush=True),
        table=table,
    )
    print(format_table(result))
    print(f"took {result['elapsed_s'] / 60:.1f} min")
    if args.json:
        print(f"wrote {args.json}")
    if args.png:
        print(f"wrote {args.png}" if result.get("png") else "no PNG: matplotlib is not installed")
    return 0 if any(r["status"] == "ok" for r in result["arms"].values()) else 1


def _calibrate_command(args: Any) -> int:
    from weightlift.memory import fresh

    size = int(args.size_gib * GIB) if args.size_gib else 512 * MIB
    pause = QUICK_SETTLE_S if args.quick and args.settle is None else (SETTLE_S if args.settle is None else args.settle)
    rounds = args.runs or (1 if args.quick else 3)
    print(
        f"filling {size / MIB:.0f} MiB of fresh memory {len(fresh.TRIALS)} ways, {rounds} round(s), "
        f"{pause:g} s pause before each, fresh process each",
        file=sys.stderr,
        flush=True,
    )
    res = fresh.calibrate(size, rounds=rounds, pause=pause, log=lambda s: print(s, file=sys.stderr, flush=True))
    for name, v in sorted(res["medians_s"].items(), key=lambda kv: kv[1]):
        print(f"{name:<20} {v:.3f} s  {size / v / 1e9:.2f} GB/s")
    pol = res["policy"]
    print(
        f"chosen: {'huge' if pol['huge'] else '4 KiB'} pages, kernel copies "
        f"{'faulted ahead (' + pol['method'] + ')' if pol['ahead'] else 'fault their own pages'}, "
        f"fault method {pol['method']}; remembered in {fresh.memory_file()}"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0
