"""Reading large cache entries with several readers: the same bytes, the same checks, and no
reader left writing into the destination once the read has returned or failed."""

from __future__ import annotations

import os
import threading
from dataclasses import replace

import blake3
import numpy as np
import pytest

import weightlift.remote.server.cache as cache_mod
import weightlift.remote.server.cache.read as read_mod
from weightlift.errors import CacheError
from weightlift.remote.server.cache import TensorCache


@pytest.fixture
def small_pieces(monkeypatch):
    """Entries of a few KiB take the parallel path, in many pieces."""
    monkeypatch.setattr(read_mod, "PARALLEL_READ_MIN", 1)
    monkeypatch.setattr(cache_mod, "READ_CHUNK", 4096)


def _put(cache: TensorCache, data: bytes) -> bytes:
    d = blake3.blake3(data).digest()
    with cache.writer(d, len(data)) as w:
        w.write(data)
        w.commit()
    return d


def _data(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_a_large_entry_is_read_by_the_readers_byte_for_byte(tmp_path, small_pieces):
    cache = TensorCache(tmp_path)
    data = _data(100_003, 1)  # not a whole number of pieces
    d = _put(cache, data)
    seen: list[tuple[int, int]] = []
    threads: set[str] = set()

    def before(b: int, e: int) -> None:
        seen.append((b, e))
        threads.add(threading.current_thread().name)

    out = bytearray(len(data))
    cache.read_into(d, out, before=before)
    assert bytes(out) == data
    assert sorted(seen) == [(b, min(b + 4096, len(data))) for b in range(0, len(data), 4096)]
    caller = threading.current_thread().name  # the caller reads too, beside its helpers
    assert all(t == caller or t.startswith("weightlift-cache-read") for t in threads)


def test_the_caller_and_a_connections_helper_share_the_read(tmp_path, small_pieces):
    # The caller's first piece waits until a helper has landed one: both read, and the bytes
    # and the digest still come out whole and in order.
    cache = TensorCache(tmp_path)
    data = _data(64 * 4096 + 5, 5)
    d = _put(cache, data)
    caller = threading.current_thread()
    helped = threading.Event()
    by: dict[int, str] = {}

    def before(b: int, e: int) -> None:
        by[b] = threading.current_thread().name
        if threading.current_thread() is not caller:
            helped.set()
        elif b == 0:
            assert helped.wait(10), "no helper took a piece"

    readers = read_mod.reader_pool()
    try:
        for _ in range(3):  # the same helpers, read after read
            out = bytearray(len(data))
            by.clear()
            helped.clear()
            cache.read_into(d, out, before=before, readers=readers)
            assert bytes(out) == data
            assert by[0] == caller.name
            assert any(name.startswith("weightlift-cache-read") for name in by.values())
    finally:
        readers.close()


def test_a_helper_that_comes_late_touches_nothing(tmp_path, small_pieces, monkeypatch):
    # The helper is held up until the caller has read the whole entry alone and returned: it
    # finds the read closed, writes nothing into the (since reused) destination, and is still
    # there for the next read.
    cache = TensorCache(tmp_path)
    data = _data(40 * 4096, 6)
    d = _put(cache, data)
    gate = threading.Event()
    join = read_mod._ReadJob.join

    def late_join(job):  # only helpers join: the caller works without
        gate.wait(10)
        return join(job)

    monkeypatch.setattr(read_mod._ReadJob, "join", late_join)
    readers = read_mod.Readers(helpers=1)
    try:
        out = bytearray(len(data))
        cache.read_into(d, out, readers=readers)
        assert bytes(out) == data
        out[:] = bytes(len(out))  # the memory goes to someone else
        gate.set()
        again = bytearray(len(data))
        cache.read_into(d, again, readers=readers)
        assert bytes(again) == data
    finally:
        gate.set()
        readers.close()  # the helper has seen both reads and left
    assert bytes(out) == bytes(len(out))


def test_a_corrupt_large_entry_is_dropped(tmp_path, small_pieces):
    cache = TensorCache(tmp_path)
    data = _data(60_000, 2)
    d = _put(cache, data)
    path = cache.path_for(d)
    raw = bytearray(open(path, "rb").read())
    raw[50_000] ^= 1
    open(path, "wb").write(raw)
    with pytest.raises(CacheError, match="does not match"):
        cache.read_into(d, bytearray(len(data)))
    assert not os.path.exists(path)


def test_a_read_that_fails_midway_leaves_no_reader_writing(tmp_path, small_pieces, monkeypatch):
    cache = TensorCache(tmp_path)
    data = _data(80_000, 3)
    d = _put(cache, data)
    real = read_mod._pread_exact
    running = []

    def pread(fd, chunk, offset):
        running.append(offset)
        if offset == 40_960:
            raise read_mod.BadRead("is unreadable (test)")
        real(fd, chunk, offset)
        running.remove(offset)

    monkeypatch.setattr(read_mod, "_pread_exact", pread)
    with pytest.raises(CacheError, match="unreadable"):
        cache.read_into(d, bytearray(len(data)))
    assert running == [40_960]  # every other read started had finished when read_into raised
    assert not os.path.exists(cache.path_for(d))


def test_an_error_in_before_passes_through_and_keeps_the_entry(tmp_path, small_pieces):
    cache = TensorCache(tmp_path)
    data = _data(50_000, 4)
    d = _put(cache, data)

    def before(b: int, e: int) -> None:
        if b >= 20_000:
            raise MemoryError("no memory for the destination")

    with pytest.raises(MemoryError):
        cache.read_into(d, bytearray(len(data)), before=before)
    assert cache.has(d, len(data))


def test_a_fill_from_the_cache_waits_for_the_faulter_on_its_destination(tmp_path, monkeypatch):
    # A tensor allocated without a digest gets its destination at ALLOC, handed to the
    # connection's faulter, whose helpers write into the pages they fault. Filled from the cache
    # instead, that memory must leave the faulter first: a helper still faulting it would write
    # over bytes the cache's readers have landed and hashed, and the tensor published corrupt.
    import weightlift.memory.faulter as faulter_mod
    import weightlift.remote.protocol as P
    import weightlift.remote.server.receive as receive_mod
    from tests.remote.rawclient import Raw, _barrier
    from weightlift.memory.fresh import policy
    from weightlift.remote.server.server import Server

    data = _data(3 * 1024 * 1024, 7)  # pooled: fresh memory, faulted ahead by the helpers
    d = _put(TensorCache(tmp_path / "c"), data)
    monkeypatch.setattr(receive_mod, "fill_policy", lambda: replace(policy(), helpers=1))
    started, go = threading.Event(), threading.Event()
    fault_in, cancel = faulter_mod.fault_in, faulter_mod.Faulter.cancel

    def held_fault_in(buf, **kw):  # the helper is inside its piece until the region is let go
        started.set()
        go.wait(10)
        fault_in(buf, method="touch")  # one zero written into each page

    def cancelling(self, key):
        go.set()
        cancel(self, key)

    monkeypatch.setattr(faulter_mod, "fault_in", held_fault_in)
    monkeypatch.setattr(faulter_mod.Faulter, "cancel", cancelling)
    with Server(cache_dir=tmp_path / "c") as s:
        raw = Raw.connected(s.address)
        raw.send(P.Alloc(0, "w", "U8", (len(data),), len(data), None))
        assert started.wait(10), "no helper faulted the destination in"
        raw.send(P.FillFromCache(0, d))
        assert _barrier(raw).tensors == 1
        go.set()
        assert s.tensors()["w"].tobytes() == data
        raw.close()
