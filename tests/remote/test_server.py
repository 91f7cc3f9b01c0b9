"""The tensor server over real loopback sockets, driven by raw frames where the client would not misbehave."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

import weightlift.remote.protocol as P
from tests.devices import has_cuda, needs_cuda, needs_torch
from tests.waiting import wait_for
from weightlift.digest.blake import hash_buffer
from weightlift.errors import OptionError, StateError
from weightlift.remote.protocol import (
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
from weightlift.remote.server.server import Server, is_loopback
from weightlift.remote.server.store import entry_cost


def _cost(name: str, nbytes: int, ndim: int = 1) -> int:
    """What one tensor counts against max_memory."""
    return entry_cost(name, nbytes, ndim)


class Raw:
    """A hand-driven client: sends exactly the frames a test writes, reads replies."""

    def __init__(self, address, *, minor: int = P.PROTOCOL_MINOR, source: str | None = None):
        self.sock = socket.create_connection(address, timeout=10, source_address=(source, 0) if source else None)
        self.dec = Decoder(our_role="client")
        self.minor = minor
        self.mac_out: P.FrameMac | None = None  # a protected connection (token, minor 2)
        self.mac_in: P.FrameMac | None = None
        self._payload = b""

    @classmethod
    def over(cls, sock: socket.socket, *, minor: int = P.PROTOCOL_MINOR) -> Raw:
        """A Raw client on a socket already connected (one end of a socketpair)."""
        raw = cls.__new__(cls)
        sock.settimeout(10)
        raw.sock, raw.dec, raw.minor = sock, Decoder(our_role="client"), minor
        raw.mac_out = raw.mac_in = None
        raw._payload = b""
        return raw

    def hello(self, *, token: bytes | None = None) -> Hello:
        nonce = P.new_nonce()
        ours = Hello(1, self.minor, nonce=nonce)
        self.send(ours)
        reply = self.recv()
        if token is not None:
            self.send(Auth(P.client_mac(token, nonce, reply.nonce)))
            assert isinstance(self.recv(), Auth)
            if P.mac_usable(min(self.minor, reply.minor), token):
                c2s, s2c = P.frame_keys(token, ours, reply)
                self.mac_out, self.mac_in = P.FrameMac(c2s), P.FrameMac(s2c)
        return reply

    def send(self, msg, payload: bytes = b"") -> None:
        raw = send(msg, minor=self.minor) + payload
        self.sock.sendall(raw + (self.mac_out.seal([raw]) if self.mac_out is not None else b""))

    def _exactly(self, n: int) -> bytes | None:
        out = b""
        while len(out) < n:
            data = self.sock.recv(n - len(out))
            if not data:
                return None
            out += data
        return out

    def recv(self):
        if self.mac_in is not None:  # frame by frame, each checked against the tag after it
            self.mac_in.begin()
            while (ev := self.dec.next_event()) is NEED_DATA:
                data = self._exactly(self.dec.bytes_wanted())
                if data is None:
                    return None
                self.dec.feed(data)
                self.mac_in.update(data)
            if ev.HAS_PAYLOAD:
                self._payload = self._exactly(ev.length)
                self.dec.payload_received(ev.length)
                self.mac_in.update(self._payload)
            self.mac_in.check(self._exactly(P.MAC_SIZE))
            return ev
        while True:
            ev = self.dec.next_event()
            if ev is not NEED_DATA:
                return ev
            data = self.sock.recv(65536)
            if not data:
                return None
            self.dec.feed(data)

    def read_payload(self, n: int) -> bytes:
        if self.mac_in is not None:
            out, self._payload = self._payload, b""
            assert len(out) == n
            return out
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


def _put(raw: Raw, tid: int, name: str, arr: np.ndarray, *, digest: bytes | None = None, dtype: str = "F32") -> None:
    raw.send(Alloc(tid, name, dtype, arr.shape, arr.nbytes, digest))
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
    assert server.memory_used == _cost("w", a.nbytes) + _cost("empty", 0, 2)
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
    assert server.memory_used == sum(_cost(n, arrays[n].nbytes) for n in ("t02", "t03", "t04"))


def test_list_is_paged_to_the_clients_frame_limit(server):
    raw = Raw(server.address)
    nonce = P.new_nonce()
    raw.send(Hello(1, 1, 0, P.MIN_FRAME, 0, nonce))  # this client takes the smallest frames allowed
    assert isinstance(raw.recv(), Hello)
    n, pad = 300, "x" * 4000  # 300 entries of about 4 KB: more than one 1 MiB page
    for i in range(n):
        raw.send(Alloc(i, f"tensor.{i:03d}.{pad}", "U8", (0,), 0))
    assert _barrier(raw).tensors == n
    names, after, pages = [], "", 0
    while True:
        raw.send(ListRequest(after))
        page = raw.recv()
        pages += 1
        names += [e.name for e in page.entries]
        if not page.more:
            break
        assert 0 < len(page.entries) < n
        after = page.entries[-1].name
    assert pages == 2
    assert names == [f"tensor.{i:03d}.{pad}" for i in range(n)]


def test_same_name_replaces_and_frees_the_old(server):
    raw = Raw(server.address)
    raw.hello()
    _put(raw, 0, "w", _f32(100, 1))
    _put(raw, 1, "w", _f32(100, 2))
    _barrier(raw)
    assert np.array_equal(server.tensors()["w"], _f32(100, 2))
    assert server.memory_used == _cost("w", 400)


def test_max_memory_enforced():
    limit = _cost("a", 800) + _cost("c", 200)
    with Server(max_memory=limit) as s:
        raw = Raw(s.address)
        assert raw.hello().max_memory == limit  # no token: anyone here may know it
        _put(raw, 0, "a", _f32(200))  # 800 bytes
        raw.send(Alloc(1, "b", "F32", (100,), 400))  # 400 more would not fit
        raw.send(WriteHeader(1, 0, 400), bytes(400))  # drained, no second error
        raw.send(Alloc(2, "c", "F32", (50,), 200))
        raw.send(WriteHeader(2, 0, 200), bytes(200))
        reply = _barrier(raw)
        assert reply.tensors == 2
        assert len(reply.errors) == 1 and "memory limit" in reply.errors[0]
        assert sorted(s.tensors()) == ["a", "c"] and s.memory_used == limit
        raw.send(Alloc(3, "big", "U8", (20000,), 20000))
        reply = raw.recv()  # over the largest tensor the server takes: a protocol error
        assert isinstance(reply, Error) and "limit" in reply.message


def test_token_required_before_anything():
    with Server(token="sesame-sesame-sesame") as s:
        raw = Raw(s.address)
        hello = raw.hello()
        assert hello.has(Capability.AUTH)
        raw.send(Alloc(0, "w", "U8", (4,), 4))
        reply = raw.recv()
        assert isinstance(reply, Error) and reply.code == ErrorCode.AUTH
        assert raw.closed()

        wrong = Raw(s.address)
        nonce = P.new_nonce()
        wrong.send(Hello(1, P.PROTOCOL_MINOR, nonce=nonce))
        srv_nonce = wrong.recv().nonce
        wrong.send(Auth(P.client_mac(b"guess", nonce, srv_nonce)))
        reply = wrong.recv()
        assert isinstance(reply, Error) and reply.code == ErrorCode.AUTH
        assert wrong.closed()

        good = Raw(s.address)
        good.hello(token=b"sesame-sesame-sesame")
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
    Server("0.0.0.0", 0, token="t" * 16)  # made, never bound
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
    with pytest.raises(OptionError, match="at least 16"):
        Server(token="short-token")
    s = Server()
    with pytest.raises(StateError, match="not started"):
        _ = s.address


def _cache_push(raw: Raw, a: np.ndarray, tid: int, name: str, digest: bytes) -> None:
    _put(raw, tid, name, a, digest=digest)


def _fill(raw: Raw, a: np.ndarray, tid: int, name: str, digest: bytes) -> None:
    """Allocate ``name`` named by ``digest`` and ask the server to fill it from what it holds."""
    raw.send(Alloc(tid, name, "F32", a.shape, a.nbytes, digest))
    raw.send(P.FillFromCache(tid, digest))


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
        assert s.memory_used == _cost("w", a.nbytes)


@pytest.mark.parametrize("n", [50_000, (9 << 20) // 4 + 3])  # the second lands in fresh memory the helpers fault in
def test_fill_from_cache_and_a_corrupt_entry_is_asked_for_again(tmp_path, n):
    a = _f32(n, 6)
    d = hash_buffer(a)
    with Server(cache_dir=tmp_path / "c") as s:
        first = Raw(s.address)
        first.hello()
        _cache_push(first, a, 0, "w", d)
        _barrier(first)
    with Server(cache_dir=tmp_path / "c") as s:  # restarted: the bytes are only on disk now
        second = Raw(s.address)
        second.hello()
        _fill(second, a, 0, "w.copy", d)
        assert _barrier(second) == BarrierReply(1, 0)
        assert np.array_equal(s.tensors()["w.copy"], a)
        assert s.stats()["bytes_received"] == 0 and s.stats()["cache_hits"] == 1
        second.send(Free(("w.copy",)))  # nothing held in memory: the disk entry is the only source
        assert second.recv() == FreeReply(1)

        entry = tmp_path / "c" / d.hex()[:2] / d.hex()
        raw_bytes = bytearray(entry.read_bytes())
        raw_bytes[1000] ^= 0xFF
        entry.write_bytes(raw_bytes)
        _fill(second, a, 1, "w.again", d)
        assert _barrier(second) == BarrierReply(0, 0, (), (1,))  # not filled: send it
        assert not entry.exists()  # the bad entry is gone
        assert "w.again" not in s.tensors()
        second.send(WriteHeader(1, 0, a.nbytes), a.tobytes())
        assert _barrier(second).tensors == 1
        assert np.array_equal(s.tensors()["w.again"], a)
        assert entry.read_bytes() == a.tobytes()  # and cached afresh


def test_second_push_of_a_held_tensor_keeps_its_memory(tmp_path):
    a = _f32(700_000, 8)  # above the pool's minimum: huge-page backed
    d = hash_buffer(a)
    with Server(cache_dir=tmp_path / "c") as s:
        raw = Raw(s.address)
        raw.hello()
        _cache_push(raw, a, 0, "w", d)
        _barrier(raw)
        held = s.tensors()["w"]
        used = s.memory_used
        (tmp_path / "c" / d.hex()[:2] / d.hex()).unlink()  # only the held tensor has these bytes now
        raw.send(P.Have((d, hash_buffer(b"other"))))
        assert raw.recv() == P.HaveReply((True, False))
        _fill(raw, a, 1, "w", d)
        assert _barrier(raw) == BarrierReply(1, 0)
        assert s.tensors()["w"] is held  # verified and kept: no copy, no new memory
        assert s.memory_used == used
        st = s.stats()
        assert st["memory_hits"] == 1 and st["bytes_from_memory"] == a.nbytes and st["cache_hits"] == 0
        # another name with the same bytes gets its own copy
        _fill(raw, a, 2, "w.tied", d)
        assert _barrier(raw) == BarrierReply(1, 0)
        tied = s.tensors()["w.tied"]
        assert np.array_equal(tied, a) and not np.shares_memory(tied, held)
        assert s.stats()["memory_hits"] == 2


def test_held_tensors_are_handed_out_read_only_and_then_need_no_second_hash(tmp_path, monkeypatch):
    """numpy tensors come as read-only views (the same object each time): nobody can write into
    them, so a digest-named push of the same bytes finds them in memory without hashing them
    again. One handed out writable is hashed again before it is trusted."""
    from weightlift.remote.server import fills

    hashed: list[int] = []
    real = fills.hash_buffer
    monkeypatch.setattr(
        fills, "hash_buffer", lambda buf, **kw: hashed.append(len(memoryview(buf).cast("B"))) or real(buf, **kw)
    )
    a = _f32(700_000, 7)
    d = hash_buffer(a)
    with Server(cache_dir=tmp_path / "c") as s:
        raw = Raw(s.address)
        raw.hello()
        _cache_push(raw, a, 0, "w", d)
        _barrier(raw)
        view = s.tensors()["w"]
        assert s.tensors()["w"] is view and not view.flags.writeable
        with pytest.raises(ValueError):
            view[0] = 1.0
        hashed.clear()
        _fill(raw, a, 1, "w", d)
        assert _barrier(raw) == BarrierReply(1, 0)
        assert hashed == [] and s.stats()["memory_hits"] == 1  # trusted: nobody could write into it
        assert s.tensors()["w"] is view
        s.tensors(writable=True)  # handed out writable: exposed from now on
        _fill(raw, a, 2, "w", d)
        assert _barrier(raw) == BarrierReply(1, 0)
        assert hashed == [a.nbytes] and s.stats()["memory_hits"] == 2  # proven again, then kept


def test_a_held_tensor_written_in_place_is_not_trusted(tmp_path):
    a = _f32(700_000, 9)
    d = hash_buffer(a)
    with Server(cache_dir=tmp_path / "c") as s:
        raw = Raw(s.address)
        raw.hello()
        _cache_push(raw, a, 0, "w", d)
        _barrier(raw)
        s.tensors(writable=True)["w"][10] += 1.0  # a reader changed its weights
        _fill(raw, a, 1, "w", d)
        assert _barrier(raw) == BarrierReply(1, 0)
        assert np.array_equal(s.tensors()["w"], a)  # the pushed bytes, from the verified disk entry
        st = s.stats()
        assert st["memory_hits"] == 0 and st["cache_hits"] == 1
        # with no disk entry either, the client is asked for the bytes
        (tmp_path / "c" / d.hex()[:2] / d.hex()).unlink()
        s.tensors(writable=True)["w"][10] += 1.0
        _fill(raw, a, 2, "w", d)
        assert _barrier(raw) == BarrierReply(0, 0, (), (2,))


def test_replaced_tensors_reuse_memory_but_never_under_a_reader():
    v = [_f32(700_000, i) for i in range(5)]
    with Server() as s:
        raw = Raw(s.address)
        raw.hello()
        _put(raw, 0, "w", v[0])
        _barrier(raw)
        kept = s.tensors()["w"]  # a reader holds the first version
        for i in (1, 2):  # each version lands beside the one it replaces: fresh memory so far
            _put(raw, i, "w", v[i])
            _barrier(raw)
        assert s.stats()["pooled"] == 0
        _put(raw, 3, "w", v[3])  # version 2 replaced version 1, which nobody held: its memory again
        _barrier(raw)
        assert s.stats()["pooled"] == 1
        assert np.array_equal(kept, v[0]) and np.array_equal(s.tensors()["w"], v[3])
        del kept  # the reader lets go: the first version's memory is free for the next tensor
        _put(raw, 4, "x", v[4])
        _put(raw, 5, "y", v[4])
        _barrier(raw)
        assert s.stats()["pooled"] == 3
        assert np.array_equal(s.tensors()["x"], v[4]) and np.array_equal(s.tensors()["y"], v[4])
        assert np.array_equal(s.tensors()["w"], v[3])


def test_idle_pooled_memory_gives_way_to_new_tensors():
    a = _f32(700_000, 4)  # 2.8 MB: a 4 MiB mapping, charged whole
    big = np.ones(6 * 2**20 // 4, dtype=np.float32)  # another size class (6 MiB): the idle memory must go first
    with Server(max_memory=_cost("w", 4 * 2**20) + _cost("v", big.nbytes) - 2**20) as s:
        raw = Raw(s.address)
        raw.hello()
        _put(raw, 0, "w", a)
        _barrier(raw)
        assert s.memory_used == _cost("w", 4 * 2**20)
        raw.send(Free(("w",)))
        assert raw.recv() == FreeReply(1)
        assert s.stats().pool_idle_bytes == 4 * 2**20 and s.memory_used == 0
        raw.send(Alloc(1, "v", "F32", big.shape, big.nbytes))
        raw.send(WriteHeader(1, 0, big.nbytes), big.tobytes())
        assert _barrier(raw) == BarrierReply(1, big.nbytes)
        assert s.stats()["pooled"] == 0
        assert s.stats().pool_idle_bytes == 0  # given back to make room
        assert s.stats().pool_idle_bytes + s.memory_used <= s.max_memory


def test_a_lazy_allocation_that_fails_leaves_nothing_in_flight(tmp_path, monkeypatch):
    a = _f32(700_000, 5)
    d = hash_buffer(a)

    def no_memory(nbytes: int):
        raise OSError(12, "Cannot allocate memory")

    with Server(cache_dir=tmp_path / "c") as s:
        raw = Raw(s.address)
        raw.hello()
        _cache_push(raw, a, 9, "v", d)  # on disk now ...
        assert _barrier(raw).tensors == 1
        raw.send(Free(("v",)))  # ... and nowhere in memory
        assert raw.recv() == FreeReply(1)
        s.trim(0)  # not even pooled
        monkeypatch.setattr(pool_mod, "new_mapping", no_memory)
        raw.send(Alloc(0, "w", "F32", a.shape, a.nbytes, d))  # named by digest: memory comes at the first byte
        raw.send(P.FillFromCache(0, d))  # a fill from the disk needs memory now, and there is none
        reply = _barrier(raw)
        assert reply.tensors == 0 and "cannot allocate 'w'" in reply.errors[0]
        assert s.memory_used == 0
        monkeypatch.undo()
        _cache_push(raw, a, 0, "w", d)  # the same id again: not "already in flight"
        assert _barrier(raw) == BarrierReply(1, a.nbytes)


def test_a_reserve_is_faulted_at_start_and_carved_for_the_first_push():
    v = [_f32(700_000, i) for i in range(4)]
    s = Server(reserve=32 * 2**20, max_memory=1 << 30)
    assert s.reserved == (0, 0)  # nothing before start
    with s:  # starts it
        wait_for(lambda: s.reserved[0] == s.reserved[1] == 32 * 2**20)
        raw = Raw(s.address)
        raw.hello()
        for i, a in enumerate(v):
            _put(raw, i, f"w{i}", a)
        assert _barrier(raw).tensors == 4
        assert s.stats()["pooled"] == 4  # every tensor carved from the reserve, none fresh
        for i, a in enumerate(v):
            assert np.array_equal(s.tensors()[f"w{i}"], a)
        assert s.memory_used == 4 * _cost("w0", 4 * 2**20)  # each charged its whole 4 MiB slice
        assert s.stats().pool_idle_bytes == 32 * 2**20 - 4 * 4 * 2**20  # the rest of the reserve, still counted


def test_a_reserve_as_large_as_max_memory_is_carved_not_cut_away():
    v = [_f32(700_000, i) for i in range(8)]  # 8 x 4 MiB slices: the whole reserve
    with Server(reserve=32 * 2**20, max_memory=32 * 2**20 + 8 * _cost("w0", 0)) as s:
        wait_for(lambda: s.reserved[0] == s.reserved[1] == 32 * 2**20)
        raw = Raw(s.address)
        raw.hello()
        for i, a in enumerate(v):
            _put(raw, i, f"w{i}", a)
        assert _barrier(raw) == BarrierReply(8, 8 * v[0].nbytes)
        assert s.stats()["pooled"] == 8  # each tensor took its slice: nothing trimmed, nothing fresh
        assert s.reserved == (32 * 2**20, 32 * 2**20)
        assert s.memory_used == s.max_memory and s.stats().pool_idle_bytes == 0
        assert all(np.array_equal(s.tensors()[f"w{i}"], a) for i, a in enumerate(v))


def test_reserve_must_fit_in_max_memory():
    with pytest.raises(OptionError, match="reserve"):
        Server(reserve=2 << 20, max_memory=1 << 20)


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
    with pytest.raises(StateError, match="closed"):
        s.start()


@pytest.mark.gpu
@needs_cuda
def test_cuda_server_round_trip(tmp_path):
    import torch

    a = _f32(5_000_000, 10)  # 20 MB: several staging slots
    d = hash_buffer(a)
    with Server(device="cuda", framework="torch", cache_dir=tmp_path / "c") as s:
        raw = Raw(s.address)
        raw.hello()
        _cache_push(raw, a, 0, "w", d)
        _fill(raw, a, 1, "from.cache", d)
        assert _barrier(raw).tensors == 2
        got = s.tensors()
        for name in ("w", "from.cache"):
            assert got[name].device.type == "cuda"
            assert torch.equal(got[name].cpu(), torch.from_numpy(a))
        raw.send(Read("w", 0, a.nbytes))
        assert raw.recv() == ReadReply(a.nbytes)
        assert raw.read_payload(a.nbytes) == a.tobytes()


# ----- hostile clients: every byte is checked, bad input changes nothing, the server goes on --------


import weightlift.memory.faulter as faulter_mod  # noqa: E402
import weightlift.memory.fresh as fresh_mod  # noqa: E402
import weightlift.memory.pool as pool_mod  # noqa: E402
import weightlift.remote.server.config as config_mod  # noqa: E402
import weightlift.remote.server.connection as connection_mod  # noqa: E402
import weightlift.remote.server.destinations as destinations_mod  # noqa: E402
import weightlift.remote.server.paths as paths_mod  # noqa: E402
import weightlift.remote.server.pending as pending_mod  # noqa: E402
import weightlift.remote.server.reads as reads_mod  # noqa: E402
from weightlift.errors import DeviceError  # noqa: E402


def _serves(s: Server) -> None:
    ok = Raw(s.address)
    ok.hello()
    _put(ok, 0, "ok", _f32(4))
    assert _barrier(ok).tensors == 1
    ok.close()


def test_unauthenticated_big_frame_is_refused_from_its_prefix():
    with Server(token="sesame-sesame-sesame") as s:
        for after_hello in (False, True):
            raw = Raw(s.address)
            if after_hello:
                raw.send(Hello(1, P.PROTOCOL_MINOR, nonce=P.new_nonce()))
                assert isinstance(raw.recv(), Hello)
            # an ALLOC announcing a 16 MiB body: refused before the body is read or buffered
            raw.sock.sendall(P.PREFIX.pack(P.Command.ALLOC, P.MAX_FRAME) + bytes(1000))
            reply = raw.recv()
            assert isinstance(reply, Error) and reply.code == ErrorCode.PROTOCOL
            assert "frame limit of 256" in reply.message
            assert raw.closed()
        assert s.memory_used == 0
        good = Raw(s.address)
        good.hello(token=b"sesame-sesame-sesame")
        _put(good, 0, "w", _f32(300_000))  # once READY the full frame and payload sizes apply
        assert _barrier(good).tensors == 1


def test_handshake_timeout_closes_connections_that_never_become_ready():
    with Server(token="sesame-sesame-sesame", handshake_timeout=0.3) as s:
        silent = Raw(s.address)
        reply = silent.recv()  # sent nothing: closed with a reason
        assert isinstance(reply, Error) and reply.code == ErrorCode.PROTOCOL
        assert "no HELLO and AUTH within 0.3 s" in reply.message
        assert silent.closed()
        silent.close()

        no_auth = Raw(s.address)
        no_auth.send(Hello(1, P.PROTOCOL_MINOR, nonce=P.new_nonce()))
        assert isinstance(no_auth.recv(), Hello)
        assert "within" in no_auth.recv().message  # HELLO alone is not READY
        assert no_auth.closed()
        no_auth.close()

        trickle = Raw(s.address)  # a HELLO a byte at a time, never finished: the deadline is for the whole
        for b in send(Hello(1, P.PROTOCOL_MINOR, nonce=P.new_nonce()))[:10]:
            try:
                trickle.sock.sendall(bytes([b]))
            except OSError:
                break
            time.sleep(0.05)
        assert "within" in trickle.recv().message
        trickle.close()

        ready = Raw(s.address)
        ready.hello(token=b"sesame-sesame-sesame")
        time.sleep(0.6)  # twice the handshake timeout: a READY connection is not held to it
        _put(ready, 0, "w", _f32(4))
        assert _barrier(ready).tensors == 1
        wait_for(lambda: s.stats().open_connections == 1)
        assert s.stats().open_connections == 1


def test_connections_over_the_limit_are_closed_at_accept():
    with Server(max_connections=2) as s:
        a, b = Raw(s.address), Raw(s.address)
        a.hello()
        b.hello()
        extra = Raw(s.address)
        reply = extra.recv()
        assert isinstance(reply, Error) and reply.code == ErrorCode.LIMIT and "2 connections" in reply.message
        assert extra.closed()
        assert s.stats().open_connections == 2  # no thread kept for it
        _put(a, 0, "w", _f32(4))
        assert _barrier(a).tensors == 1
        a.send(Bye())
        assert a.closed()
        wait_for(lambda: s.stats().open_connections < 2)
        _serves(s)  # a slot freed: the next client is served


def test_default_memory_cap_is_most_of_physical_memory():
    total = __import__("os").sysconf("SC_PAGE_SIZE") * __import__("os").sysconf("SC_PHYS_PAGES")
    assert config_mod.default_max_memory("cpu") == int(total * 0.9)
    with Server() as s:
        assert s.max_memory == int(total * 0.9)
        raw = Raw(s.address)
        assert raw.hello().max_memory == s.max_memory
    assert Server(max_memory=123).max_memory == 123


@needs_torch
def test_a_cuda_server_is_checked_without_allocating(monkeypatch):
    made = []
    real = config_mod.make_target
    monkeypatch.setattr(config_mod, "make_target", lambda *a, **k: made.append(a) or real(*a, **k))
    with pytest.raises(OptionError, match="framework='torch'"):
        Server(device="cuda", framework="numpy")
    with pytest.raises(OptionError, match="unknown device"):
        Server(device="cudaX", framework="torch")
    if not has_cuda():
        with pytest.raises(DeviceError, match="no CUDA device"):
            Server(device="cuda", framework="torch", max_memory=1 << 20)
    assert made == []  # none of that made a target


@pytest.mark.gpu
@needs_cuda
def test_cuda_target_is_made_at_the_first_alloc_not_at_connect(monkeypatch):
    import torch

    import weightlift.remote.server.context as context_mod

    made = []
    real = config_mod.make_target
    monkeypatch.setattr(config_mod, "make_target", lambda *a, **k: made.append(a) or real(*a, **k))
    monkeypatch.setattr(context_mod, "make_target", lambda *a, **k: made.append(a) or real(*a, **k))
    with pytest.raises(DeviceError, match="CUDA devices"):
        Server(device=f"cuda:{torch.cuda.device_count()}", framework="torch")
    with Server(device="cuda", framework="torch") as s:
        assert s.max_memory == torch.cuda.get_device_properties(0).total_memory
        idle = [Raw(s.address) for _ in range(3)]
        for r in idle:
            r.hello()
            assert _barrier(r) == BarrierReply(0, 0)
        assert made == []  # idle connections pin no host memory
        _put(idle[0], 0, "w", _f32(1000))
        assert _barrier(idle[0]).tensors == 1
        assert len(made) == 1
        assert torch.equal(s.tensors()["w"].cpu(), torch.from_numpy(_f32(1000)))


def test_fresh_destination_is_faulted_in_at_most_a_window_ahead_of_the_payload(monkeypatch):
    # with the receiver faulting what the helpers have not reached (one fill policy), every
    # page is faulted exactly once, by a helper or by the receiver
    monkeypatch.setenv("WEIGHTLIFT_FAULT_AHEAD", "1")
    fresh_mod.reset_policy()
    monkeypatch.setattr(fresh_mod, "_policy", None)  # forgotten again after the test
    piece = 64 * 1024
    monkeypatch.setattr(destinations_mod, "FAULT_PIECE", piece)
    monkeypatch.setattr(destinations_mod, "FAULT_WINDOW", 4 * piece)
    touched: list[int] = []
    real = faulter_mod.fault_in

    def counting(buf):
        touched.append(len(buf))
        real(buf)

    monkeypatch.setattr(faulter_mod, "fault_in", counting)
    monkeypatch.setattr(paths_mod, "populate", counting)
    with Server() as s:
        raw = Raw(s.address)
        raw.hello()
        data = np.random.default_rng(1).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()
        raw.send(Alloc(0, "w", "U8", (len(data),), len(data)))
        # nothing sent yet: the helpers fault the window in, and no more
        wait_for(lambda: sum(touched) >= 4 * piece)
        time.sleep(0.1)  # a server that faulted the whole tensor in would have gone on by now
        assert sum(touched) == 4 * piece and max(touched) <= piece
        sent = 100_000
        raw.send(WriteHeader(0, 0, len(data)), data[:sent])  # the header announces 4 MiB; 100 KB follow
        wait_for(lambda: sum(touched) >= sent + 4 * piece)
        time.sleep(0.1)
        # what arrived (in whole pieces) and the window ahead of it
        assert sum(touched) <= (sent // piece + 1) * piece + 4 * piece
        raw.sock.sendall(data[sent:])
        assert _barrier(raw).tensors == 1
        assert s.tensors()["w"].tobytes() == data
        assert sum(touched) == len(data)  # every page once, by a helper or by the receiver


def test_tensors_allocated_ahead_land_whole_in_any_write_order(monkeypatch):
    # fresh pool mappings (>= 2 MiB) go to the faulter at ALLOC; the WRITEs come in another
    # order, in pieces, one tensor abandoned half-written: every byte where it belongs. The
    # helpers are slowed down, so the receiver meets pieces queued, running and done.
    real = faulter_mod.fault_in
    monkeypatch.setattr(faulter_mod, "fault_in", lambda buf: (time.sleep(0.002), real(buf)))
    rng = np.random.default_rng(5)
    data = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (3 << 20, (5 << 20) + 123, 2 << 20)]
    with Server() as s:
        raw = Raw(s.address)
        raw.hello()
        for i, d in enumerate(data):
            raw.send(Alloc(i, f"t{i}", "U8", (len(d),), len(d)))
        raw.send(Alloc(9, "gone", "U8", (4 << 20,), 4 << 20))
        raw.send(WriteHeader(9, 1 << 20, 1000), b"\x01" * 1000)
        d0, d1, d2 = data
        half = len(d1) // 2 + 7
        raw.send(WriteHeader(2, 0, len(d2)), d2)
        raw.send(WriteHeader(1, half, len(d1) - half), d1[half:])
        raw.send(WriteHeader(0, 0, len(d0)), d0)
        raw.send(WriteHeader(1, 0, half), d1[:half])
        assert _barrier(raw).tensors == 3
        held = s.tensors()
        assert [held[f"t{i}"].tobytes() == d for i, d in enumerate(data)] == [True] * 3
        assert "gone" not in held
        before = s.memory_used
        raw.close()  # the half-written tensor is dropped, its faulting cancelled, its charge released
        wait_for(lambda: s.memory_used < before)
        assert before - s.memory_used >= 4 << 20
        raw = Raw(s.address)
        raw.hello()
        _put(raw, 0, "after", np.arange(1 << 20, dtype=np.float32))
        assert _barrier(raw).tensors == 1


def test_a_tensor_allocated_ahead_at_the_limit_is_charged_at_its_first_byte():
    # a weight update into a server with room for about one more tensor: the client's ALLOCs
    # run ahead of its WRITEs, while the old versions still count
    ts = [np.full(3 << 20, i, dtype=np.uint8) for i in range(4)]
    with Server() as s:
        raw = Raw(s.address)
        raw.hello()
        for i, t in enumerate(ts):
            raw.send(Alloc(i, f"t{i}", "U8", t.shape, t.nbytes))
            raw.send(WriteHeader(i, 0, t.nbytes), t.tobytes())
        assert _barrier(raw).tensors == 4
        full = s.memory_used
    # room for one more tensor's data, and the bookkeeping of those allocated ahead of it
    headroom = (4 << 20) + 4 * _cost("t0", 0)
    with Server(max_memory=full + headroom) as s:
        raw = Raw(s.address)
        raw.hello()
        for i, t in enumerate(ts):
            _put(raw, i, f"t{i}", t, dtype="U8")
        assert _barrier(raw).tensors == 4
        for i in range(4):  # version 2: every ALLOC first, then the WRITEs
            raw.send(Alloc(10 + i, f"t{i}", "U8", ts[i].shape, ts[i].nbytes))
        for i, t in enumerate(ts):
            raw.send(WriteHeader(10 + i, 0, t.nbytes), (t + 1).tobytes())
        reply = _barrier(raw)
        assert reply.errors == () and reply.tensors == 4
        assert all(s.tensors()[f"t{i}"][0] == i + 1 for i in range(4))
        assert s.memory_used <= s.max_memory
        # with nothing else in flight the limit is the limit, at ALLOC
        raw.send(Alloc(20, "big", "U8", (8 << 20,), 8 << 20))
        reply = _barrier(raw)
        assert reply.tensors == 0 and "memory limit" in reply.errors[0]
        # and one allocated ahead that never finds the room fails at its first byte
        raw.send(Alloc(21, "t0", "U8", ts[0].shape, ts[0].nbytes))
        raw.send(Alloc(22, "big", "U8", (8 << 20,), 8 << 20))
        raw.send(WriteHeader(22, 0, 8 << 20), bytes(8 << 20))
        raw.send(WriteHeader(21, 0, ts[0].nbytes), ts[0].tobytes())
        reply = _barrier(raw)
        assert reply.tensors == 1 and len(reply.errors) == 1 and "memory limit" in reply.errors[0]
        assert "big" not in s.tensors() and s.tensors()["t0"][0] == 0
        used = s.memory_used
    assert used <= full + headroom


def test_failed_allocations_release_their_reservation(monkeypatch, thread_errors):
    with Server(max_memory=1 << 30) as s:
        raw = Raw(s.address)
        raw.hello()
        raw.send(Alloc(1, "absurd", "U8", (0, 2**64 - 1), 0))  # zero bytes, a shape numpy refuses
        real = pool_mod.new_mapping

        def no_memory(nbytes: int):
            if nbytes >= 1 << 20:
                raise OSError(12, "Cannot allocate memory")
            return real(nbytes)

        monkeypatch.setattr(pool_mod, "new_mapping", no_memory)  # what mmap says to an overcommitted ask
        raw.send(Alloc(2, "huge", "U8", (1 << 29,), 1 << 29))
        raw.send(WriteHeader(2, 0, 10), bytes(10))  # drained quietly: the ALLOC failed already
        reply = _barrier(raw)
        assert reply.tensors == 0 and len(reply.errors) == 2
        assert "cannot allocate 'absurd'" in reply.errors[0] and "ValueError" in reply.errors[0]
        assert "cannot allocate 'huge'" in reply.errors[1] and "OSError" in reply.errors[1]
        assert s.memory_used == 0  # the budget is whole again
        _put(raw, 3, "small", _f32(1000))
        assert _barrier(raw).tensors == 1
    assert thread_errors == []


@pytest.mark.parametrize(
    "hello, then, expect",
    [
        (Hello(1, 1, 0, 1), Barrier(), "max_frame 1 is below"),  # a client frame no reply fits in
        (Hello(1, 0), Have((bytes(32),)), "HAVE is not valid"),  # a command its minor lacks
        (Hello(1, 0), P.FillFromCache(1, bytes(32)), "FILL_FROM_CACHE is not valid"),
    ],
)
def test_what_a_client_may_not_send_is_an_error_not_a_dead_thread(server, thread_errors, hello, then, expect):
    raw = Raw(server.address, minor=min(hello.minor, P.PROTOCOL_MINOR))
    raw.sock.sendall(send(Hello(hello.major, hello.minor, hello.flags, hello.max_frame, 0, P.new_nonce())))
    reply = raw.recv()
    if isinstance(reply, Hello):
        raw.sock.sendall(send(Alloc(1, "x", "U8", (4,), 4), minor=1) + send(then, minor=1))
        reply = raw.recv()
    assert isinstance(reply, Error) and reply.code == ErrorCode.PROTOCOL and expect in reply.message
    assert raw.closed()
    raw.close()
    _serves(server)
    wait_for(lambda: server.memory_used == _cost("ok", 16))
    assert server.memory_used == _cost("ok", 16)  # the refused client's ALLOC was dropped with it
    assert thread_errors == []


def test_an_unexpected_failure_answers_internal_and_ends_only_that_connection(
    server, thread_errors, monkeypatch, caplog
):
    def broken(self, req):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(reads_mod.Reads, "list", broken)
    raw = Raw(server.address)
    raw.hello()
    raw.send(Alloc(0, "w", "U8", (4,), 4))
    raw.send(ListRequest())
    reply = raw.recv()
    assert isinstance(reply, Error) and reply.code == ErrorCode.INTERNAL and "ZeroDivisionError" in reply.message
    assert raw.closed()
    raw.close()
    wait_for(lambda: server.memory_used == 0)
    assert server.memory_used == 0
    _serves(server)
    assert thread_errors == []
    assert "ZeroDivisionError: a bug" in caplog.text


def test_ranges_merge_in_any_order():
    rng = np.random.default_rng(7)
    n = 200
    for _ in range(10):
        p = pending_mod.Pending(Alloc(0, "t", "U8", (n,), n), 0, None)
        have = np.zeros(n, dtype=bool)
        while not have.all():
            b = int(rng.integers(0, n))
            e = min(n, b + int(rng.integers(0, 12)))
            assert p.can_add(b, e)
            p.add(b, e)
            have[b:e] = True
            want = []  # the ranges of the model, touching ones joined
            for i in np.flatnonzero(have):
                if want and want[-1][1] == i:
                    want[-1] = (want[-1][0], i + 1)
                else:
                    want.append((int(i), int(i) + 1))
            assert p.ranges == want
        assert p.complete


def test_too_many_separate_ranges_is_a_request_error(server):
    k = pending_mod.MAX_RANGES
    n = 2 * k + 4
    raw = Raw(server.address)
    raw.hello()
    frames = [send(Alloc(0, "holes", "U8", (n,), n))]
    frames += [send(WriteHeader(0, 2 * i, 1)) + b"x" for i in range(k + 2)]  # k fit, then one too many
    raw.sock.sendall(b"".join(frames))
    reply = _barrier(raw)
    assert reply.tensors == 0 and len(reply.errors) == 1  # the WRITE after is drained quietly
    assert f"more than {k} separate byte ranges" in reply.errors[0]
    assert server.memory_used == 0 and server.tensors() == {}
    _put(raw, 0, "again", _f32(4))  # the id is free again
    assert _barrier(raw).tensors == 1


def test_errors_kept_per_connection_are_capped_and_the_rest_counted(server, monkeypatch):
    conns = []
    real_init = connection_mod.Connection.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        conns.append(self)

    monkeypatch.setattr(connection_mod.Connection, "__init__", init)
    extra = 10
    raw = Raw(server.address)
    raw.hello()
    raw.sock.sendall(send(WriteHeader(7, 0, 0)) * (P.MAX_ERRORS + extra))
    raw.send(ListRequest())  # a reply after the WRITEs: they have all been handled
    assert isinstance(raw.recv(), ListReply)
    (conn,) = conns
    kept = conn.rx.outcomes
    assert len(kept.errors) == P.MAX_ERRORS and kept.dropped_errors == extra  # kept: bounded; the rest: counted
    reply = _barrier(raw)
    assert len(reply.errors) == P.MAX_ERRORS
    assert all("not allocated" in e for e in reply.errors[:-1])
    assert reply.errors[-1] == f"... and {extra + 1} more errors"
    assert server.stats()["errors"] == P.MAX_ERRORS + extra
    assert _barrier(raw) == BarrierReply(0, 0)


def test_every_tensor_is_charged_for_its_name_and_entry():
    per = _cost("t.0", 0)
    with Server(max_memory=3 * per) as s:
        raw = Raw(s.address)
        raw.hello()
        for i in range(5):
            raw.send(Alloc(i, f"t.{i}", "U8", (0,), 0))  # zero bytes, but not free
        reply = _barrier(raw)
        assert reply.tensors == 3 and len(reply.errors) == 2 and "memory limit" in reply.errors[0]
        assert sorted(s.tensors()) == ["t.0", "t.1", "t.2"] and s.memory_used == 3 * per
        raw.send(Free(("t.0",)))
        assert raw.recv() == FreeReply(1)
        assert s.memory_used == 2 * per


def test_need_list_names_each_pending_tensor_once(server):
    raw = Raw(server.address)
    raw.hello()
    raw.send(Alloc(0, "a", "U8", (4,), 4))
    raw.send(Alloc(1, "b", "U8", (4,), 4))
    for _ in range(3):  # no cache here: every fill is a need, but each id is asked for once
        raw.send(P.FillFromCache(0, bytes(32)))
        raw.send(P.FillFromCache(1, bytes(32)))
    raw.send(WriteHeader(1, 0, 4), b"bbbb")  # its bytes came anyway: not needed any more
    reply = _barrier(raw)
    assert reply.need == (0,) and reply.tensors == 1
