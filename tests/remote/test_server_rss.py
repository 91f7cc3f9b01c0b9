"""The server process's resident memory under every attack that used to get it past its limit:
within max_memory plus a documented constant (SECURITY.md), measured from /proc."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests.remote.rawclient import Raw, _barrier, _put
from weightlift.remote.protocol import Alloc, Free, FreeReply, Have, Read, send
from weightlift.remote.server.store import entry_cost

LIMIT = 96 << 20
SLACK = 48 << 20  # SECURITY.md: threads, interpreter and allocator overhead a server holds beyond max_memory

_SERVE = f"""
from weightlift.remote.server.server import Server
s = Server(max_memory={LIMIT}, idle_timeout=None)
print(s.bind()[1], flush=True)
s.serve_forever()
"""

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc")


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@contextlib.contextmanager
def _serving() -> Iterator[tuple[subprocess.Popen, tuple[str, int], list[Raw]]]:
    """A server process under LIMIT, its address, and a list of raw connections to close after."""
    proc = subprocess.Popen([sys.executable, "-c", _SERVE], stdout=subprocess.PIPE, text=True)
    socks: list[Raw] = []
    try:
        assert proc.stdout is not None
        yield proc, ("127.0.0.1", int(proc.stdout.readline())), socks
    finally:
        for r in socks:
            r.close()
        proc.terminate()
        proc.wait(timeout=10)


def _within_limit(base: int, peak: int) -> None:
    grew = peak - base
    print(f"resident memory grew {grew >> 20} MiB")
    assert grew <= LIMIT + SLACK, f"resident memory grew {grew >> 20} MiB; limit {LIMIT >> 20} + {SLACK >> 20} MiB"


def test_resident_memory_stays_within_the_limit_under_every_attack():
    with _serving() as (proc, address, socks):

        def client() -> Raw:
            raw = Raw(address)
            raw.hello()
            socks.append(raw)
            return raw

        raw = client()
        _put(raw, 0, "warm", np.ones(1000, dtype=np.uint8), dtype="U8")
        _barrier(raw)
        base = _rss(proc.pid)
        peak = [base]

        def measure() -> None:
            peak[0] = max(peak[0], _rss(proc.pid))

        # stalled readers pin each version while it is replaced
        big = 40 << 20
        for v in range(3):
            _put(raw, 10 + v, "w", np.full(big, v, dtype=np.uint8), dtype="U8")
            _barrier(raw)
            stalled = Raw(address)
            stalled.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stalled.hello()
            stalled.send(Read("w", 0, big))
            assert stalled.sock.recv(1)
            socks.append(stalled)
            measure()
        raw.send(Free(("w",)))
        assert raw.recv() == FreeReply(1)
        # allocations ahead of the limit, with long names and many dimensions
        flood = client()
        flood.send(Alloc(0, "first", "U8", (8 << 20,), 8 << 20))
        shape = (1,) * 63 + (1 << 20,)
        for i in range(1, 2000):
            flood.send(Alloc(i, "n" * 4000 + str(i), "U8", shape, 1 << 20))
        _barrier(flood)
        measure()
        # zero-byte entries with long names until the limit refuses them
        names = client()
        for i in range(3000):
            names.send(Alloc(i, "z" * 4000 + str(i), "U8", (0,) + (1,) * 63, 0))
        _barrier(names)
        measure()
        # unfinished large frames on several connections
        frame = send(Have(tuple(i.to_bytes(32, "little") for i in range(65536))))
        for _ in range(6):
            c = client()
            c.sock.sendall(frame[: len(frame) - 1])
        time.sleep(0.2)
        measure()
        _within_limit(base, peak[0])


def test_resident_memory_stays_within_the_limit_under_delta_frames_cut_short():
    """DELTAs whose one frame states the chunk's size but is cut short, on connections kept open:
    zstd decodes such a frame through a window buffer as large as its header names, and kept it
    in each connection thread's decompressor (24 MiB a connection here) beyond every charge."""
    import blake3
    import zstandard

    from weightlift.remote.client.client import Client
    from weightlift.remote.protocol import Delta, DeltaEncoding

    with _serving() as (proc, address, socks):
        nbytes = 24 << 20  # the base, the result, the payload and the chunk's scratch fit in LIMIT
        b = np.zeros(nbytes // 2, np.uint16)
        with Client(address) as c:
            c.push({"b": b})
        base = _rss(proc.pid)
        x = np.random.default_rng(0).integers(0, 4, nbytes, dtype=np.uint8).tobytes()
        params = zstandard.ZstdCompressionParameters.from_level(1, window_log=27)
        frame = zstandard.ZstdCompressor(compression_params=params).compress(x)[:-1]
        payload = struct.pack("<III", nbytes, 1, len(frame)) + frame
        d0, d1 = blake3.blake3(b.tobytes()).digest(), blake3.blake3(x).digest()
        delta = Delta(1, "b", "U16", b.shape, nbytes, DeltaEncoding.PLANES, d0, d1, len(payload))
        peak = base
        for _ in range(10):
            raw = Raw(address)
            raw.hello()
            socks.append(raw)
            raw.sock.sendall(send(delta) + payload)
            reply = _barrier(raw)
            assert reply.errors and "decompress" in reply.errors[0]
            peak = max(peak, _rss(proc.pid))
        _within_limit(base, peak)


def test_entry_cost_covers_a_long_name():
    assert entry_cost("n" * 4000, 0, 64) > 3 * 4000 + 64 * 64
