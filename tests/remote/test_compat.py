"""Version compatibility: current and previous-minor clients and servers in all four pairings, and
pinned previous-minor HELLO bytes in both directions."""

from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import pytest

import weightlift.remote.protocol as P
from tests.remote.models import holds, write_u8
from weightlift.remote.client.client import Client
from weightlift.remote.protocol import NEED_DATA, Barrier, BarrierReply, Decoder, Hello, send
from weightlift.remote.server.server import Server

NEW, OLD = P.PROTOCOL_MINOR, P.PREVIOUS_MINOR
THRESHOLD = 100_000

# The previous minor's HELLO as it went on the wire: major 1, minor 0, flags CACHE (an old server
# never set it; a confused one might), max_frame 1 MiB, max_tensor_bytes 1 GiB, nonce 0x00..0x1f.
OLD_HELLO = bytes.fromhex("00000000340000000100000001000000000010000000004000000000") + bytes(range(32))


def _model(tmp_path) -> tuple[str, dict[str, bytes]]:
    rng = np.random.default_rng(0)
    tensors = {f"small.{i}": rng.integers(0, 256, 64 * (i + 1), dtype=np.uint8).tobytes() for i in range(3)}
    tensors.update({f"large.{i}": rng.integers(0, 256, 150_000, dtype=np.uint8).tobytes() for i in range(3)})
    return write_u8(tmp_path / "m.safetensors", tensors)


# the previous minor's four pairings, and minor 1's and 2's with the current one
PAIRINGS = [(NEW, NEW), (NEW, OLD), (OLD, NEW), (OLD, OLD), (NEW, 1), (1, NEW), (1, OLD), (NEW, 2), (2, NEW)]


@pytest.mark.parametrize("client_minor,server_minor", PAIRINGS)
def test_four_pairings_move_the_same_bytes(tmp_path, client_minor, server_minor):
    path, tensors = _model(tmp_path)
    large = sum(len(b) for n, b in tensors.items() if n.startswith("large"))
    both_new = client_minor >= 1 and server_minor >= 1
    with Server(cache_dir=tmp_path / "cache", protocol_minor=server_minor) as s:
        with Client(s.address, protocol_minor=client_minor) as c:
            hello = c.server_hello
            assert hello.minor == server_minor
            # an old server has no cache to offer; a new one only offers it to a peer that knows HAVE
            assert hello.has(P.Capability.CACHE) == both_new
            first = c.push(path, hash_threshold=THRESHOLD)
            holds(s, tensors)
            c.free(list(tensors))
            second = c.push(path, hash_threshold=THRESHOLD)
            holds(s, tensors)
            assert sorted(t.name for t in c.list()) == sorted(tensors)
    total = sum(len(b) for b in tensors.values())
    assert first.bytes == second.bytes == total
    if both_new:
        assert first.bytes_hashed == large and second.bytes_hashed == 0
        assert second.cached == 3 and second.bytes_sent == total - large
    else:
        # nothing hashed, since nobody could use the digest: the saving survives a mixed pair
        assert first.bytes_hashed == second.bytes_hashed == 0
        assert second.cached == 0 and second.bytes_sent == total


def test_old_client_hello_bytes_and_replies_it_can_read():
    with Server(max_memory=1 << 30) as s:
        sock = socket.create_connection(s.address, timeout=10)
        sock.sendall(OLD_HELLO)
        dec = Decoder(our_role="client", minor=OLD)

        def recv():
            while (ev := dec.next_event()) is NEED_DATA:
                dec.feed(sock.recv(65536))
            return ev

        reply = recv()
        # the server answers in its own (longer) layout; an old reader takes the head and skips the rest
        assert reply.minor == NEW and reply.max_memory == 1 << 30
        assert not reply.has(P.Capability.CACHE)
        sock.sendall(send(Barrier(), minor=OLD))
        raw = b""
        while len(raw) < 8 + BarrierReply.LAYOUT.size:
            raw += sock.recv(65536)
        # negotiated down to the old minor: no need list on the wire
        assert raw == P.PREFIX.pack(P.Command.BARRIER_REPLY, 16) + BarrierReply.LAYOUT.pack(0, 0, 0)
        sock.close()


class _FakeOldServer:
    """Accepts one connection, records the client's HELLO, answers with the pinned old HELLO."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        self.client_hello = b""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            data = b""
            while len(data) < 8 or len(data) < 8 + struct.unpack_from("<I", data, 4)[0]:
                data += conn.recv(65536)
            self.client_hello = data
            conn.sendall(OLD_HELLO)
            while conn.recv(65536):  # until the client says BYE and closes
                pass
        self.sock.close()


def test_new_client_against_pinned_old_server_hello():
    fake = _FakeOldServer()
    with Client(fake.address) as c:
        hello = c.server_hello
        assert hello == Hello(1, 0, 1, 1 << 20, 1 << 30, bytes(range(32)), max_memory=0)  # absent -> default
        assert not c.connections[0].cache  # the flag alone does not make an old server able to serve HAVE
        assert c.connections[0].max_frame == 1 << 20
    fake.thread.join(10)
    raw = fake.client_hello
    assert raw[:8] == P.PREFIX.pack(P.Command.HELLO, P.HELLO_LAYOUT.size)
    major, minor = struct.unpack_from("<HH", raw, 8)
    assert (major, minor) == (1, NEW)


def test_newer_minor_client_is_served_at_our_minor():
    with Server() as s:
        sock = socket.create_connection(s.address, timeout=10)
        body = P.HELLO_LAYOUT.pack(1, NEW + 5, 0, 0, 0, bytes(32), 0) + b"fields of the future"
        sock.sendall(P.PREFIX.pack(P.Command.HELLO, len(body)) + body + send(Barrier()))
        dec = Decoder(our_role="client")
        events = []
        while len(events) < 2:
            dec.feed(sock.recv(65536))
            while (ev := dec.next_event()) is not NEED_DATA:
                events.append(ev)
        assert events[0].minor == NEW
        assert events[1] == BarrierReply(0, 0)
        sock.close()
