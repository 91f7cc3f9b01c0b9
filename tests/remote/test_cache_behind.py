"""Cache entries written behind the push: off the path that publishes a tensor, from its memory,
never wrong, never before they are complete, and never holding memory past a replacement."""

from __future__ import annotations

import threading
import time

import numpy as np

from tests.remote.rawclient import Raw, _barrier, _cache_push, _cost, _f32
from weightlift.digest.blake import hash_buffer
from weightlift.memory.pool import size_class
from weightlift.remote.server.cache import CacheWriter
from weightlift.remote.server.cache import behind as cache_behind
from weightlift.remote.server.server import Server


def _entry(root, d):
    return root / d.hex()[:2] / d.hex()


class _Gate:
    """Holds every behind-write at its first piece until ``open()``; says when one is waiting."""

    def __init__(self, monkeypatch):
        self.waiting = threading.Event()
        self._go = threading.Event()
        real = CacheWriter.write

        def write(w, buf):
            self.waiting.set()
            assert self._go.wait(30)
            real(w, buf)

        monkeypatch.setattr(CacheWriter, "write", write)

    def open(self):
        self._go.set()


def test_a_push_does_not_wait_for_the_disk(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    a = _f32(700_000, 1)
    d = hash_buffer(a)
    with Server(cache_dir=tmp_path / "c") as s:
        raw = Raw(s.address)
        raw.hello()
        _cache_push(raw, a, 0, "w", d)
        assert _barrier(raw).tensors == 1  # published while its entry is not written
        assert np.array_equal(s.tensors()["w"], a)
        assert gate.waiting.wait(10)
        assert not _entry(tmp_path / "c", d).exists()  # nothing visible before it is whole
        gate.open()
        assert s.cache.flush(10)
        assert _entry(tmp_path / "c", d).read_bytes() == a.tobytes()


def test_an_entry_being_written_is_waited_for_by_the_next_push(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    a = _f32(700_000, 2)
    d = hash_buffer(a)
    with Server(cache_dir=tmp_path / "c") as s:
        assert s.cache is not None
        raw = Raw(s.address)
        raw.hello()
        _cache_push(raw, a, 0, "w", d)
        _barrier(raw)
        assert gate.waiting.wait(10) and s.cache.behind.pending(d)
        threading.Timer(0.3, gate.open).start()
        assert s.cache.has(d, a.nbytes)  # waits for the write in progress, then finds the entry
        assert not s.cache.behind.pending(d)


def test_a_tensor_written_into_before_its_entry_is_not_cached(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    a = _f32(700_000, 3)
    d = hash_buffer(a)
    with Server(cache_dir=tmp_path / "c") as s:
        assert s.cache is not None
        raw = Raw(s.address)
        raw.hello()
        _cache_push(raw, _f32(700_000, 4), 1, "first", hash_buffer(_f32(700_000, 4)))
        _barrier(raw)
        assert gate.waiting.wait(10)  # the writer holds at the first entry; "w" waits its turn
        _cache_push(raw, a, 0, "w", d)
        _barrier(raw)
        s.tensors(writable=True)["w"][10] += 1.0  # a reader changes the weights before the entry is written
        gate.open()
        assert s.cache.flush(10)
        assert not _entry(tmp_path / "c", d).exists()  # hashed as it was written: it no longer matches
        # "first" was handed out writable too while it was written unhashed: given up as well
        assert s.cache.behind.counts["written"] == 0 and s.cache.behind.counts["aborted"] == 1


def test_a_handle_given_out_during_the_write_aborts_the_entry(tmp_path, monkeypatch):
    a = _f32(700_000, 5)
    d = hash_buffer(a)
    with Server(cache_dir=tmp_path / "c") as s:
        real = CacheWriter.write

        def write(w, buf):
            s.tensors(writable=True)  # a writable handle goes out while the entry is written
            real(w, buf)

        monkeypatch.setattr(CacheWriter, "write", write)
        raw = Raw(s.address)
        raw.hello()
        _cache_push(raw, a, 0, "w", d)
        _barrier(raw)
        assert s.cache is not None and s.cache.flush(10)
        assert not _entry(tmp_path / "c", d).exists()
        assert s.cache.behind.counts["aborted"] == 1


def test_a_replaced_tensor_is_dropped_from_the_queue_and_its_memory_goes_back(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    blocker = _f32(700_000, 6)
    old, new = _f32(700_000, 7), _f32(700_000, 8)
    with Server(cache_dir=tmp_path / "c") as s:
        assert s.cache is not None
        raw = Raw(s.address)
        raw.hello()
        _cache_push(raw, blocker, 0, "blocker", hash_buffer(blocker))
        _barrier(raw)
        assert gate.waiting.wait(10)
        _cache_push(raw, old, 1, "w", hash_buffer(old))
        _barrier(raw)
        _cache_push(raw, new, 2, "w", hash_buffer(new))  # replaces "w" before its entry was written
        _barrier(raw)
        assert s.cache.behind.counts["dropped"] == 1
        # only the held tensors are charged: the replaced version's memory is not kept by the queue
        pooled = size_class(old.nbytes)
        assert s.memory_used == _cost("blocker", pooled) + _cost("w", pooled)
        gate.open()
        assert s.cache.flush(10)
        assert not _entry(tmp_path / "c", hash_buffer(old)).exists()
        assert _entry(tmp_path / "c", hash_buffer(new)).read_bytes() == new.tobytes()


def test_a_full_queue_skips_caching_and_never_holds_the_push(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_behind, "MAX_JOBS", 1)
    gate = _Gate(monkeypatch)
    arrays = [_f32(700_000, 10 + i) for i in range(3)]
    with Server(cache_dir=tmp_path / "c") as s:
        assert s.cache is not None
        raw = Raw(s.address)
        raw.hello()
        for i, a in enumerate(arrays):
            _cache_push(raw, a, i, f"w{i}", hash_buffer(a))
            assert _barrier(raw).tensors == 1
            if i == 0:
                assert gate.waiting.wait(10)  # the first is being written, the second waits
        assert s.cache.behind.counts["skipped"] == 1
        gate.open()
        assert s.cache.flush(10)
        assert [_entry(tmp_path / "c", hash_buffer(a)).exists() for a in arrays] == [True, True, False]


def test_closing_the_server_writes_what_is_queued(tmp_path):
    arrays = [_f32(700_000, 20 + i) for i in range(4)]
    with Server(cache_dir=tmp_path / "c") as s:
        raw = Raw(s.address)
        raw.hello()
        for i, a in enumerate(arrays):
            _cache_push(raw, a, i, f"w{i}", hash_buffer(a))
        assert _barrier(raw).tensors == 4
    assert all(_entry(tmp_path / "c", hash_buffer(a)).read_bytes() == a.tobytes() for a in arrays)


class _Recording:
    def __init__(self):
        self.written = threading.Event()

    def __call__(self, digest, length, hashed):
        rec = self

        class W:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                pass

            def write(self, buf):
                pass

            def commit(self):
                rec.written.set()

        return W()


def _queued_while_receiving() -> tuple[_Recording, cache_behind.WriteBehind]:
    """A writer with one entry queued while connection 1 has a tensor in flight."""
    rec = _Recording()
    behind = cache_behind.WriteBehind(rec)
    behind.receiving(1, True)
    a = np.zeros(1000, np.uint8)
    assert behind.submit(b"d" * 32, a, a, lambda: True)
    return rec, behind


def test_the_writer_waits_while_a_connection_is_receiving(monkeypatch):
    rec, behind = _queued_while_receiving()
    assert not rec.written.wait(0.3)  # a tensor is still in flight on connection 1
    behind.receiving(1, False)
    assert rec.written.wait(10)
    behind.close()


def test_a_gap_between_two_tensors_does_not_start_the_writer(monkeypatch):
    # A push leaves a moment with nothing in flight between one tensor and the next ALLOC: the
    # writer starts only once no tensor has been in flight for QUIET_S.
    monkeypatch.setattr(cache_behind, "QUIET_S", 1.0)
    rec, behind = _queued_while_receiving()
    behind.receiving(1, False)  # the gap
    time.sleep(0.05)
    behind.receiving(1, True)  # the next tensor
    assert not rec.written.wait(0.3)
    behind.receiving(1, False)  # the push is over
    assert rec.written.wait(10)
    behind.close()


def test_the_writer_waits_for_the_receive_a_bounded_while(monkeypatch):
    monkeypatch.setattr(cache_behind, "MAX_DEFER_S", 0.2)
    rec, behind = _queued_while_receiving()  # on a connection that never finishes
    assert rec.written.wait(10)
    behind.close()


def test_an_in_place_update_waits_for_the_entry_being_written_from_its_base(tmp_path, monkeypatch):
    # v0's entry is being written behind from v0's memory when an in-place update changes that
    # memory: the switch waits for the entry first, so the entry named by v0's digest holds v0
    from weightlift.remote.client import Client

    gate = _Gate(monkeypatch)
    rng = np.random.default_rng(5)
    v0 = rng.standard_normal(1 << 20).astype(np.float32)
    v1 = v0.copy()
    v1[rng.choice(v1.size, v1.size // 100, replace=False)] += 1.0
    d0 = hash_buffer(v0)
    with Server(cache_dir=tmp_path / "c") as s, Client(s.address, keep_base=True) as c:
        c.push({"w": v0})
        assert gate.waiting.wait(10) and s.cache.behind.pending(d0)
        threading.Timer(0.5, gate.open).start()
        r = c.push({"w": v1}, in_place=True)
        assert r.deltas == 1 and np.array_equal(s.tensors()["w"], v1)
        assert s.cache.flush(10)
        assert _entry(tmp_path / "c", d0).read_bytes() == v0.tobytes()


def test_an_in_place_switch_between_a_publish_and_its_entry_queued_leaves_no_entry_under_the_old_digest(
    tmp_path, monkeypatch
):
    # v0 is published and visible, its entry not queued yet, when another client switches v1 in
    # place into v0's memory. The entry is then written unhashed (the bytes were proven as they
    # arrived) from memory that holds v1: filed under v0's digest, it would be a wrong entry that
    # HAVE offers and every FILL of v0 reads, refuses and removes. The switch must drop the
    # entry's job, or the job must write v0's bytes.
    from weightlift.remote.client import Client
    from weightlift.remote.server import receive

    rng = np.random.default_rng(9)
    v0 = rng.standard_normal(1 << 20).astype(np.float32)
    v1 = v0.copy()
    v1[rng.choice(v1.size, v1.size // 100, replace=False)] += 1.0
    d0 = hash_buffer(v0)
    published, switched = threading.Event(), threading.Event()
    real = receive.sealed_since

    def between(store, name, tensor, **kw):  # runs after the publish, before the job is queued
        if published.is_set():
            return real(store, name, tensor, **kw)
        published.set()
        # until the switch is done, or waits for this receive (its claim taken, nothing changed)
        for _ in range(30_000):
            if switched.is_set() or store._gates.busy()[1]:
                break
            switched.wait(0.001)
        return real(store, name, tensor, **kw)

    monkeypatch.setattr(receive, "sealed_since", between)
    with Server(cache_dir=tmp_path / "c") as s:
        raw = Raw(s.address)
        raw.hello()
        first = threading.Thread(target=lambda: (_cache_push(raw, v0, 0, "w", d0), _barrier(raw)), daemon=True)
        first.start()  # a push of v0 outside an update: visible once published
        assert published.wait(30)
        with Client(s.address) as c:
            assert c.push({"w": v1}, base={"w": v0}, in_place=True).deltas == 1
        switched.set()
        first.join(30)
        assert not first.is_alive() and np.array_equal(s.tensors()["w"], v1)
        assert s.cache is not None and s.cache.flush(10)
        entry = _entry(tmp_path / "c", d0)
        assert not entry.exists() or entry.read_bytes() == v0.tobytes()
