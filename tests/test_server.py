"""The tensor server over real loopback sockets, driven by raw frames where the client would not misbehave."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

import weightlift.protocol as P
from weightlift.digests import hash_buffer
from weightlift.errors import OptionError
from weightlift.protocol import (
    NEED_DATA,
    Alloc,
    Auth,
    Barrier,
    BarrierReply,
    Bye,
    Capability,
    Decoder,
    Error,
    ErrorCode,
    Free,
    FreeReply,
    Have,
    HaveReply,
    Hello,
    ListReply,
    ListRequest,
    Read,
    ReadReply,
    WriteHeader,
    send,
)
from weightlift.server import Server, is_loopback


class Raw:
    """A hand-driven client: sends exactly the frames a test writes, reads replies."""

    def __init__(self, address, *, minor: int = P.PROTOCOL_MINOR):
        self.sock = socket.create_connection(address, timeout=10)
        self.dec = Decoder(our_role="client")
        self.minor = minor

    def hello(self, *, token: bytes | None = None) -> Hello:
        nonce = P.new_nonce()
        self.send(Hello(1, self.minor, nonce=nonce))
        reply = self.recv()
        if token is not None:
            self.send(Auth(P.client_mac(token, nonce, reply.nonce)))
            assert isinstance(self.recv(), Auth)
        return reply

    def send(self, msg, payload: bytes = b"") -> None:
        self.sock.sendall(send(msg, minor=self.minor) + payload)

    def recv(self):
        while True:
            ev = self.dec.next_event()
            if ev is not NEED_DATA:
                return ev
            data = self.sock.recv(65536)
            if not data:
                return None
            self.dec.feed(data)

    def read_payload(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            ev = self.dec.next_event()
            if ev is NEED_DATA:
                self.dec.feed(self.sock.recv(65536))
            else:
                out += ev.data
        return out

    def closed(self) -> bool:
        """True once the server has closed its end (reads EOF)."""
        try:
            return self.sock.recv(1) == b""
        except OSError:
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def server():
    with Server() as s:
        yield s


def _f32(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def _put(raw: Raw, tid: int, name: str, arr: np.ndarray, *, digest: bytes | None = None) -> None:
    raw.send(Alloc(tid, name, "F32", arr.shape, arr.nbytes, digest))
    raw.send(WriteHeader(tid, 0, arr.nbytes), arr.tobytes())


def _barrier(raw: Raw) -> BarrierReply:
    raw.send(Barrier())
    reply = raw.recv()
    assert isinstance(reply, BarrierReply), reply
    return reply


def test_raw_push_becomes_visible_and_reports_at_barrier(server):
    raw = Raw(server.address)
    hello = raw.hello()
    assert hello.major == 1 and hello.minor == P.PROTOCOL_MINOR
    assert not hello.has(Capability.CACHE) and not hello.has(Capability.AUTH)
    a = _f32(1000)
    _put(raw, 0, "w", a)
    raw.send(Alloc(1, "empty", "I8", (0, 4), 0))
    assert _barrier(raw) == BarrierReply(2, a.nbytes)
    got = server.tensors()
    assert np.array_equal(got["w"], a) and got["w"].dtype == np.float32
    assert got["empty"].shape == (0, 4)
    assert server.memory_used == a.nbytes
    raw.send(Bye())
    assert raw.closed()


def test_tensor_invisible_until_every_byte_arrived(server):
    raw = Raw(server.address)
    raw.hello()
    a = _f32(4096, 1)
    data = a.tobytes()
    raw.send(Alloc(0, "w", "F32", a.shape, a.nbytes))
    raw.send(WriteHeader(0, 8192, 8192), data[8192:])  # out of order, and in pieces
    raw.send(WriteHeader(0, 0, 100), data[:100])
    _barrier(raw)
    assert "w" not in server.tensors()
    raw.send(WriteHeader(0, 100, 8092), data[100:8192])
    assert _barrier(raw) == BarrierReply(1, 8092)
    assert server.tensors()["w"].tobytes() == data


def test_client_killed_mid_tensor_leaves_nothing_and_server_keeps_serving(server):
    a = _f32(100_000, 2)
    raw = Raw(server.address)
    raw.hello()
    raw.send(Alloc(0, "half", "F32", a.shape, a.nbytes))
    raw.sock.sendall(send(WriteHeader(0, 0, a.nbytes)) + a.tobytes()[: a.nbytes // 2])
    raw.close()
    deadline = time.monotonic() + 10
    while server.memory_used and time.monotonic() < deadline:  # the server notices the close
        time.sleep(0.01)
    assert server.memory_used == 0
    assert server.tensors() == {}
    other = Raw(server.address)
    other.hello()
    _put(other, 0, "next", a)
    assert _barrier(other).tensors == 1
    assert list(server.tensors()) == ["next"]


def test_unknown_command_gets_error_then_close(server):
    raw = Raw(server.address)
    raw.hello()
    raw.sock.sendall(P.PREFIX.pack(0x55, 0))
    reply = raw.recv()
    assert isinstance(reply, Error) and reply.code == ErrorCode.PROTOCOL and "unknown command" in reply.message
    assert raw.closed()
    assert server.tensors() == {}
    ok = Raw(server.address)  # and it goes on serving
    ok.hello()
    assert _barrier(ok) == BarrierReply(0, 0)


def test_anything_before_hello_is_refused(server):
    raw = Raw(server.address)
    raw.send(Alloc(0, "w", "U8", (1,), 1))
    reply = raw.recv()
    assert isinstance(reply, Error) and "not allowed" in reply.message
    assert raw.closed()


def test_other_major_version_is_refused(server):
    raw = Raw(server.address)
    raw.send(Hello(2, 0, nonce=P.new_nonce()))
    reply = raw.recv()
    assert isinstance(reply, Error) and reply.code == ErrorCode.VERSION
    assert raw.closed()


def test_oversize_frame_rejected_without_reading_it(server):
    raw = Raw(server.address)
    raw.hello()
    raw.sock.sendall(P.PREFIX.pack(P.Command.HAVE, P.MAX_FRAME + 1))
    reply = raw.recv()
    assert isinstance(reply, Error) and "frame limit" in reply.message


def test_bad_requests_are_reported_at_the_barrier_and_the_connection_lives(server):
    raw = Raw(server.address)
    raw.hello()
    raw.send(WriteHeader(7, 0, 5), b"12345")  # never allocated: payload drained
    raw.send(Alloc(0, "w", "U8", (4,), 4))
    raw.send(WriteHeader(0, 2, 4), b"abcd")  # runs past the end
    raw.send(Alloc(0, "w2", "U8", (4,), 4))  # id in use
    raw.send(WriteHeader(0, 0, 4), b"wxyz")
    reply = _barrier(raw)
    assert reply.tensors == 1 and reply.nbytes == 4
    assert len(reply.errors) == 3
    assert "not allocated" in reply.errors[0]
    assert "[2, 6) runs past the 4 bytes of 'w'" in reply.errors[1]
    assert "already in flight" in reply.errors[2]
    assert server.tensors()["w"].tobytes() == b"wxyz"
    assert server.stats()["errors"] == 3
    assert _barrier(raw) == BarrierReply(0, 0)  # errors are reported once


def test_read_list_free(server):
    raw = Raw(server.address)
    raw.hello()
    arrays = {f"t{i:02d}": _f32(10 + i, i) for i in range(5)}
    for i, (n, a) in enumerate(arrays.items()):
        _put(raw, i, n, a)
    _barrier(raw)
    raw.send(ListRequest())
    page = raw.recv()
    assert isinstance(page, ListReply) and not page.more
    assert [(e.name, e.dtype, e.shape, e.nbytes) for e in page.entries] == [
        (n, "F32", a.shape, a.nbytes) for n, a in arrays.items()
    ]
    raw.send(ListRequest("t02"))
    assert [e.name for e in raw.recv().entries] == ["t03", "t04"]
    raw.send(Read("t03", 4, 20))
    assert raw.recv() == ReadReply(20)
    assert raw.read_payload(20) == arrays["t03"].tobytes()[4:24]
    raw.send(Read("nope", 0, 1))
    reply = raw.recv()
    assert isinstance(reply, Error) and reply.code == ErrorCode.NOT_FOUND
    raw.send(Read("t00", 0, 1000))
    assert raw.recv().code == ErrorCode.LIMIT  # past the end: refused, not clamped
    raw.send(Free(("t00", "t01", "nope")))
    assert raw.recv() == FreeReply(2)
    assert sorted(server.tensors()) == ["t02", "t03", "t04"]
    assert server.memory_used == sum(arrays[n].nbytes for n in ("t02", "t03", "t04"))


def test_list_is_paged_to_the_clients_frame_limit(server):
    raw = Raw(server.address)
    nonce = P.new_nonce()
    raw.send(Hello(1, 1, 0, 300, 0, nonce))  # this client takes frames of 300 bytes at most
    raw.recv()
    for i in range(40):
        raw.send(Alloc(i, f"tensor.{i:03d}", "U8", (0,), 0))
    _barrier(raw)
    names, after = [], ""
    while True:
        raw.send(ListRequest(after))
        page = raw.recv()
        names += [e.name for e in page.entries]
        if not page.more:
            break
        assert 0 < len(page.entries) < 40
        after = page.entries[-1].name
    assert names == [f"tensor.{i:03d}" for i in range(40)]


def test_same_name_replaces_and_frees_the_old(server):
    raw = Raw(server.address)
    raw.hello()
    _put(raw, 0, "w", _f32(100, 1))
    _put(raw, 1, "w", _f32(100, 2))
    _barrier(raw)
    assert np.array_equal(server.tensors()["w"], _f32(100, 2))
    assert server.memory_used == 400


def test_max_memory_enforced():
    with Server(max_memory=1000) as s:
        raw = Raw(s.address)
        assert raw.hello().max_memory == 1000
        _put(raw, 0, "a", _f32(200))  # 800 bytes
        raw.send(Alloc(1, "b", "F32", (100,), 400))  # 1200 > 1000
        raw.send(WriteHeader(1, 0, 400), bytes(400))  # drained, no second error
        raw.send(Alloc(2, "c", "F32", (50,), 200))
        raw.send(WriteHeader(2, 0, 200), bytes(200))
        reply = _barrier(raw)
        assert reply.tensors == 2
        assert len(reply.errors) == 1 and "memory limit" in reply.errors[0]
        assert sorted(s.tensors()) == ["a", "c"] and s.memory_used == 1000
        raw.send(Alloc(3, "big", "U8", (2000,), 2000))
        reply = raw.recv()  # over the largest tensor the server takes: a protocol error
        assert isinstance(reply, Error) and "limit" in reply.message


def test_token_required_before_anything():
    with Server(token="sesame") as s:
        raw = Raw(s.address)
        hello = raw.hello()
        assert hello.has(Capability.AUTH)
        raw.send(Alloc(0, "w", "U8", (4,), 4))
        reply = raw.recv()
        assert isinstance(reply, Error) and reply.code == ErrorCode.AUTH
        assert raw.closed()

        wrong = Raw(s.address)
        nonce = P.new_nonce()
        wrong.send(Hello(1, 1, nonce=nonce))
        srv_nonce = wrong.recv().nonce
        wrong.send(Auth(P.client_mac(b"guess", nonce, srv_nonce)))
        reply = wrong.recv()
        assert isinstance(reply, Error) and reply.code == ErrorCode.AUTH
        assert wrong.closed()

        good = Raw(s.address)
        good.hello(token=b"sesame")
        _put(good, 0, "w", _f32(4))
        assert _barrier(good).tensors == 1
        assert list(s.tensors()) == ["w"]


def test_binding_beyond_loopback_needs_token_or_insecure():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.8.9.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("myhost")
    with pytest.raises(OptionError, match="token"):
        Server("0.0.0.0", 0)
    with pytest.raises(OptionError, match="token"):
        Server("192.0.2.1", 0)
    Server("0.0.0.0", 0, token="t")  # made, never bound
    with pytest.warns(RuntimeWarning, match="without a token"):
        Server("0.0.0.0", 0, insecure=True)


def test_options_checked():
    with pytest.raises(OptionError):
        Server(port=70000)
    with pytest.raises(OptionError):
        Server(max_memory=-1)
    with pytest.raises(OptionError):
        Server(framework="jax")
    with pytest.raises(OptionError):
        Server(device="tpu")
    with pytest.raises(OptionError):
        Server(token="")
    s = Server()
    with pytest.raises(OptionError):
        s.address


def _cache_push(raw: Raw, a: np.ndarray, tid: int, name: str, digest: bytes) -> None:
    raw.send(Alloc(tid, name, "F32", a.shape, a.nbytes, digest))
    raw.send(WriteHeader(tid, 0, a.nbytes), a.tobytes())


def test_cache_is_filled_as_bytes_arrive_and_checks_the_digest(tmp_path):
    a = _f32(300_000, 3)  # 1.2 MB: several receive pieces
    d = hash_buffer(a)
    with Server(cache_dir=tmp_path / "c") as s:
        raw = Raw(s.address)
        assert raw.hello().has(Capability.CACHE)
        raw.send(Have((d,)))
        assert raw.recv() == HaveReply((False,))
        _cache_push(raw, a, 0, "w", d)
        assert _barrier(raw).tensors == 1
        raw.send(Have((d, bytes(32))))
        assert raw.recv() == HaveReply((True, False))
        entry = tmp_path / "c" / d.hex()[:2] / d.hex()
        assert entry.read_bytes() == a.tobytes()

        # the bytes that arrive are not the bytes the digest names: the tensor is refused
        b = _f32(1000, 4)
        _cache_push(raw, b, 1, "liar", hash_buffer(_f32(1000, 5)))
        reply = _barrier(raw)
        assert reply.tensors == 0 and "do not match the digest" in reply.errors[0]
        assert "liar" not in s.tensors()
        assert s.memory_used == a.nbytes


def test_fill_from_cache_and_a_corrupt_entry_is_asked_for_again(tmp_path):
    a = _f32(50_000, 6)
    d = hash_buffer(a)
    with Server(cache_dir=tmp_path / "c") as s:
        first = Raw(s.address)
        first.hello()
        _cache_push(first, a, 0, "w", d)
        _barrier(first)
        received = s.stats()["bytes_received"]

        second = Raw(s.address)
        second.hello()
        second.send(Alloc(0, "w.copy", "F32", a.shape, a.nbytes, d))
        second.send(P.FillFromCache(0, d))
        assert _barrier(second) == BarrierReply(1, 0)
        assert np.array_equal(s.tensors()["w.copy"], a)
        assert s.stats()["bytes_received"] == received and s.stats()["cache_hits"] == 1

        entry = tmp_path / "c" / d.hex()[:2] / d.hex()
        raw_bytes = bytearray(entry.read_bytes())
        raw_bytes[1000] ^= 0xFF
        entry.write_bytes(raw_bytes)
        second.send(Alloc(1, "w.again", "F32", a.shape, a.nbytes, d))
        second.send(P.FillFromCache(1, d))
        assert _barrier(second) == BarrierReply(0, 0, (), (1,))  # not filled: send it
        assert not entry.exists()  # the bad entry is gone
        assert "w.again" not in s.tensors()
        second.send(WriteHeader(1, 0, a.nbytes), a.tobytes())
        assert _barrier(second).tensors == 1
        assert np.array_equal(s.tensors()["w.again"], a)
        assert entry.read_bytes() == a.tobytes()  # and cached afresh


def test_torch_framework_gives_torch_tensors():
    torch = pytest.importorskip("torch")
    with Server(framework="torch") as s:
        raw = Raw(s.address)
        raw.hello()
        _put(raw, 0, "w", _f32(64, 7))
        raw.send(Alloc(1, "h", "BF16", (2, 2), 8))
        raw.send(WriteHeader(1, 0, 8), bytes(range(8)))
        _barrier(raw)
        got = s.tensors()
        assert isinstance(got["w"], torch.Tensor) and torch.equal(got["w"], torch.from_numpy(_f32(64, 7)))
        assert got["h"].dtype == torch.bfloat16 and got["h"].view(torch.uint8).flatten().tolist() == list(range(8))
        raw.send(Read("h", 0, 8))
        assert raw.recv() == ReadReply(8) and raw.read_payload(8) == bytes(range(8))


def test_naive_arm_receives_the_same_bytes(monkeypatch):
    monkeypatch.setenv("WEIGHTLIFT_LOAD_OPT", "0")
    with Server() as s:
        raw = Raw(s.address)
        raw.hello()
        a = _f32(10_000, 8)
        _put(raw, 0, "w", a)
        _barrier(raw)
        assert s.tensors()["w"].tobytes() == a.tobytes()


def test_profiler_is_per_connection(monkeypatch, capfd):
    monkeypatch.setenv("WEIGHTLIFT_LOADPROF", "1")
    with Server() as s:
        first = Raw(s.address)
        first.hello()
        for i in range(3):
            _put(first, i, f"a{i}", _f32(1000, i))
        _barrier(first)
        first.send(Bye())
        assert first.closed()
        time.sleep(0.3)  # idle time between clients must not show in the second report
        t0 = time.perf_counter()
        second = Raw(s.address)
        second.hello()
        _put(second, 0, "b", _f32(10, 9))
        _barrier(second)
        second.send(Bye())
        assert second.closed()
        elapsed = time.perf_counter() - t0
        deadline = time.monotonic() + 10
        while len(s.profile_reports()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        r1, r2 = s.profile_reports()
    assert (r1["tensors"], r1["bytes"]) == (3, 12000)
    assert (r2["tensors"], r2["bytes"]) == (1, 40)
    assert r2["commands"]["ALLOC"]["count"] == 1 and r1["commands"]["ALLOC"]["count"] == 3
    assert r2["span_s"] <= elapsed
    err = capfd.readouterr().err
    assert err.count("weightlift server: connection") == 2


def test_close_ends_connections_and_drops_partial_tensors():
    s = Server()
    s.start()
    raw = Raw(s.address)
    raw.hello()
    raw.send(Alloc(0, "w", "U8", (100,), 100))
    raw.send(WriteHeader(0, 0, 100), b"x" * 10)
    raw.sock.sendall(send(Barrier()))
    s.close()
    assert raw.closed()
    assert s.tensors() == {} and s.memory_used == 0
    with pytest.raises(OptionError):
        s.start()


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_server_round_trip(tmp_path):
    import torch

    a = _f32(5_000_000, 10)  # 20 MB: several staging slots
    d = hash_buffer(a)
    with Server(device="cuda", framework="torch", cache_dir=tmp_path / "c") as s:
        raw = Raw(s.address)
        raw.hello()
        _cache_push(raw, a, 0, "w", d)
        raw.send(Alloc(1, "from.cache", "F32", a.shape, a.nbytes, d))
        raw.send(P.FillFromCache(1, d))
        assert _barrier(raw).tensors == 2
        got = s.tensors()
        for name in ("w", "from.cache"):
            assert got[name].device.type == "cuda"
            assert torch.equal(got[name].cpu(), torch.from_numpy(a))
        raw.send(Read("w", 0, a.nbytes))
        assert raw.recv() == ReadReply(a.nbytes)
        assert raw.read_payload(a.nbytes) == a.tobytes()
