"""The pool of touched host memory: reuse only after the last view is gone, trim, close."""

from __future__ import annotations

import gc
import mmap
import weakref

import numpy as np

import weightlift.memory.pool as pool_mod
from weightlift.memory.pool import MAPPED_MIN, POOL_MIN, HostPool, held_bytes, own_mappings, size_class


def test_memory_comes_back_only_when_the_last_view_is_gone():
    pool = HostPool()
    a = pool.take(3 * 2**20 + 5)
    assert a.size == 3 * 2**20 + 5 and a.dtype == np.uint8 and a.flags.writeable
    a[:] = 7
    view = a[10:20].view(np.int8)  # a reader's view keeps the memory in use
    del a
    gc.collect()
    assert pool.idle_bytes == 0
    del view
    assert pool.idle_bytes == size_class(3 * 2**20 + 5)
    b = pool.take(3 * 2**20 + 100)  # same size class: the same, already touched memory
    assert pool.reused == 1 and pool.idle_bytes == 0
    assert b[0] == 7  # not zeroed again: whoever takes it overwrites every byte
    c = pool.take(9 * 2**20)  # another class: fresh
    assert pool.reused == 1
    del b, c
    assert pool.idle_bytes == size_class(3 * 2**20) + size_class(9 * 2**20)


def test_small_buffers_are_not_pooled():
    pool = HostPool()
    a = pool.take(POOL_MIN - 1)
    del a
    assert pool.idle_bytes == 0 and pool.take(0).size == 0


def test_trim_and_close_give_memory_back():
    pool = HostPool()
    arrays = [pool.take(4 * 2**20) for _ in range(3)]
    del arrays
    assert pool.idle_bytes == 3 * 4 * 2**20
    assert pool.trim(keep=5 * 2**20) == 2 * 4 * 2**20
    assert pool.idle_bytes == 4 * 2**20
    alive = pool.take(2 * 2**20)
    pool.close()
    assert pool.idle_bytes == 0
    alive[:] = 1  # an array still alive keeps its memory
    del alive
    assert pool.idle_bytes == 0  # and frees it itself after close


def _wait(cond) -> None:
    import time

    deadline = time.monotonic() + 10
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_reserve_faults_in_the_background_and_never_touches_what_was_carved():
    pool = HostPool()
    pool.reserve(256 * 2**20)
    assert pool.idle_bytes == 256 * 2**20  # counted from the start
    arrays = []
    for i in range(40):  # carve while the faulting thread runs (or fall back to fresh memory)
        a = pool.take(3 * 2**20)
        a[:] = i % 251
        arrays.append(a)
    _wait(lambda: pool.reserved[0] == pool.reserved[1])
    assert pool.reserved == (256 * 2**20, 256 * 2**20)
    for i, a in enumerate(arrays):
        assert a.min() == a.max() == i % 251, i  # the faulting thread wrote no zero into them
    carved = pool.reused
    b = pool.take(5 * 2**20)  # faulted by now: carved from the reserve
    assert pool.reused == carved + 1
    assert not any(np.shares_memory(b, a) for a in arrays)
    del b
    assert pool.idle_bytes >= 6 * 2**20


def test_trim_gives_back_the_uncarved_reserve_and_keeps_the_carved():
    pool = HostPool()
    pool.reserve(64 * 2**20)
    _wait(lambda: pool.reserved[0] == pool.reserved[1])
    a = pool.take(4 * 2**20)
    a[:] = 9
    assert pool.idle_bytes == 60 * 2**20
    assert pool.trim(keep=10 * 2**20) == 50 * 2**20
    assert pool.idle_bytes == 10 * 2**20 and pool.reserved == (14 * 2**20, 14 * 2**20)
    assert a.min() == a.max() == 9
    pool.close()
    assert pool.idle_bytes == 0 and a.min() == 9


