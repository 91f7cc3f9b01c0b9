"""What a hostile client can make the server hold: every byte of it is charged to max_memory.

Each test reproduces one way a client got the server past its limit and checks the limit holds.
"""

from __future__ import annotations

import dataclasses
import gc
import socket
import struct
import threading
import tracemalloc

import numpy as np
import pytest

from tests.remote.rawclient import Raw, _barrier, _fill, _put, _stalled_reader
from tests.waiting import wait_for
from weightlift.memory.targets import STAGING_SLOT, CudaTarget
from weightlift.remote.protocol import (
    Alloc,
    BarrierReply,
    ErrorCode,
    Free,
    FreeReply,
    Have,
    HaveReply,
    WriteHeader,
    send,
)
from weightlift.remote.server.admission import Context
from weightlift.remote.server.config import CONFIG_ONLY, INPUT_ONLY, ServerConfig, ServerOptions, cuda_budget
from weightlift.remote.server.connection import Connection
from weightlift.remote.server.receive import PINNED_STAGING
from weightlift.remote.server.server import Server
from weightlift.remote.server.store import Store, entry_cost
from weightlift.remote.transport import SocketStream


def test_a_stalled_reader_keeps_the_old_version_charged():
    big = 24 << 20
    data = np.ones(big, dtype=np.uint8)
    with Server(max_memory=entry_cost("w", big) + (8 << 20)) as s:
        raw = Raw.connected(s.address)
        _put(raw, 0, "w", data, dtype="U8")
        assert _barrier(raw).tensors == 1
        used = s.memory_used
        stalled = _stalled_reader(s.address, "w", big)
        raw.send(Free(("w",)))
        assert raw.recv() == FreeReply(1)
        # the freed version is still held by the reply in flight: it still counts
        assert s.memory_used == used
        _put(raw, 1, "v", data, dtype="U8")
        reply = _barrier(raw)
        assert reply.tensors == 0 and "memory limit" in reply.errors[0]
        stalled.close()  # the reader goes: the send fails, the memory and its charge go back
        wait_for(lambda: s.memory_used == 0)
        _put(raw, 2, "v", data, dtype="U8")
        assert _barrier(raw).tensors == 1
        raw.close()


def test_allocations_ahead_at_the_limit_are_charged_their_bookkeeping():
    name = "n" * 4000
    shape = (1,) * 63 + (1 << 20,)
    per = entry_cost(name, 0, len(shape))
    limit = entry_cost("first", 1 << 20) + 10 * per
    with Server(max_memory=limit) as s:
        raw = Raw.connected(s.address)
        raw.send(Alloc(0, "first", "U8", (1 << 20,), 1 << 20))  # pending: its bytes have not come
        for i in range(1, 101):  # none of these fit: allocated ahead, charged at least their bookkeeping
            raw.send(Alloc(i, f"{name}{i:03}", "U8", shape, 1 << 20))
        reply = _barrier(raw)
        assert s.memory_used <= limit
        assert len(reply.errors) >= 100 - 10 and all("memory limit" in e for e in reply.errors)
        raw.close()
        wait_for(lambda: s.memory_used == 0)


def _rss_python() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def test_an_entry_is_charged_at_least_what_it_costs():
    # zero-byte tensors with the longest names and the most dimensions the protocol allows
    name = "x" * 4000
    shape = (0,) + (1,) * 63
    n = 300
    with Server() as s:
        raw = Raw.connected(s.address)
        raw.send(Alloc(0, "warm-up", "U8", shape, 0))
        _barrier(raw)
        tracemalloc.start()
        try:
            before, used = _rss_python(), s.memory_used
            for i in range(n):
                raw.send(Alloc(i + 1, f"{name}{i:04}", "U8", shape, 0))
            assert _barrier(raw).tensors == n
            held, charged = _rss_python() - before, s.memory_used - used
        finally:
            tracemalloc.stop()
        assert held <= charged, f"{held / n:.0f} bytes held per entry, {charged / n:.0f} charged"
        raw.close()


