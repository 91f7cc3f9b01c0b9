#!/usr/bin/env python3
"""Sharded push against gather-then-push: 4 FSDP senders into 2 tensor-parallel servers.

A synthetic bf16 Llama-like checkpoint (``--size-mib``, default 512) is held by 4 sender
processes as FSDP2 dim-0 shards (each rank makes only its own rows: no process ever holds a
tensor it does not own). Two ``weightlift serve --shard-rules`` processes hold tensor-parallel
rank 0 and 1 of it (q, k, v, gate, up, embeddings column-parallel; o and down row-parallel; norms
replicated). Arms, in the same run, on the same servers:

* ``sharded``: every sender pushes to both servers at once (``push_shards``): only the
  intersection of its rows with each server's slice. Ready: both servers report every tensor
  complete; the senders' sketch parts are checked against the servers'.
* ``gather``: senders 1-3 push their shards to a whole-tensor server inside sender 0 (the gather
  on one rank, over the same links), then sender 0 pushes each server its slice from the full
  tensors.

With ``--netns`` (root, ``ip``, ``tc``) each process runs in its own network namespace of a
``tests/net/netns.py`` star, every member's uplink capped at ``--rate`` by ``tc tbf``, so that
links, not the 2 cores, are the limit; without it everything is on loopback (the cores are).
Figures: wall time from the start signal to ready, bytes on the wire (frames whole) against the
bytes the receivers need, the busiest uplink's bytes and its time at ``--rate``.

    python bench/reshard_push.py --netns --rate 400mbit --json reshard.json
    python bench/reshard_push.py --size-mib 128        # loopback
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import MIB, ROOT, parser, write_json

SENDERS, SERVERS = 4, 2
RULES = {
    "*.[qkv]_proj.weight": "colwise",
    "*.gate_proj.weight": "colwise",
    "*.up_proj.weight": "colwise",
    "*.o_proj.weight": "rowwise",
    "*.down_proj.weight": "rowwise",
    "embed_tokens.weight": "colwise",
}


def model(size: int) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a Llama-like model of about ``size`` bytes in bf16."""
    hidden, inter, vocab = 2048, 5632, 32000
    layer = 2 * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden)
    n = max(1, -(-(size - 2 * vocab * hidden) // layer))  # at least size bytes
    out: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (vocab, hidden)}
    for i in range(n):
        p = f"layers.{i}."
        for k in "qkvo":
            out[p + f"{k}_proj.weight"] = (hidden, hidden)
        out[p + "gate_proj.weight"] = (inter, hidden)
        out[p + "up_proj.weight"] = (inter, hidden)
        out[p + "down_proj.weight"] = (hidden, inter)
        out[p + "norm.weight"] = (hidden,)
    return out


def rows(name: str, shape: tuple[int, ...], lo: int, hi: int) -> Any:
    """Rows [lo, hi) of tensor ``name``: a pattern any rank can make for its own rows alone."""
    import ml_dtypes
    import numpy as np

    inner = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    seed = sum(name.encode()) * 2654435761 % (1 << 16)
    idx = np.arange(lo * inner, hi * inner, dtype=np.uint64)
    bits = ((idx * np.uint64(40503) + np.uint64(seed)) >> np.uint64(3)).astype(np.uint16) & np.uint16(0x3FFF)
    return bits.view(ml_dtypes.bfloat16).reshape((hi - lo, *shape[1:]))


def my_shards(shapes: dict[str, tuple[int, ...]], rank: int) -> dict[str, Any]:
    from weightlift.distributed import ShardOf, chunk_bounds

    out = {}
    for name, shape in shapes.items():
        lo, hi = chunk_bounds(shape[0], rank, SENDERS)
        out[name] = ShardOf(rows(name, shape, lo, hi), shape, (lo,) + (0,) * (len(shape) - 1))
    return out


# -- children ------------------------------------------------------------------------------------


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write("RESULT " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _push_each(servers: list[str], state: dict[str, Any]) -> list[Any]:
    import weightlift as wl
    from weightlift.distributed import push_shards

    out: list[Any] = [None] * len(servers)

    def one(i: int) -> None:
        with wl.Client(servers[i], timeout=600) as c:
            out[i] = push_shards(c, state)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(servers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(p is None for p in out):
        raise RuntimeError("a push failed")
    return out


def child_sender(rank: int, size: int, servers: list[str], arm: str, host: str) -> None:
    import weightlift as wl
    from weightlift.distributed import Shard, push_shards, server_sketches

    shapes = model(size)
    state = my_shards(shapes, rank)
    gather = None
    if arm == "gather" and rank == 0:
        gather = wl.Server(host, 0, shard=Shard({}, rank=0, world=1), insecure=True)
        gather.start()
    _emit({"ready": rank, "gather": f"{host}:{gather.address[1]}" if gather is not None else None})
    go = json.loads(sys.stdin.readline())
    t0 = time.time()
    wire = held = 0
    sketches: list[dict[str, int]] = [{} for _ in servers]
    if arm == "sharded":
        for i, p in enumerate(_push_each(servers, state)):
            wire += p.wire_bytes
            sketches[i] = p.sketches
    elif rank != 0:
        with wl.Client(go["gather"], timeout=600) as c:
            wire += push_shards(c, state).wire_bytes
    else:
        assert gather is not None
        with wl.Client((host, gather.address[1]), timeout=600) as c:  # its own address: no link crossed
            push_shards(c, state)
            server_sketches(c, list(shapes), timeout=600)
        full = gather.tensors()
        held = sum(a.nbytes for a in full.values())
        for i, p in enumerate(_push_each(servers, full)):
            wire += p.wire_bytes
            sketches[i] = p.sketches
        gather.close()
    _emit({"rank": rank, "t0": t0, "t1": time.time(), "wire": wire, "sketches": sketches, "held": held})


# -- the parent ----------------------------------------------------------------------------------


def child_check(servers: list[str], size: int) -> None:
    """Every server holds what the senders sent (their sketch parts on stdin), proven without a
    gather; prints the bytes the servers needed."""
    import weightlift as wl
    from weightlift.distributed import ShardPush, check_sketches, server_sketches

    sent = json.loads(sys.stdin.read())
    need = 0
    for i, addr in enumerate(servers):
        with wl.Client(addr, timeout=600) as c:
            status = server_sketches(c, list(model(size)), timeout=60)
        check_sketches([ShardPush(sketches=s[i]) for s in sent], status)
        need += sum(e.needed for e in status.values())
    _emit({"need": need})


def _run_arm(arm: str, spawn: Any, servers: list[str], size: int, hosts: list[str]) -> dict[str, Any]:
    procs = [
        spawn(i, [sys.executable, __file__, "--child", str(i), arm, json.dumps(servers), str(size), hosts[i]])
        for i in range(SENDERS)
    ]
    go: dict[str, Any] = {}
    for p in procs:  # every sender has made its shards (and sender 0 its gather server)
        line = p.stdout.readline()
        if not line.startswith("RESULT "):
            raise RuntimeError(f"sender did not start: {line!r} {p.stderr.read()[-2000:]}")
        go["gather"] = go.get("gather") or json.loads(line[7:])["gather"]
    start = time.time()
    for p in procs:
        p.stdin.write(json.dumps(go) + "\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError(f"sender failed: {err[-2000:]}")
        results.append(json.loads([ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1][7:]))
    # the servers' sketches against the senders' parts, from a sender's place on the network
    check = spawn(0, [sys.executable, __file__, "--check", json.dumps(servers), str(size)])
    out, err = check.communicate(json.dumps([r["sketches"] for r in results]), timeout=600)
    if check.returncode:
        raise RuntimeError(f"check failed: {err[-2000:]}")
    need = json.loads([ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1][7:])["need"]
    end = max(r["t1"] for r in results)
    uplinks = [r["wire"] for r in results]
    return {
        "arm": arm,
        "seconds": end - start,
        "wire_bytes": sum(uplinks),
        "need_bytes": need,
        "wire_over_need": sum(uplinks) / need,
        "busiest_uplink_bytes": max(uplinks),
        "gather_rank_holds": max(r["held"] for r in results),
    }


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--netns", action="store_true", help="one network namespace per process, uplinks capped")
    p.add_argument("--rate", default="400mbit", help="each uplink's cap with --netns (tc notation)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--check", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.check:
        child_check(json.loads(a.check[0]), int(a.check[1]))
        return 0
    if a.child:
        rank, arm, servers, size, host = a.child
        child_sender(int(rank), int(size), json.loads(servers), arm, host)
        return 0
    size = a.size_mib * MIB
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    rules = Path(tempfile.mkdtemp()) / "rules.json"
    rules.write_text(json.dumps({"rules": RULES}))
    serve_opts = ["--shard-rules", str(rules), "--world", str(SERVERS), "--insecure", "--idle-timeout", "0"]
    out: dict[str, Any] = {"size_bytes": sum(2 * _prod(s) for s in model(size).values()), "senders": SENDERS}
    if a.netns:
        sys.path.insert(0, str(ROOT))
        from tests.net.netns import Net

        net = Net()
        members = net.star(SENDERS + SERVERS)
        for ns, dev, _ in members:
            cmd = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", a.rate, "burst", "4mb"]
            subprocess.run([*cmd, "latency", "50ms"], check=True, capture_output=True, timeout=30)
        servers = [
            net.serve(members[SENDERS + r][0], members[SENDERS + r][2], *serve_opts, "--rank", str(r))[1]
            for r in range(SERVERS)
        ]
        hosts = [m[2] for m in members[:SENDERS]]

        def spawn(i: int, argv: list[str]) -> Any:
            return net.popen(
                members[i][0],
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=ROOT,
            )

        out["network"] = f"netns star, every uplink capped at {a.rate} (tc tbf)"
    else:
        net = None
        procs = []
        servers = []
        for r in range(SERVERS):
            proc = subprocess.Popen(
                [sys.executable, "-m", "weightlift", "serve", "--port", "0", *serve_opts, "--rank", str(r)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=ROOT,
            )
            procs.append(proc)
            servers.append(proc.stdout.readline().split()[3])  # type: ignore[union-attr]
        hosts = ["127.0.0.1"] * SENDERS

        def spawn(i: int, argv: list[str]) -> Any:
            return subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=ROOT,
            )

        out["network"] = "loopback (the 2 cores, not a link, are the limit)"
    try:
        out["arms"] = [_run_arm(arm, spawn, servers, size, hosts) for arm in ("sharded", "gather")]
    finally:
        if net is not None:
            net.close()
        else:
            for proc in procs:
                proc.terminate()
                proc.communicate(timeout=30)
    if a.netns:
        rate = _bits(a.rate) / 8
        for arm in out["arms"]:
            arm["busiest_uplink_seconds_at_rate"] = arm["busiest_uplink_bytes"] / rate
            arm["wall_over_busiest_link"] = arm["seconds"] / arm["busiest_uplink_seconds_at_rate"]
    print(json.dumps(out, indent=2))
    if a.json:
        write_json(a.json, out)
    return 0


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, m in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * m
    return float(rate)


if __name__ == "__main__":
    sys.exit(main())