def test_a_carve_ahead_of_the_reserve_thread_waits_for_it():
    pool = HostPool()
    pool.reserve(512 * 2**20)
    big = pool.take(400 * 2**20)  # almost certainly beyond what is faulted yet: waits, then is handed out
    faulted, total = pool.reserved
    assert faulted >= 400 * 2**20 and total == 512 * 2**20
    big[:] = 3
    _wait(lambda: pool.reserved[0] == pool.reserved[1])
    assert big.min() == big.max() == 3  # the thread went on past it without writing into it
    assert pool.servable(100 * 2**20) == 100 * 2**20 and pool.servable(200 * 2**20) == 0
    pool.close()
    assert pool.idle_bytes == 0 and big.min() == 3


def test_mid_sized_buffers_are_mappings_of_their_own_that_go_with_them():
    # From malloc, a buffer freed by one of a server's threads would stay in that thread's
    # arena; a mapping of its own is unmapped when the last view of it goes.
    pool = HostPool()
    a, fresh = pool.take_marked(MAPPED_MIN + 5)
    assert a.size == MAPPED_MIN + 5 and a.flags.writeable and not fresh
    mapping = a.base.obj  # frombuffer's memoryview of the mapping
    assert isinstance(mapping, mmap.mmap)
    gone = weakref.ref(mapping)
    a[:] = 3
    view = a[1:4]
    del a, mapping
    assert gone() is not None and view.tolist() == [3, 3, 3]  # a view keeps it
    del view
    assert gone() is None and pool.idle_bytes == 0  # unmapped, never pooled
    small, fresh = pool.take_marked(MAPPED_MIN - 1)
    assert not isinstance(getattr(small.base, "obj", None), mmap.mmap) and not fresh


def test_held_bytes_are_the_pages_a_take_holds():
    page = mmap.PAGESIZE
    assert held_bytes(0) == 0 and held_bytes(MAPPED_MIN - 1) == MAPPED_MIN - 1  # malloc: its bytes
    assert held_bytes(MAPPED_MIN) == MAPPED_MIN and held_bytes(MAPPED_MIN + 1) == MAPPED_MIN + page
    assert held_bytes(POOL_MIN - 1) == POOL_MIN  # whole pages of a mapping of its own
    assert held_bytes(POOL_MIN + 1) == size_class(POOL_MIN + 1) == 2 * POOL_MIN
    a = HostPool().take(MAPPED_MIN + 1)
    assert len(a.base.obj) == held_bytes(MAPPED_MIN + 1)  # the mapping is that many bytes


def test_the_bound_on_mappings_of_their_own_is_well_under_the_kernel_limit():
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
    except OSError:
        limit = pool_mod.DEFAULT_MAX_MAP_COUNT
    assert pool_mod.MAPPINGS_BOUND == limit // 4


def test_past_the_bound_mid_sized_buffers_come_from_malloc_with_their_bytes_exact(monkeypatch):
    gc.collect()
    start = own_mappings()
    monkeypatch.setattr(pool_mod, "MAPPINGS_BOUND", start + 3)
    pool = HostPool()
    sizes = [MAPPED_MIN + 5 + 4099 * i for i in range(6)]
    arrays = [pool.take(n) for n in sizes]
    mapped = [isinstance(getattr(a.base, "obj", None), mmap.mmap) for a in arrays]
    assert mapped == [True] * 3 + [False] * 3 and pool.unmapped == 3
    assert own_mappings() == start + 3
    for i, a in enumerate(arrays):
        a[:] = np.arange(a.size, dtype=np.uint64).astype(np.uint8) ^ i
    for i, (a, n) in enumerate(zip(arrays, sizes, strict=True)):
        assert a.size == n and a.tobytes() == (np.arange(n, dtype=np.uint64).astype(np.uint8) ^ i).tobytes()
    view = arrays[0][5:9]
    del arrays[0]
    assert own_mappings() == start + 3  # a view keeps the mapping, and its count
    del view
    assert own_mappings() == start + 2  # unmapped with its last view: room for one more
    again = pool.take(MAPPED_MIN + 5)
    assert isinstance(again.base.obj, mmap.mmap) and own_mappings() == start + 3 and pool.unmapped == 3
    del arrays, again
    assert own_mappings() == start and pool.idle_bytes == 0  # none of them pooled
