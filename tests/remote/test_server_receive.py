"""Receiving tensors: ALLOC, WRITE and FILL_FROM_CACHE until each completes, the receive paths,
the fills from memory and the disk cache, and what the next BARRIER reports.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import weightlift.memory.faulter as faulter_mod
import weightlift.memory.fresh as fresh_mod
import weightlift.remote.protocol as P
import weightlift.remote.server.receive as receive_mod
from tests.remote.rawclient import Raw, _barrier, _cache_push, _cached, _cost, _entry, _f32, _fill, _put
from tests.waiting import wait_for
from weightlift.digest.blake import hash_buffer
from weightlift.remote.protocol import (
    Alloc,
    BarrierReply,
    Capability,
    Free,
    FreeReply,
    Have,
    HaveReply,
    ListReply,
    ListRequest,
    WriteHeader,
    send,
)
from weightlift.remote.server.server import Server


def test_tensor_invisible_until_every_byte_arrived(server):
    raw = Raw.connected(server.address)
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
    raw = Raw.connected(server.address)
    raw.send(Alloc(0, "half", "F32", a.shape, a.nbytes))
    raw.sock.sendall(send(WriteHeader(0, 0, a.nbytes)) + a.tobytes()[: a.nbytes // 2])
    raw.close()
    deadline = time.monotonic() + 10
    while server.memory_used and time.monotonic() < deadline:  # the server notices the close
        time.sleep(0.01)
    assert server.memory_used == 0
    assert server.tensors() == {}
    other = Raw.connected(server.address)
    _put(other, 0, "next", a)
    assert _barrier(other).tensors == 1
    assert list(server.tensors()) == ["next"]


def test_same_name_replaces_and_frees_the_old(server):
    raw = Raw.connected(server.address)
    _put(raw, 0, "w", _f32(100, 1))
    _put(raw, 1, "w", _f32(100, 2))
    _barrier(raw)
    assert np.array_equal(server.tensors()["w"], _f32(100, 2))
    assert server.memory_used == _cost("w", 400)


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
        assert raw.recv() == HaveReply((True, False))  # held in memory, its bytes proven
        assert s.cache is not None and s.cache.flush(10)  # the entry is written behind the push
        entry = _entry(tmp_path / "c", d)
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
    with _cached(tmp_path / "c", a, d):
        pass  # pushed named by its digest; the server stops
    with Server(cache_dir=tmp_path / "c") as s:  # restarted: the bytes are only on disk now
        second = Raw.connected(s.address)
        _fill(second, a, 0, "w.copy", d)
        assert _barrier(second) == BarrierReply(1, 0)
        assert np.array_equal(s.tensors()["w.copy"], a)
        assert s.stats()["bytes_received"] == 0 and s.stats()["cache_hits"] == 1
        second.send(Free(("w.copy",)))  # nothing held in memory: the disk entry is the only source
        assert second.recv() == FreeReply(1)

        entry = _entry(tmp_path / "c", d)
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
        assert s.cache.flush(10)  # the entry is written behind the push
        assert entry.read_bytes() == a.tobytes()  # and cached afresh


def test_second_push_of_a_held_tensor_keeps_its_memory(tmp_path):
    a = _f32(700_000, 8)  # above the pool's minimum: huge-page backed
    d = hash_buffer(a)
    with _cached(tmp_path / "c", a, d) as (s, raw):
        assert s.cache.flush(10)  # the entry is written behind the push
        held = s.tensors()["w"]
        used = s.memory_used
        _entry(tmp_path / "c", d).unlink()  # only the held tensor has these bytes now
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
    from weightlift.remote.server import receive as fills

    hashed: list[int] = []
    real = fills.digest_of
    monkeypatch.setattr(fills, "digest_of", lambda buf: hashed.append(len(memoryview(buf).cast("B"))) or real(buf))
    a = _f32(700_000, 7)
    d = hash_buffer(a)
    with _cached(tmp_path / "c", a, d) as (s, raw):
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
    with _cached(tmp_path / "c", a, d) as (s, raw):
        assert s.cache.flush(10)  # the entry is written behind the push
        s.tensors(writable=True)["w"][10] += 1.0  # a reader changed its weights
        _fill(raw, a, 1, "w", d)
        assert _barrier(raw) == BarrierReply(1, 0)
        assert np.array_equal(s.tensors()["w"], a)  # the pushed bytes, from the verified disk entry
        st = s.stats()
        assert st["memory_hits"] == 0 and st["cache_hits"] == 1
        # with no disk entry either, the client is asked for the bytes
        _entry(tmp_path / "c", d).unlink()
        s.tensors(writable=True)["w"][10] += 1.0
        _fill(raw, a, 2, "w", d)
        assert _barrier(raw) == BarrierReply(0, 0, (), (2,))


def test_naive_arm_receives_the_same_bytes(monkeypatch):
    monkeypatch.setenv("WEIGHTLIFT_LOAD_OPT", "0")
    with Server() as s:
        raw = Raw.connected(s.address)
        a = _f32(10_000, 8)
        _put(raw, 0, "w", a)
        _barrier(raw)
        assert s.tensors()["w"].tobytes() == a.tobytes()


@pytest.fixture
def touched(monkeypatch) -> list[int]:
    """The length of every piece faulted in, by a faulter helper or by the receiver."""
    pieces: list[int] = []
    real = faulter_mod.fault_in

    def counting(buf):
        pieces.append(len(buf))
        real(buf)

    monkeypatch.setattr(faulter_mod, "fault_in", counting)
    monkeypatch.setattr(receive_mod, "populate", counting)
    return pieces


def test_fresh_destination_is_faulted_in_at_most_a_window_ahead_of_the_payload(monkeypatch, request, touched):
    # with the receiver faulting what the helpers have not reached (one fill policy), every
    # page is faulted exactly once, by a helper or by the receiver
    monkeypatch.setenv("WEIGHTLIFT_FAULT_AHEAD", "1")
    fresh_mod.reset_policy()
    request.addfinalizer(fresh_mod.reset_policy)  # the policy read under this environment is forgotten again
    piece = 64 * 1024
    monkeypatch.setattr(receive_mod, "FAULT_PIECE", piece)
    monkeypatch.setattr(receive_mod, "FAULT_WINDOW", 4 * piece)
    with Server() as s:
        raw = Raw.connected(s.address)
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
        raw = Raw.connected(s.address)
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
        raw = Raw.connected(s.address)
        _put(raw, 0, "after", np.arange(1 << 20, dtype=np.float32))
        assert _barrier(raw).tensors == 1


def test_ranges_merge_in_any_order():
    rng = np.random.default_rng(7)
    n = 200
    for _ in range(10):
        p = receive_mod.Pending(Alloc(0, "t", "U8", (n,), n), 0, None)
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
    k = receive_mod.MAX_RANGES
    n = 2 * k + 4
    raw = Raw.connected(server.address)
    frames = [send(Alloc(0, "holes", "U8", (n,), n))]
    frames += [send(WriteHeader(0, 2 * i, 1)) + b"x" for i in range(k + 2)]  # k fit, then one too many
    raw.sock.sendall(b"".join(frames))
    reply = _barrier(raw)
    assert reply.tensors == 0 and len(reply.errors) == 1  # the WRITE after is drained quietly
    assert f"more than {k} separate byte ranges" in reply.errors[0]
    assert server.memory_used == 0 and server.tensors() == {}
    _put(raw, 0, "again", _f32(4))  # the id is free again
    assert _barrier(raw).tensors == 1


def test_errors_kept_per_connection_are_capped_and_the_rest_counted(server):
    extra = 10
    raw = Raw.connected(server.address)
    raw.sock.sendall(send(WriteHeader(7, 0, 0)) * (P.MAX_ERRORS + extra))
    raw.send(ListRequest())  # a reply after the WRITEs: they have all been handled
    assert isinstance(raw.recv(), ListReply)
    reply = _barrier(raw)
    assert len(reply.errors) == P.MAX_ERRORS
    assert all("not allocated" in e for e in reply.errors[:-1])
    assert reply.errors[-1] == f"... and {extra + 1} more errors"
    assert server.stats()["errors"] == P.MAX_ERRORS + extra
    assert _barrier(raw) == BarrierReply(0, 0)


def test_what_a_connection_keeps_for_its_barrier_is_bounded():
    from weightlift.remote.server.receive import Outcomes
    from weightlift.remote.server.store import Store

    store = Store(max_memory=1 << 20, pool=None, remember_digests=False)
    kept = Outcomes(store, max_digests=3)
    for i in range(P.MAX_ERRORS + 10):
        kept.error(f"error {i} " + "x" * (2 * P.MAX_MESSAGE))
    assert len(kept.errors) == P.MAX_ERRORS and kept.dropped_errors == 10  # kept: bounded; the rest: counted
    assert all(len(e) <= P.MAX_MESSAGE for e in kept.errors)
    for i in range(P.MAX_TENSORS + 5):
        kept.mark_failed(i)
    assert len(kept.failed) == P.MAX_TENSORS and 0 not in kept.failed  # the oldest forgotten
    for i in range(5):
        kept.add_verified(i, bytes(32))
    reply = kept.barrier(P.Barrier.FLAG_DIGESTS)
    assert [i for i, _ in reply.digests] == [0, 1, 2] and reply.errors[-1] == "... and 12 more errors"
    assert store.stats()["errors"] == P.MAX_ERRORS + 11  # the lost digests are one more error
    assert kept.barrier() == BarrierReply(0, 0)


def test_need_list_names_each_pending_tensor_once(server):
    raw = Raw.connected(server.address)
    raw.send(Alloc(0, "a", "U8", (4,), 4))
    raw.send(Alloc(1, "b", "U8", (4,), 4))
    for _ in range(3):  # no cache here: every fill is a need, but each id is asked for once
        raw.send(P.FillFromCache(0, bytes(32)))
        raw.send(P.FillFromCache(1, bytes(32)))
    raw.send(WriteHeader(1, 0, 4), b"bbbb")  # its bytes came anyway: not needed any more
    reply = _barrier(raw)
    assert reply.need == (0,) and reply.tensors == 1


def test_bad_requests_are_reported_at_the_barrier_and_the_connection_lives(server):
    raw = Raw.connected(server.address)
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


def test_a_weight_update_into_reused_memory_faults_nothing_in(touched):
    # the third version of a tensor lands in the first one's pool memory, every page of it
    # touched already: neither the receiver nor a helper asks the kernel to fault it in again
    with Server() as s:
        raw = Raw.connected(s.address)
        for version in range(3):
            if version == 2:
                touched.clear()
            a = _f32(700_000, 40 + version)
            _put(raw, version, "w", a)
            assert _barrier(raw).tensors == 1
            assert np.array_equal(s.tensors()["w"], a)
        assert s.stats()["pooled"] >= 1 and touched == []
