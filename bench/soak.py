#!/usr/bin/env python3
"""Soak a tensor server: several clients pushing, pulling, listing and freeing at once, for a
bounded time, against a server in a subprocess under ``max_memory`` (with a disk cache unless
``--no-cache``).

What it checks, and prints (``--json``: as JSON):

* every byte pulled is a version of that tensor some client pushed, and a client's own tensors
  are exactly what it last pushed (``bytes_lost`` counts tensors that were not: it must be 0);
* the server's resident memory grows at most ``max_memory`` plus the constant SECURITY.md
  documents (``rss_growth`` against ``rss_allowed``), sampled from /proc all along;
* once the clients have gone and freed their tensors, the server's descriptors and threads are
  back to their count before the first client (``fds``, ``threads``: start and end).

Two more clients run alongside (unless turned off): a *trickler* that sends a frame one byte at
a time, each byte inside the server's I/O timeout, and must be cut by the frame deadline
(``io_timeout + N / min_frame_rate``) every time (``trickle``: how often it was cut, and the
longest a trickled frame was held, against the bound); and a *lister* that lists a server which
also holds ``--many`` small tensors (100,000 by default from the command line), each listing
checked to name every one of them with its size, while the other clients push (``many``); the
small tensors are pulled and checked byte for byte with everything else. Their memory counts:
the server's ``max_memory`` is raised by what they are charged.

A push the server refuses because its memory is full is the limit doing its job, counted in
``refused``. A pull lists, then reads each tensor as the version listed (protocol 1.2): one
replaced in between by the same layout is read again as its new version; one freed, or
replaced by another layout again and again, fails that pull clearly (``pull_conflicts``; the
client reconnects). A tensor that comes back as the first bytes of a newer version under the
old shape (the defect the versions removed; tests/faults/test_pull_during_replace.py) counts in
``torn_pulls`` and fails the soak. Anything else a client sees is an error, listed in
``errors``, and any other pulled bytes that no client pushed count in ``bytes_lost``.

    python bench/soak.py --seconds 600 --clients 8 --json soak.json
    python bench/soak.py --seconds 5 --many 2000   # a short functional run

Linux only (reads /proc). tests/faults/test_soak.py runs it for ten seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import blake3

from weightlift.benchmark.synthetic import write_checkpoint
from weightlift.errors import NotFoundError, RemoteProtocolError, StateError, WeightliftError
from weightlift.remote.client.client import Client
from weightlift.remote.protocol import NEED_DATA, Decoder, Have, Hello, new_nonce, send
from weightlift.remote.server.config import MIN_FRAME_RATE
from weightlift.remote.server.store import entry_cost

MIB = 1 << 20
SLACK = 48 * MIB  # SECURITY.md: what a server holds beyond max_memory (threads, interpreter, allocator)
VARIANTS = 3  # checkpoints per client, pushed in turn: each push replaces the client's tensors

_SERVE = """
import sys
from weightlift.remote.server.server import Server
cache = sys.argv[2] or None
s = Server(max_memory=int(sys.argv[1]), cache_dir=cache, idle_timeout=None, io_timeout=float(sys.argv[3]))
print(s.bind()[1], flush=True)
s.serve_forever()
"""


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/{pid}/status")


def rss(pid: int) -> int:
    return _status(pid, "VmRSS") * 1024


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    return _status(pid, "Threads")


def settled(pid: int, want_fds: int, seconds: float = 30.0) -> None:
    """Wait until the process holds ``want_fds`` descriptors and the same thread count for a
    tenth of a second (a connection's thread ends just after its socket closes)."""
    end = time.monotonic() + seconds
    last, same = None, 0
    while time.monotonic() < end:
        now = (fds(pid), threads(pid))
        same = same + 1 if now == last else 0
        last = now
        if now[0] == want_fds and same >= 5:
            return
        time.sleep(0.02)
    raise RuntimeError(f"the server did not settle: {last}, wanted {want_fds} descriptors")


def _tensors(path: Path) -> dict[str, bytes]:
    """Each tensor's bytes, read by the format's definition (not weightlift's reader)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    return {k: data[base + v["data_offsets"][0] : base + v["data_offsets"][1]] for k, v in header.items()}


def _digests(path: Path) -> dict[str, str]:
    return {k: blake3.blake3(v).hexdigest() for k, v in _tensors(path).items()}


class Worker:
    """One client: pushes its checkpoints in turn, pulls everything, lists and frees its own."""

    def __init__(self, k: int, address: tuple[str, int], folder: Path, tensor_bytes: int, tensors: int, seed: int):
        self.k = k
        self.address = address
        self.folder = folder
        self.rng = random.Random(seed * 1000 + k)
        self.files = []
        self.names = [f"c{k}.t{i}" for i in range(tensors)]
        raw = []
        for v in range(VARIANTS):
            path = folder / f"c{k}-v{v}.safetensors"
            # sizes differ between variants, so replacing a tensor changes its size class too
            size = max(1, tensor_bytes * (v + 1) // VARIANTS)
            write_checkpoint(path, [(n, "U8", (size,)) for n in self.names], seed=seed * 1000 + k * 10 + v)
            raw.append(_tensors(path))
            self.files.append((path, {n: blake3.blake3(b).hexdigest() for n, b in raw[-1].items()}))
        self.known: dict[str, set[str]] = {n: {d[n] for _, d in self.files} for n in self.names}
        # what a pull that read a tensor replaced after its LIST gets: the new version's first
        # bytes, as many as the listed version had (tests/faults/test_pull_during_replace.py)
        self.torn_all: dict[str, set[str]] = {}
        self.torn: dict[str, set[str]] = {
            n: {blake3.blake3(b[n][: len(a[n])]).hexdigest() for a in raw for b in raw if len(a[n]) < len(b[n])}
            for n in self.names
        }
        # what each own tensor may be now: a digest, or None for absent
        self.expect: dict[str, set[str | None]] = {n: {None} for n in self.names}
        self.ops = {"push": 0, "pull": 0, "list": 0, "free": 0}
        self.streams = 1
        self.refused = 0
        self.conflicts = 0
        self.torn_pulls = 0
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self.lost: list[str] = []
        self.errors: list[str] = []

    def run(self, deadline: float, others: dict[str, set[str]]) -> None:
        c = Client(self.address, timeout=60, streams=self.streams)
        try:
            while time.monotonic() < deadline:
                op = self.rng.choices(["push", "pull", "list", "free"], weights=[5, 2, 2, 1])[0]
                try:
                    getattr(self, "_" + op)(c, others)
                except (NotFoundError, RemoteProtocolError, StateError) as e:
                    # a pull lists, then reads: a tensor another client freed, or kept replacing
                    # with another layout, in between is a clear error of that pull
                    if op != "pull" or not (isinstance(e, (NotFoundError, StateError)) or "runs past" in str(e)):
                        raise
                    self.conflicts += 1
                    c.close()
                    c = Client(self.address, timeout=60, streams=self.streams)
                self.ops[op] += 1
            self._free(c, others)
        except WeightliftError as e:
            self.errors.append(f"client {self.k}: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - reported, the soak goes on
            self.errors.append(f"client {self.k}: unexpected {type(e).__name__}: {e}")
        finally:
            c.close()

    def _push(self, c: Client, others: dict[str, set[str]]) -> None:
        path, digests = self.files[self.rng.randrange(VARIANTS)]
        try:
            r = c.push(path)
        except RemoteProtocolError as e:
            if "memory limit" not in str(e):
                raise
            # refused for lack of memory: the tensors that did land are this version, the rest
            # are as they were
            self.refused += 1
            for n in self.names:
                self.expect[n] = self.expect[n] | {digests[n]}
            return
        self.bytes_pushed += r.bytes_sent
        for n in self.names:
            self.expect[n] = {digests[n]}

    def _pull(self, c: Client, others: dict[str, set[str]]) -> None:
        torn = self.torn_all
        out = self.folder / f"pulled-{self.k}.safetensors"
        c.pull(out)
        got = _digests(out)
        self.bytes_pulled += out.stat().st_size
        for n, d in got.items():
            allowed = self.expect[n] if n in self.expect else others.get(n, set())
            if d not in allowed and n not in self.expect and d in torn.get(n, set()):
                self.torn_pulls += 1
            elif d not in allowed:
                where = sorted(m for m, ds in others.items() if d in ds)
                self.lost.append(
                    f"client {self.k} pulled {n} = {d[:16]}: allowed {sorted(str(x)[:16] for x in allowed)}; "
                    f"a version of {where or 'no tensor'}"
                )
                if os.environ.get("WL_SOAK_KEEP"):
                    shutil.copy(out, f"{os.environ['WL_SOAK_KEEP']}/lost-{self.k}-{self.ops['pull']}.safetensors")
        for n in self.names:
            if n not in got and None not in self.expect[n]:
                self.lost.append(f"{n}: pushed, but missing from a pull")
        out.unlink()
        for n in self.names:  # what a pull showed settles an uncertain tensor
            self.expect[n] = {got.get(n)}

    def _list(self, c: Client, others: dict[str, set[str]]) -> None:
        for t in c.list():
            if t.name not in others and t.name not in self.expect:
                self.lost.append(f"{t.name}: listed, but no client pushed it")

    def _free(self, c: Client, others: dict[str, set[str]]) -> None:
        c.free(self.names)
        for n in self.names:
            self.expect[n] = {None}


class Trickler:
    """A peer that trickles a HAVE one byte at a time, every byte inside the I/O timeout: the
    server must cut each such frame at its deadline. It reconnects after each cut."""

    def __init__(self, address: tuple[str, int], io_timeout: float):
        self.address = address
        self.io_timeout = io_timeout
        self.frame = send(Have(tuple(i.to_bytes(32, "little") for i in range(64))))
        # the deadline, and some room for a loaded machine to notice and close
        self.bound = io_timeout + len(self.frame) / MIN_FRAME_RATE + 2.0
        self.cuts = 0
        self.held_max = 0.0
        self.errors: list[str] = []

    def _hello(self, sock: socket.socket) -> None:
        sock.sendall(send(Hello(1, 0, nonce=new_nonce())))
        dec = Decoder(our_role="client")
        while dec.next_event() is NEED_DATA:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("closed during HELLO")
            dec.feed(data)

    def run(self, deadline: float) -> None:
        every = self.io_timeout / 2
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(self.address, timeout=10) as sock:
                    self._hello(sock)
                    t0 = time.monotonic()  # the frame's first byte goes now
                    for i in range(len(self.frame)):
                        sock.sendall(self.frame[i : i + 1])
                        if select.select([sock], [], [], every)[0] or time.monotonic() > deadline + self.bound:
                            break  # the server's end closed (or it gave up the frame)
                    held = time.monotonic() - t0
                    if held < self.bound:
                        self.cuts += 1
                    self.held_max = max(self.held_max, held)
            except OSError as e:
                if time.monotonic() < deadline:
                    self.errors.append(f"trickler: {type(e).__name__}: {e}")
                return


class Lister:
    """Lists the server again and again; each listing must name every small tensor with its size."""

    def __init__(self, address: tuple[str, int], many: dict[str, int]):
        self.address = address
        self.many = many
        self.listings = 0
        self.slowest = 0.0
        self.errors: list[str] = []

    def run(self, deadline: float) -> None:
        try:
            with Client(self.address, timeout=60) as c:
                while time.monotonic() < deadline:
                    t0 = time.monotonic()
                    got = {t.name: t.nbytes for t in c.list() if t.name in self.many}
                    self.slowest = max(self.slowest, time.monotonic() - t0)
                    if got != self.many:
                        missing = sorted(set(self.many) - set(got))[:3]
                        self.errors.append(f"lister: a listing lacked or misstated {missing or 'sizes'}")
                        return
                    self.listings += 1
        except WeightliftError as e:
            self.errors.append(f"lister: {type(e).__name__}: {e}")


def _many(root: Path, n: int, seed: int) -> tuple[Path, dict[str, str], dict[str, int], int]:
    """A checkpoint of ``n`` small tensors: its path, their digests and sizes, and their charge."""
    path = root / "many.safetensors"
    spec = [(f"many.{i:06d}", "U8", (1 + i % 16,)) for i in range(n)]
    written = write_checkpoint(path, spec, seed=seed, digests=True)
    digests = {name: written[name] for name, _, _ in spec}
    sizes = {name: shape[0] for name, _, shape in spec}
    return path, digests, sizes, sum(entry_cost(name, size) for name, size in sizes.items())


def soak(
    seconds: float = 10.0,
    *,
    clients: int = 4,
    max_memory: int = 48 * MIB,
    tensor_bytes: int = 4 * MIB,
    tensors: int = 4,
    cache: bool = True,
    streams: int = 2,
    seed: int = 0,
    folder: str | os.PathLike[str] | None = None,
    many: int = 0,
    trickle: bool = True,
    io_timeout: float = 2.0,
) -> dict[str, Any]:
    """Run the soak; returns its figures (see the module docstring). ``many`` small tensors are
    pushed first for the lister (0: no lister); ``trickle`` runs the trickler against a server
    whose I/O timeout is ``io_timeout``."""
    own = folder is None
    root = Path(tempfile.mkdtemp(prefix="wl-soak-")) if folder is None else Path(folder)
    cache_dir = root / "cache"
    many_path, many_digests, many_sizes, many_cost = _many(root, many, seed) if many else (None, {}, {}, 0)
    limit = max_memory + many_cost
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE, str(limit), str(cache_dir) if cache else "", str(io_timeout)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        address = ("127.0.0.1", int(proc.stdout.readline()))
        workers = [Worker(k, address, root, tensor_bytes, tensors, seed) for k in range(clients)]
        others: dict[str, set[str]] = {n: {d} for n, d in many_digests.items()}
        torn: dict[str, set[str]] = {}
        for w in workers:
            others.update(w.known)
            torn.update(w.torn)
        for w in workers:
            w.torn_all = torn
            w.streams = 1 + w.k % streams  # some clients spread their pushes over several connections

        # a warm-up push, pull and free: the server's lasting threads (the hash pool) start here
        fds0 = fds(proc.pid)
        warm = workers[0]
        with Client(address) as c:
            c.push(warm.files[0][0])
            c.pull(root / "warm.safetensors")
            c.free(warm.names)
        (root / "warm.safetensors").unlink()
        settled(proc.pid, fds0)  # the warm-up's connection has ended on the server's side
        time.sleep(1.5)  # and the cache's write-behind thread, idle, has ended (it ends after 1 s)
        start = {"rss": rss(proc.pid), "fds": fds(proc.pid), "threads": threads(proc.pid)}
        peak = [start["rss"]]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.02):
                peak[0] = max(peak[0], rss(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        if many_path is not None:
            with Client(address, timeout=600) as c:
                c.push(many_path)
        t0 = time.monotonic()
        deadline = t0 + seconds
        ts = [threading.Thread(target=w.run, args=(deadline, others)) for w in workers]
        trickler = Trickler(address, io_timeout) if trickle else None
        lister = Lister(address, many_sizes) if many else None
        for extra in (trickler, lister):
            if extra is not None:
                ts.append(threading.Thread(target=extra.run, args=(deadline,)))
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        elapsed = time.monotonic() - t0
        if many_path is not None:
            with Client(address, timeout=600) as c:
                c.free(list(many_sizes))
        # the server closes each connection on its own threads: wait for it, a bounded while
        end_by = time.monotonic() + 30
        while time.monotonic() < end_by and (fds(proc.pid), threads(proc.pid)) != (start["fds"], start["threads"]):
            time.sleep(0.05)
        done.set()
        sampler.join()
        end = {"fds": fds(proc.pid), "threads": threads(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
        if own:
            shutil.rmtree(root, ignore_errors=True)

    ops = {k: sum(w.ops[k] for w in workers) for k in workers[0].ops}
    extra_errors = (trickler.errors if trickler else []) + (lister.errors if lister else [])
    return {
        "seconds": round(elapsed, 2),
        "clients": clients,
        "max_memory": max_memory,
        "cache": cache,
        "streams": streams,
        "ops": ops,
        "refused": sum(w.refused for w in workers),
        "pull_conflicts": sum(w.conflicts for w in workers),
        "torn_pulls": sum(w.torn_pulls for w in workers),
        "bytes_pushed": sum(w.bytes_pushed for w in workers),
        "bytes_pulled": sum(w.bytes_pulled for w in workers),
        "bytes_lost": sum(len(w.lost) for w in workers),
        "lost": [x for w in workers for x in w.lost][:20],
        "errors": ([x for w in workers for x in w.errors] + extra_errors)[:20],
        "trickle": {
            "cuts": trickler.cuts,
            "held_max_s": round(trickler.held_max, 2),
            "bound_s": round(trickler.bound, 2),
        }
        if trickler
        else None,
        "many": {"tensors": many, "listings": lister.listings, "slowest_list_s": round(lister.slowest, 2)}
        if lister
        else None,
        "rss_growth": peak[0] - start["rss"],
        "rss_allowed": limit + SLACK,
        "fds": [start["fds"], end["fds"]],
        "threads": [start["threads"], end["threads"]],
    }


def ok(r: dict[str, Any]) -> bool:
    """Whether a soak's figures hold every promise."""
    return (
        not r["errors"]
        and r["bytes_lost"] == 0
        and r["torn_pulls"] == 0
        and r["rss_growth"] <= r["rss_allowed"]
        and r["fds"][0] == r["fds"][1]
        and r["threads"][0] == r["threads"][1]
        and (
            r["trickle"] is None or (r["trickle"]["cuts"] > 0 and r["trickle"]["held_max_s"] <= r["trickle"]["bound_s"])
        )
        and (r["many"] is None or r["many"]["listings"] > 0)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-memory-mib", type=int, default=48)
    p.add_argument("--tensor-mib", type=float, default=4.0, help="the largest variant's tensor size")
    p.add_argument("--tensors", type=int, default=4, help="tensors per client checkpoint")
    p.add_argument("--no-cache", action="store_true", help="serve without a disk cache")
    p.add_argument("--streams", type=int, default=2, help="client k pushes over 1 + k %% STREAMS connections")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--many", type=int, default=100_000, help="small tensors the lister's server also holds (0: no lister)"
    )
    p.add_argument("--no-trickle", action="store_true", help="without the client that trickles at the frame deadline")
    p.add_argument("--io-timeout", type=float, default=2.0, help="the server's I/O timeout, seconds")
    p.add_argument(
        "--json", metavar="FILE", nargs="?", const="-", help="write the figures as JSON (- or no name: stdout)"
    )
    a = p.parse_args(argv)
    r = soak(
        a.seconds,
        clients=a.clients,
        max_memory=a.max_memory_mib * MIB,
        tensor_bytes=int(a.tensor_mib * MIB),
        tensors=a.tensors,
        cache=not a.no_cache,
        streams=a.streams,
        seed=a.seed,
        many=a.many,
        trickle=not a.no_trickle,
        io_timeout=a.io_timeout,
    )
    r["ok"] = ok(r)
    text = json.dumps(r, indent=2)
    if a.json is None or a.json == "-":
        print(text)
    else:
        Path(a.json).write_text(text + "\n")
        print(f"soak: {'ok' if r['ok'] else 'FAILED'}; figures in {a.json}")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
