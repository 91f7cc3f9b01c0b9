"""The tensor server over real loopback sockets, driven by raw frames where the client would not
misbehave: the handshake, the options, the lifecycle and what a hostile peer cannot do to it.

The raw client and the helpers the server tests share are in tests/remote/rawclient.py.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import weightlift.remote.protocol as P
import weightlift.remote.server.config as config_mod
import weightlift.remote.server.reads as reads_mod
from tests.devices import has_cuda, needs_cuda, needs_torch
from tests.remote.rawclient import Raw, _barrier, _cache_push, _cost, _f32, _fill, _put, _serves
from tests.waiting import wait_for
from weightlift.digest.blake import hash_buffer
from weightlift.errors import DeviceError, OptionError, StateError
from weightlift.remote.client.client import Client
from weightlift.remote.protocol import (
    Alloc,
    Auth,
    Barrier,
    BarrierReply,
    Bye,
    Capability,
    Error,
    ErrorCode,
    Free,
    FreeReply,
    Have,
    Hello,
    ListRequest,
    Read,
    ReadReply,
    WriteHeader,
    send,
)
from weightlift.remote.server.receive import PINNED_STAGING
from weightlift.remote.server.server import Server, is_loopback

__all__ = ["Raw", "_barrier", "_cache_push", "_f32", "_put"]  # what other tests take from here


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


@needs_torch
def test_a_cuda_server_is_checked_without_allocating(monkeypatch):
    made = []
    real = config_mod.target_for
    monkeypatch.setattr(config_mod, "target_for", lambda *a, **k: made.append(a) or real(*a, **k))
    with pytest.raises(OptionError, match="framework='torch'"):
        Server(device="cuda", framework="numpy")
    with pytest.raises(OptionError, match="unknown device"):
        Server(device="cudaX", framework="torch")
    if not has_cuda():
        with pytest.raises(DeviceError, match="no CUDA device"):
            Server(device="cuda", framework="torch", max_memory=1 << 20)
    assert made == []  # none of that made a target


@needs_cuda
def test_cuda_target_is_made_at_the_first_alloc_not_at_connect(monkeypatch):
    import torch

    import weightlift.remote.server.admission as context_mod

    made = []
    real = config_mod.target_for
    monkeypatch.setattr(config_mod, "target_for", lambda *a, **k: made.append(a) or real(*a, **k))
    monkeypatch.setattr(context_mod, "target_for", lambda *a, **k: made.append(a) or real(*a, **k))
    with pytest.raises(DeviceError, match="CUDA devices"):
        Server(device=f"cuda:{torch.cuda.device_count()}", framework="torch")
    with Server(device="cuda", framework="torch") as s:
        _, total = torch.cuda.mem_get_info(0)
        assert s.device == f"cuda:{torch.cuda.current_device()}"  # resolved here, not in each connection
        assert 0 < s.max_memory <= total - (1 << 30)  # what is free, less headroom; not the total
        idle = [Raw(s.address) for _ in range(3)]
        for r in idle:
            r.hello()
            assert _barrier(r) == BarrierReply(0, 0)
        assert made == []  # idle connections pin no host memory
        _put(idle[0], 0, "w", _f32(1000))
        assert _barrier(idle[0]).tensors == 1
        assert len(made) == 1
        assert s.memory_used == _cost("w", 4000) + PINNED_STAGING  # its pinned slots are charged
        assert torch.equal(s.tensors()["w"].cpu(), torch.from_numpy(_f32(1000)))


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


def test_stats_tell_what_the_server_holds_without_reading_its_insides():
    import dataclasses
    import json

    with Server(max_memory=64 << 20, max_connections=5, max_handshakes=3, max_per_address=4, reserve=4 << 20) as s:
        wait_for(lambda: s.stats().reserve_faulted == 4 << 20)
        raw = Raw(s.address)
        raw.hello()
        _put(raw, 0, "w", _f32(1000))
        _put(raw, 1, "v", _f32(10))
        assert _barrier(raw).tensors == 2
        st = s.stats()
        assert (st.tensors_held, st.bytes_held) == (2, 4040)
        assert st.memory_used == s.memory_used == _cost("w", 4000) + _cost("v", 40)
        assert st.max_memory == 64 << 20 and st.reserve_bytes == 4 << 20
        assert (st.open_connections, st.ready, st.handshakes) == (1, 1, 0)
        assert (st.max_connections, st.max_handshakes, st.max_per_address) == (5, 3, 4)
        assert st.connections == 1 and st.tensors == 2 and st.bytes_received == 4040 and st.errors == 0
        # the counters as they always were, by name, and the whole as a plain dict for a report
        assert st["bytes_received"] == 4040 and dict(st)["tensors_held"] == 2 and "pooled" in st
        assert json.loads(json.dumps(dict(st)))["memory_used"] == st.memory_used
        with pytest.raises(dataclasses.FrozenInstanceError):
            st.tensors_held = 0  # type: ignore[misc]
        raw.send(Free(("w", "v")))
        assert raw.recv() == FreeReply(2)
        assert s.stats().tensors_held == 0 and s.stats().memory_used == 0
        assert s.stats().pool_idle_bytes > 0  # the reserve, idle, still counted
        assert s.trim(0) > 0 and s.stats().pool_idle_bytes == 0
        raw.close()
        wait_for(lambda: s.stats().open_connections == 0)
        assert s.stats().ready == 0
    assert s.config.max_memory == 64 << 20 and s.cache is None


@needs_cuda
def test_trim_gives_a_cuda_servers_dropped_tensors_back(tmp_path):
    import torch

    with Server(device="cuda", framework="torch") as s, Client(s.address) as c:
        c.push({"w": torch.ones(64 << 20, dtype=torch.uint8)})
        c.push({"w": torch.zeros(64 << 20, dtype=torch.uint8)})  # the first version is dropped
        assert s.trim() >= 64 << 20
        assert bool((s.tensors()["w"] == 0).all())


@needs_cuda
def test_a_memory_push_to_a_cuda_server_commits_and_states_its_set_digest():
    import blake3
    import torch

    from weightlift.digest.setdigest import set_digest

    tensors = {f"w{i}": torch.randn(1000 + i) for i in range(3)}
    with Server(device="cuda", framework="torch") as s, Client(s.address) as c:
        c.push(tensors)
        got = s.tensors()
        assert all(torch.equal(got[n].cpu(), t) for n, t in tensors.items())
        want = set_digest({n: blake3.blake3(t.numpy().tobytes()).digest() for n, t in tensors.items()})
        assert s.set_digest() == want
