"""Which arms a benchmark runs and against which floors: the arm table, the skips, the whole run.

An :class:`ArmTable` names the arms a benchmark knows (their :class:`~.arms.ArmSpec`), the arm
files a child loads their bodies from, and the groups ``local``, ``remote`` and the ``--quick``
set. :data:`PACKAGE` is what ``weightlift bench`` runs on a user's machine: weightlift's loads
and loopback push against safetensors and the copy, raw-read and raw-TCP floors. A research
bench passes a larger table (peer loaders, weightlift's variants) to the same functions.

An arm whose module is missing or that needs a device that is not here is listed as skipped
with the reason. Baselines measured in the same run bound what an arm could reach: the copy
limit (mapped file to memory on every core), the best raw read (preadv, 1/2/4 threads), raw
loopback TCP (sendfile to recv_into) and pinned host-to-device bandwidth where a CUDA device is
present.

The result of :func:`run_benchmark` is one JSON-able dict (``SCHEMA``): ``checkpoint``,
``mode``, ``cold_check``, ``runs``, ``order``, ``baseline``, ``arms`` ({name: status, reason,
times_s, inner_s, load_s, summary, gbps, load_gbps, speedup, load_speedup, floor_speedup,
timed_imports, bytes, tensors, profile}), ``baselines``, ``notes`` and ``machine``; every ratio
in it is a speed-up (the reference's time over the arm's: above 1 = the arm is faster).
:mod:`.report` renders it (table, plot).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightlift.benchmark import arms as bench_arms
from weightlift.benchmark import floors as bench_floors
from weightlift.benchmark.arms import ArmSpec
from weightlift.benchmark.harness import (
    ARM_FILES,
    QUICK_SETTLE_S,
    SETTLE_S,
    Arm,
    ArmFailed,
    ArmSkipped,
    child_argv,
    default_checkpoint,
    describe_checkpoint,
    ensure_bytecode,
    run_arms,
    run_once,
)
from weightlift.benchmark.report import plot
from weightlift.benchmark.synthetic import GIB, MIB
from weightlift.errors import OptionError

__all__ = [
    "SCHEMA",
    "ArmTable",
    "PACKAGE",
    "LOCAL_ARMS",
    "REMOTE_ARMS",
    "QUICK_ARMS",
    "cuda_reason",
    "missing_module",
    "arm_reason",
    "expand_arm_names",
    "build_arms",
    "run_baselines",
    "run_benchmark",
    "estimate_s",
]

# 2: ratio became speedup (inverted: the baseline over the arm); limit_share became floor_speedup
SCHEMA = "weightlift-bench/2"
ARM_KINDS = ("local", "remote", "probe", "limit")  # what runs as an interleaved arm

LOCAL_ARMS = (
    "safetensors.numpy",
    "safetensors.torch",
    "safetensors.cuda",
    "fastsafetensors",
    "wl.numpy",
    "wl.numpy.nocopy",
    "wl.torch",
    "wl.cuda",
    "limit.copy",
    "limit.copy.huge",
)
REMOTE_ARMS = ("wl.push", "limit.tcp", "limit.tcp.fresh")
QUICK_ARMS = ("safetensors.numpy", "wl.numpy", "wl.numpy.nocopy", "wl.push", "limit.copy", "limit.tcp.fresh")

# prepare(name, checkpoint, options): adds what arm ``name`` needs to its options (a converted
# copy of the checkpoint, a cache folder) and returns the files to evict before its runs (None:
# the checkpoint's) and why it cannot run, if it cannot
Prepare = Callable[[str, dict[str, Any], dict[str, Any]], tuple[tuple[str, ...] | None, str | None]]


@dataclass(frozen=True)
class ArmTable:
    """The arms a benchmark knows, the files their bodies live in, and its groups of arms."""

    specs: Mapping[str, ArmSpec]
    files: tuple[str, ...]  # arm files a child loads, weightlift.benchmark.arms first
    local: tuple[str, ...]
    remote: tuple[str, ...]
    quick: tuple[str, ...]
    prepare: Prepare | None = None
    before: Callable[[], None] | None = None  # called once before a benchmark builds its arms


PACKAGE = ArmTable(
    specs={**bench_arms.SPECS, **bench_floors.SPECS},
    files=ARM_FILES,
    local=LOCAL_ARMS,
    remote=REMOTE_ARMS,
    quick=QUICK_ARMS,
)


# -- which arms can run here -------------------------------------------------------------------

_cuda_memo: list[str | None] = []


def cuda_reason() -> str | None:
    """None when a CUDA device is usable from torch; otherwise why not."""
    if _cuda_memo:
        return _cuda_memo[0]
    reason: str | None
    import glob

    # a cheap negative first: no driver node, no driver proc entry, no nvidia-smi (ROCm: /dev/kfd)
    if not (
        glob.glob("/dev/nvidia*")
        or os.path.exists("/proc/driver/nvidia")
        or os.path.exists("/dev/kfd")
        or shutil.which("nvidia-smi")
    ):
        reason = "no CUDA device (no NVIDIA driver on this machine)"
    elif missing_module("torch"):
        reason = "torch is not installed"
    else:
        probe = "import torch,sys;sys.exit(0 if torch.cuda.is_available() else 3)"
        rc = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=300).returncode
        reason = None if rc == 0 else "torch sees no CUDA device (CPU build of torch, or no GPU)"
    _cuda_memo.append(reason)
    return reason


def missing_module(module: str) -> str | None:
    """None when ``module`` can be imported here; otherwise why it cannot."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    if module.startswith("weightlift."):
        return f"{module} is not in this build of weightlift"
    return f"module {module} is not installed"


