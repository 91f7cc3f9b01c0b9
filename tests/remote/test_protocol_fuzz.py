"""Property-based fuzzing of the frame decoder and of the server's dispatch, run in process.

A short bounded run in CI (hypothesis, derandomized so a failure reproduces); long runs go to
bench/fuzz_protocol.py under atheris. The properties:

- the decoder, fed any bytes in any fragmentation, in either role, yields messages and payload
  or raises RemoteProtocolError, and never asks for more than the current frame holds;
- a valid stream with bytes flipped, dropped or inserted decodes to messages whose re-encoding
  is a well-formed frame, or fails with RemoteProtocolError;
- a live server fed any sequence of well-formed but arbitrary requests (lying sizes, unknown
  names, reads past the end, payloads cut short, digests it never saw) answers or closes the
  connection, and afterwards holds exactly what completed, charges nothing else against its
  memory limit, and still serves a well-behaved client byte for byte.
"""

from __future__ import annotations

import logging
import socket
import threading

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import weightlift.remote.protocol as P  # noqa: E402
from tests.waiting import wait_for  # noqa: E402
from weightlift.errors import RemoteProtocolError  # noqa: E402
from weightlift.remote.client.client import Client  # noqa: E402
from weightlift.remote.protocol import (  # noqa: E402
    NEED_DATA,
    Alloc,
    Barrier,
    Decoder,
    FillFromCache,
    Free,
    Have,
    Hello,
    ListRequest,
    Payload,
    Read,
    WriteHeader,
    send,
)
from weightlift.remote.server.server import Server  # noqa: E402

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _drain(dec: Decoder, chunks: list[bytes]) -> list:
    events = []
    for c in chunks:
        dec.feed(c)
        while True:
            assert dec.bytes_wanted() >= 0
            ev = dec.next_event()
            if ev is NEED_DATA:
                break
            assert isinstance(ev, (P.Message, Payload))
            events.append(ev)
    return events


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:], strict=False)]


@FUZZ
@given(st.binary(max_size=2048), st.lists(st.integers(0, 4096), max_size=8), st.sampled_from(["server", "client"]))
def test_decoder_takes_any_bytes_in_any_fragmentation(data, cuts, role):
    dec = Decoder(our_role=role)
    try:
        _drain(dec, _split(data, cuts))
    except RemoteProtocolError:
        pass


_VALID = [
    Hello(1, P.PROTOCOL_MINOR, nonce=bytes(range(P.NONCE_SIZE))),
    Alloc(1, "layer.0.weight", "F32", (2, 4), 32),
    WriteHeader(1, 0, 32),
    Alloc(2, "layer.1.weight", "BF16", (16,), 32, bytes(32)),
    FillFromCache(2, bytes(32)),
    Have((bytes(32), bytes(range(32)))),
    Read("layer.0.weight", 8, 8),
    ListRequest("a"),
    Free(("layer.0.weight",)),
    Barrier(),
    P.UseModel("llama-a"),
    P.Update(P.Update.FLAG_JOIN, 7),
    P.Commit(P.Commit.FLAG_NO_ROOT),
    P.Stats(),
    P.Remove("llama-a"),
]


def _valid_stream() -> bytes:
    out = b""
    for m in _VALID:
        out += send(m)
        if isinstance(m, WriteHeader):
            out += bytes(range(m.length))
    return out


@FUZZ
@given(
    st.lists(
        st.tuples(st.sampled_from(["flip", "drop", "insert"]), st.integers(0, 10_000), st.integers(0, 255)),
        min_size=1,
        max_size=6,
    ),
    st.lists(st.integers(0, 4096), max_size=6),
)
def test_decoder_on_a_mutated_valid_stream(edits, cuts):
    data = bytearray(_valid_stream())
    for op, pos, val in edits:
        pos %= len(data) + (op == "insert")
        if op == "flip" and data:
            data[pos % len(data)] ^= val or 1
        elif op == "drop" and data:
            del data[pos % len(data)]
        elif op == "insert":
            data.insert(pos, val)
    dec = Decoder(our_role="server")
    try:
        events = _drain(dec, _split(bytes(data), cuts))
    except RemoteProtocolError:
        return
    for ev in events:
        if isinstance(ev, P.Message) and not isinstance(ev, Hello):  # HELLO's layout follows its version
            frame = send(ev)  # whatever was accepted is a message that encodes again
            again = Decoder(our_role="server")
            again.feed(frame)
            assert again.next_event() == ev


# -- the server's dispatch -----------------------------------------------------------------------

