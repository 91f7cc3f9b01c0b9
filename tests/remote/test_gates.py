"""The store's read and write gates per tensor memory (weightlift.remote.server.updates.gates), in process:
what waits for what, the bound on a writer's wait, and no deadlock between overlapping sets."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from weightlift.remote.server.store import Store
from weightlift.remote.server.updates.gates import Gates, GateTimeout

JOIN = 30  # seconds a thread that must finish is given (a hang fails instead of blocking the run)


def _memories(n: int) -> list[np.ndarray]:
    return [np.zeros(16, np.uint8) for _ in range(n)]


def _in_thread(fn) -> tuple[threading.Thread, threading.Event]:
    """``fn`` run in a thread; the event is set once it returned."""
    done = threading.Event()

    def run() -> None:
        fn()
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done


def _until(held) -> None:
    """Wait (at most JOIN seconds) until ``held()`` is true of the gates."""
    done = threading.Event()
    for _ in range(JOIN * 1000):
        if held():
            return
        done.wait(0.001)
    raise AssertionError("the gates never reached the state waited for")


def test_a_writer_waits_for_the_reader_of_its_memory_and_holds_new_ones_off_but_not_readers_of_other_memory():
    gates = Gates()
    a, b = _memories(2)
    reader_out, written = threading.Event(), []

    def reader() -> None:
        with gates.reading(a):
            reader_out.wait(JOIN)

    def writer() -> None:
        with gates.exclusive({"a": a}):
            written.append("a")

    r, _ = _in_thread(reader)
    _until(lambda: gates.busy()[0])
    w, wrote = _in_thread(writer)
    _until(lambda: gates.busy()[1])  # the writer claimed a and waits for its reader
    assert not wrote.is_set()
    with gates.reading(b):  # other memory: read at once, the writer waiting or not
        pass
    late, late_in = _in_thread(lambda: gates.reading(a).__enter__())
    assert not late_in.wait(0.2), "a new reader of claimed memory went in before the waiting writer"
    reader_out.set()
    assert wrote.wait(JOIN) and written == ["a"]
    assert late_in.wait(JOIN)  # the writer done, the reader that waited on it goes in
    r.join(JOIN), w.join(JOIN), late.join(JOIN)


def test_a_writer_whose_reader_never_finishes_is_refused_after_its_bound_and_holds_nothing():
    gates = Gates(timeout=0.2)
    a, b = _memories(2)
    reader_out = threading.Event()

    def reader() -> None:
        with gates.reading(a):
            reader_out.wait(JOIN)

    r, _ = _in_thread(reader)
    _until(lambda: gates.busy()[0])
    changed = []
    with pytest.raises(GateTimeout, match=r"a READ of 'a' was still sending its bytes after 0.2 s"):
        with gates.exclusive({"b": b, "a": a}):
            changed.append(True)
    assert not changed  # the block never ran
    assert gates.busy() == (1, 0)  # only the stalled reader: the claim on a and b was given up
    with gates.reading(a), gates.reading(b):  # and new readers of both go in
        pass
    with gates.exclusive({"b": b}):  # as does a writer of b
        pass
    reader_out.set()
    r.join(JOIN)
    with gates.exclusive({"a": a}):  # the reader gone, a writer of a goes in
        pass
    assert gates.busy() == (0, 0)


def test_a_writer_waits_its_bound_for_another_writer_of_the_same_memory():
    gates = Gates(timeout=0.2)
    (a,) = _memories(1)
    out = threading.Event()

    def first() -> None:
        with gates.exclusive({"a": a}):
            out.wait(JOIN)

    t, _ = _in_thread(first)
    _until(lambda: gates.busy()[1])
    with pytest.raises(GateTimeout, match=r"another in-place update of 'a' held it"):
        with gates.exclusive({"a": a}):
            pass
    out.set()
    t.join(JOIN)
    assert gates.busy() == (0, 0)


def test_a_reader_of_several_waits_while_a_writer_claims_any_of_them():
    gates = Gates()
    a, b, c = _memories(3)
    hold, inside = threading.Event(), threading.Event()

    def writer() -> None:
        with gates.exclusive({"b": b}):
            inside.set()
            hold.wait(JOIN)

    w, _ = _in_thread(writer)
    assert inside.wait(JOIN)
    several, entered = _in_thread(lambda: gates.reading(a, b, c).__enter__())
    assert not entered.wait(0.2), "a reader of several went in while one of them was being changed"
    with gates.reading(a, c):  # a set without b is read at once
        pass
    hold.set()
    assert entered.wait(JOIN)
    w.join(JOIN), several.join(JOIN)


@pytest.mark.parametrize("nested", [False, True])
def test_writers_and_readers_of_overlapping_sets_never_deadlock_and_never_overlap(nested):
    """Many threads take random overlapping sets (writers, readers of several) in every order:
    all finish, and no memory is ever read and written, or written twice, at once. ``nested``:
    a reader often reads another set (its own memory too, at times) before its first read ends."""
    gates = Gates()
    mems = _memories(5)
    state = [0] * len(mems)  # readers inside (> 0) or a writer inside (-1), per memory
    lock, errors = threading.Lock(), []

    def enter(ix: list[int], writer: bool) -> None:
        with lock:
            for i in ix:
                if state[i] < 0 or (writer and state[i] > 0):
                    errors.append((ix, writer, list(state)))
                state[i] = -1 if writer else state[i] + 1

    def leave(ix: list[int], writer: bool) -> None:
        with lock:
            for i in ix:
                state[i] = 0 if writer else state[i] - 1

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(200):
            ix = rng.sample(range(len(mems)), rng.randint(1, 3))
            writer = rng.random() < 0.5
            gate = gates.exclusive({str(i): mems[i] for i in ix}) if writer else gates.reading(*(mems[i] for i in ix))
            with gate:
                enter(ix, writer)
                if nested and not writer and rng.random() < 0.5:
                    again = rng.sample(range(len(mems)), rng.randint(1, 3))
                    with gates.reading(*(mems[i] for i in again)):
                        enter(again, False)
                        leave(again, False)
                leave(ix, writer)

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(8)]
    for t in threads:
        t.start()
    end = time.monotonic() + JOIN
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "gates deadlocked"
    assert not errors
    assert gates.busy() == (0, 0)


def test_reading_entries_holds_off_an_in_place_change_of_what_it_gives():
    """The store's reader of a set: every entry it gives is current, and none changes in place
    until its block ends (a writer of one waits), while a writer of memory outside it goes on."""
    store = Store(max_memory=1 << 20, pool=None, remember_digests=False, gate_timeout=0.2)
    for name in ("a", "b"):
        store.publish(name, "U8", (16,), 16, np.zeros(16, np.uint8), store.charge(16), None)
    other = np.zeros(16, np.uint8)
    with store.reading_entries(["a", "b"]) as entries:
        assert sorted(entries) == ["a", "b"]
        assert all(store.get(n) is e for n, e in entries.items())
        with pytest.raises(GateTimeout, match="'b'"):
            with store.exclusive({"b": entries["b"].tensor}):
                pass
        with store.exclusive({"other": other}):
            pass
    with store.exclusive({"a": store.get("a").tensor, "b": store.get("b").tensor}):  # all given back
        pass


class _E:
    """An entry as the gates see one: its memory."""

    def __init__(self, tensor: np.ndarray):
        self.tensor = tensor


def test_a_reader_of_a_set_takes_it_again_when_an_entry_was_switched_before_its_gates_were_held():
    from weightlift.remote.server.updates.gates import READ_AGAIN

    gates = Gates()
    a, b = _memories(2)
    old, new, kept = _E(a), _E(a), _E(b)  # a switched in place: another entry, the same memory
    snaps = iter([{"a": old, "b": kept}, {"a": new, "b": kept}, {"a": new, "b": kept}, {"a": new, "b": kept}])
    with gates.reading_current(lambda: next(snaps)) as got:
        assert got == {"a": new, "b": kept}  # the current entries, all of them
        assert gates.busy() == (2, 0)
    # a set whose ``a`` holds other memory every time it is taken (replaced, not switched in
    # place): after READ_AGAIN takes, only what stayed
    taken = []
    with gates.reading_current(lambda: taken.append(1) or {"a": _E(np.zeros(16, np.uint8)), "b": kept}) as got:
        pass
    assert len(taken) == 2 * READ_AGAIN
    assert set(got) == {"b"} and gates.busy() == (0, 0)


def _waiting(gates: Gates) -> int:
    """Threads waiting on the gates' condition right now (a reader held off, a writer queued)."""
    with gates._cond:
        return len(gates._cond._waiters)  # type: ignore[attr-defined]


