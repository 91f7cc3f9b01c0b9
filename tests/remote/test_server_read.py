"""READ, LIST and FREE: serving what the store holds back to clients."""

from __future__ import annotations

import threading

import numpy as np

import weightlift.remote.protocol as P
from tests.remote.rawclient import Raw, _barrier, _cost, _f32, _put
from tests.waiting import wait_for
from weightlift.remote.client import Client
from weightlift.remote.protocol import (
    Alloc,
    Error,
    ErrorCode,
    Free,
    FreeReply,
    Hello,
    ListReply,
    ListRequest,
    Read,
    ReadReply,
)
from weightlift.remote.server.server import Server
from weightlift.remote.server.store import Store


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


def test_server_free_drops_what_it_holds_and_its_cache_fills_the_next_push(tmp_path):
    arrays = {f"t{i}": _f32(600_000 + i, i) for i in range(3)}  # above the pool's smallest class
    with Server(cache_dir=tmp_path / "cache") as s:
        with Client(s.address) as c:
            first = c.push(arrays)
        assert s.cache is not None and s.cache.flush(10)  # written behind: now on disk
        held = s.memory_used
        assert s.free(["t0", "nope"]) == 1
        assert sorted(s.tensors()) == ["t1", "t2"] and s.memory_used < held
        assert s.free() == 2 and s.tensors() == {}
        wait_for(lambda: s.memory_used == 0)
        assert s.trim() > 0 and s.stats().pool_idle_bytes == 0
        with Client(s.address) as c:
            again = c.push(arrays)
        assert first.bytes_sent == sum(a.nbytes for a in arrays.values())
        assert again.bytes_sent == 0 and again.cached == 3  # the digests outlive the memory
        assert all(np.array_equal(s.tensors()[n], a) for n, a in arrays.items())


def test_cache_held_writes_what_arrived_as_changes_so_a_free_loses_no_digest(tmp_path):
    first = {f"t{i}": _f32(300_000, i) for i in range(3)}
    second = {n: a.copy() for n, a in first.items()}
    second["t0"][::1000] += 1  # a sparse change: it arrives as a DELTA, not whole and named
    with Server(cache_dir=tmp_path / "cache") as s:
        with Client(s.address, keep_base=True) as c:
            c.push(first, hash_threshold=0)
            step = c.push(second)
        assert step.deltas == 3 and s.cache is not None and s.cache.flush(10)
        assert s.cache_held() == 1  # t0's new version; t1 and t2 arrived whole, named by digest
        assert s.cache.flush(10) and s.cache_held() == 0
        s.free()
        with Client(s.address) as c:
            again = c.push(second, hash_threshold=0)
        assert again.bytes_sent == 0 and again.cached == 3
        assert all(np.array_equal(s.tensors()[n], a) for n, a in second.items())


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


class _SlowName(str):
    """A tensor name whose comparisons wait for a signal: shows where a listing compares names."""

    started = threading.Event()
    go = threading.Event()

    def _wait(self) -> None:
        type(self).started.set()
        type(self).go.wait(10)

    def __gt__(self, other):  # type: ignore[override]
        self._wait()
        return str.__gt__(self, other)

    def __lt__(self, other):  # type: ignore[override]
        self._wait()
        return str.__lt__(self, other)


def test_a_listing_compares_names_outside_the_store_lock():
    # Filtering and sorting every entry is the costly part of a LIST of a large store: while it
    # runs, another client's push (a charge, a publish) must not wait for it.
    store = Store(max_memory=1 << 30, pool=None, remember_digests=False)
    for name in ("a", _SlowName("b"), "c"):
        arr = np.zeros(4, dtype=np.uint8)
        store.publish(name, "U8", (4,), 4, arr, store.charge(100), None)
    got: list = []
    lister = threading.Thread(target=lambda: got.append(store.listing("", 10)))
    try:
        lister.start()
        assert _SlowName.started.wait(10)  # the listing is comparing names now
        pusher = threading.Thread(target=lambda: store.charge(10).release())
        pusher.start()
        pusher.join(3)
        assert not pusher.is_alive(), "a charge waited for a listing to sort its names"
    finally:
        _SlowName.go.set()
        lister.join(10)
    (page, more) = got[0]
    assert [n for n, _ in page] == ["a", "b", "c"] and not more


def test_a_listing_pages_in_name_order():
    store = Store(max_memory=1 << 30, pool=None, remember_digests=False)
    names = [f"t{i:05d}" for i in range(1000)]
    for name in reversed(names):
        store.publish(name, "U8", (1,), 1, np.zeros(1, dtype=np.uint8), store.charge(10), None)
    page, more = store.listing("", 300)
    assert [n for n, _ in page] == names[:300] and more
    page, more = store.listing(names[899], 300)
    assert [n for n, _ in page] == names[900:] and not more