def _weightlift_reason(name: str) -> str | None:
    """Why one of weightlift's own arms cannot run with the installed weightlift, if it cannot."""
    import inspect

    try:
        from weightlift.api import load
    except ImportError as e:
        return f"weightlift.api does not import: {e}"
    params = inspect.signature(load).parameters
    if name == "wl.split" and "remote" not in params:
        return "weightlift.load has no remote= option in this build"
    if name.startswith("wl.push") or name == "wl.split":
        try:
            from weightlift.remote.client import Client  # noqa: F401
            from weightlift.remote.server import Server  # noqa: F401
        except ImportError as e:
            return f"weightlift's server/client do not import: {e}"
    return None


def arm_reason(name: str, ck: dict[str, Any], *, table: ArmTable = PACKAGE) -> str | None:
    """None if arm ``name`` can run on checkpoint ``ck`` here; otherwise the reason it cannot."""
    spec = table.specs[name]
    if spec.safetensors_only and ck["format"] != "safetensors":
        return f"reads safetensors files only; this checkpoint is {ck['format']}"
    for mod in spec.requires:
        r = missing_module(mod)
        if r:
            return r
    if spec.cuda:
        r = cuda_reason()
        if r:
            return r
    if spec.weightlift:
        return _weightlift_reason(name)
    return None


def expand_arm_names(text: str | Sequence[str] | None, *, quick: bool = False, table: ArmTable = PACKAGE) -> list[str]:
    """Arm names from a comma list; "local", "remote" and "all" name groups."""
    if text is None:
        return list(table.quick if quick else table.local + table.remote)
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[str] = []
    groups = {"local": table.local, "remote": table.remote, "all": table.local + table.remote}
    specs = table.specs
    for item in (i.strip() for i in items):
        if not item:
            continue
        names = groups.get(item, (item,))
        for n in names:
            if n not in specs or specs[n].kind not in ARM_KINDS:
                known = ", ".join(n for n, s in specs.items() if s.kind in ARM_KINDS)
                raise OptionError(f"unknown arm {n!r}; known arms: {known} (groups: local, remote, all)")
            if n not in out:
                out.append(n)
    return out


def build_arms(ck: dict[str, Any], names: Sequence[str], *, table: ArmTable = PACKAGE) -> list[Arm]:
    """Arms for ``names`` on checkpoint ``ck`` (from :func:`describe_checkpoint`), skips decided."""
    arms = []
    for name in names:
        spec = table.specs[name]
        reason = arm_reason(name, ck, table=table)
        opts: dict[str, Any] = {"path": ck["path"], "files": ck["files"]}
        files: tuple[str, ...] = tuple(ck["files"])
        if table.prepare is not None and reason is None:
            own, reason = table.prepare(name, ck, opts)
            files = files if own is None else own
        arms.append(
            Arm(
                name,
                child_argv(name, opts, table.files),
                env=dict(spec.env),
                files=files,
                skip=reason,
                description=spec.description,
                kind=spec.kind,
                profile_argv=child_argv(name, {**opts, "profile": True}, table.files) if spec.weightlift else None,
                floored=spec.floored,
            )
        )
    return arms