def test_a_reader_of_several_goes_in_before_a_writer_that_came_after_it():
    """A reader of {a, b} waits for a writer of ``a``. A writer of ``b`` that comes after it
    waits for it in turn: otherwise writers of a and b taking turns (each claim made while the
    other's is still held) keep a reader of both out for as long as they go on (a vLLM engine's
    ``Server.reading`` of every tensor, starved by two clients pushing in place)."""
    gates = Gates(timeout=JOIN)
    a, b = _memories(2)
    order: list[str] = []
    first = gates.exclusive({"a": a})
    first.__enter__()

    def read() -> None:
        with gates.reading(a, b):
            order.append("reader")

    def write() -> None:
        with gates.exclusive({"b": b}):
            order.append("writer of b")

    r, _ = _in_thread(read)
    _until(lambda: _waiting(gates) == 1)  # the reader waits for the writer of a
    w, wrote = _in_thread(write)
    _until(lambda: wrote.is_set() or _waiting(gates) == 2)  # in, or queued behind the reader
    first.__exit__(None, None, None)
    r.join(JOIN), w.join(JOIN)
    assert order == ["reader", "writer of b"]


def test_a_writer_does_not_queue_behind_a_reader_that_waits_for_a_claim_its_readers_hold():
    """A reader stalls inside ``a`` (a peer taking a READ's reply slowly); a writer of ``a``
    claims it and waits for that reader; a reader of {a, b} waits for that claim. A writer of
    ``b`` must not wait behind that reader: it would wait for the stalled reader of ``a``
    (a commit of one tensor held off by a READ of another, and refused after its bound)."""
    gates = Gates(timeout=JOIN)
    a, b = _memories(2)
    order: list[str] = []
    stalled = gates.reading(a)
    stalled.__enter__()

    def write_a() -> None:
        with gates.exclusive({"a": a}):
            order.append("writer of a")

    def read() -> None:
        with gates.reading(a, b):
            order.append("reader")

    wa, _ = _in_thread(write_a)
    _until(lambda: gates.busy() == (1, 1) and _waiting(gates) == 1)  # claimed, waiting for the stalled reader
    r, _ = _in_thread(read)
    _until(lambda: _waiting(gates) == 2)
    with gates.exclusive({"b": b}):  # at once: the stalled reader holds nothing of b
        order.append("writer of b")
    stalled.__exit__(None, None, None)
    wa.join(JOIN), r.join(JOIN)
    assert order == ["writer of b", "writer of a", "reader"]


