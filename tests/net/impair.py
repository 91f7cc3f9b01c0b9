"""A slow, lossy, reordering link in user space, for kernels built without ``tc netem``.

Two TUN devices, one in each network namespace, carry IP packets between them through this
process, which does to the packets going from the first namespace to the second what
``tc qdisc add dev X root netem delay D loss L reorder R`` does on X's egress: each packet is
dropped with probability L; of the rest, a fraction R goes at once and the others after D
(so the ones sent at once overtake those held back: reordering); packets going the other way
(the acknowledgements of a push) pass unchanged. The devices are made by the fixture
(``ip tuntap add ... mode tun``, addressed and up); this process attaches to them by name,
entering each namespace in turn (``setns``), and runs until killed; on SIGUSR1 it prints what
it has done so far as one JSON line (packets forwarded, dropped, sent ahead of held ones). The random choices come
from a seeded generator, so a run is repeatable up to the timing of the packets.

    python -m tests.net.impair NS_A TUN_A NS_B TUN_B --delay-ms 20 --loss 0.01 --reorder 0.05
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import heapq
import json
import os
import random
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
READ_MAX = 65536


def setns(name: str) -> None:
    """Enter network namespace ``name`` (as made by ``ip netns add``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def attach(ns: str, dev: str) -> int:
    """A file descriptor for the persistent TUN device ``dev`` of namespace ``ns``."""
    setns(ns)
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", dev.encode(), IFF_TUN | IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


def forward(fd_a: int, fd_b: int, *, delay: float, loss: float, reorder: float, seed: int) -> None:
    rng = random.Random(seed)
    counts = {"forwarded": 0, "dropped": 0, "reordered": 0, "returned": 0}
    signal.signal(signal.SIGUSR1, lambda *_: print(json.dumps(counts), flush=True))
    held: list[tuple[float, int, bytes]] = []  # (due, sequence, packet) bound for b
    seq = 0
    poller = select.poll()
    poller.register(fd_a, select.POLLIN)
    poller.register(fd_b, select.POLLIN)
    while True:
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, _, pkt = heapq.heappop(held)
            _write(fd_b, pkt)
        wait_ms = -1 if not held else max(0, int((held[0][0] - now) * 1000) + 1)
        for fd, _ in poller.poll(wait_ms):
            for _ in range(256):  # a batch per wake-up, then the held queue again
                try:
                    pkt = os.read(fd, READ_MAX)
                except BlockingIOError:
                    break
                if fd == fd_b:
                    counts["returned"] += 1
                    _write(fd_a, pkt)
                    continue
                if loss and rng.random() < loss:
                    counts["dropped"] += 1
                    continue
                counts["forwarded"] += 1
                if delay <= 0 or (reorder and rng.random() < reorder):
                    counts["reordered"] += bool(held)  # overtakes the packets held back, if any
                    _write(fd_b, pkt)
                    continue
                seq += 1
                heapq.heappush(held, (time.monotonic() + delay, seq, pkt))


def _write(fd: int, pkt: bytes) -> None:
    try:
        os.write(fd, pkt)
    except (BlockingIOError, OSError):
        pass  # a full device queue drops the packet, as a real link would


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ns_a")
    p.add_argument("tun_a")
    p.add_argument("ns_b")
    p.add_argument("tun_b")
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--loss", type=float, default=0.0, help="fraction of packets a to b dropped")
    p.add_argument("--reorder", type=float, default=0.0, help="fraction of packets a to b sent without delay")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    fd_a = attach(a.ns_a, a.tun_a)
    fd_b = attach(a.ns_b, a.tun_b)
    print("READY", flush=True)
    try:
        forward(fd_a, fd_b, delay=a.delay_ms / 1000, loss=a.loss, reorder=a.reorder, seed=a.seed)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
