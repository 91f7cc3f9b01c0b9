"""Rendering a benchmark result: the text table with its notes and baselines, and the optional plot."""

from __future__ import annotations

from typing import Any

from weightlift.benchmark.floors import BASELINES
from weightlift.benchmark.synthetic import GIB

__all__ = ["COLUMNS", "legend", "format_table", "plot"]


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


COLUMNS = (
    (
        "median s",
        "time to ready, median of the counted runs: from spawning a fresh process to every "
        "tensor in memory with every page touched (a device: synchronised); it includes the imports "
        "and the start-up a user's process pays",
    ),
    ("min-max s", "the fastest and the slowest counted run"),
    ("IQR s", "interquartile range of the runs: the spread of the middle half"),
    ("GB/s", "checkpoint bytes over the median time to ready"),
    (
        "load s",
        "the load call alone, median: its clock starts after the imports (every arm imports "
        "what it needs before its clock, the same for all) and stops at ready",
    ),
    ("load GB/s", "checkpoint bytes over load s"),
    (
        "vs floor",
        "the floor's load s over this arm's, as a speed-up: 1.00x runs as fast as the "
        "simplest code doing the same work (local: reading or copying the file into fresh memory; "
        "remote: raw loopback TCP, into fresh memory where limit.tcp.fresh ran); above 1 the arm beat that code, which a loader can; '-' for a load "
        "that copies nothing (a mapping)",
    ),
    (
        "speed-up",
        "the baseline's time to ready over this arm's, run by run in the same round, "
        "median; above 1.00x this arm was faster than the baseline",
    ),
    ("load speed-up", "the same for load s"),
)


def legend() -> str:
    """What every column of the table means (printed under the table and in ``--help``)."""
    import textwrap

    return "\n".join(
        textwrap.fill(text, 100, initial_indent=f"  {name:<14}", subsequent_indent=" " * 16) for name, text in COLUMNS
    )


def format_table(result: dict[str, Any]) -> str:
    """The result as a terminal table, its legend, then the baselines, the skips and the notes."""
    ck = result["checkpoint"]
    base = result["baseline"]
    lines = [
        f"checkpoint: {ck['path']} ({ck['tensors']} tensors, {ck['bytes'] / GIB:.2f} GiB, {ck['format']}); "
        f"{result['mode']}, {result.get('warmup', 1)} warm-up + {result['runs']} runs per arm, fresh process per run"
        + (f", {result['settle_s']:g} s pause before each" if result.get("settle_s") else ""),
        f"{'arm':<18} {'median s':>9} {'min-max s':>15} {'IQR s':>7} {'GB/s':>6} {'load s':>7} "
        f"{'load GB/s':>9} {'vs floor':>8} {'speed-up':>8} {'load speed-up':>13}",
    ]
    skipped = []
    for name, r in result["arms"].items():
        if r["status"] != "ok":
            skipped.append(f"  {name}: {r['status']}: {r['reason']}")
            continue
        s = r["summary"]
        speedup = r["speedup"]["median"] if r.get("speedup") else None
        load_speedup = r["load_speedup"]["median"] if r.get("load_speedup") else None
        lines.append(
            f"{name:<18} {_f(s['median']):>9} {_f(s['min']) + '-' + _f(s['max']):>15} {_f(s['iqr']):>7} "
            f"{_f(r['gbps'], '.2f'):>6} {_f(r['load']['median']):>7} {_f(r['load_gbps'], '.2f'):>9} "
            f"{_x(r.get('floor_speedup')):>8} {_x(speedup):>8} {_x(load_speedup):>13}"
            f"{'  (baseline)' if name == base else ''}"
        )
    lines.append(
        f"columns (baseline: {base}; floors: local {result.get('local_limit', 'base.copy')}, "
        f"remote {result.get('remote_limit', 'base.tcp')}):"
    )
    lines.append(legend())
    lines += _spread_lines(result)
    lines += _floor_lines(result)
    lines += _baseline_lines(result["baselines"])
    if skipped:
        lines.append("not run:")
        lines += skipped
    lines += _selection_lines(result)
    lines += _import_lines(result)
    lines += result.get("notes", [])
    return "\n".join(lines)


