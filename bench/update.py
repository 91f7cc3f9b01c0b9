#!/usr/bin/env python3
"""Weight updates over a capped link: a synthetic RL step pushed into weightlift servers.

The checkpoint is Llama-shaped bf16 of ``--size-mib`` (version v), and for each fraction in
``--fractions`` a version v+1 in which about that fraction of the bf16 values changed, as in an
Adam step at a small learning rate: each changed value moves by one bf16 ulp (the step is below
the resolution of most weights; those it moves, it moves by one step), up or down at random.
Every file gets its sidecar manifest first (``weightlift manifest``), as a trainer's would, so no
arm hashes on the client.

Two network namespaces joined by a veth pair, the client's side capped by ``tc tbf`` at each of
``--rates`` (``none``: uncapped), as in ``bench/verify_link.py``. Every arm runs fresh processes
(a ``weightlift serve`` in the server's namespace, the client in the other); what an arm needs
beforehand (a server holding v, a filled cache) is pushed inside the server's namespace, over
its loopback, so only the timed transfer crosses the link. Arms run in a seeded shuffled order
per round with a pause before each; each figure is a median over rounds, and each ratio the
median of per-round ratios.

Arms (seconds are the client's: connect to the last acknowledgement):

* ``push.fresh``: v+1 pushed into a fresh server without a cache.
* ``push.cache``: v+1 pushed into a fresh server with an empty ``--cache-dir``.
* ``update.<f>``: v+1 (fraction f) pushed into a running server holding v whose pool holds the
  memory of an earlier version (steady state: the server got v, v+1, v before).
* ``tcp.touched``: the floor: ``sendfile`` of the v+1 file into a socket, ``recv_into`` one
  preallocated buffer of its size whose every page was touched, then a one-byte acknowledgement.
* ``hit``: v+1 pushed into a fresh server whose cache holds every tensor of v+1 (filled by an
  earlier server process), the entry files in the page cache.
* ``load.warm``: ``weightlift.load`` of the v+1 file in a fresh process, the file in the page
  cache: the owned copy a cache hit is compared with.
* ``delta`` (per fraction): a trainer's step with ``Client(keep_base=True)``: v, v+1 and v pushed
  from memory before (the earlier versions over the link, untimed), then v+1 timed; each
  tensor goes as what changed where that pays. Also prints the first step (v+1 right after v, into fresh server
  memory) and the CPU seconds client and server used in the timed step (client and server share
  this machine's cores, unless ``--server-cpus`` and ``--client-cpus`` pin each to its own, as
  two machines would have them).
* ``delta.given``: ``push(v+1, base=v)`` after a push of v: the caller's v as the base.

Ratios: ``update/tcp`` (goal >= 0.95 as tcp/update), ``cache/fresh`` (goal <= 1.15),
``hit/load`` (goal <= 1.1). Needs root; run from the repository root.

Adding an arm: a function ``arm_NAME(ctx, frac) -> seconds`` registered in :data:`ARMS` (and,
when it depends on the fraction, in :data:`PER_FRACTION`). An in-memory or delta push runs
``child_push_mem`` in the client's namespace (``ctx.client_child("push_mem", ...)``), which loads
v+1 into memory and times ``Client.push(tensors, **push_kwargs)``.

    python bench/update.py --size-mib 768 --rates none,4gbit,1gbit --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the namespace helpers live with the tests: tests/net/netns.py

MIB = 1 << 20
CLI = [sys.executable, "-m", "weightlift.cli"]
PORT = 7841


# -- the checkpoints ------------------------------------------------------------------------


def _bf16(n: int, rng: Any) -> Any:
    import numpy as np

    w = (rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint32)
    return (w >> 16).astype(np.uint16)


def make_versions(size: int, fractions: list[float], seed: int = 0) -> tuple[str, dict[float, str]]:
    """The v checkpoint and, per fraction, its v+1: paths under the benchmark folder, made once."""
    import numpy as np

    from weightlift.benchmark.harness import bench_dir
    from weightlift.benchmark.synthetic import llama_for_size, write_checkpoint

    layout = [(n, "BF16", s) for n, _, s in llama_for_size(size)]
    base = os.path.join(bench_dir(), f"update-{size // MIB}m-v0.safetensors")
    outs = {f: os.path.join(bench_dir(), f"update-{size // MIB}m-f{f:g}.safetensors") for f in fractions}
    todo = [f for f, p in outs.items() if not os.path.exists(p)]
    if os.path.exists(base) and not todo:
        return base, outs
    rng = np.random.default_rng(seed)
    v0 = [(n, dt, s, _bf16(int(np.prod(s)), rng)) for n, dt, s in layout]
    if not os.path.exists(base):
        write_checkpoint(base, [(n, dt, s, a.tobytes()) for n, dt, s, a in v0])
    for f in todo:
        step = np.random.default_rng(seed + 1 + int(f * 1e6))
        tensors = []
        for n, dt, s, a in v0:
            b = a.copy()
            k = max(1, round(f * b.size))
            idx = np.arange(b.size) if k >= b.size else step.choice(b.size, size=k, replace=False)
            moves = np.where(step.random(len(idx)) < 0.5, 1, -1).astype(np.int16)
            b.view(np.int16)[idx] += moves  # one bf16 ulp up or down (sign-magnitude: away from or towards 0)
            tensors.append((n, dt, s, b.tobytes()))
        write_checkpoint(outs[f], tensors)
    return base, outs


def changed_fraction(a_path: str, b_path: str) -> float:
    import weightlift as wl

    a, b = wl.load(a_path), wl.load(b_path)
    diff = sum(int((a[k].view("u2") != b[k].view("u2")).sum()) for k in a)
    return diff / sum(a[k].size for k in a)


# -- children: what runs inside a namespace ---------------------------------------------------


def child_tcp_recv(host: str, size: int) -> None:
    """Listen, preallocate and touch a buffer of ``size``, print READY, receive into it, ack."""
    import numpy as np

    buf = np.ones(size, dtype=np.uint8)  # every page touched
    view = memoryview(buf)
    with socket.create_server((host, PORT)) as ls:
        print("READY", flush=True)
        conn, _ = ls.accept()
        with conn:
            got = 0
            while got < size:
                n = conn.recv_into(view[got:], min(size - got, 64 * MIB))
                if n == 0:
                    raise SystemExit(f"short: {got} of {size}")
                got += n
            conn.sendall(b"k")


def child_tcp_send(host: str, path: str) -> None:
    size = os.path.getsize(path)
    t0 = time.perf_counter()
    with socket.create_connection((host, PORT)) as s, open(path, "rb") as f:
        off = 0
        while off < size:
            off += os.sendfile(s.fileno(), f.fileno(), off, size - off)
        if s.recv(1) != b"k":
            raise SystemExit("no acknowledgement")
    print(json.dumps({"seconds": time.perf_counter() - t0}))


def child_load(path: str) -> None:
    import ml_dtypes  # noqa: F401  (imported before the clock, as a server imports it at start)

    import weightlift as wl

    t0 = time.perf_counter()
    out = wl.load(path)
    dt = time.perf_counter() - t0
    print(json.dumps({"seconds": dt, "tensors": len(out)}))


def child_push_mem(to: str, path: str, push_kwargs: str) -> None:
    """Load ``path`` into memory (the trainer's tensors), then time ``Client.push(tensors, ...)``."""
    import weightlift as wl
    from weightlift.remote.client import Client

    tensors = wl.load(path)
    host, port = to.rsplit(":", 1)
    t0 = time.perf_counter()
    with Client((host, int(port))) as c:
        r = c.push(tensors, **json.loads(push_kwargs))
    print(json.dumps({"seconds": time.perf_counter() - t0, "bytes": r.bytes_sent}))


def _cpu(pid: int) -> float:
    """CPU seconds (user and system, every thread) a process has used: from /proc, so that the
    client can read the server's across network namespaces (they share the PID namespace)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pin(pid: int, cpus: str) -> None:
    """Every thread of ``pid`` onto the cores ``cpus`` ("0", "1-3", "0,2"); the threads it starts
    later inherit them. Empty: left where the scheduler puts it."""
    if not cpus:
        return
    cores: set[int] = set()
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), cores)


def child_push_delta(to: str, base_path: str, path: str, server_pid: str, how: str, cpus: str = "") -> None:
    """A trainer's steps. ``kept``: ``Client(keep_base=True)`` pushes v from memory (the server
    then holds v, the client a copy of it and its digests), then v+1 (the first step: timed as
    ``first``), v and v+1 again: the last is timed as the steady state, where the server's pool
    holds the memory of the version two steps back, as in training. Each step after the first
    push sends what changed against the kept copy. ``given``: v, then ``push(v+1, base=v)``
    with the caller's v as the base (hashed by the push), timed. Prints the seconds, the bytes
    sent and the CPU seconds each side used during the timed push."""
    import weightlift as wl
    from weightlift.remote.client import Client

    _pin(os.getpid(), cpus)
    base, tensors = wl.load(base_path), wl.load(path)
    host, port = to.rsplit(":", 1)
    kw = {"base": base} if how == "given" else {}
    first = None
    with Client((host, int(port)), keep_base=how == "kept") as c:
        c.push(base)
        if how == "kept":
            t0 = time.perf_counter()
            c.push(tensors)
            first = time.perf_counter() - t0
            c.push(base)
        srv0, cli0 = _cpu(int(server_pid)), time.process_time()
        t0 = time.perf_counter()
        r = c.push(tensors, **kw)
        dt = time.perf_counter() - t0
        cpu = {"client_cpu": time.process_time() - cli0, "server_cpu": _cpu(int(server_pid)) - srv0}
    print(json.dumps({"seconds": dt, "first": first, "bytes": r.bytes_sent, "deltas": r.deltas, **cpu}))


CHILDREN: dict[str, Callable[..., None]] = {
    "tcp_recv": lambda host, size: child_tcp_recv(host, int(size)),
    "tcp_send": child_tcp_send,
    "load": child_load,
    "push_mem": child_push_mem,
    "push_delta": child_push_delta,
}


# -- the arms -----------------------------------------------------------------------------------


class Ctx:
    """One link: its two namespaces, the checkpoints, and how to run things on either side."""

    def __init__(self, net: Any, ends: list[tuple[str, str, str]], base: str, versions: dict[float, str], tmp: str):
        (self.ns_c, _, _), (self.ns_s, _, self.addr) = ends
        self.net, self.base, self.versions, self.tmp = net, base, versions, tmp
        self.server_cpus = self.client_cpus = ""  # delta arms: the cores each side is pinned to
        self.full = versions[max(versions)]  # the v+1 every whole-push arm sends
        # delta arms: (client CPU s, server CPU s, bytes sent, first step s)
        self.cpu: dict[str, list[tuple[float, float, int, float]]] = {}

    def serve(self, *options: str) -> tuple[Any, str]:
        return self.net.serve(self.ns_s, self.addr, "--insecure", *options)

    def push(self, ns: str, to: str, path: str) -> dict[str, Any]:
        r = self.net.run(ns, [*CLI, "push", path, "--to", to, "--json"], timeout=600)
        if r.returncode:
            raise RuntimeError(f"push failed ({r.returncode}): {r.stderr[-2000:]}")
        return json.loads(r.stdout)

    def child(self, ns: str, name: str, *args: Any) -> dict[str, Any]:
        r = self.net.run(ns, [sys.executable, __file__, "_child", name, *map(str, args)], timeout=600, cwd=ROOT)
        if r.returncode:
            raise RuntimeError(f"{name} failed ({r.returncode}): {r.stderr[-2000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def client_child(self, name: str, *args: Any) -> dict[str, Any]:
        return self.child(self.ns_c, name, *args)


def _stop(proc: Any, graceful: bool = False) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT if graceful else signal.SIGKILL)  # SIGINT: serve closes, writing its cache
    proc.wait(timeout=120)


def arm_push_fresh(c: Ctx, frac: float) -> float:
    server, to = c.serve()
    try:
        return c.push(c.ns_c, to, c.full)["seconds"]
    finally:
        _stop(server)


def arm_push_cache(c: Ctx, frac: float) -> float:
    d = tempfile.mkdtemp(prefix="cache-", dir=c.tmp)
    server, to = c.serve("--cache-dir", d)
    try:
        return c.push(c.ns_c, to, c.full)["seconds"]
    finally:
        _stop(server)
        shutil.rmtree(d, ignore_errors=True)


def arm_update(c: Ctx, frac: float) -> float:
    server, to = c.serve()
    try:
        for p in (c.base, c.full if frac != max(c.versions) else c.versions[min(c.versions)], c.base):
            c.push(c.ns_s, to, p)  # over the server's own loopback: v, another version, v
        return c.push(c.ns_c, to, c.versions[frac])["seconds"]
    finally:
        _stop(server)


def arm_tcp(c: Ctx, frac: float) -> float:
    size = os.path.getsize(c.full)
    recv = c.net.popen(
        c.ns_s,
        [sys.executable, __file__, "_child", "tcp_recv", c.addr, str(size)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        if recv.stdout.readline().strip() != "READY":
            raise RuntimeError("the raw TCP receiver did not start")
        return c.client_child("tcp_send", c.addr, c.full)["seconds"]
    finally:
        recv.wait(timeout=60)


def _filled_cache(c: Ctx) -> str:
    d = os.path.join(c.tmp, "hit-cache")
    if not os.path.isdir(d):
        server, to = c.serve("--cache-dir", d)
        try:
            c.push(c.ns_s, to, c.full)
        finally:
            _stop(server, graceful=True)
    return d


def arm_hit(c: Ctx, frac: float) -> float:
    server, to = c.serve("--cache-dir", _filled_cache(c))
    try:
        r = c.push(c.ns_c, to, c.full)
        if r.get("cached", 0) == 0:
            raise RuntimeError(f"the cache-hit push filled nothing from the cache: {r}")
        return r["seconds"]
    finally:
        _stop(server)


def arm_load(c: Ctx, frac: float) -> float:
    return c.child(c.ns_s, "load", c.full)["seconds"]


def _delta(c: Ctx, frac: float, how: str) -> float:
    server, to = c.serve()
    try:
        _pin(server.pid, c.server_cpus)
        out = c.client_child("push_delta", to, c.base, c.versions[frac], server.pid, how, c.client_cpus)
        first = f", first step {out['first']:.3f} s" if out["first"] is not None else ""
        print(
            f"  delta.{how} {frac}: {out['bytes']} bytes sent, {out['deltas']} deltas, CPU s client "
            f"{out['client_cpu']:.3f} server {out['server_cpu']:.3f}{first}",
            file=sys.stderr,
        )
        row = (out["client_cpu"], out["server_cpu"], out["bytes"], out["first"] or 0.0)
        c.cpu.setdefault(f"delta.{how}.{frac:g}", []).append(row)
        return float(out["seconds"])
    finally:
        _stop(server)


def arm_delta(c: Ctx, frac: float) -> float:
    """v+1 (fraction f) pushed from memory into a running server holding v, as a trainer does:
    ``Client(keep_base=True)`` pushed v, v+1 and v before (untimed but for the first step),
    then pushes v+1 (timed)."""
    return _delta(c, frac, "kept")


def arm_delta_given(c: Ctx, frac: float) -> float:
    """The same step with ``push(v+1, base=v)``: the caller's v as the base, hashed by the push."""
    return _delta(c, frac, "given")


