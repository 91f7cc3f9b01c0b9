"""A hostile or stalled server cannot hang the client, make it grow or resend without bound, or
write to its terminal: fake servers on 127.0.0.1 that stop answering, stop reading, trickle
their replies, answer LIST with "more" forever, ask for one tensor again and again, or send
terminal escapes in their error text."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.checkpoints import write
from weightlift import cli
from weightlift.errors import FormatError, RemoteProtocolError, TransportError
from weightlift.formats.safetensors import MAX_HEADER_SIZE
from weightlift.remote.client import MAX_LIST_BYTES
from weightlift.remote.client import pull as pull_module
from weightlift.remote.client.client import Client
from weightlift.remote.protocol import (
    MAX_FRAME,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    Alloc,
    Barrier,
    BarrierReply,
    Capability,
    Commit,
    CommitReply,
    Decoder,
    Error,
    ErrorCode,
    FillFromCache,
    Have,
    HaveReply,
    Hello,
    ListEntry,
    ListReply,
    ListRequest,
    Payload,
    Read,
    ReadReply,
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


def trickle(conn: socket.socket, data: bytes, gap: float) -> None:
    """Send ``data`` one byte at a time, ``gap`` seconds apart: each receive gets a byte in time."""
    for i in range(len(data)):
        conn.sendall(data[i : i + 1])
        time.sleep(gap)


class FakeServer:
    """Accepts one client, answers its HELLO (with ``flags``; trickled ``gap`` seconds a byte when
    given), then runs ``behave(conn, decoder)``."""

    def __init__(
        self, behave: Callable[[socket.socket, Decoder], None], *, flags: int = 0, hello_gap: float | None = None
    ):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.behave = behave
        self.flags = flags
        self.hello_gap = hello_gap
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            dec = Decoder(our_role="server", minor=PROTOCOL_MINOR)
            _next(conn, dec)  # the client's HELLO
            try:
                hello = send(Hello(PROTOCOL_MAJOR, PROTOCOL_MINOR, self.flags))
                if self.hello_gap is None:
                    conn.sendall(hello)
                else:
                    trickle(conn, hello, self.hello_gap)
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

    def start(behave: Callable[[socket.socket, Decoder], None], **kw: Any) -> FakeServer:
        servers.append(FakeServer(behave, **kw))
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
    monkeypatch.setattr(pull_module, "MAX_LIST_ENTRIES", 1000)
    s = fake(_list_forever(distinct=True))
    with Client(s.address, timeout=5) as c:
        with pytest.raises(RemoteProtocolError, match="more than 1000 tensors"):
            c.list()


def test_list_that_does_not_advance_is_refused(fake):
    s = fake(_list_forever(distinct=False))
    with Client(s.address, timeout=5) as c:
        with pytest.raises(RemoteProtocolError, match="out of order"):
            c.list()


def _pages(entries: list[ListEntry]) -> list[ListReply]:
    """``entries`` as LIST_REPLY pages that each fit one frame."""
    pages: list[ListReply] = []
    page: list[ListEntry] = []
    size = 64
    for e in entries:
        cost = 32 + len(e.name.encode())
        if page and size + cost > MAX_FRAME:
            pages.append(ListReply(tuple(page), more=True))
            page, size = [], 64
        page.append(e)
        size += cost
    pages.append(ListReply(tuple(page), more=False))
    return pages


def _serve_listing(entries: list[ListEntry]) -> Callable[[socket.socket, Decoder], None]:
    """Answer LIST page by page with ``entries``, and READ with their (empty or zero) bytes."""
    pages = iter(_pages(entries))

    def behave(conn: socket.socket, dec: Decoder) -> None:
        while (msg := _next(conn, dec)) is not None:
            if isinstance(msg, ListRequest):
                conn.sendall(send(next(pages)))
            elif isinstance(msg, Read):
                conn.sendall(send(ReadReply(msg.length)) + bytes(msg.length))

    return behave


def test_list_bounds_the_bytes_of_a_listing(fake):
    # few entries, long names: far under the entry cap, over the byte bound
    name = 4000
    count = MAX_LIST_BYTES // name + 100
    s = fake(_serve_listing([ListEntry(f"{i:012d}" + "x" * (name - 12), "U8", (0,), 0) for i in range(count)]))
    with Client(s.address, timeout=30) as c:
        with pytest.raises(RemoteProtocolError, match=f"more than {MAX_LIST_BYTES} bytes"):
            c.list()


# ----- a reply is held to one deadline, however its bytes are spaced --------------------------


def test_a_trickled_hello_runs_into_the_deadline(fake):
    s = fake(lambda conn, dec: None, hello_gap=0.06)  # every receive gets a byte well inside 0.5 s
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="in time"):
        Client(s.address, timeout=0.5)
    assert time.monotonic() - t0 < 3


def test_a_trickled_reply_runs_into_the_deadline(fake):
    def behave(conn: socket.socket, dec: Decoder) -> None:
        _next(conn, dec)
        trickle(conn, send(ListReply((ListEntry("w", "U8", (1,), 1, 1),))), 0.1)

    s = fake(behave)
    with Client(s.address, timeout=0.5) as c:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="in time"):
            c.list()
        assert time.monotonic() - t0 < 3


def test_a_trickled_payload_runs_into_the_deadline(fake, tmp_path):
    def behave(conn: socket.socket, dec: Decoder) -> None:
        _next(conn, dec)
        conn.sendall(send(ListReply((ListEntry("w", "U8", (64,), 64, 1),))))
        _next(conn, dec)
        conn.sendall(send(ReadReply(64)))
        trickle(conn, bytes(64), 0.1)

    s = fake(behave)
    out = tmp_path / "out.safetensors"
    with Client(s.address, timeout=0.5) as c:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="in time"):
            c.pull(out)
        assert time.monotonic() - t0 < 3
    assert os.listdir(tmp_path) == []


# ----- a BARRIER reply's need list cannot make the client send more than it pushed -----------

SIZE = 1 << 20


def _asks_again(*, have: bool, repeat: int, seen: dict[str, int]) -> Callable[[socket.socket, Decoder], None]:
    """A caching server that answers HAVE with ``have``, then lists one tensor ``repeat`` times in
    the first BARRIER reply's need list: the one it filled from its cache, else the first sent.
    It counts the payload bytes sent after that reply and hangs up past twice the tensor."""

    def behave(conn: socket.socket, dec: Decoder) -> None:
        filled: list[int] = []
        allocated: list[int] = []
        barriers = 0
        seen["again"] = 0
        while (msg := _next(conn, dec)) is not None:
            if isinstance(msg, Have):
                conn.sendall(send(HaveReply((have,) * len(msg.digests))))
            elif isinstance(msg, Alloc):
                allocated.append(msg.tensor_id)
            elif isinstance(msg, FillFromCache):
                filled.append(msg.tensor_id)
            elif isinstance(msg, Payload) and barriers:
                seen["again"] += len(msg.data)
                if seen["again"] > 2 * SIZE:
                    conn.shutdown(socket.SHUT_RDWR)
                    return
            elif isinstance(msg, Barrier):
                barriers += 1
                need = ((filled or allocated)[0],) * repeat if barriers == 1 else ()
                conn.sendall(send(BarrierReply(1, SIZE, (), need)))

    return behave


@pytest.fixture
def one_tensor(tmp_path):
    raw = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    return write(tmp_path / "m.safetensors", [("w", "U8", (SIZE,), raw)])


def _need_list_refused(fake, path, *, have: bool, repeat: int, match: str) -> None:
    """A push to a server whose need list repeats (``_asks_again``) fails with ``match`` before a
    byte is sent again."""
    seen: dict[str, int] = {}
    s = fake(_asks_again(have=have, repeat=repeat, seen=seen), flags=Capability.CACHE)
    with Client(s.address, timeout=10) as c:
        with pytest.raises(RemoteProtocolError, match=match):
            c.push(path, hash_threshold=1)
    assert seen["again"] == 0


def test_a_need_list_repeating_one_id_is_refused_not_resent(fake, one_tensor):
    _need_list_refused(fake, one_tensor, have=True, repeat=65536, match="asks for tensor id 0 65536 times")


def test_a_need_list_naming_a_tensor_sent_whole_is_refused(fake, one_tensor):
    # only a FILL_FROM_CACHE can fail for want of a cache entry: the bytes of a WRITE are there
    _need_list_refused(fake, one_tensor, have=False, repeat=1, match="not asked to fill from its cache")


# ----- a server's text reaches the terminal escaped ------------------------------------------

EVIL = "\x1b[2J\x1b[Hpulled 7 tensors, every tensor verified\n\rweightlift: OK\x07"


def _one_line_escaped(err: str) -> None:
    assert not any(c in err for c in "\x1b\r\x07"), repr(err)
    assert err.count("\n") == 1 and err.endswith("\n"), repr(err)
    assert "\\x1b[2J" in err and "\\n" in err


def test_the_cli_escapes_a_server_error(fake, capsys):
    def behave(conn: socket.socket, dec: Decoder) -> None:
        _next(conn, dec)
        conn.sendall(send(Error(ErrorCode.INTERNAL, EVIL)))

    s = fake(behave)
    assert cli.main(["ls", "--from", s.address]) == 2
    _one_line_escaped(capsys.readouterr().err)


def test_the_cli_escapes_the_errors_of_a_barrier_reply(fake, capsys, one_tensor):
    def behave(conn: socket.socket, dec: Decoder) -> None:
        while (msg := _next(conn, dec)) is not None:
            if isinstance(msg, Barrier):
                conn.sendall(send(BarrierReply(0, 0, (EVIL,))))
            elif isinstance(msg, Commit):  # the push's unit, aborted after the refusal
                conn.sendall(send(CommitReply(False, 0, 0, bytes(32), "aborted")))

    s = fake(behave)
    assert cli.main(["push", str(one_tensor), "--to", s.address]) == 2
    _one_line_escaped(capsys.readouterr().err)


# ----- a pull writes only files that load ---------------------------------------------------


def test_pull_refuses_a_listing_whose_header_no_loader_opens(fake, tmp_path):
    # a name of control characters is written \u00XX in the JSON header: six bytes for one, so a
    # listing of a few thousand long names makes a header over the limit both loaders share
    name = 4096 - 8
    count = MAX_HEADER_SIZE // (6 * name) + 10
    entries = [ListEntry(f"{i:08d}" + "\x01" * name, "U8", (0,), 0, 1) for i in range(count)]
    s = fake(_serve_listing(entries))
    out = tmp_path / "out" / "pulled.safetensors"
    out.parent.mkdir()
    with Client(s.address, timeout=30) as c:
        with pytest.raises(FormatError, match=f"header .* exceeds the limit of {MAX_HEADER_SIZE} bytes"):
            c.pull(out)
    assert os.listdir(out.parent) == []