def _spread_lines(result: dict[str, Any]) -> list[str]:
    """The arms whose per-round speed-ups over the baseline fall on both sides of 1.00x: the
    run does not say which of the two is faster."""
    out = []
    for name, r in result["arms"].items():
        if r["status"] != "ok" or name == result["baseline"] or r.get("kind") == "limit":
            continue  # a floor is not a contender
        both = []
        for label, key in (("to ready", "speedup"), ("load", "load_speedup")):
            xs = (r.get(key) or {}).get("ratios") or []
            if len(xs) > 1 and min(xs) < 1 < max(xs):
                both.append(f"{label} {min(xs):.2f}x-{max(xs):.2f}x")
        if both:
            out.append(
                f"{name}: per-round speed-ups over {result['baseline']} span 1.00x ({', '.join(both)}): "
                "this run does not tell which is faster; more --runs or a quieter machine will"
            )
    return out


def _import_lines(result: dict[str, Any]) -> list[str]:
    """The arms whose counted runs still imported a module inside their clock (should be none)."""
    out = []
    for name, r in result["arms"].items():
        mods = sorted({m.split(".")[0] for m in r.get("timed_imports") or ()})
        if r["status"] == "ok" and mods:
            out.append(f"warning: {name} imported {', '.join(mods)} inside its clock: its load s includes that import")
    return out


def _floor_lines(result: dict[str, Any]) -> list[str]:
    """The second-push speed-ups, and each arm against the fault-in and copy floors."""
    lines: list[str] = []
    for name, r in result["arms"].items():
        if r["status"] == "ok" and r.get("second_speedup") and r["second_speedup"]["median"]:
            lines.append(
                f"{name}: first push {_f(r['first']['median'])} s, timed push {_f(r['load']['median'])} s "
                f"(medians, same server); {r['second_speedup']['median']:.1f}x faster than the first "
                "(median of per-run ratios)"
            )
    floors = [
        (r["load"]["median"], n)
        for n in ("limit.fault", "limit.fault.huge")
        if (r := result["arms"].get(n)) and r["status"] == "ok" and r["load"]["median"]
    ]
    if floors:
        fl, fname = min(floors)  # the faster page size
        over = [
            f"{n} {fl / r['load']['median']:.2f}x"
            for n, r in result["arms"].items()
            if r["status"] == "ok" and r["load"]["median"] and (r["kind"] == "remote" or n == "limit.tcp.fresh")
        ]
        lines.append(f"fault-in floor ({fname}, load {fl:.3f} s): its load s over each arm's: " + ", ".join(over))
    copies = [
        (r["load"]["median"], n)
        for n in ("limit.copy", "limit.copy.huge")
        if (r := result["arms"].get(n)) and r["status"] == "ok" and r["load"]["median"]
    ]
    if copies:
        cf, cname = min(copies)
        over = [
            f"{n} {cf / r['load']['median']:.2f}x"
            for n, r in result["arms"].items()
            if r["status"] == "ok" and r["load"]["median"] and r["kind"] == "local" and r.get("floored", True)
        ]
        lines.append(f"copy floor ({cname}, load {cf:.3f} s): its load s over each arm's: " + ", ".join(over))
    return lines


def _baseline_lines(bl: dict[str, Any]) -> list[str]:
    """The in-process baselines, one line each."""
    lines: list[str] = []
    if any(n in bl for n in BASELINES):
        lines.append(f"baselines on {bl.get('file')}:")
    for name in BASELINES:
        b = bl.get(name)
        if b is None:
            continue
        if b["status"] != "ok":
            lines.append(f"  {name}: {b['status']}: {b['reason']}")
        elif name == "base.copy":
            lines.append(
                f"  copy limit: {b['fresh']['gbps']:.2f} GB/s into fresh memory, "
                f"{b['touched']['gbps']:.2f} GB/s into touched memory ({b['threads']} threads)"
            )
        elif name == "base.read":
            per = ", ".join(f"{k}: {v['gbps']:.2f}" for k, v in b["by_threads"].items())
            lines.append(
                f"  raw read ({'cold' if b.get('cold') else 'warm'}): best {b['gbps']:.2f} GB/s "
                f"with {b['best_threads']} threads (threads: GB/s {per})"
            )
        elif name == "base.tcp":
            lines.append(f"  raw loopback TCP (sendfile -> recv_into): {b['gbps']:.2f} GB/s")
        elif name == "base.h2d":
            lines.append(f"  pinned host -> device: {b['gbps']:.2f} GB/s ({b.get('device', '')})")
    return lines