def _oracle(store: Store, after: str, limit: int) -> tuple[list[str], bool]:
    # what a page was before names were kept in order: every name after the cursor, sorted
    later = sorted(n for n in store.entries() if n > after)
    return later[:limit], len(later) > limit


def test_listing_pages_match_a_sort_of_every_name_through_any_changes():
    import random

    from weightlift.remote.server.store import Staged

    rng = random.Random(7)
    store = Store(max_memory=1 << 40, pool=None, remember_digests=False)
    one = np.zeros(1, dtype=np.uint8)

    def put(name: str) -> None:
        store.publish(name, "U8", (1,), 1, one, store.charge(10), None)

    def check(after: str, limit: int) -> None:
        page, more = store.listing(after, limit)
        names, oracle_more = _oracle(store, after, limit)
        assert [n for n, _ in page] == names and more == oracle_more, (after, limit)
        held = store.entries()
        assert all(e is held[n] for n, e in page)

    names = [f"a{i:05d}" for i in range(3000)]
    for n in rng.sample(names, len(names)):
        put(n)
    check("", 100)
    # many names into one chunk, a few at a time with pages between: chunks split, firsts move
    for k in range(1200):
        put(f"a00100.{k:04d}")
        if k % 50 == 0:
            check("a00099", 30)
    put("")  # the empty name sorts first of all
    check("", 3)
    held = sorted(store.entries())
    for start in range(8):  # every name dropped and brought back, the firsts and lasts of chunks
        store.free(tuple(held[start::8]))  # among them, an eighth at a time: taken in one by one
        check("", 10_000)
        for n in held[start::8]:
            put(n)
        check("", 10_000)
    pool = sorted(store.entries())
    for step in range(400):
        op = rng.random()
        if op < 0.35:
            put(rng.choice(["a", "b", "z", "a00100.", "a02999~"]) + str(rng.randrange(10_000)))
        elif op < 0.6:
            store.free(tuple(rng.sample(pool, 3)))
        elif op < 0.7:
            name = rng.choice(pool)  # replaced, or brought back: its name stays or returns
            put(name)
        elif op < 0.75:
            staged = [Staged(f"s{step}.{i}", "U8", (1,), 1, one, store.charge(10), None) for i in range(3)]
            store.switch(staged, [])
        else:
            pool = sorted(store.entries()) or [""]
        cursor = rng.choice([*pool, "", "a00100.05", "zzzz", "a00050~"])
        check(cursor, rng.choice([1, 7, 100, 10_000]))
    # paging a whole store with names added and removed between pages: each page is what a sort
    # of the names held then gives after the cursor
    after, seen = "", []
    while True:
        check(after, 500)
        page, more = store.listing(after, 500)
        seen += [n for n, _ in page]
        if not more:
            break
        after = page[-1][0]
        put(after + "~new")  # after the cursor: the next page holds it
        store.free((seen[0],))  # before it: nothing changes
    assert seen == sorted(seen) and len(seen) == len(set(seen))
    store.free(tuple(store.entries()))
    check("", 10)
    assert store.listing("", 10) == ([], False)


def test_cache_held_writes_no_entry_from_memory_an_in_place_switch_changes(tmp_path):
    import blake3

    first = {"t0": _f32(300_000, 0)}
    second = {"t0": first["t0"].copy()}
    second["t0"][::1000] += 1  # arrives as a DELTA: not in the cache
    third = {"t0": second["t0"].copy()}
    third["t0"][::997] += 1
    d1 = blake3.blake3(second["t0"].tobytes()).digest()
    with Server(cache_dir=tmp_path / "cache") as s, Client(s.address, keep_base=True) as c:
        c.push(first, hash_threshold=0)
        c.push(second)
        assert s.cache is not None and s.cache.flush(10) and not s.cache.has(d1, wait=False)
        behind, switched = s.cache.behind, []
        real = behind.submit

        def racing(digest, tensor, view, sealed):
            # an in-place update of the same tensor switches in while cache_held queues its entry;
            # while cache_held holds in-place changes off, the switch waits for it (the join gives up)
            t = threading.Thread(target=lambda: switched.append(c.push(third, in_place=True)))
            t.start()
            t.join(2)
            racing.thread = t
            return real(digest, tensor, view, sealed)

        behind.submit = racing
        try:
            assert s.cache_held() == 1
        finally:
            behind.submit = real
        racing.thread.join(30)
        assert switched and np.array_equal(s.tensors()["t0"], third["t0"])
        assert s.cache.flush(10)
        if s.cache.has(d1, wait=False):  # written before the switch, or dropped by it: never another version
            out = np.empty_like(second["t0"])
            s.cache.read_into(d1, out)
            assert np.array_equal(out, second["t0"])