ARMS: dict[str, Callable[[Ctx, float], float]] = {
    "push.fresh": arm_push_fresh,
    "push.cache": arm_push_cache,
    "update": arm_update,
    "tcp.touched": arm_tcp,
    "hit": arm_hit,
    "load.warm": arm_load,
    "delta": arm_delta,
    "delta.given": arm_delta_given,
}
PER_FRACTION = {"update", "delta", "delta.given"}
DEFAULT_ARMS = "push.fresh,push.cache,update,tcp.touched,hit,load.warm"
RATIOS = (
    ("update/tcp", "update.1", "tcp.touched"),
    ("cache/fresh", "push.cache", "push.fresh"),
    ("hit/load", "hit", "load.warm"),
)


def _run_rate(net: Any, k: int, rate: str, args: Any, base: str, versions: dict[float, str]) -> dict[str, Any]:
    ends = net.pair(f"10.242.{k}", rate=None if rate == "none" else rate)
    names: list[tuple[str, float]] = []
    for arm in args.arms.split(","):
        fracs = sorted(versions) if arm in PER_FRACTION else [max(versions)]
        names += [(arm, f) for f in fracs if arm in PER_FRACTION or f == max(versions)]
    label = {(a, f): (f"{a}.{f:g}" if a in PER_FRACTION else a) for a, f in names}
    times: dict[str, list[float]] = {label[n]: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="wl-update-", dir=args.tmp) as tmp:
        c = Ctx(net, ends, base, versions, tmp)
        c.server_cpus, c.client_cpus = args.server_cpus, args.client_cpus
        if any(a == "hit" for a, _ in names):
            _filled_cache(c)
        for rnd in range(args.runs):
            order = list(names)
            random.Random(rnd).shuffle(order)
            for arm, f in order:
                time.sleep(args.settle)
                s = ARMS[arm](c, f)
                times[label[(arm, f)]].append(s)
                print(f"  {rate} round {rnd} {label[(arm, f)]}: {s:.3f} s", flush=True)
    out: dict[str, Any] = {"seconds": times, "median": {a: statistics.median(v) for a, v in times.items() if v}}
    out["cpu"] = {a: [statistics.median(x) for x in zip(*v, strict=True)] for a, v in c.cpu.items()}
    out["ratios"] = {}
    for name, a, b in RATIOS:
        if times.get(a) and times.get(b):
            out["ratios"][name] = statistics.median(x / y for x, y in zip(times[a], times[b], strict=False))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_child":
        CHILDREN[argv[1]](*argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=768, help="checkpoint size (default 768)")
    p.add_argument("--fractions", default="0.01,0.1,1", help="changed fractions of v+1 (default 0.01,0.1,1)")
    p.add_argument("--rates", default="none,4gbit,1gbit", help="link caps, tc notation; none: uncapped")
    p.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated (default {DEFAULT_ARMS}; also: delta)")
    p.add_argument("--runs", type=int, default=3, help="rounds per rate (default 3)")
    p.add_argument("--settle", type=float, default=2.0, help="seconds of pause before each run (default 2)")
    p.add_argument("--tmp", default=None, help="where cache folders go (default: the system's temporary folder)")
    p.add_argument("--check-fractions", action="store_true", help="measure the changed fraction of each v+1")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    p.add_argument("--server-cpus", default="", help="delta arms: pin the server to these cores (taskset notation)")
    p.add_argument("--client-cpus", default="", help="delta arms: pin the client to these cores")
    args = p.parse_args(argv)

    from tests.net.netns import Net, unavailable

    reason = unavailable()
    if reason:
        print(f"update benchmark skipped: {reason}", file=sys.stderr)
        return 2
    fractions = sorted(float(f) for f in args.fractions.split(","))
    base, versions = make_versions(args.size_mib * MIB, fractions)
    for path in (base, *versions.values()):
        subprocess.run([*CLI, "manifest", path, "-o", "-"], check=True, capture_output=True)  # the sidecar
    result: dict[str, Any] = {"bytes": os.path.getsize(base), "runs": args.runs, "rates": {}}
    result["pinned"] = {"server": args.server_cpus, "client": args.client_cpus}
    if args.check_fractions:
        result["changed"] = {f: changed_fraction(base, v) for f, v in versions.items()}
        print(f"changed fractions: {result['changed']}")
    result["load_before"] = os.getloadavg()
    print(f"checkpoint v: {base} ({result['bytes'] / 1e6:.0f} MB), load {result['load_before']}", flush=True)
    with Net() as net:
        for k, rate in enumerate(r.strip() for r in args.rates.split(",") if r.strip()):
            result["rates"][rate] = _run_rate(net, k, rate, args, base, versions)
    result["load_after"] = os.getloadavg()
    _print(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _print(result: dict[str, Any]) -> None:
    rates = list(result["rates"])
    arms = sorted({a for r in result["rates"].values() for a in r["median"]})
    print(f"\n{'arm (median s)':<16s}" + "".join(f"{r:>10s}" for r in rates))
    for a in arms:
        print(f"{a:<16s}" + "".join(f"{result['rates'][r]['median'].get(a, float('nan')):10.3f}" for r in rates))
    for name, _, _ in RATIOS:
        vals = [result["rates"][r]["ratios"].get(name) for r in rates]
        print(f"{name:<16s}" + "".join(f"{v:10.2f}" if v is not None else f"{'-':>10s}" for v in vals))
    for r in rates:
        for a, (cli, srv, sent, first) in sorted(result["rates"][r].get("cpu", {}).items()):
            step = f"; first step {first:.3f} s" if first else ""
            print(f"{r} {a}: median CPU s client {cli:.3f}, server {srv:.3f}; {sent / 1e6:.1f} MB sent{step}")
    pinned = result["pinned"]
    if pinned["server"] or pinned["client"]:
        print(f"delta arms pinned: server to cores {pinned['server'] or 'any'}, client to {pinned['client'] or 'any'}")
    print(f"load average before {result['load_before']}, after {result['load_after']}")


if __name__ == "__main__":
    sys.exit(main())
