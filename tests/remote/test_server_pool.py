"""The memory account and the pool: every tensor charged, idle pooled memory giving way, the
reserve, allocations ahead of the limit, and memory reused but never under a reader.
"""

from __future__ import annotations

import numpy as np
import pytest

import weightlift.memory.pool as pool_mod
import weightlift.remote.protocol as P
import weightlift.remote.server.config as config_mod
from tests.remote.rawclient import Raw, _barrier, _cache_push, _cost, _f32, _put
from tests.waiting import wait_for
from weightlift.digest.blake import hash_buffer
from weightlift.errors import OptionError
from weightlift.remote.protocol import (
    Alloc,
    BarrierReply,
    Error,
    Free,
    FreeReply,
    Read,
    ReadReply,
    WriteHeader,
)
from weightlift.remote.server.server import Server


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
        assert _barrier(raw).tensors == 1 and s.cache.flush(10)  # (the entry is written behind the push)
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


def test_default_memory_cap_is_most_of_physical_memory():
    total = __import__("os").sysconf("SC_PAGE_SIZE") * __import__("os").sysconf("SC_PHYS_PAGES")
    assert config_mod.default_max_memory("cpu") == int(total * 0.9)
    with Server() as s:
        assert s.max_memory == int(total * 0.9)
        raw = Raw(s.address)
        assert raw.hello().max_memory == s.max_memory
    assert Server(max_memory=123).max_memory == 123


def test_mid_sized_tensors_past_the_mapping_bound_land_in_malloc_charged_their_pages(monkeypatch):
    """Each tensor from MAPPED_MIN to POOL_MIN is a mapping of its own, one more against the
    kernel's vm.max_map_count; past the bound on live ones the server places them with malloc.
    Either way every byte lands, and each is charged the pages it holds, not its bytes."""
    import gc

    gc.collect()
    start = pool_mod.own_mappings()
    monkeypatch.setattr(pool_mod, "MAPPINGS_BOUND", start + 2)
    arrays = {f"t{i}": _f32(pool_mod.MAPPED_MIN // 4 + 1000 * i + 1, i) for i in range(6)}
    with Server() as s:
        raw = Raw.connected(s.address)
        for i, (name, a) in enumerate(arrays.items()):
            _put(raw, i, name, a)
        assert _barrier(raw).tensors == 6
        assert pool_mod.own_mappings() == start + 2  # two mappings of their own, four from malloc
        got = s.tensors()
        assert all(got[n].tobytes() == a.tobytes() for n, a in arrays.items())
        assert s.memory_used == sum(_cost(n, a.nbytes) for n, a in arrays.items())
        assert all(_cost(n, a.nbytes) > _cost(n, 0) + a.nbytes for n, a in arrays.items())  # pages, not bytes
        del got
        raw.send(Free(tuple(arrays)))
        assert raw.recv() == FreeReply(6)
        assert s.memory_used == 0
        wait_for(lambda: pool_mod.own_mappings() == start)
        raw.close()
