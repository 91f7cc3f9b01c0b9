"""Rendering a benchmark result: the text table with its notes and baselines, and the optional plot."""

from __future__ import annotations

from typing import Any

from weightlift.benchmark.floors import BASELINES
from weightlift.benchmark.synthetic import GIB

__all__ = ["format_table", "plot"]


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(result: dict[str, Any]) -> str:
    """The result as a terminal table, then the baselines, the skips and the notes."""
    ck = result["checkpoint"]
    lines = [
        f"checkpoint: {ck['path']} ({ck['tensors']} tensors, {ck['bytes'] / GIB:.2f} GiB, {ck['format']}); "
        f"{result['mode']}, 1 warm-up + {result['runs']} runs per arm, fresh process per run"
        + (f", {result['settle_s']:g} s pause before each" if result.get("settle_s") else ""),
        "time to ready = spawn -> every tensor in memory and every page touched (device: synchronised)",
        f"{'arm':<18} {'median s':>9} {'min-max s':>15} {'IQR s':>7} {'GB/s':>6} {'load s':>7} "
        f"{'load GB/s':>9} {'of limit':>8} {'ratio':>6}",
    ]
    base = result["baseline"]
    skipped = []
    for name, r in result["arms"].items():
        if r["status"] != "ok":
            skipped.append(f"  {name}: {r['status']}: {r['reason']}")
            continue
        s = r["summary"]
        ratio = r["ratio"]["median"] if r["ratio"] else None
        lines.append(
            f"{name:<18} {_f(s['median']):>9} {_f(s['min']) + '-' + _f(s['max']):>15} {_f(s['iqr']):>7} "
            f"{_f(r['gbps'], '.2f'):>6} {_f(r['load']['median']):>7} {_f(r['load_gbps'], '.2f'):>9} "
            f"{(format(100 * r['limit_share'], '.0f') + '%') if r['limit_share'] else '-':>8} "
            f"{_f(ratio, '.2f'):>6}{'  (baseline)' if name == base else ''}"
        )
    lines += _floor_lines(result)
    lines.append(
        f"ratio: run i over run i of {base} in the same round, median; "
        f"of limit: load GB/s over the copy or read limit (local: {result.get('local_limit', 'base.copy')}) "
        f"or raw loopback TCP (remote: {result.get('remote_limit', 'base.tcp')})"
    )
    lines += _baseline_lines(result["baselines"])
    if skipped:
        lines.append("not run:")
        lines += skipped
    lines += _selection_lines(result)
    lines += result.get("notes", [])
    return "\n".join(lines)


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
            f"{n} {r['load']['median'] / fl:.2f}x"
            for n, r in result["arms"].items()
            if r["status"] == "ok" and r["load"]["median"] and (r["kind"] == "remote" or n == "limit.tcp.fresh")
        ]
        lines.append(f"fault-in floor ({fname}, load {fl:.3f} s): load s over it: " + ", ".join(over))
    copies = [
        (r["load"]["median"], n)
        for n in ("limit.copy", "limit.copy.huge")
        if (r := result["arms"].get(n)) and r["status"] == "ok" and r["load"]["median"]
    ]
    if copies:
        cf, cname = min(copies)
        over = [
            f"{n} {r['load']['median'] / cf:.2f}x"
            for n, r in result["arms"].items()
            if r["status"] == "ok" and r["load"]["median"] and r["kind"] == "local"
        ]
        lines.append(f"copy floor ({cname}, load {cf:.3f} s): load s over it: " + ", ".join(over))
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
    colors = ["tab:orange" if n.startswith("wl.") else "tab:blue" for n in names]
    ax1.barh(names, med, xerr=err, color=colors, capsize=3, label="spawn to ready")
    loads = [r["load"]["median"] or 0.0 for _, r in ok]
    ax1.barh(names, loads, height=0.35, color="black", alpha=0.45, label="of which the load call (load_s)")
    ax1.invert_yaxis()
    ax1.legend(fontsize=8, loc="lower right")
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
