#!/usr/bin/env python3
"""A cache hit against a warm local load, a first push with and without a cache, on loopback.

The question asked of a caching server: a push of a checkpoint whose every tensor the server's
cache holds should cost about what loading the same file from the page cache costs
(``weightlift.load``, an owned copy). Both read the same bytes from the page cache into fresh
memory; the hit also hashes them (an entry is verified on every read) and speaks the protocol.

Arms, each a fresh process per run (seconds as each measures itself):

* ``hit``: ``weightlift push FILE --json`` into a fresh ``weightlift serve --cache-dir D``
  whose cache holds every tensor of FILE (filled once by an earlier server), entries in the
  page cache; the client's seconds, connect to the last acknowledgement.
* ``load.warm``: ``weightlift.load(FILE)`` in a fresh process, FILE in the page cache.
* ``push.fresh``, ``push.cache``: a first push of FILE into a fresh server without a cache, and
  into one with an empty ``--cache-dir`` (what the cache costs a first push; its entries are
  written behind, after the push).
* ``hit.old``, ``push.fresh.old``, ``push.cache.old`` (with ``--old DIR``, for each of those
  arms asked for): the same with the server run from another checkout.
* ``hash``: blake3 of FILE's bytes, single-threaded, read from the page cache into one fresh
  buffer (what a hit adds to a load at the least, when nothing overlaps).

Each arm's CPU seconds (all threads, user and system) are printed beside its wall time: on a
machine shared with other work the wall time swings with the load, the CPU a run needs much
less (the server's CPU during the push for the push arms, the load call's for ``load.warm``).

Runs in a seeded shuffled order per round, ``--settle`` seconds before each; medians and the
median of per-round ratios. ``--profile`` runs one more hit with ``WEIGHTLIFT_LOADPROF=1`` on
the server and prints its report. The checkpoint is ``bench/update.py``'s v+1 (made there if
missing: ``python bench/update.py --size-mib N --fractions 1 --arms load.warm --runs 1``), or
any file with ``--file``.

    python bench/cache_hit.py --size-mib 768 --runs 7
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "weightlift.cli"]
MIB = 1 << 20
SERVER_ARMS = ("hit", "push.fresh", "push.cache")  # the arms whose server --old can run from another tree


def _env(tree: str | Path = ROOT, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def serve(cache: str | None, tree: str | Path = ROOT, **env: str) -> tuple[subprocess.Popen[str], str]:
    """A fresh ``weightlift serve`` on loopback (run from ``tree``), with ``cache`` as its
    ``--cache-dir`` (None: no cache); the process and its address."""
    cached = ["--cache-dir", cache, "--cache-max", "none"] if cache is not None else []
    proc = subprocess.Popen(
        [*CLI, "serve", "--port", "0", *cached],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tree,
        env=_env(tree, **env),
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith("weightlift: serving on "):
        raise RuntimeError(f"the server did not start: {line!r} {proc.stderr.read()}")  # type: ignore[union-attr]
    return proc, line.split()[3]


def stop(proc: subprocess.Popen[str], graceful: bool = False) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT if graceful else signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err or ""


def push(path: str, to: str) -> dict[str, Any]:
    r = subprocess.run([*CLI, "push", path, "--to", to, "--json"], capture_output=True, text=True, env=_env())
    if r.returncode:
        raise RuntimeError(f"push failed ({r.returncode}): {r.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def child(name: str, path: str) -> tuple[float, float]:
    r = subprocess.run(
        [sys.executable, __file__, "_child", name, path], capture_output=True, text=True, env=_env(), cwd=ROOT
    )
    if r.returncode:
        raise RuntimeError(f"{name} failed ({r.returncode}): {r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return float(out["seconds"]), float(out["cpu"])


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_of(pid: int) -> float:
    """CPU seconds (user and system, all threads) process ``pid`` has used so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_load(path: str) -> None:
    import ml_dtypes  # noqa: F401  (imported before the clock, as a server imports it at start)

    import weightlift as wl

    c0, t0 = _cpu_self(), time.perf_counter()
    wl.load(path)
    print(json.dumps({"seconds": time.perf_counter() - t0, "cpu": _cpu_self() - c0}))


def child_hash(path: str) -> None:
    import blake3
    import numpy as np

    n = os.path.getsize(path)
    buf = np.empty(n, dtype=np.uint8)
    t0 = time.perf_counter()
    c0 = _cpu_self()
    h = blake3.blake3(max_threads=1)
    with open(path, "rb", buffering=0) as f:
        view = memoryview(buf)
        for off in range(0, n, 4 * MIB):
            chunk = view[off : off + 4 * MIB]
            f.readinto(chunk)
            h.update(chunk)
    h.digest()
    print(json.dumps({"seconds": time.perf_counter() - t0, "cpu": _cpu_self() - c0}))


def filled_cache(path: str, tmp: str) -> str:
    d = os.path.join(tmp, "hit-cache")
    proc, to = serve(d)
    try:
        push(path, to)
    finally:
        stop(proc, graceful=True)
    return d


