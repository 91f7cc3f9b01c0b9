#!/usr/bin/env python3
"""Fan-out and group loads: time to ready against the number of receivers, bytes read per rank.

Arms, each in fresh processes, rounds in a seeded shuffled order, a pause before every run:

* ``push.N``: N receiver processes, each a ``weightlift.Server`` on loopback; one pusher
  process sends the whole checkpoint to all N at once (``weightlift.distributed.push_many``,
  one ``Client`` per server). Ready: push_many returned, i.e. every server acknowledged every
  tensor (the servers' BARRIER replies). Server start-up is not counted.
* ``bcast.N``: a gloo group of N receivers plus the source; ``broadcast_load`` on every rank.
  Ready: the last rank's return, from the moment the source left a barrier (one clock: one
  machine). Every rank's result is hashed afterwards and must equal the source's.

Then, once each: bytes read from the files per rank for a group load (``load(group=)``), a
sharded group load (``load(shard=, group=)``, tensor-parallel rules) and a sharded load
without a group, at 2 and 4 ranks; the storage rate (cold and warm sequential ``preadv``),
the gloo link rate (a 2-rank broadcast of memory) and the single-push rate; and from those a
model of 8 and 64 receivers on separate machines (bench/fanout_model.py, which also takes
this script's --json output).

    python bench/distributed.py --size-mib 256 --runs 3 --json dist.json
    python bench/distributed.py --quick
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from typing import Any

from _common import MIB, add_run_arguments, checkpoint, parser, write_json

RULES = {
    "*.self_attn.[qkv]_proj.weight": "colwise",
    "*.mlp.gate_proj.weight": "colwise",
    "*.mlp.up_proj.weight": "colwise",
    "*.self_attn.o_proj.weight": "rowwise",
    "*.mlp.down_proj.weight": "rowwise",
    "model.embed_tokens.weight": "colwise",
    "lm_head.weight": "colwise",
}


# -- children ------------------------------------------------------------------------------------


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write("RESULT " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def child_server() -> None:
    import weightlift as wl

    with wl.Server(port=0) as srv:
        host, port = srv.start()
        print(f"PORT {port}", flush=True)
        sys.stdin.read()  # until the parent closes our stdin
        tensors = srv.tensors()
        _emit({"tensors": len(tensors), "bytes": int(sum(t.nbytes for t in tensors.values()))})


def child_push(path: str, to: list[str]) -> None:
    from weightlift.distributed import push_many

    t0 = time.perf_counter()
    res = push_many(path, {a: None for a in to}, timeout=120)
    _emit({"seconds": time.perf_counter() - t0, "bytes": sum(r.bytes for r in res.values())})


def _init(rank: int, world: int, port: int) -> Any:
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    return dist


def _digest(sd: dict[str, Any]) -> str:
    import blake3
    import numpy as np

    h = blake3.blake3()
    for v in sd.values():
        h.update(memoryview(np.ascontiguousarray(v).reshape(-1).view(np.uint8)))
    return h.hexdigest()[:16]


def child_bcast(path: str, rank: int, world: int, port: int) -> None:
    dist = _init(rank, world, port)
    from weightlift.distributed import broadcast_load

    dist.barrier()
    t0 = time.time()
    rep: dict[str, Any] = {}
    sd = broadcast_load(path if rank == 0 else None, timeout=300, report=rep)
    t1 = time.time()
    _emit({"rank": rank, "t0": t0, "t1": t1, "digest": _digest(sd), "bytes_read": rep["bytes_read"]})
    os._exit(0)


def child_group(path: str, rank: int, world: int, port: int, mode: str) -> None:
    dist = _init(rank, world, port)
    import weightlift as wl

    dist.barrier()
    rep: dict[str, Any] = {}
    t0 = time.perf_counter()
    if mode == "group":
        wl.load(path, group=dist.group.WORLD, report=rep)
    elif mode == "shard+group":
        wl.load(path, shard=wl.Shard(RULES), group=dist.group.WORLD, report=rep)
    else:  # shard alone: rank and world from the default group, each rank reading for itself
        wl.load(path, shard=wl.Shard(RULES), report=rep)
    seconds = time.perf_counter() - t0
    dist.barrier()
    _emit(
        {
            "rank": rank,
            "seconds": seconds,
            "bytes_read": rep["bytes_read"],
            "bytes": rep["bytes"],
            "paths": rep["paths"],
        }
    )
    os._exit(0)


def child_link(rank: int, port: int, size: int) -> None:
    dist = _init(rank, 2, port)
    import torch

    buf = torch.empty(size, dtype=torch.uint8)
    buf[::4096] = 1  # touched memory on both sides: the link alone
    best = math.inf
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(buf, src=0)
        dist.barrier()
        best = min(best, time.perf_counter() - t0)
    _emit({"rank": rank, "seconds": best})
    os._exit(0)


# -- the parent ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")


def _me(*args: Any) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--child", *map(str, args)]


def _results(procs: list[subprocess.Popen], timeout: float) -> list[dict[str, Any]]:
    out = []
    end = time.monotonic() + timeout
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError("a child ran past the timeout") from None
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not lines:
            raise RuntimeError(f"a child failed (status {p.returncode}):\n{text[-2000:]}")
        out.append(json.loads(lines[-1][7:]))
    return out


def run_push(path: str, n: int, timeout: float) -> dict[str, Any]:
    servers = [
        subprocess.Popen(_me("server"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
        for _ in range(n)
    ]
    try:
        ports = []
        for s in servers:
            line = s.stdout.readline()  # type: ignore[union-attr]
            if not line.startswith("PORT "):
                raise RuntimeError(f"server did not start: {line!r}")
            ports.append(int(line.split()[1]))
        pusher = subprocess.Popen(
            _me("push", path, ",".join(f"127.0.0.1:{p}" for p in ports)), stdout=subprocess.PIPE, text=True, env=_env()
        )
        res = _results([pusher], timeout)[0]
    finally:
        for s in servers:
            if s.stdin is not None:
                s.stdin.close()  # the server reports what it holds and exits
                s.stdin = None
    got = _results(servers, timeout)
    if any(g["bytes"] != res["bytes"] // n for g in got):
        raise RuntimeError(f"a server holds other bytes than were pushed: {got}")
    return {"seconds": res["seconds"]}


def run_bcast(path: str, n: int, timeout: float) -> dict[str, Any]:
    port = _free_port()
    procs = [
        subprocess.Popen(_me("bcast", path, r, n + 1, port), stdout=subprocess.PIPE, text=True, env=_env())
        for r in range(n + 1)
    ]
    res = _results(procs, timeout)
    if len({r["digest"] for r in res}) != 1:
        raise RuntimeError(f"ranks hold different weights: {[r['digest'] for r in res]}")
    t0 = res[0]["t0"]
    return {"seconds": max(r["t1"] for r in res) - t0, "bytes_read": [r["bytes_read"] for r in res]}


def run_group(path: str, world: int, mode: str, timeout: float) -> dict[str, Any]:
    port = _free_port()
    procs = [
        subprocess.Popen(_me("group", path, r, world, port, mode), stdout=subprocess.PIPE, text=True, env=_env())
        for r in range(world)
    ]
    res = _results(procs, timeout)
    return {
        "seconds": max(r["seconds"] for r in res),
        "bytes_read": [r["bytes_read"] for r in res],
        "bytes": [r["bytes"] for r in res],
        "paths": res[0]["paths"],
    }


def run_link(size: int, timeout: float) -> float:
    port = _free_port()
    procs = [
        subprocess.Popen(_me("link", r, port, size), stdout=subprocess.PIPE, text=True, env=_env()) for r in range(2)
    ]
    res = _results(procs, timeout)
    return size / max(r["seconds"] for r in res)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    add_run_arguments(p, size_mib=256, runs=3, settle=2.0, verb="use")
    p.add_argument("--receivers", default="1,2,4", help="receiver counts (default 1,2,4)")
    p.add_argument("--cold", action="store_true", help="evict the checkpoint before every timed run")
    p.add_argument("--quick", action="store_true", help="one round")
    args = p.parse_args(argv)

    from weightlift.benchmark.harness import evict_files, round_order
    from weightlift.benchmark.stats import summarize
    from weightlift.distributed import BROADCAST_CHUNK

    path = checkpoint(args)
    import weightlift as wl

    size = wl.open(path).nbytes
    runs = 1 if args.quick else args.runs
    counts = [int(x) for x in args.receivers.split(",")]
    arms = [f"{kind}.{n}" for kind in ("push", "bcast") for n in counts]
    times: dict[str, list[float]] = {a: [] for a in arms}
    print(f"checkpoint: {path} ({size / 1e6:.0f} MB of tensors), {runs} round(s), {os.cpu_count()} cores", flush=True)
    for rnd in range(runs):
        for arm in round_order(arms, rnd):
            kind, n = arm.split(".")
            time.sleep(args.settle)
            if args.cold:
                evict_files([path])
            r = run_push(path, int(n), args.timeout) if kind == "push" else run_bcast(path, int(n), args.timeout)
            times[arm].append(r["seconds"])
            print(f"  round {rnd} {arm:8s} {r['seconds']:.3f} s", flush=True)

    result: dict[str, Any] = {"path": path, "bytes": size, "runs": runs, "cores": os.cpu_count(), "arms": {}}
    print(f"\n{'arm':10s} {'receivers':>9s} {'median s':>9s} {'min-max s':>14s} {'GB/s each':>10s} {'GB/s all':>9s}")
    for arm in arms:
        s = summarize(times[arm])
        n = int(arm.split(".")[1])
        result["arms"][arm] = {"receivers": n, "seconds": times[arm], **s}
        med = s["median"]
        print(
            f"{arm:10s} {n:9d} {med:9.3f} {s['min']:6.3f}-{s['max']:6.3f}   {size / med / 1e9:9.2f} {n * size / med / 1e9:9.2f}"
        )

    print("\nbytes read from the checkpoint per rank (MB), and the slowest rank's load time:")
    result["reads"] = {}
    for world in (2, 4):
        for mode in ("group", "shard+group", "shard"):
            time.sleep(args.settle)
            if args.cold:
                evict_files([path])
            r = run_group(path, world, mode, args.timeout)
            result["reads"][f"{mode}.{world}"] = r
            per = ", ".join(f"{b / 1e6:.1f}" for b in r["bytes_read"])
            print(
                f"  {mode:12s} world {world}: [{per}] sum {sum(r['bytes_read']) / size:.2f}x the checkpoint, "
                f"{r['seconds']:.3f} s, paths {r['paths']}"
            )
    bc = result["arms"].get(f"bcast.{counts[-1]}")
    if bc:
        print(f"  broadcast: the source reads {size / 1e6:.1f} MB, receivers 0")

    time.sleep(args.settle)
    from fanout_model import storage_rate  # bench/ is this script's folder: on its path

    cold = storage_rate(path, cold=True)
    warm = storage_rate(path, cold=False)
    link = run_link(min(size, 256 * MIB), args.timeout)
    push1 = size / result["arms"][f"push.{counts[0]}"]["median"] * counts[0] if counts else float("nan")
    rates = {"storage_cold": cold, "storage_warm": warm, "link_gloo": link, "push_one": push1}
    result["rates"] = rates
    print(
        f"\nrates: storage {cold / 1e9:.2f} GB/s cold, {warm / 1e9:.2f} GB/s warm (one preadv stream); "
        f"gloo link {link / 1e9:.2f} GB/s (2-rank broadcast of memory); push {push1 / 1e9:.2f} GB/s "
        f"(x receivers, from push.{counts[0]})"
    )
    # the projection for separate machines: bench/fanout_model.py (also runnable on this JSON)
    from fanout_model import print_table, table

    model_rates = {"bytes": size, "link": link, "storage": cold, "latency": 0.0, "chunk": BROADCAST_CHUNK}
    model_rates["push"] = push1
    print("\nmodel for separate machines (bench/fanout_model.py), the gloo loopback link as the link:")
    rows = table(model_rates, sorted({*counts, 8, 64}))
    print_table(model_rates, rows)
    result["model"] = {"rates": model_rates, "projection": rows}
    write_json(args.json, result)
    return 0


def child(argv: list[str]) -> None:
    role, rest = argv[0], argv[1:]
    if role == "server":
        child_server()
    elif role == "push":
        child_push(rest[0], rest[1].split(","))
    elif role == "bcast":
        child_bcast(rest[0], int(rest[1]), int(rest[2]), int(rest[3]))
    elif role == "group":
        child_group(rest[0], int(rest[1]), int(rest[2]), int(rest[3]), rest[4])
    elif role == "link":
        child_link(int(rest[0]), int(rest[1]), int(rest[2]))
    else:
        raise SystemExit(f"unknown child role {role!r}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        sys.exit(0)
    sys.exit(main())
