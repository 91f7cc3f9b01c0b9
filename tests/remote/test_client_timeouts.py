"""A hostile or stalled server cannot hang the client or make it grow without bound: fake servers
on 127.0.0.1 that stop answering, stop reading, or answer LIST with "more" forever."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import numpy as np
import pytest

from tests.checkpoints import write
from weightlift.errors import RemoteProtocolError, TransportError
from weightlift.remote.client import client as client_module
from weightlift.remote.client.client import Client
from weightlift.remote.protocol import (
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    Decoder,
    Hello,
    ListEntry,
    ListReply,
    ListRequest,
    send,
)


def _next(conn: socket.socket, dec: Decoder):
    from weightlift.remote.protocol import NEED_DATA

    while True:
        ev = dec.next_event()
        if ev is not NEED_DATA:
            return ev
        data = conn.recv(65536)
        if not data:
            return None
        dec.feed(data)


class FakeServer:
    """Accepts one client, answers its HELLO, then runs ``behave(conn, decoder)``."""

    def __init__(self, behave: Callable[[socket.socket, Decoder], None]):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.behave = behave
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            dec = Decoder(our_role="server", minor=PROTOCOL_MINOR)
            _next(conn, dec)  # the client's HELLO
            conn.sendall(send(Hello(PROTOCOL_MAJOR, PROTOCOL_MINOR)))
            try:
                self.behave(conn, dec)
            except OSError:
                pass
            self.stop.wait()  # hold the connection open, silent, until the test ends

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()


@pytest.fixture
def fake():
    servers: list[FakeServer] = []

    def start(behave: Callable[[socket.socket, Decoder], None]) -> FakeServer:
        servers.append(FakeServer(behave))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_a_server_that_never_replies_times_out(fake):
    s = fake(lambda conn, dec: None)
    with Client(s.address, timeout=0.3) as c:
        with pytest.raises(TransportError, match="timed out"):
            c.list()


def test_a_server_that_stops_reading_times_out_the_push(fake, tmp_path):
    s = fake(lambda conn, dec: None)  # reads nothing after HELLO: the socket buffers fill
    raw = np.zeros(48 << 20, dtype=np.uint8).tobytes()
    path = write(tmp_path / "m.safetensors", [("w", "U8", (len(raw),), raw)])
    c = Client(s.address, timeout=0.3)
    try:
        with pytest.raises(TransportError, match="timed out"):
            c.push(path)
    finally:
        c.close()


def _list_forever(distinct: bool) -> Callable[[socket.socket, Decoder], None]:
    def behave(conn: socket.socket, dec: Decoder) -> None:
        i = 0
        while True:
            msg = _next(conn, dec)
            if not isinstance(msg, ListRequest):
                return
            names = [f"t{i + k:09d}" if distinct else "t" for k in range(100)]
            i += 100
            conn.sendall(send(ListReply(tuple(ListEntry(n, "U8", (1,), 1) for n in names), more=True)))

    return behave


def test_list_with_more_forever_is_capped(fake, monkeypatch):
    monkeypatch.setattr(client_module, "MAX_LIST_ENTRIES", 1000)
    s = fake(_list_forever(distinct=True))
    with Client(s.address, timeout=5) as c:
        with pytest.raises(RemoteProtocolError, match="more than 1000 tensors"):
            c.list()


def test_list_that_does_not_advance_is_refused(fake):
    s = fake(_list_forever(distinct=False))
    with Client(s.address, timeout=5) as c:
        with pytest.raises(RemoteProtocolError, match="out of order"):
            c.list()