def test_a_reader_of_a_set_switched_in_place_every_time_it_is_taken_gets_all_of_it_as_it_is_now():
    """An in-place switch publishes another entry over the same memory, and a reader holding
    that memory's gate has it as it is now. A reader each of whose takes overlaps such a switch
    (a ``Server.reading`` of every tensor while clients push in place) must still get every
    tensor: left out, a vLLM engine loading "every tensor held" would load only some of them,
    and keep its old weights for the rest without a word."""
    gates = Gates()
    a, b = _memories(2)
    kept = _E(b)
    latest: list[_E] = []

    def snapshot() -> dict:
        latest.append(_E(a))  # a switched in place again: another entry, the same memory
        return {"a": latest[-1], "b": kept}

    with gates.reading_current(snapshot) as got:
        assert got == {"a": latest[-1], "b": kept}
        assert gates.busy() == (2, 0)


def _recorded(fn, errors: list) -> None:
    try:
        fn()
    except Exception as e:  # the test looks at it
        errors.append(e)


def test_a_thread_inside_a_read_reads_again_at_once_while_a_writer_waits_for_its_first_read():
    """A thread reading ``a`` reads ``a`` again, and ``b``, before its first read ends (a nested
    ``Server.reading``), while a writer of {a, b} waits for that first read: the writer waits
    for this thread, so this thread must not wait for the writer's claim (it would until the
    writer's bound ran out, the commit refused). The writer goes in once both reads end."""
    gates = Gates(timeout=5.0)
    a, b = _memories(2)
    order: list[str] = []
    errors: list[Exception] = []

    def write() -> None:
        with gates.exclusive({"a": a, "b": b}):
            order.append("writer")

    def read() -> None:
        with gates.reading(a):
            w, _ = _in_thread(lambda: _recorded(write, errors))
            _until(lambda: gates.busy() == (1, 2) and _waiting(gates) == 1)  # claimed, waiting for this read
            with gates.reading(a):
                order.append("a again")
            with gates.reading(b), gates.reading(a, b):
                order.append("b, and both")
        w.join(JOIN)

    r, done = _in_thread(lambda: _recorded(read, errors))
    assert done.wait(JOIN)
    assert not errors, errors
    assert order == ["a again", "b, and both", "writer"]
    assert gates.busy() == (0, 0)


def test_a_thread_inside_a_read_still_waits_for_a_writer_changing_the_memory_it_reads_next():
    """Reading again without waiting is only for writers that wait for their readers: memory a
    writer is changing now is not read by anyone, nested or not, until the writer is done."""
    gates = Gates()
    a, x = _memories(2)
    order: list[str] = []
    inside, nested_in = threading.Event(), threading.Event()

    def read() -> None:
        with gates.reading(x):
            inside.set()
            with gates.reading(a):
                order.append("reader of a")
                nested_in.set()

    with gates.exclusive({"a": a}):
        r, _ = _in_thread(read)
        assert inside.wait(JOIN)
        assert not nested_in.wait(0.2), "a nested read went into memory a writer was changing"
        order.append("writer")
    assert nested_in.wait(JOIN)
    r.join(JOIN)
    assert order == ["writer", "reader of a"]