_NAMES = st.sampled_from(["a", "b", "layer.0.weight", "x" * 300, "", "é", "__metadata__"])
_DIGESTS = st.sampled_from([bytes(32), bytes(range(32)), b"\xff" * 32])
_SHAPES = st.lists(st.integers(0, 64), min_size=0, max_size=3).map(tuple)


def _alloc() -> st.SearchStrategy:
    return st.builds(
        Alloc,
        st.integers(0, 6),
        _NAMES,
        st.sampled_from(["F32", "BF16", "U8", "I64"]),
        _SHAPES,
        st.integers(0, 1 << 16),
        st.one_of(st.none(), _DIGESTS),
    )


def _put(tid: int, name: str, n: int, cut: int, digest: bytes | None) -> list:
    """A tensor allocated and written whole (or cut short by ``cut`` bytes): the requests that
    make the server hold memory, so the fuzz reaches its accounting and not only its refusals."""
    return [Alloc(tid, name, "U8", (n,), n, digest), (tid, 0, n, n - min(cut, n))]


_REQUEST = st.one_of(
    st.builds(
        _put,
        st.integers(0, 6),
        _NAMES,
        st.integers(0, 1 << 15),
        st.sampled_from([0, 0, 0, 1, 100]),
        st.one_of(st.none(), st.none(), _DIGESTS),
    ),
    _alloc(),
    st.tuples(st.integers(0, 6), st.integers(0, 1 << 16), st.integers(0, 4096), st.integers(0, 4096)),  # a write
    st.builds(Read, _NAMES, st.integers(0, 1 << 16), st.integers(0, 1 << 16)),
    st.builds(Free, st.lists(_NAMES, max_size=3).map(tuple)),
    st.builds(Have, st.lists(_DIGESTS, max_size=3).map(tuple)),
    st.builds(FillFromCache, st.integers(0, 6), _DIGESTS),
    st.builds(ListRequest, _NAMES),
    st.just(Barrier()),
)


class _Errors(logging.Handler):
    """Collects what the server logs at ERROR: an exception outside the protocol's error tree."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    errors = _Errors()
    log = logging.getLogger("weightlift.remote.server")
    log.addHandler(errors)
    s = Server(max_memory=8 << 20, cache_dir=str(tmp_path_factory.mktemp("fuzz-cache")))
    s.start()
    s.fuzz_errors = errors.records  # type: ignore[attr-defined]
    yield s
    s.close()
    log.removeHandler(errors)


def _session(address, requests) -> None:
    """HELLO, then the requests as frames (a write's payload as long as it claims, or cut short),
    then half-close: the server reads EOF wherever it stands and must clean up after itself."""
    sock = socket.create_connection(address, timeout=10)
    try:
        out = bytearray(send(Hello(1, P.PROTOCOL_MINOR, nonce=bytes(P.NONCE_SIZE))))
        flat = [x for r in requests for x in (r if isinstance(r, list) else [r])]
        for r in flat:
            if isinstance(r, tuple):
                tid, offset, length, sent = r
                out += send(WriteHeader(tid, offset, length)) + bytes(min(length, sent))
            else:
                out += send(r)
        try:
            sock.sendall(out)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass
        except OSError:
            pass  # the server may close first, on a request it refuses
    finally:
        sock.close()


@FUZZ
@given(st.lists(_REQUEST, min_size=1, max_size=12))
def test_server_dispatch_survives_arbitrary_requests(fuzz_server, requests):
    _session(fuzz_server.address, requests)


def test_server_after_fuzzing_charges_only_what_it_holds(fuzz_server, tmp_path):
    """Run after the fuzz above (same module server): every connection gone, what is charged is
    exactly what it holds, freeing it returns the charge to zero, and a real push still works."""
    crashes = [r.getMessage() + (f" ({r.exc_info[1]!r})" if r.exc_info else "") for r in fuzz_server.fuzz_errors]
    assert crashes == []  # every request was answered or refused, none failed inside the server
    threads_before = threading.active_count()
    with Client(fuzz_server.address) as c:
        names = [e.name for e in c.list()]
        if names:
            c.free(names)
    wait_for(lambda: fuzz_server.memory_used == 0)  # nothing charged beyond what it held
    from tests.checkpoints import write

    rng = np.random.default_rng(3)
    raw = {f"t{i}": rng.integers(0, 256, 4096 * (i + 1), dtype=np.uint8).tobytes() for i in range(3)}
    path = write(tmp_path / "m.safetensors", [(n, "U8", (len(b),), b) for n, b in raw.items()])
    with Client(fuzz_server.address) as c:
        c.push(str(path))
    got = fuzz_server.tensors()
    assert {n: np.asarray(got[n]).tobytes() for n in raw} == raw
    wait_for(lambda: threading.active_count() <= threads_before)  # the connections' threads are gone
