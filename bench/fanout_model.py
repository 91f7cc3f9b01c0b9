#!/usr/bin/env python3
"""Fan-out to many machines, projected from measured rates: N separate pushes against a broadcast.

One source holds a checkpoint of S bytes; n receivers on separate machines need all of it.
From a link rate L (what one TCP connection carries between two machines), a storage rate R
(one sequential read of the checkpoint), a per-hop latency h and the broadcast's chunk c:

* ``push``: n separate pushes from the source. Its uplink carries every byte once per
  receiver: ``max(n*S/L, S/R)``. (``push.measured`` uses weightlift's own single-push rate P,
  protocol included, in place of L: ``n*S/P``.)
* ``tree``: gloo's broadcast, a binomial tree: the source sends each chunk to ``ceil(log2(n+1))``
  children one after another, and the tree is that deep: ``max(ceil(log2(n+1))*S/L, S/R)``,
  chunked so the levels overlap: ``+ depth*(c/L + h)`` to fill the pipe.
* ``chain``: a pipelined chain (or ring): every link carries the bytes once, each hop behind the
  one before by a chunk and a latency: ``S/min(L, R) + (n-1)*(c/L + h)``. This is the lower bound a
  pipelined broadcast can reach; NCCL's ring broadcast is of this kind.
* ``group``: shared storage and a process group (``load(group=)``): each rank reads 1/n, then
  a ring all-gather moves ``(n-1)/n`` of the bytes through every link: ``S/(n*R) + (n-1)/n*S/L``.

Terms not counted: each receiver's own copy into fresh memory (parallel, the same for every
strategy, independent of n), process start-up, rendezvous.

Measure the rates on this machine (root: the link is a veth pair between two network
namespaces, timed with a raw TCP transfer; latency is a TCP round trip of one byte), then
project:

    python bench/fanout_model.py --measure --path model.safetensors --json rates.json
    python bench/fanout_model.py rates.json --receivers 1,2,4,8,64

Rates JSON: ``{"bytes": S, "link": L, "storage": R, "latency": h, "chunk": c, "push": P}``
(bytes per second and seconds; ``push`` optional). A ``bench/distributed.py --json`` output is
accepted too: its ``rates`` give the storage and push rates and the gloo link.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
CHUNK = 64 * MIB  # weightlift.distributed.BROADCAST_CHUNK


def model(
    size: float, n: int, *, link: float, storage: float, latency: float = 0.0, chunk: float = CHUNK, push: float = 0.0
) -> dict[str, float]:
    """Seconds to ready for ``n`` receivers by each strategy (see the module docstring)."""
    c = min(chunk, size)
    depth = math.ceil(math.log2(n + 1))
    out = {
        "push": max(n * size / link, size / storage),
        "tree": max(depth * size / link, size / storage) + depth * (c / link + latency),
        "chain": size / min(link, storage) + (n - 1) * (c / link + latency),
        "group": size / (n * storage) + (n - 1) / n * size / link,
    }
    if push:
        out["push.measured"] = n * size / push
    return out


def table(rates: dict[str, Any], counts: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in counts:
        m = model(
            rates["bytes"],
            n,
            link=rates["link"],
            storage=rates["storage"],
            latency=rates.get("latency", 0.0),
            chunk=rates.get("chunk", CHUNK),
            push=rates.get("push", 0.0),
        )
        rows.append({"receivers": n, **m, "push/chain": m["push"] / m["chain"]})
    return rows


def print_table(rates: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print(
        f"S {rates['bytes'] / 1e9:.3f} GB, link {rates['link'] / 1e9:.2f} GB/s, storage {rates['storage'] / 1e9:.2f} GB/s, "
        f"latency {rates.get('latency', 0) * 1e6:.0f} us, chunk {rates.get('chunk', CHUNK) / MIB:.0f} MiB"
        + (f", push {rates['push'] / 1e9:.2f} GB/s" if rates.get("push") else "")
    )
    head = f"{'receivers':>9s} {'push s':>9s} {'tree s':>8s} {'chain s':>8s} {'group s':>8s} {'push/chain':>10s}"
    if rates.get("push"):
        head += f" {'push@P s':>9s}"
    print(head)
    for r in rows:
        line = (
            f"{r['receivers']:9d} {r['push']:9.2f} {r['tree']:8.2f} {r['chain']:8.2f} {r['group']:8.2f} "
            f"{r['push/chain']:9.1f}x"
        )
        if rates.get("push"):
            line += f" {r['push.measured']:9.2f}"
        print(line)


# -- measuring ---------------------------------------------------------------------------------------


def storage_rate(path: str, *, cold: bool) -> float:
    """One sequential ``preadv`` stream through the file, 16 MiB at a time (cold: evicted first)."""
    from weightlift.benchmark.harness import evict_files

    if cold:
        evict_files([path])
    size = os.path.getsize(path)
    mv = memoryview(bytearray(16 * MIB))
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        off = 0
        while off < size:
            got = os.preadv(fd, [mv], off)
            if got <= 0:
                break
            off += got
        return size / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def _rtt(net: Any, ends: list[tuple[str, str, str]]) -> float:
    """Median round trip of one byte over a connected TCP socket, from one namespace to the other."""
    (na, _, _), (nb, _, addr) = ends
    code = (
        "import socket,sys\ns=socket.create_server((sys.argv[1],9600));print('READY',flush=True)\n"
        "c,_=s.accept();c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n"
        "while (b:=c.recv(1)):c.sendall(b)\n"
    )
    echo = net.popen(nb, [sys.executable, "-c", code, addr], stdout=subprocess.PIPE, text=True)
    assert echo.stdout.readline().strip() == "READY"
    client = (
        "import socket,sys,time,statistics\nc=socket.create_connection((sys.argv[1],9600))\n"
        "c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\nts=[]\n"
        "for _ in range(200):\n t=time.perf_counter();c.sendall(b'x');c.recv(1);ts.append(time.perf_counter()-t)\n"
        "print(statistics.median(ts))\n"
    )
    r = net.run(na, [sys.executable, "-c", client, addr])
    echo.wait(timeout=10)
    return float(r.stdout.strip())


def link_rate(nbytes: int, streams: int = 1) -> tuple[float, float]:
    """(bytes per second of a raw TCP transfer over a veth pair between two namespaces, round trip s)."""
    sys.path.insert(0, str(ROOT))
    from tests.net.netns import Net

    with Net() as net:
        ends = net.pair("10.241.0")
        (na, _, _), (nb, _, addr) = ends
        best = 0.0
        for _ in range(3):
            sink = net.popen(
                nb, [sys.executable, "-m", "tests.net.tcprate", "sink", addr, "9555"], stdout=subprocess.PIPE, text=True
            )
            assert sink.stdout.readline().strip() == "READY"
            r = net.run(
                na, [sys.executable, "-m", "tests.net.tcprate", "send", addr, "9555", str(nbytes), str(streams)]
            )
            if r.returncode:
                raise RuntimeError(r.stderr)
            got = json.loads(sink.stdout.readline())
            sink.wait(timeout=10)
            best = max(best, got["bytes"] / got["seconds"])
        return best, _rtt(net, ends)


def measure(path: str, nbytes: int) -> dict[str, Any]:
    import weightlift as wl

    cold = storage_rate(path, cold=True)
    warm = storage_rate(path, cold=False)
    link, rtt = link_rate(nbytes)
    return {
        "bytes": wl.open(path).nbytes,
        "link": link,
        "storage": cold,
        "storage_warm": warm,
        "latency": rtt / 2,
        "chunk": CHUNK,
        "measured": {"path": path, "link_bytes": nbytes, "socket": "veth pair between two network namespaces"},
    }


def load_rates(path: str) -> dict[str, Any]:
    obj = json.loads(Path(path).read_text())
    if "projection" in obj:  # this script's own --json output
        return obj["rates"]
    if "rates" in obj and "link" not in obj:  # a bench/distributed.py result
        r = obj["rates"]
        return {
            "bytes": obj["bytes"],
            "link": r["link_gloo"],
            "storage": r["storage_cold"],
            "latency": 0.0,
            "chunk": CHUNK,
            "push": r.get("push_one", 0.0),
        }
    return obj


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rates", nargs="?", help="a rates JSON (or a bench/distributed.py --json result)")
    p.add_argument("--measure", action="store_true", help="measure link (needs root), storage and latency here")
    p.add_argument("--path", help="the checkpoint whose storage rate and size to measure")
    p.add_argument("--link-mib", type=int, default=1024, help="bytes of the raw TCP transfer (default 1024 MiB)")
    p.add_argument("--push", type=float, help="a measured single-push rate, bytes per second")
    p.add_argument("--bytes", type=float, help="project for this checkpoint size instead")
    p.add_argument("--receivers", default="1,2,4,8,64")
    p.add_argument("--json", metavar="FILE", help="write the rates and the projection as JSON")
    a = p.parse_args(argv)
    if a.measure:
        if not a.path:
            p.error("--measure needs --path")
        rates = measure(a.path, a.link_mib * MIB)
    elif a.rates:
        rates = load_rates(a.rates)
    else:
        p.error("give a rates JSON, or --measure --path FILE")
    if a.push:
        rates["push"] = a.push
    if a.bytes:
        rates["bytes"] = a.bytes
    rows = table(rates, [int(x) for x in a.receivers.split(",")])
    print_table(rates, rows)
    if a.json:
        Path(a.json).write_text(json.dumps({"rates": rates, "projection": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
