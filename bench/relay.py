#!/usr/bin/env python3
"""One model to N servers: relayed pushes (a chain) against direct pushes (one per server).

A star of network namespaces (``tests/net/netns.py``, one bridge): the client in one, a fresh
``weightlift serve`` in each of N others, every member's uplink capped by ``tc tbf`` (default
200 Mbit/s) so the links, not the 2 cores, are the limit. For each N and each arm, one fresh
client process runs ``Client.push(path, to=[...], relay=ARM)`` with a token (MACs on every hop)
and reports its own seconds, from connect to every server holding every tensor; the client's
interface counts the bytes that left it (payload, framing and TCP/IP headers). Arms are
interleaved per N (A B A B over ``--runs``); medians.

Goals (issue 35): N receivers at most 1.15 times the time of one; bytes out of the source at
most 1.05 times the model. A chain forwards each tensor once it is proven, so it adds about a
tensor's time per hop: ``--tensor-mib`` sets the tensors' size (default 4 MiB).

    sudo python bench/relay.py --size-mib 256 --counts 1,2,4 --json relay.json
    sudo python bench/relay.py --quick
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import MIB, ROOT, netns, parser, write_json


def _client(argv: list[str]) -> int:
    """In the client's namespace: one push, its seconds and per-server results as JSON."""
    sys.path.insert(0, str(ROOT))
    from weightlift.errors import PushError
    from weightlift.remote.client.client import Client
    from weightlift.remote.token import read_token

    path, token_file, arm, *addrs = argv
    token = read_token(token_file)
    errors: dict[str, str] = {}
    t0 = time.perf_counter()
    with Client(addrs[0], token=token, timeout=300) as c:
        try:
            results = c.push(path, to=addrs[1:], relay=arm) if len(addrs) > 1 else {addrs[0]: c.push(path)}
        except PushError as e:  # a server killed on purpose: the others' results, and its error
            results = e.results
            errors = {k: str(v) for k, v in e.errors.items()}
    seconds = time.perf_counter() - t0
    sent = sum(r.bytes_sent for r in results.values())
    held = [r.bytes for r in results.values()]
    print(json.dumps({"seconds": seconds, "bytes_sent": sent, "bytes": held, "errors": errors}))
    return 0