def _selection_lines(result: dict[str, Any]) -> list[str]:
    """The arms left out, those that could have run and those that could not."""
    lines: list[str] = []
    others = result.get("not_selected") or {}
    could = [n for n, why in others.items() if why is None]
    if could:
        lines.append(
            f"{'left out by --quick' if result.get('quick') else 'not selected'} (could run here): {', '.join(could)}"
        )
    cannot = [(n, why) for n, why in others.items() if why is not None]
    if cannot:
        lines.append("not selected, and could not run here:")
        lines += [f"  {n}: {why}" for n, why in cannot]
    return lines


_GROUPS = (
    ("wl.", "tab:orange", "weightlift: spawn to ready"),
    ("limit.", "tab:gray", "floors (simplest code doing the same work): spawn to ready"),
    ("", "tab:blue", "peers (safetensors, ...): spawn to ready"),
)


def bar_colors(names: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Each arm's bar colour by group (weightlift, floors, peers), and the legend's (label, colour)
    for every group that has a bar."""
    group = [next(g for g in _GROUPS if n.startswith(g[0])) for n in names]
    return [g[1] for g in group], [(label, c) for p, c, label in _GROUPS if any(g[0] == p for g in group)]


def plot(result: dict[str, Any], path: str) -> str | None:
    """Time to ready per arm (median, min-max bars) and weightlift's phases; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [(n, r) for n, r in result["arms"].items() if r["status"] == "ok" and r["summary"]["median"]]
    prof = [(n, r["profile"]) for n, r in ok if r.get("profile")]
    prof += [(n + " (server)", r["server_profile"]) for n, r in ok if r.get("server_profile")]
    fig, (ax1, ax2) = plt.subplots(
        1, 2, figsize=(14, max(4.0, 0.5 * len(ok) + 2)), gridspec_kw={"width_ratios": [3, 2]}
    )
    names = [n for n, _ in ok]
    med = [r["summary"]["median"] for _, r in ok]
    err = [
        [m - r["summary"]["min"] for m, (_, r) in zip(med, ok, strict=False)],
        [r["summary"]["max"] - m for m, (_, r) in zip(med, ok, strict=False)],
    ]
    from matplotlib.patches import Patch

    colors, keys = bar_colors(names)
    ax1.barh(names, med, xerr=err, color=colors, capsize=3)
    loads = [r["load"]["median"] or 0.0 for _, r in ok]
    ax1.barh(names, loads, height=0.35, color="black", alpha=0.45)
    ax1.invert_yaxis()
    handles = [Patch(color=c, label=label) for label, c in keys]
    handles.append(Patch(color="black", alpha=0.45, label="of which the load call (load s)"))
    ax1.legend(handles=handles, fontsize=8, loc="lower right")
    ax1.set_xlabel("seconds, spawn to ready (median; whiskers: min-max)")
    ck = result["checkpoint"]
    ax1.set_title(f"{ck['bytes'] / GIB:.2f} GiB, {result['mode']}, {result['runs']} runs")
    for y, (_, r) in enumerate(ok):
        if r["gbps"]:
            ax1.text(r["summary"]["max"], y, f"  {r['gbps']:.2f} GB/s", va="center", fontsize=8)
    phases = ("read", "hash", "stage", "wire", "device", "gap")
    if prof:
        left = [0.0] * len(prof)
        for ph in phases:
            vals = [p["phases_s"].get(ph, 0.0) for _, p in prof]
            ax2.barh([n for n, _ in prof], vals, left=left, label=ph)
            left = [a + b for a, b in zip(left, vals, strict=False)]
        ax2.invert_yaxis()
        ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax2.set_xlabel("seconds of the load span, by phase (profiled round)")
    else:
        ax2.text(0.5, 0.5, "no weightlift arm was profiled", ha="center", va="center")
        ax2.set_axis_off()
    ax2.set_title("weightlift phases")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
