#!/usr/bin/env python3
"""Second push of a mixture-of-experts checkpoint to a caching server, against the first push
into a freshly started one.

The checkpoint is synthetic (weightlift.benchmark.synthetic.moe_tensors): about 0.5 GiB in 215
tensors, experts of 1 to 4 MiB per projection, an embedding and a head of 16 MiB; fewer than
6 % of its bytes lie in tensors of 10 MiB or more, the threshold llama.cpp's cache uses. Arms
(fresh process each, the server inside the child):

- wl.push: a push into a freshly started server (no cache);
- wl.push.second: two pushes to one caching server (a fresh cache folder per run); the first
  fills the cache, the second is timed (its first push is reported as first_s).

The goal: the second push sends at most 10 % of the bytes and is at least 5 times faster than
the first into a fresh server.

    python bench/moe_push.py [--runs 5] [--json moe.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from suite import run_benchmark

from weightlift.benchmark.harness import bench_dir
from weightlift.benchmark.synthetic import moe_tensors, write_checkpoint


def moe_checkpoint() -> str:
    path = os.path.join(bench_dir(), "synthetic-moe.safetensors")
    if not os.path.exists(path):
        write_checkpoint(path, moe_tensors(), seed=7)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--settle", type=float, default=None, help="pause before every run (default: the harness's)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    path = moe_checkpoint()
    result = run_benchmark(
        path,
        arms=["wl.push", "wl.push.second"],
        runs=a.runs,
        baselines=[],
        profile_round=False,
        settle=a.settle,
        json_path=a.json,
        log=print,
    )
    first = result["arms"]["wl.push"]["load"]["median"]
    arm = result["arms"]["wl.push.second"]
    second = arm["load"]["median"]
    sent = [p["bytes_sent"] / result["checkpoint"]["bytes"] for p in arm.get("push", [])]
    firsts = [f / s for f, s in zip(arm.get("first_s", []), arm["load_s"], strict=False) if f and s]
    out = {
        "first_push_fresh_server_s": first,
        "second_push_s": second,
        "speedup": first / second if second else None,
        "first_over_second_same_process": statistics.median(firsts) if firsts else None,
        "second_bytes_sent_share": statistics.median(sent) if sent else None,
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