def test_a_large_unfinished_frame_is_charged():
    # A HAVE of many digests is a large frame; its buffer is charged while it arrives.
    with Server(max_memory=1 << 20) as s:
        raw = Raw.connected(s.address)
        from weightlift.remote.protocol import send

        frame = send(Have(tuple(bytes([i % 256]) * 32 for i in range(60_000))))
        raw.sock.sendall(frame[: len(frame) // 2])
        reply = raw.recv()  # the frame would not fit: refused before it is buffered
        assert reply is not None and reply.code == ErrorCode.LIMIT and "memory" in reply.message
        raw.close()
    with Server() as s:
        raw = Raw.connected(s.address)
        raw.sock.sendall(frame[: len(frame) // 2])
        wait_for(lambda: s.memory_used >= len(frame))
        raw.sock.sendall(frame[len(frame) // 2 :])
        assert raw.recv() == HaveReply((False,) * 60_000)
        wait_for(lambda: s.memory_used == 0)
        raw.close()


def test_write_into_a_pending_tensor_still_works_at_the_limit():
    data = np.arange(1000, dtype=np.uint8)
    with Server(max_memory=entry_cost("a", 1000)) as s:
        raw = Raw.connected(s.address)
        raw.send(Alloc(0, "a", "U8", data.shape, data.nbytes))
        raw.send(WriteHeader(0, 0, data.nbytes), data.tobytes())
        assert _barrier(raw).tensors == 1 and s.memory_used == s.max_memory
        raw.close()


def test_the_naive_path_charges_its_whole_write_buffer(monkeypatch):
    # WEIGHTLIFT_LOAD_OPT=0 receives each WRITE into a fresh buffer of its whole length: that
    # buffer counts against max_memory while it lives, like everything else a peer makes the
    # server hold
    monkeypatch.setenv("WEIGHTLIFT_LOAD_OPT", "0")
    n = 8 << 20
    data = np.ones(n, dtype=np.uint8)
    with Server(max_memory=entry_cost("w", n) + (1 << 20)) as s:
        raw = Raw.connected(s.address)
        _put(raw, 0, "w", data, dtype="U8")
        reply = _barrier(raw)
        assert reply.tensors == 0 and "memory limit" in reply.errors[0]
        assert s.tensors() == {} and s.memory_used == 0
        _put(raw, 1, "small", np.ones(1000, dtype=np.uint8), dtype="U8")  # the connection goes on
        assert _barrier(raw).tensors == 1
        raw.close()
    with Server(max_memory=2 * n + (1 << 20)) as s:
        raw = Raw.connected(s.address)
        raw.send(Alloc(0, "w", "U8", (n,), n))
        raw.sock.sendall(send(WriteHeader(0, 0, n)) + data.tobytes()[: n // 2])
        wait_for(lambda: s.memory_used == entry_cost("w", n) + n)  # the tensor and the buffer
        raw.sock.sendall(data.tobytes()[n // 2 :])
        assert _barrier(raw).tensors == 1
        assert s.memory_used == entry_cost("w", n)  # the buffer went
        raw.close()


class _NoDeviceTorch:
    """Just enough of torch for a CudaTarget to be made: it never copies here."""

    class cuda:
        @staticmethod
        def is_available() -> bool:
            return True

    @staticmethod
    def device(name: str) -> str:
        return name


class _FakeCuda(CudaTarget):
    """A CUDA target made through its constructor over a torch without a device: host arrays."""

    def __init__(self):
        super().__init__("cuda:0", torch=_NoDeviceTorch, stream=object(), pinned=lambda n: np.zeros(n, dtype=np.uint8))

    def empty(self, dtype, shape):
        return np.zeros(shape, dtype=np.uint8)

    def finish(self, dest):
        return dest


def _cuda_server(limit: int, cache=None) -> tuple[Store, Context]:
    """A CUDA server's store and context, without a device or a listening socket."""
    store = Store(max_memory=limit, pool=None, remember_digests=False)
    return store, Context(ServerConfig(max_memory=limit), store, cache, host_target=None, new_target=_FakeCuda)


def _connected(ctx: Context) -> tuple[Raw, threading.Thread]:
    """A connection of ``ctx``'s server on one end of a socketpair, a Raw client past HELLO on the other."""
    ours, theirs = socket.socketpair()
    t = threading.Thread(target=Connection(ctx, SocketStream(ours, peer="test")).run, daemon=True)
    t.start()
    raw = Raw.over(theirs)
    raw.hello()
    return raw, t


def test_a_cuda_connection_is_charged_its_pinned_staging():
    # A CUDA server's connection makes its target, with 2 x 64 MiB of pinned host slots, at its
    # first ALLOC: that host memory is charged to max_memory, and given back when it closes.
    store, ctx = _cuda_server(1 << 30)
    raw, t = _connected(ctx)
    assert _barrier(raw) == BarrierReply(0, 0)
    assert store.used == 0  # a connection that allocates nothing pins nothing
    raw.send(Alloc(0, "w", "U8", (0,), 0))
    assert _barrier(raw).tensors == 1
    assert _FakeCuda().pinned_bytes() == PINNED_STAGING == 2 * STAGING_SLOT
    assert store.used == entry_cost("w", 0) + PINNED_STAGING
    raw.close()
    t.join(10)
    assert store.used == entry_cost("w", 0)  # the tensor stays; the staging went with the connection


def test_a_cuda_connection_over_the_limit_with_its_staging_fails_its_alloc():
    limit = PINNED_STAGING // 2
    store, ctx = _cuda_server(limit)
    raw, t = _connected(ctx)
    raw.send(Alloc(0, "w", "U8", (0,), 0))
    reply = _barrier(raw)
    assert reply.tensors == 0 and "memory limit" in reply.errors[0]
    assert store.used == 0
    raw.close()
    t.join(10)


def test_a_fill_whose_staging_does_not_fit_leaves_nothing_charged(tmp_path):
    # A CUDA connection fills from the cache through its 8 MiB staging buffer, charged when first
    # made: when that charge does not fit, the tensor is abandoned, not left charged in flight.
    from weightlift.digest.blake import hash_buffer
    from weightlift.remote.server.cache import TensorCache
    from weightlift.remote.server.receive import STAGING_BYTES

    a = np.arange(256, dtype=np.float32)
    d = hash_buffer(a)
    cache = TensorCache(tmp_path / "c", max_bytes=None)
    with cache.writer(d, a.nbytes) as w:
        w.write(a.tobytes())
        w.commit()
    limit = PINNED_STAGING + entry_cost("w", 1) + a.nbytes + STAGING_BYTES // 2
    store, ctx = _cuda_server(limit, cache)
    raw, t = _connected(ctx)
    _fill(raw, a, 0, "w", d)
    reply = _barrier(raw)
    assert reply.tensors == 0 and "exceed" in reply.errors[0]
    assert store.used == PINNED_STAGING  # the tensor's charge went back; only the target's pins remain
    raw.close()
    t.join(10)
    assert store.used == 0


def test_connections_that_pin_host_memory_are_capped_together():
    # On a CUDA server max_memory counts the device; the pinned host staging of all connections
    # together has a cap of its own, so many connections cannot pin the host's memory away.
    from weightlift.remote.server.admission import MAX_PINNED

    _, ctx = _cuda_server(1 << 50)
    fit = MAX_PINNED // PINNED_STAGING
    conns = []

    def connect():
        raw, t = _connected(ctx)
        raw.send(Alloc(0, "w", "U8", (0,), 0))
        conns.append((raw, t))
        return _barrier(raw)

    for _ in range(fit):
        assert connect().tensors == 1
    assert ctx.pins.used == MAX_PINNED
    over = connect()
    assert over.tensors == 0 and "pinned host" in over.errors[0]
    raw, t = conns.pop(0)
    raw.close()
    t.join(10)
    assert ctx.pins.used == MAX_PINNED - PINNED_STAGING  # a closed connection gives its pins back
    assert connect().tensors == 1
    for raw, t in conns:
        raw.close()
        t.join(10)
    assert ctx.pins.used == 0


def test_a_server_configs_token_stays_out_of_its_repr():
    token = b"a token long enough for the weightlift server 0123456789"
    config = ServerConfig(max_memory=1 << 20, token=token)
    assert token.decode() not in repr(config) and "max_memory=1048576" in repr(config)
    assert config.token == token


def test_each_server_option_is_listed_once_and_is_a_config_field():
    """Server takes its options from ServerOptions alone; every key but the two that only shape
    other settings is a ServerConfig field, so the two lists cannot drift apart."""
    options = set(ServerOptions.__annotations__)
    config = {f.name for f in dataclasses.fields(ServerConfig)}
    assert options - INPUT_ONLY == config - CONFIG_ONLY
    assert INPUT_ONLY.isdisjoint(config) and CONFIG_ONLY <= config


def test_an_option_left_out_takes_the_config_fields_default_and_an_unknown_one_is_refused():
    s = Server(max_memory=1 << 20)
    try:
        for f in dataclasses.fields(ServerConfig):
            if f.name in ServerOptions.__annotations__ and f.default is not dataclasses.MISSING:
                assert getattr(s.config, f.name) == f.default, f.name
        assert s.config.max_memory == 1 << 20 and s.config.host == "127.0.0.1" and s.config.port == 0
    finally:
        s.close()
    with pytest.raises(TypeError, match="max_memry"):
        Server(max_memry=1 << 20)  # type: ignore[call-arg]


def test_what_applying_a_delta_takes_is_charged_before_it_is_decoded():
    """A SPARSE DELTA of a few hundred bytes whose one chunk says every element changed decodes
    to several times the tensor: that is charged before it is decoded, in and out of place, so
    a server with room for the base, the result and the payload refuses it at its limit."""
    import blake3
    import zstandard

    from weightlift.remote.protocol import Commit, CommitReply, Delta, DeltaEncoding, Update

    n = 1 << 20
    base = np.full(n, 0xAB, np.uint8)
    d0, d1 = blake3.blake3(base).digest(), blake3.blake3(bytes(n)).digest()
    blob = struct.pack("<II", n, 0) + struct.pack("<I", 1) * (n - 1) + bytes(n)  # every element set to 0
    frame = zstandard.ZstdCompressor(level=1).compress(blob)
    payload = struct.pack("<III", n, 1, len(frame)) + frame
    limit = 2 * entry_cost("w", n) + (2 << 20)  # room for the base and the result, not the decode
    with Server(max_memory=limit) as s:
        raw = Raw.connected(s.address)
        raw.send(Alloc(0, "w", "U8", (n,), n, d0, True))  # verified: the server knows its digest
        raw.send(WriteHeader(0, 0, n), base.tobytes())
        assert _barrier(raw).tensors == 1
        for tid, flags in ((1, None), (2, Update.FLAG_IN_PLACE)):
            if flags is not None:
                raw.send(Update(flags))
            raw.send(Delta(tid, "w", "U8", (n,), n, DeltaEncoding.SPARSE, d0, d1, len(payload)), payload)
            reply = _barrier(raw)
            if flags is None:
                assert reply.errors and "memory limit" in reply.errors[0]
            else:
                raw.send(Commit())
                commit = raw.recv()
                assert isinstance(commit, CommitReply) and not commit.ok and "memory limit" in commit.message
            assert s.tensors()["w"].tobytes() == base.tobytes() and s.memory_used <= limit
        raw.close()


def test_an_in_place_commits_wait_for_readers_is_bounded_also_without_an_io_timeout():
    import inspect

    from weightlift.remote.client import Client
    from weightlift.remote.server.config import GATE_TIMEOUT

    client_default = inspect.signature(Client).parameters["timeout"].default
    assert ServerConfig(max_memory=0, io_timeout=5.0).gate_timeout == 5.0
    # below the client's default timeout: a client waiting for its COMMIT hears the refusal
    assert ServerConfig(max_memory=0, io_timeout=60.0).gate_timeout == GATE_TIMEOUT == 20.0 < client_default
    assert ServerConfig(max_memory=0, io_timeout=None).gate_timeout == GATE_TIMEOUT
    with Server(io_timeout=None) as s:  # a server without an I/O deadline: the config it runs with
        assert s.config.io_timeout is None and s.config.gate_timeout == GATE_TIMEOUT


def test_a_cuda_budget_is_what_is_free_less_headroom():
    gib = 1 << 30
    assert cuda_budget(free=100 * gib, total=141 * gib) == 100 * gib - int(141 * gib * 0.05)
    assert cuda_budget(free=10 * gib, total=16 * gib) == 9 * gib  # at least 1 GiB of headroom
    assert cuda_budget(free=gib // 2, total=16 * gib) == 0


def test_a_bare_cuda_server_names_the_callers_device_and_what_is_free_there(monkeypatch):
    """``Server(device="cuda")`` after ``set_device(1)``: every connection's target is on cuda:1
    (the connection threads' own current device is 0), and the default cap is what cuda:1 has free."""
    torch = pytest.importorskip("torch")
    gib = 1 << 30
    asked = []

    def mem_get_info(dev):
        asked.append(str(dev))
        return 60 * gib, 80 * gib

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda, "current_device", lambda: 1)
    monkeypatch.setattr(cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(cuda, "memory_reserved", lambda dev=None: 2 * gib)
    monkeypatch.setattr(cuda, "memory_allocated", lambda dev=None: gib)
    with Server(device="cuda", framework="torch") as s:
        assert s.device == "cuda:1"
        assert asked == ["cuda:1"]
        assert s.max_memory == cuda_budget(61 * gib, 80 * gib) < 80 * gib