def warm(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(64 * MIB):
            pass


def _served_push(path: str, cache: str | None, tree: str | Path) -> tuple[dict[str, Any], float]:
    """One push of ``path`` into a fresh server (``cache`` its cache folder, or none): the push's
    report, and the CPU seconds the server spent on it."""
    proc, to = serve(cache, tree)
    try:
        c0 = _cpu_of(proc.pid)
        r = push(path, to)
        return r, _cpu_of(proc.pid) - c0
    finally:
        stop(proc)


def arm_hit(path: str, cache: str, tree: str | Path = ROOT) -> tuple[float, float]:
    """The client's seconds, and the CPU seconds the server spent on the push."""
    r, cpu = _served_push(path, cache, tree)
    if r.get("cached", 0) == 0:
        raise RuntimeError(f"the cache-hit push filled nothing from the cache: {r}")
    return float(r["seconds"]), cpu


def arm_push(path: str, tmp: str, cached: bool, tree: str | Path = ROOT) -> tuple[float, float]:
    """A first push into a fresh server, with an empty cache (``cached``) or none: the
    client's seconds, and the CPU seconds the server spent on the push (the entries it writes
    behind afterwards not counted)."""
    cache = tempfile.mkdtemp(prefix="cache-", dir=tmp) if cached else None
    try:
        r, cpu = _served_push(path, cache, tree)
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    return float(r["seconds"]), cpu


def _ratios(runs: dict[str, list[float]], a: str, b: str) -> None:
    if a in runs and b in runs:
        ratios = [x / y for x, y in zip(runs[a], runs[b], strict=True)]
        print(f"{a}/{b} per round: {' '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=768)
    ap.add_argument("--file", help="the checkpoint (default: bench/update.py's v+1 of --size-mib)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--settle", type=float, default=1.0)
    ap.add_argument("--arms", default="hit,load.warm,hash")
    ap.add_argument("--old", metavar="DIR", help="also the server arms as NAME.old, the server run from this checkout")
    ap.add_argument("--profile", action="store_true", help="one more hit with the server's profile printed")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    if a.file:
        path = a.file
    else:
        from weightlift.benchmark.harness import bench_dir

        path = os.path.join(bench_dir(), f"update-{a.size_mib}m-f1.safetensors")
        if not os.path.exists(path):
            raise SystemExit(f"{path} is missing: make it with bench/update.py (see this script's --help)")
    arms = a.arms.split(",")
    arms += [f"{x}.old" for x in arms if x in SERVER_ARMS] if a.old else []
    load0 = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="wl-cache-hit-")
    try:
        cache = filled_cache(path, tmp)
        warm(path)
        runs: dict[str, list[float]] = {k: [] for k in arms}
        cpus: dict[str, list[float]] = {k: [] for k in arms}
        fns = {"hit": lambda: arm_hit(path, cache), "load.warm": lambda: child("load", path)}
        fns["hash"] = lambda: child("hash", path)
        fns["push.fresh"] = lambda: arm_push(path, tmp, False)
        fns["push.cache"] = lambda: arm_push(path, tmp, True)
        if a.old:
            fns["hit.old"] = lambda: arm_hit(path, cache, a.old)
            fns["push.fresh.old"] = lambda: arm_push(path, tmp, False, a.old)
            fns["push.cache.old"] = lambda: arm_push(path, tmp, True, a.old)
        for rnd in range(-1, a.runs):  # round -1: uncounted warm-up
            order = list(arms)
            random.Random(rnd).shuffle(order)
            for arm in order:
                time.sleep(a.settle)
                s, cpu = fns[arm]()
                print(f"  round {rnd} {arm}: {s:.3f} s, {cpu:.2f} CPU s", file=sys.stderr)
                if rnd >= 0:
                    runs[arm].append(s)
                    cpus[arm].append(cpu)
        if a.profile:
            proc, to = serve(cache, WEIGHTLIFT_LOADPROF="1")
            try:
                push(path, to)
            finally:
                print(stop(proc, graceful=True)[-6000:], file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'arm':12} {'median s':>9} {'min':>7} {'max':>7} {'CPU s':>7}")
    for arm, xs in runs.items():
        cpu = statistics.median(cpus[arm])
        print(f"{arm:12} {statistics.median(xs):9.3f} {min(xs):7.3f} {max(xs):7.3f} {cpu:7.3f}")
    _ratios(runs, "hit", "load.warm")
    _ratios(runs, "push.cache", "push.fresh")
    _ratios(runs, "push.cache.old", "push.fresh.old")
    for x in ("hit", "push.cache"):
        _ratios(runs, x, f"{x}.old")
    print(f"load average before {load0}, after {os.getloadavg()}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"file": path, "runs": runs, "cpu": cpus, "load": [load0, os.getloadavg()]}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        {"load": child_load, "hash": child_hash}[sys.argv[2]](sys.argv[3])
    else:
        main()
