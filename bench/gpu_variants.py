"""Host-to-device loading on a CUDA machine: weightlift's engines and thread counts against the
pinned-memory copy bandwidth measured in the same process, warm page cache.

    python bench/gpu_variants.py [PATH] [--size-gib 4] [--rounds 3] [--json FILE]

Every arm is timed after one uncounted warm-up, rounds interleaved (A B C A B C); medians.
This is the quick in-process companion to ``bench/load.py --arms wl.cuda,...`` (fresh
processes), made to choose the defaults of the device path in one short session.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _common import write_json


def pageable_h2d(nbytes: int, reps: int = 3) -> float:
    """Host-to-device from ordinary (pageable) memory: what a copy without pinned staging gets."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", nargs="?")
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch

    import weightlift as wl
    from weightlift.benchmark.synthetic import write_checkpoint

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    path = a.path
    if path is None:
        layers = max(1, int(a.size_gib * 2**30 / (4 * 2**20 * 32)))
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"wl-gpu-{a.size_gib:g}g.safetensors")
        if not os.path.exists(path):
            write_checkpoint(
                __import__("pathlib").Path(path),
                [(f"layers.{i}.w{j}", "BF16", (2048, 1024)) for i in range(layers) for j in range(32)],
            )
    size = sum(t.length for t in wl.open(path))
    with open(path, "rb") as f:  # warm the page cache
        while f.read(64 << 20):
            pass
    arms = {}
    for engine in ("pread", "mmap"):
        for threads in (4, 8, 16):
            arms[f"wl.cuda.{engine}.t{threads}"] = lambda e=engine, k=threads: wl.load(
                path, device="cuda", framework="torch", engine=e, threads=k, progress=False
            )
    try:
        from safetensors.torch import load_file

        arms["safetensors.cuda"] = lambda: load_file(path, device="cuda")
    except ImportError:
        pass
    res: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(a.rounds + 1):
        for k, f in arms.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = f()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            del out
            torch.cuda.empty_cache()
            if r:
                res[k].append(dt)
    from weightlift.benchmark.floors import BODIES

    pinned = BODIES["base.h2d"]({"files": [path], "repeats": 5})["gbps"]  # the harness's own baseline
    pageable = pageable_h2d(1 << 30)
    out = {"bytes": size, "pinned_h2d_gbps": pinned, "pageable_h2d_gbps": pageable, "cpus": os.cpu_count(), "arms": {}}
    print(f"checkpoint {path}: {size / 2**30:.2f} GiB; pinned H2D {pinned:.1f} GB/s, pageable H2D {pageable:.1f} GB/s")
    for k, v in res.items():
        med = statistics.median(v)
        gbps = size / med / 1e9
        out["arms"][k] = {"median_s": med, "runs": v, "gbps": gbps, "of_pinned": gbps / pinned}
        print(
            f"{k:<22} median {med:.3f} s  {gbps:6.1f} GB/s  {100 * gbps / pinned:5.1f} % of pinned  runs {[round(x, 3) for x in v]}"
        )
    write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
