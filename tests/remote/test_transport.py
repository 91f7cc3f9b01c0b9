"""The socket stream: scatter-gather sends, sendfile, recv_into, and error mapping (loopback only)."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from weightlift.errors import OptionError, TransportError
from weightlift.remote import transport
from weightlift.remote.transport import SocketListener as Listener
from weightlift.remote.transport import SocketStream, connect, parse_address


@pytest.fixture
def pair():
    lst = Listener("127.0.0.1", 0)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("s", lst.accept(timeout=10)))
    t.start()
    client = connect(lst.address)
    t.join()
    server = box["s"]
    lst.close()
    yield client, server
    client.close()
    server.close()


def _drain(stream: SocketStream, n: int, out: bytearray) -> threading.Thread:
    def run() -> None:
        buf = memoryview(bytearray(n))
        stream.recv_exactly(buf)
        out[:] = buf

    t = threading.Thread(target=run)
    t.start()
    return t


def test_send_parts_in_order_across_partial_sends(pair):
    client, server = pair
    # Many small buffers (more than one sendmsg may carry) and large ones (several partial sends).
    parts = [bytes([i % 251]) * (i % 7 + 1) for i in range(1500)]
    parts += [os.urandom(3 << 20), bytearray(os.urandom(5 << 20)), memoryview(os.urandom(1 << 20))[17:]]
    parts.insert(3, b"")
    expected = b"".join(bytes(p) for p in parts)
    got = bytearray()
    t = _drain(server, len(expected), got)
    client.send_parts(parts)
    t.join()
    assert got == expected


def test_send_parts_takes_non_byte_views(pair):
    import numpy as np

    client, server = pair
    arr = np.arange(1000, dtype=np.float32)
    got = bytearray()
    t = _drain(server, 4 + arr.nbytes, got)
    client.send_parts([b"head", memoryview(arr)])
    t.join()
    assert bytes(got) == b"head" + arr.tobytes()


def test_sendfile_sends_exactly_the_range(pair, tmp_path):
    client, server = pair
    data = os.urandom(3 << 20)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    got = bytearray()
    t = _drain(server, (2 << 20) + 5, got)
    with open(path, "rb") as f:
        client.sendfile(f.fileno(), 12345, 2 << 20)
        client.send_parts([b"after"])
    t.join()
    assert bytes(got) == data[12345 : 12345 + (2 << 20)] + b"after"


def test_sendfile_past_the_end_of_the_file(pair, tmp_path):
    client, _ = pair
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 100)
    with open(path, "rb") as f, pytest.raises(TransportError, match="file ended"):
        client.sendfile(f.fileno(), 50, 100)


def test_sendfile_fallback_by_reads(pair, tmp_path, monkeypatch):
    client, server = pair
    data = os.urandom(100_000)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    monkeypatch.delattr(transport.os, "sendfile")
    got = bytearray()
    t = _drain(server, 90_000, got)
    with open(path, "rb") as f:
        client.sendfile(f.fileno(), 10_000, 90_000)
    t.join()
    assert bytes(got) == data[10_000:]


def test_recv_into_returns_zero_at_eof_and_recv_exactly_raises(pair):
    client, server = pair
    client.send_parts([b"abc"])
    client.close()
    buf = memoryview(bytearray(10))
    with pytest.raises(TransportError, match="7 bytes early"):
        server.recv_exactly(buf)
    assert server.recv_into(buf) == 0


def test_send_to_a_closed_peer_is_a_transport_error(pair):
    client, server = pair
    server.close()
    with pytest.raises(TransportError):
        for _ in range(100):  # the first sends may still land in the kernel buffer
            client.send_parts([bytes(1 << 20)])


def test_shutdown_wakes_a_blocked_receiver(pair):
    client, server = pair
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("n", server.recv_into(memoryview(bytearray(4)))))
    t.start()
    server.shutdown()
    t.join(10)
    assert not t.is_alive() and box["n"] == 0


def test_sockets_are_tuned(pair):
    client, server = pair
    for s in (client, server):
        assert s._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert s._sock.gettimeout() is None


def test_connect_refused_is_a_transport_error():
    lst = Listener("127.0.0.1", 0)
    addr = lst.address
    lst.close()
    with pytest.raises(TransportError, match="cannot connect"):
        connect(addr, timeout=5)


def test_listener_accept_times_out_with_none():
    lst = Listener("127.0.0.1", 0)
    try:
        assert lst.accept(timeout=0.01) is None
    finally:
        lst.close()


def test_listen_on_a_taken_port_is_a_transport_error():
    lst = Listener("127.0.0.1", 0)
    try:
        with pytest.raises(TransportError, match="cannot listen"):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen()
            try:
                Listener("127.0.0.1", s.getsockname()[1])
            finally:
                s.close()
    finally:
        lst.close()


@pytest.mark.parametrize(
    "text,expected",
    [
        ("127.0.0.1:80", ("127.0.0.1", 80)),
        ("host.example:65535", ("host.example", 65535)),
        ("[::1]:9000", ("::1", 9000)),
        (("10.0.0.1", 1), ("10.0.0.1", 1)),
    ],
)
def test_parse_address(text, expected):
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["nohost", ":80", "h:port", "h:70000", ("h",), ("h", -1)])
def test_parse_address_rejects(text):
    with pytest.raises(OptionError):
        parse_address(text)


def test_client_and_server_take_a_backend():
    """The client and the server reach the network only through the backend they are given."""
    from weightlift.remote.client import Client
    from weightlift.remote.server import Server
    from weightlift.remote.transport import TCP

    calls = []

    class Recording:
        def connect(self, address, *, timeout=30.0):
            calls.append("connect")
            return TCP.connect(address, timeout=timeout)

        def listen(self, host, port, *, backlog=64):
            calls.append("listen")
            return TCP.listen(host, port, backlog=backlog)

    with Server(port=0, backend=Recording()) as s:
        s.start()
        with Client(s.address, backend=Recording(), streams=2) as c:
            assert c.list() == []
    assert calls == ["listen", "connect"]  # further streams connect at the first push
