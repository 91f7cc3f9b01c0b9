"""READ, LIST and FREE: serving what the store holds back to clients."""

from __future__ import annotations

import threading

import numpy as np

from weightlift.remote.server.store import Store


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
