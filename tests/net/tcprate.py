"""A raw TCP transfer, to measure what a link carries with nothing but the kernel's TCP on it.

    python -m tests.net.tcprate sink HOST PORT          # prints READY, then the bytes and seconds
    python -m tests.net.tcprate send HOST PORT NBYTES [STREAMS]

The sender writes NBYTES of zeros from a 4 MiB buffer (over STREAMS connections, each its
share); the sink counts them and prints one JSON line, ``{"bytes": n, "seconds": s}``, timed
from its first accepted connection to the last byte received.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

BUF = 4 << 20


def sink(host: str, port: int) -> None:
    srv = socket.create_server((host, port))
    print("READY", flush=True)
    total = [0]
    lock = threading.Lock()
    t0 = [0.0]
    done: list[threading.Thread] = []

    def drain(conn: socket.socket) -> None:
        buf = bytearray(BUF)
        with conn:
            while n := conn.recv_into(buf):
                with lock:
                    total[0] += n
        with lock:
            t0.append(time.perf_counter())

    srv.settimeout(None)
    conn, _ = srv.accept()
    t0[0] = time.perf_counter()
    streams = int.from_bytes(conn.recv(4, socket.MSG_WAITALL), "big")
    first = threading.Thread(target=drain, args=(conn,))
    first.start()
    done.append(first)
    for _ in range(streams - 1):
        c, _ = srv.accept()
        t = threading.Thread(target=drain, args=(c,))
        t.start()
        done.append(t)
    for t in done:
        t.join()
    print(json.dumps({"bytes": total[0], "seconds": max(t0[1:]) - t0[0]}), flush=True)


def send(host: str, port: int, nbytes: int, streams: int = 1) -> None:
    buf = memoryview(bytes(BUF))

    def push(share: int, header: bool) -> None:
        with socket.create_connection((host, port)) as s:
            if header:
                s.sendall(streams.to_bytes(4, "big"))
            while share > 0:
                share -= s.send(buf[: min(share, BUF)])

    first = threading.Thread(target=push, args=(nbytes // streams + nbytes % streams, True))
    first.start()
    time.sleep(0.05)  # the first connection carries the stream count: let it be accepted first
    rest = [threading.Thread(target=push, args=(nbytes // streams, False)) for _ in range(streams - 1)]
    for t in rest:
        t.start()
    for t in [first, *rest]:
        t.join()


if __name__ == "__main__":
    if sys.argv[1] == "sink":
        sink(sys.argv[2], int(sys.argv[3]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]) if len(sys.argv) > 5 else 1)