# -- baselines ---------------------------------------------------------------------------------


def _warm(path: str) -> None:
    buf = bytearray(bench_arms.BLOCK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def run_baselines(
    ck: dict[str, Any],
    names: Sequence[str],
    *,
    cold: bool = False,
    repeats: int = 3,
    timeout: float = 600.0,
    log: Callable[[str], None] | None = None,
    table: ArmTable = PACKAGE,
) -> dict[str, Any]:
    """Measure each baseline in its own child, on the checkpoint's largest file."""
    say = log or (lambda s: None)
    target = max(ck["files"], key=os.path.getsize)
    out: dict[str, Any] = {"file": target}
    for name in names:
        spec = table.specs[name]
        reason = next((r for r in (missing_module(m) for m in spec.requires) if r), None)
        if reason is None and spec.cuda:
            reason = cuda_reason()
        if reason:
            out[name] = {"status": "skipped", "reason": reason}
            continue
        if name != "base.read" or not cold:
            _warm(target)  # memory and socket limits, measured without the disk
        try:
            s = run_once(
                child_argv(name, {"files": [target], "repeats": repeats, "cold": cold}, table.files), timeout=timeout
            )
            out[name] = {"status": "ok", "description": spec.description, **s.info}
            say(f"  baseline {name}: {s.info.get('gbps', 0):.2f} GB/s")
        except ArmSkipped as e:
            out[name] = {"status": "skipped", "reason": str(e)}
        except ArmFailed as e:
            out[name] = {"status": "failed", "reason": str(e)}
    return out


# -- the whole benchmark -----------------------------------------------------------------------


def estimate_s(
    arm_list: Sequence[Arm],
    *,
    nbytes: int,
    runs: int,
    warmup: int,
    settle: float,
    profile_round: bool,
    baselines: int,
    table: ArmTable = PACKAGE,
) -> float:
    """A guess, before anything runs, of how long a benchmark takes: each run pays the pause,
    a process start, its imports (torch's are the slow ones) and a load at a modest 0.5 GB/s;
    a weightlift arm runs once more when profiled; each baseline reads the file a few times."""

    def one(a: Arm) -> float:
        spec = table.specs.get(a.name)
        torch = spec is not None and "torch" in spec.requires
        return settle + 0.6 + (1.5 if torch else 0.0) + nbytes / 0.5e9

    live = [a for a in arm_list if not a.skip]
    total = sum(one(a) for a in live) * (warmup + runs)
    if profile_round:
        total += sum(one(a) for a in live if a.profile_argv)
    return total + baselines * (0.5 + 3 * 3 * nbytes / 1e9)


def _estimate_line(
    arm_list: Sequence[Arm],
    nbytes: int,
    runs: int,
    warmup: int,
    settle: float,
    profile_round: bool,
    baselines: int,
    quick: bool,
    table: ArmTable,
) -> str:
    """What a benchmark says before it starts: how long it will take, and how to make it shorter
    (--quick) or publishable (bench/RESULTS.md's settings)."""
    guess = functools.partial(estimate_s, warmup=warmup, profile_round=profile_round, table=table)
    live = sum(1 for a in arm_list if not a.skip)
    head = (
        f"this will take about {_minutes(guess(arm_list, nbytes=nbytes, runs=runs, settle=settle, baselines=baselines))}: "
        f"{live} arms x ({warmup} warm-up + {runs} runs), a fresh process each, {settle:g} s pause before each run; "
    )
    if quick:
        middle = "without --quick every arm runs on your checkpoint (or the demo's)"
    else:
        quick_arms = [a for a in arm_list if a.name in table.quick]
        short = guess(quick_arms, nbytes=256 * MIB, runs=3, settle=QUICK_SETTLE_S, baselines=baselines)
        full = guess(arm_list, nbytes=nbytes, runs=5, settle=SETTLE_S, baselines=baselines)
        middle = (
            f"--quick ({len(table.quick)} arms, a 256 MiB synthetic checkpoint) is a first look in about "
            f"{_minutes(short)}; bench/RESULTS.md's settings, --settle {SETTLE_S:g} --runs 5, take about {_minutes(full)}"
        )
    return head + middle + "; --arms, --runs, --settle, --no-profile and --no-baselines change it"


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def run_benchmark(
    path: str | None = None,
    *,
    arms: str | Sequence[str] | None = None,
    quick: bool = False,
    cold: bool = False,
    runs: int | None = None,
    warmup: int = 1,
    baseline: str | None = None,
    size: int | None = None,
    baselines: Sequence[str] | None = None,
    timeout: float = 600.0,
    profile_round: bool = True,
    settle: float | None = None,
    json_path: str | None = None,
    png_path: str | None = None,
    order: str = "shuffle",
    log: Callable[[str], None] | None = None,
    table: ArmTable = PACKAGE,
) -> dict[str, Any]:
    """Baselines, then the arms interleaved; returns the result dict and writes JSON / PNG if asked."""
    say = log or (lambda s: None)
    started = time.time()
    load_before = _loadavg()
    ensure_bytecode()
    names = expand_arm_names(arms, quick=quick, table=table)
    if cold and arms is None:
        # a copy limit of a cold file measures the disk; the read limits are the cold ceiling
        names = [n for n in names if not n.startswith("limit.copy")] + [
            f"limit.read.{k}" for k in bench_floors.READ_LIMIT_THREADS
        ]
    ck = describe_checkpoint(path or default_checkpoint(quick=quick, size=size))
    runs = runs or (3 if quick else 5)
    if table.before is not None:
        table.before()
    say(f"checkpoint {ck['path']}: {ck['tensors']} tensors, {ck['bytes'] / GIB:.2f} GiB ({ck['format']})")
    arm_list = build_arms(ck, names, table=table)
    base_names = list(bench_floors.BASELINES if baselines is None else baselines)
    if settle is None:
        settle = QUICK_SETTLE_S if quick else SETTLE_S
    say(_estimate_line(arm_list, ck["bytes"], runs, warmup, settle, profile_round, len(base_names), quick, table))
    bl = run_baselines(ck, base_names, cold=cold, repeats=2 if quick else 3, timeout=timeout, log=say, table=table)
    if baseline is None:
        baseline = "safetensors.numpy" if "safetensors.numpy" in names else None
    say(f"arms ({'cold' if cold else 'warm'}, {warmup} warm-up + {runs} runs, interleaved): {', '.join(names)}")
    result = run_arms(
        arm_list,
        runs=runs,
        warmup=warmup,
        cold=cold,
        baseline=baseline,
        timeout=timeout,
        profile_round=profile_round,
        settle=settle,
        order=order,
        log=say,
    )
    _derive(result, ck, bl)
    result.update(_context(ck, bl, names, quick=quick, started=started, table=table))
    result["machine"]["loadavg"] = {"before": load_before, "after": _loadavg()}
    result["notes"] = _notes(result)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    if png_path:
        result["png"] = plot(result, png_path)
    return result


def _context(
    ck: dict[str, Any], bl: dict[str, Any], names: Sequence[str], *, quick: bool, started: float, table: ArmTable
) -> dict[str, Any]:
    """What a result records beside its arms: the checkpoint, the baselines, the machine."""
    return {
        "schema": SCHEMA,
        "checkpoint": {k: v for k, v in ck.items() if k != "names"},
        "baselines": bl,
        "quick": quick,
        # every other arm, with the reason it could not run here (None: it could)
        "not_selected": {
            n: arm_reason(n, ck, table=table)
            for n, s in table.specs.items()
            if s.kind in ("local", "remote") and n not in names
        },
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cuda": cuda_reason() or "available",
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "elapsed_s": time.time() - started,
    }


def _derive(result: dict[str, Any], ck: dict[str, Any], bl: dict[str, Any]) -> None:
    """GB/s per arm from the checkpoint bytes, and its speed-up over the floor of its kind:
    the floor's load time over the arm's (above 1: faster than the simplest code doing the
    same work, which a loader can be; it is a reference, not a physical limit)."""
    limits = {
        "local": bl.get("base.copy", {}).get("fresh", {}).get("gbps"),
        "remote": bl.get("base.tcp", {}).get("gbps"),
    }
    # a limit measured as an arm (fresh process, same pauses, median of the same rounds) is the
    # one the arms are held to; the in-process baselines (best of three repeats) otherwise
    # the raw read into reused buffers; limit.read.fresh.* (into fresh memory) is reported beside it
    reads = [n for n in result["arms"] if n.startswith("limit.read.") and not n.startswith("limit.read.fresh.")]
    copies = ["limit.copy", "limit.copy.huge"]  # the copy floor: the faster page size
    # a push lands in a fresh server's fresh memory: raw TCP into fresh memory is the same work,
    # into a reused buffer only where that did not run
    tcp = next((n for n in ("limit.tcp.fresh", "limit.tcp") if _ran(result, n)), "limit.tcp")
    for kind, cands, fallback in (("local", reads or copies, "base.copy"), ("remote", [tcp], "base.tcp")):
        ok = [(result["arms"][n]["load"]["median"], n) for n in cands if _ran(result, n)]
        if ok:
            best, name = min(ok)  # the fastest reader count or page size
            limits[kind] = ck["bytes"] / best / 1e9
            result[f"{kind}_limit"] = name
        else:
            result[f"{kind}_limit"] = fallback
    for r in result["arms"].values():
        med, load = r["summary"]["median"], r["load"]["median"]
        r["gbps"] = ck["bytes"] / med / 1e9 if med else None
        r["load_gbps"] = ck["bytes"] / load / 1e9 if load else None
        lim = limits.get(r["kind"]) if r.get("floored", True) else None
        r["floor_speedup"] = r["load_gbps"] / lim if r["load_gbps"] and lim else None
        r["bytes_match"] = None if r["bytes"] is None else r["bytes"] == ck["bytes"]


def _loadavg() -> float | None:
    """The 1-minute load average, None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _busy_note(machine: dict[str, Any]) -> str | None:
    """A note when other work shared the cores: the load average above three quarters of them
    before or after the run (on the 2-core development VM at 3 to 9, a --quick run's medians
    moved by more than the differences between the arms)."""
    la, cpus = machine.get("loadavg") or {}, machine.get("cpus") or 1
    worst = max((v for v in (la.get("before"), la.get("after")) if v is not None), default=None)
    if worst is None or worst <= 0.75 * cpus:
        return None
    return (
        f"busy machine: load average {la.get('before') or 0:.1f} before and {la.get('after') or 0:.1f} after the run "
        f"on {cpus} CPUs; other work shared the cores, so the medians carry its noise (a loader that reads on "
        "several threads loses most when no core is free): compare on a quiet machine, or with more --runs"
    )


def _ran(result: dict[str, Any], name: str) -> bool:
    r = result["arms"].get(name)
    return r is not None and r["status"] == "ok" and bool(r["load"]["median"])


def _notes(result: dict[str, Any]) -> list[str]:
    notes = []
    cc = result.get("cold_check")
    if cc is not None:
        worst = cc["max_resident_before"]
        if worst is None:
            notes.append("cold: no run was checked")
        elif worst <= 0.001:
            notes.append(
                f"cold: evicted, {100 * worst:.1f} % resident before each run "
                f"({cc['runs_checked']} counted runs checked with mincore)"
            )
        else:
            notes.append(
                f"cold: eviction incomplete, up to {100 * worst:.1f} % resident before a run "
                "(this filesystem may keep pages, e.g. tmpfs)"
            )
    else:
        notes.append("warm: the page cache is left as it is (the warm-up round fills it)")
    busy = _busy_note(result.get("machine") or {})
    if busy:
        notes.append(busy)
    for name, r in result["arms"].items():
        if r["status"] == "ok" and r["bytes_match"] is False and r["kind"] != "limit":  # a limit copies the file
            notes.append(f"{name} reported {r['bytes']} bytes; the checkpoint holds {result['checkpoint']['bytes']}")
    return notes
