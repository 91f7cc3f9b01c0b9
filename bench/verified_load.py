#!/usr/bin/env python3
"""What a verified load costs, at two commits: does checking against a published manifest cost
more than checking against the file's own hashes did?

One synthetic safetensors file (``--size-mib``, tensors of 8 MiB), hard-linked into one folder
per arm so that the page cache holds it once and each arm's own files (a published manifest, a
hash cache beside the file from an older commit) stay apart. Arms, for each source tree given
with ``--tree NAME=ROOT``: ``NAME.none`` (``weightlift.load(folder, verify=True)``, no manifest
anywhere: the file's own hashes, from the cache after the warm-up) and ``NAME.published`` (the
same call with ``weightlift.manifest.json`` beside the file). Each run is a fresh process with
``PYTHONPATH=ROOT``; one warm-up per arm, then ``--runs`` rounds with the arms interleaved. The
figure is the load call's own seconds (warm page cache), median and spread.

    python bench/verified_load.py --tree before=OLD_CHECKOUT --tree after=. --size-mib 768 --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

TIMED = """
import json, sys, time
import weightlift as wl
t0 = time.perf_counter()
out = wl.load(sys.argv[1], verify=True)
print(json.dumps({"seconds": time.perf_counter() - t0, "tensors": len(out)}))
"""


def _write(path: str, size_mib: int) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    n = max(1, size_mib // 8)
    save_file({f"layer.{i}.w": rng.integers(0, 256, 8 << 20, dtype=np.uint8) for i in range(n)}, path)


def _run(root: str, folder: str, cache: str) -> float:
    env = dict(os.environ, PYTHONPATH=root, WEIGHTLIFT_CACHE=cache)
    out = subprocess.run([sys.executable, "-c", TIMED, folder], env=env, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.splitlines()[-1])["seconds"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=ROOT", help="a source tree to run")
    ap.add_argument("--size-mib", type=int, default=768)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", metavar="FILE", help="write every run's seconds here")
    a = ap.parse_args(argv)
    trees = dict(t.split("=", 1) for t in a.tree)
    with tempfile.TemporaryDirectory(prefix="wl-verified-load-") as tmp:
        data = os.path.join(tmp, "model.safetensors")
        _write(data, a.size_mib)
        arms: dict[str, tuple[str, str, str]] = {}
        for name, root in trees.items():
            for kind in ("none", "published"):
                folder = os.path.join(tmp, f"{name}.{kind}")
                os.mkdir(folder)
                os.link(data, os.path.join(folder, "model.safetensors"))
                if kind == "published":
                    env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
                    subprocess.run([sys.executable, "-m", "weightlift", "manifest", folder], env=env, check=True,
                                   capture_output=True)  # fmt: skip
                cache = os.path.join(tmp, f"cache.{name}.{kind}")
                arms[f"{name}.{kind}"] = (os.path.abspath(root), folder, cache)
        for root, folder, cache in arms.values():  # warm-up: page cache, hash caches
            _run(root, folder, cache)
        seconds: dict[str, list[float]] = {arm: [] for arm in arms}
        for _ in range(a.runs):
            for arm, (root, folder, cache) in arms.items():
                seconds[arm].append(_run(root, folder, cache))
    print(f"verified load of {a.size_mib} MiB, warm page cache, {a.runs} runs per arm (fresh processes, interleaved)")
    print(f"{'arm':<20} {'median s':>9} {'min':>7} {'max':>7}")
    for arm, s in seconds.items():
        print(f"{arm:<20} {statistics.median(s):>9.3f} {min(s):>7.3f} {max(s):>7.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(seconds, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