def _model(folder: Path, size: int, tensor: int) -> tuple[str, int]:
    sys.path.insert(0, str(ROOT))
    from weightlift.benchmark.synthetic import write_checkpoint

    n = max(1, size // tensor)
    path = folder / f"relay-{size // MIB}m-{tensor // MIB}m.safetensors"
    write_checkpoint(path, [(f"layer.{i}.weight", "F16", (tensor // 2,)) for i in range(n)], seed=35)
    return str(path), n * tensor


def _tx_bytes(ns: str, dev: str) -> int:
    out = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev], capture_output=True, text=True)
    return int(json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"])


def _cap(ns: str, dev: str, rate: str) -> None:
    cmd = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "1mb", "latency", "50ms"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def _one_run(
    net: Any,
    members: list[tuple[str, str, str]],
    n: int,
    arm: str,
    rnd: int,
    args: Any,
    path: str,
    token: Path,
    model: int,
    one_time: float,
) -> dict[str, Any]:
    """Fresh servers on the first ``n`` members after the client, one client run, its row."""
    client_ns, client_dev, _ = members[0]
    cache = Path(token).parent
    servers = [
        net.serve(
            ns,
            addr,
            "--token-file",
            str(token),
            *(["--cache-dir", str(cache / f"c{n}{arm}{rnd}{k}")] if args.cache else []),
        )
        for k, (ns, _, addr) in enumerate(members[1 : n + 1])
    ]
    kill = None
    if args.kill_at is not None and n >= 3 and one_time:  # the second server: a relay with hops after it
        kill = threading.Timer(args.kill_at * one_time, servers[1][0].kill)
        kill.start()
    try:
        before = _tx_bytes(client_ns, client_dev)
        cmd = [sys.executable, __file__, "client", path, str(token), arm]
        r = net.run(client_ns, cmd + [a for _, a in servers], timeout=args.timeout, cwd=ROOT)
        tx = _tx_bytes(client_ns, client_dev) - before
    finally:
        if kill is not None:
            kill.cancel()
        for proc, _ in servers:
            proc.kill()
            proc.wait()
    if r.returncode:
        raise RuntimeError(f"N={n} {arm}: {r.stderr[-3000:]}")
    res = json.loads(r.stdout.splitlines()[-1])
    survivors = n - len(res["errors"])
    if res["bytes"] != [model] * survivors or len(res["errors"]) > (1 if kill else 0):
        raise RuntimeError(f"N={n} {arm}: servers hold {res['bytes']} of {model}: {res['errors']}")
    print(
        f"N={n} {arm:6s} {res['seconds']:7.2f} s  payload out {res['bytes_sent'] / model:.3f}x"
        f"  interface tx {tx / model:.3f}x" + (f"  (a relay killed: {len(res['errors'])} lost)" if kill else ""),
        flush=True,
    )
    row = {"n": n, "arm": arm, "round": rnd, "seconds": res["seconds"], "killed": bool(kill)}
    return row | {"payload_sent": res["bytes_sent"], "tx_bytes": tx, "lost": len(res["errors"])}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["client"]:
        return _client(argv[1:])
    p = parser(__doc__)
    p.add_argument("--size-mib", type=int, default=256, help="model size (default 256)")
    p.add_argument("--tensor-mib", type=int, default=4, help="size of each tensor (default 4)")
    p.add_argument("--counts", default="1,2,4", help="numbers of receivers (default 1,2,4)")
    p.add_argument("--arms", default="chain,direct", help="relay arms (default chain,direct)")
    p.add_argument("--rate", default="200mbit", help="each member's uplink, tc notation (default 200mbit)")
    p.add_argument("--runs", type=int, default=1, help="rounds per N (default 1)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="64 MiB, N = 1, 2")
    p.add_argument(
        "--kill-at",
        type=float,
        default=None,
        help="kill the second server (a relay) this far into one receiver's time (e.g. 0.3); the rest must hold all",
    )
    p.add_argument("--cache", action="store_true", help="servers keep a cache (a hop routed to fills what it holds)")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib, args.counts = 64, "1,2"
    helpers = netns("relay")
    if helpers is None:
        return 2
    counts = [int(x) for x in args.counts.split(",")]
    arms = args.arms.split(",")
    with tempfile.TemporaryDirectory(prefix="wl-relay-bench") as tmp:
        folder = Path(tmp)
        path, model = _model(folder, args.size_mib * MIB, args.tensor_mib * MIB)
        token = folder / "token"
        token.write_bytes(os.urandom(32).hex().encode())
        token.chmod(0o600)
        rows: list[dict[str, Any]] = []
        with helpers.Net() as net:
            members = net.star(max(counts) + 1)
            for ns, dev, _ in members:
                _cap(ns, dev, args.rate)
            one_time = 0.0  # one receiver's time: when a relay is killed (--kill-at)
            for n in counts:
                for rnd in range(args.runs):
                    for arm in arms if rnd % 2 == 0 else arms[::-1]:
                        if n == 1 and arm != arms[0]:
                            continue  # one receiver: nothing to relay, the arms are one push
                        row = _one_run(net, members, n, arm, rnd, args, path, token, model, one_time)
                        rows.append(row)
                        if n == 1:
                            one_time = row["seconds"]
    one = _median([r["seconds"] for r in rows if r["n"] == 1])
    print(f"\nmodel {model / MIB:.0f} MiB in {model // (args.tensor_mib * MIB)} tensors, uplinks {args.rate}")
    print(" N  arm      seconds  vs one  payload out  tx out")
    summary = []
    for n in counts:
        for arm in arms:
            sel = [r for r in rows if r["n"] == n and (r["arm"] == arm or n == 1)]
            if not sel:
                continue
            s = _median([r["seconds"] for r in sel])
            payload = _median([r["payload_sent"] for r in sel]) / model
            tx = _median([r["tx_bytes"] for r in sel]) / model
            summary.append({"n": n, "arm": arm, "seconds": s, "vs_one": s / one, "payload_x": payload, "tx_x": tx})
            print(f"{n:2d}  {arm:7s} {s:8.2f}  {s / one:6.2f}  {payload:10.3f}x  {tx:6.3f}x")
    write_json(args.json, {"model": model, "rate": args.rate, "runs": rows, "summary": summary})
    return 0


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else (xs[k - 1] + xs[k]) / 2


if __name__ == "__main__":
    raise SystemExit(main())
