"""A split load against its two halves run alone: is time to ready the slower half, not the sum?

    python bench/split_halves.py [PATH] [--runs 5] [--json FILE]

Half the tensors (by count, in file order) load locally, the other half are pushed to a tensor
server in the same process; each arm runs in a fresh process, arms interleaved (local, remote,
split, fault, then each round in its own seeded shuffle of that order), each after a
settle pause (``--settle``, 3 s: no run inherits memory the run before it freed, still backed
by the host), medians reported with the split's ratio to the slower half.

It also reports the CPU seconds each arm used (user + system, all threads: on a VM that
includes the time a vCPU waits for the host to back fresh memory). Run on one machine, the
split does the work of both halves on the same cores: their CPU seconds over the core count
is a floor on its time to ready that no overlap can beat, printed as the best ratio possible
here. On two machines the remote half's receiving runs on the server's cores instead.

A fourth arm, ``fault``, only faults in fresh memory the size of both halves on every core
(nothing read, copied or sent): the split must land all its bytes in memory its process has
never touched, so on a VM whose host backs fresh memory slowly that is a floor too. Each half
alone needs only half of it, and this VM's guest hands out memory freed moments earlier (still
backed) before memory it has given back to the host, which favours the smaller consumer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from weightlift.benchmark.harness import round_order

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = r"""
import resource, sys, time
import weightlift as wl
from weightlift.checkpoint import open_checkpoint
mode, path = sys.argv[1], sys.argv[2]
ck = open_checkpoint(path)
names = [t.name for t in ck.tensors]
local, remote = frozenset(names[: len(names) // 2]), frozenset(names[len(names) // 2 :])
if mode == "fault":  # the research bench's limit.fault arm, on this checkpoint's data
    sys.path.insert(0, sys.argv[3])  # bench/, where peer_arms lives
    from peer_arms import BODIES
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    info = BODIES["limit.fault"]({"files": [path]})
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print(info["load_s"], r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
    sys.exit(0)
srv = wl.Server(port=0)
host, port = srv.start()
addr = f"{host}:{port}"
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
t, c0 = time.perf_counter(), cpu()
if mode == "local":
    wl.load(ck, select=local, progress=False)
elif mode == "remote":
    with wl.Client(addr) as c:
        c.push(ck, select=remote)
else:
    wl.load(ck, select=local | remote, remote={addr: remote}, progress=False)
print(time.perf_counter() - t, cpu() - c0)
srv.close()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", nargs="?")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--settle",
        type=float,
        default=3.0,
        help="pause before each run so none inherits memory the one before it freed (default 3 s)",
    )
    ap.add_argument("--json")
    a = ap.parse_args()
    path = a.path
    if path is None:
        from weightlift.benchmark.synthetic import ensure_demo_checkpoint

        path = str(ensure_demo_checkpoint())
    times: dict[str, list[float]] = {"local": [], "remote": [], "split": [], "fault": []}
    cpus: dict[str, list[float]] = {k: [] for k in times}
    modes = list(times)
    for r in range(a.runs + 1):  # the first round warms the page cache and is not counted
        for mode in round_order(modes, r):  # shuffled per round: no arm always follows the same one
            time.sleep(a.settle)
            out = subprocess.run(
                [sys.executable, "-c", CHILD, mode, path, HERE], capture_output=True, text=True, check=True
            )
            if r:
                wall, cpu = map(float, out.stdout.strip().splitlines()[-1].split())
                times[mode].append(wall)
                cpus[mode].append(cpu)
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpus.items()}
    slower = max(med["local"], med["remote"])
    for k, v in times.items():
        print(f"{k:<7} median {med[k]:.3f} s  cpu {cpu_med[k]:.3f} s  runs {[round(x, 3) for x in v]}")
    print(f"split / slower half: {med['split'] / slower:.2f}x (goal: at most 1.1x)")
    print(
        f"fault-in floor: fresh memory for both halves faulted in, nothing else, {med['fault']:.3f} s = "
        f"{med['fault'] / slower:.2f}x the slower half; the split takes {med['split'] / med['fault']:.2f}x that floor"
    )
    cores = os.cpu_count() or 1
    floor = (cpu_med["local"] + cpu_med["remote"]) / cores
    print(
        f"floor on this machine: the halves' {cpu_med['local'] + cpu_med['remote']:.3f} CPU s on {cores} cores "
        f"= {floor:.3f} s, {max(1.0, floor / slower):.2f}x the slower half at best"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "path": path,
                    "runs": times,
                    "cpu_s": cpus,
                    "median_s": med,
                    "ratio": med["split"] / slower,
                    "floor_ratio": floor / slower,
                    "fault_floor_ratio": med["fault"] / slower,
                    "at": time.time(),
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
