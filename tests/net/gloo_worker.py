"""A gloo rank in its own network namespace: the program of :mod:`tests.net.test_gloo_netns`.

    python -m tests.net.gloo_worker SCENARIO RANK WORLD MASTER_ADDR PORT TMP PATHS_JSON DEVICE

It joins the group at ``tcp://MASTER_ADDR:PORT`` over the namespace's own link (the test sets
``GLOO_SOCKET_IFNAME`` to that link's device) and runs the same checks as the loopback groups
of ``tests/distributed/test_distributed.py`` (``main``, ``die_receiver``, ``die_source``), or
``cut_receiver``: the last rank takes its own link down mid-broadcast and waits there, alive,
so no connection is ever closed and the other ranks learn of it only by their timeout. Each rank
writes its report to ``TMP/SCENARIO.RANK.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> None:
    scenario, rank, world, master, port, tmp, paths, device = argv
    rank_i, world_i = int(rank), int(world)
    import torch.distributed as dist

    from tests.distributed.test_distributed import _die_checks, _main_checks

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}:{port}",
        rank=rank_i,
        world_size=world_i,
        timeout=datetime.timedelta(seconds=20),
    )
    report: dict = {"failures": [], "bytes_read": {}, "paths": {}}
    if scenario == "main":
        _main_checks(rank_i, world_i, json.loads(paths), report)
    elif scenario == "cut_receiver":
        _cut_checks(rank_i, world_i, json.loads(paths), device, report)
    else:
        _die_checks(scenario, rank_i, world_i, json.loads(paths), report)
    (Path(tmp) / f"{scenario}.{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # no destroy_process_group: a dead peer can make it wait


def _cut_checks(rank: int, world: int, paths: dict[str, str], device: str, report: dict) -> None:
    import weightlift as wl

    cut = world - 1
    seen = [0]

    def progress(n: int) -> None:
        seen[0] += 1
        if rank == cut and seen[0] == 2:
            subprocess.run(["ip", "link", "set", "dev", device, "down"], check=True)
            time.sleep(600)  # alive and silent: the test kills it once the others have reported

    t0 = time.monotonic()
    try:
        wl.distributed.broadcast_load(
            paths["st"] if rank == 0 else None, dist_group(), chunk=64 << 10, timeout=5, progress=progress
        )
        report["error"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        report["error"] = type(e).__name__
        report["message"] = str(e)
    report["seconds"] = time.monotonic() - t0


def dist_group():
    import torch.distributed as dist

    return dist.group.WORLD


if __name__ == "__main__":
    main(sys.argv[1:])
