#!/usr/bin/env python3
"""Two checkouts of weightlift side by side, in one run: the headline figures of each.

A redesign must not move the figures; this measures that. Each arm runs in a fresh process
whose ``PYTHONPATH`` is one checkout (``--old``, ``--new``), calling only public API both have
(``weightlift.load``, ``Server``, ``Client.push``), so the same child program times either
commit. Rounds alternate the checkouts (old new, new old, ...), with a pause before every run;
the report gives each arm's median per checkout and the ratio new/old.

Arms:

- ``load.warm``: ``weightlift.load(path)`` into owned numpy arrays, file in the page cache;
- ``load.cold``: the same after ``posix_fadvise(DONTNEED)`` on the file (root drops clean pages);
- ``push.fresh``: a push of every tensor into a server started in the child (no cache);
- ``push.second``: two pushes into one caching server (fresh cache folder per run), the second
  timed: what a restart-free update of unchanged weights costs.

    python bench/ab_commits.py --old ../wt-old --new . [--path CKPT] [--runs 5] [--settle 10] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = {
    "load.warm": """
import time, weightlift as wl
t0 = time.perf_counter(); sd = wl.load(PATH); dt = time.perf_counter() - t0
print(dt)
""",
    "load.cold": """
import time, weightlift as wl
t0 = time.perf_counter(); sd = wl.load(PATH); dt = time.perf_counter() - t0
print(dt)
""",
    "push.fresh": """
import time, weightlift as wl
with wl.Server() as s:
    host, port = s.start()
    with wl.Client(f"{host}:{port}") as c:
        t0 = time.perf_counter(); c.push(PATH); dt = time.perf_counter() - t0
print(dt)
""",
    "push.second": """
import tempfile, time, weightlift as wl
with tempfile.TemporaryDirectory() as d, wl.Server(cache_dir=d) as s:
    host, port = s.start()
    with wl.Client(f"{host}:{port}") as c:
        c.push(PATH)
        t0 = time.perf_counter(); c.push(PATH); dt = time.perf_counter() - t0
print(dt)
""",
}


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _warm(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def _run(tree: str, arm: str, path: str, timeout: float) -> float:
    env = dict(os.environ, PYTHONPATH=tree, WEIGHTLIFT_LOADPROF="0")
    code = f"PATH = {path!r}\n" + CHILD[arm]
    with tempfile.TemporaryDirectory() as cwd:  # no checkout on the path but the one asked for
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    if out.returncode:
        raise RuntimeError(f"{arm} in {tree} failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def _default_path() -> str:
    from weightlift.benchmark.harness import bench_dir
    from weightlift.benchmark.synthetic import llama_for_size, write_checkpoint

    p = Path(bench_dir()) / "synthetic-768m.safetensors"
    if not p.exists():
        write_checkpoint(p, llama_for_size(768 << 20))
    return str(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="checkout of the earlier commit")
    ap.add_argument("--new", required=True, help="checkout of the later commit")
    ap.add_argument("--path", help="checkpoint (default: the 768 MiB synthetic one of weightlift bench)")
    ap.add_argument("--arms", default=",".join(CHILD), help="comma list of " + ", ".join(CHILD))
    ap.add_argument("--runs", type=int, default=5, help="rounds (each runs every arm in both checkouts)")
    ap.add_argument("--settle", type=float, default=10.0, help="pause before every run, seconds")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    path = a.path or _default_path()
    arms = [x for x in a.arms.split(",") if x]
    trees = {"old": os.path.abspath(a.old), "new": os.path.abspath(a.new)}
    times: dict[str, dict[str, list[float]]] = {arm: {"old": [], "new": []} for arm in arms}
    for r in range(a.runs):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        for arm in arms:
            for side in order:
                (_evict if arm == "load.cold" else _warm)(path)
                time.sleep(a.settle)
                times[arm][side].append(_run(trees[side], arm, path, a.timeout))
        print(f"round {r + 1}/{a.runs} done", file=sys.stderr)
    print(
        f"{'arm':<12} {'old s':>8} {'new s':>8} {'new/old':>8}   (medians of {a.runs}; load {os.getloadavg()[0]:.2f})"
    )
    out = {"path": path, "runs": a.runs, "settle": a.settle, "arms": {}}
    for arm in arms:
        mo, mn = statistics.median(times[arm]["old"]), statistics.median(times[arm]["new"])
        print(f"{arm:<12} {mo:8.3f} {mn:8.3f} {mn / mo:8.2f}")
        out["arms"][arm] = {"old": times[arm]["old"], "new": times[arm]["new"], "ratio": mn / mo}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
