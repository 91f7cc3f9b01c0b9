"""Fresh memory faulted in ahead and handed out in pieces that own their pages."""

from __future__ import annotations

import errno
import gc
import mmap
import threading

import numpy as np
import pytest

from tests.waiting import wait_for
from weightlift import libc
from weightlift.memory.prefaulted import PAGE, Prefaulted, move_into, written_pages


def _mapped(addr: int, n: int = PAGE) -> bool:
    """Whether ``[addr, addr + n)`` is mapped in this process (mincore says ENOMEM where not)."""
    try:
        libc.mincore(addr, n)
    except OSError as e:
        assert e.errno == errno.ENOMEM
        return False
    return True


def _all_ready(p: Prefaulted) -> Prefaulted:
    wait_for(lambda: p.ready == p.nbytes)
    return p


def test_pieces_are_page_aligned_zeroed_writable_and_apart():
    p = _all_ready(Prefaulted(5 * PAGE + 1, expires=None, piece=PAGE))
    assert p.nbytes == 6 * PAGE
    a, b = p.take(10), p.take(2 * PAGE + 3)
    assert a is not None and b is not None
    assert (a.size, b.size) == (10, 2 * PAGE + 3)
    assert a.ctypes.data % PAGE == 0 and b.ctypes.data == a.ctypes.data + PAGE
    assert not a.any() and not b.any()
    a[:] = 1
    b[:] = 2
    assert (a == 1).all() and (b == 2).all()
    assert p.take(2 * PAGE + 1) is None  # 2 pages left, this needs 3
    assert p.take(2 * PAGE) is not None
    assert p.take(1) is None
    p.close()


def test_a_piece_is_unmapped_when_its_last_view_dies():
    p = _all_ready(Prefaulted(4 * PAGE, expires=None, piece=PAGE))
    piece = p.take(2 * PAGE)
    assert piece is not None
    addr = piece.ctypes.data
    view = piece[PAGE:]
    p.close()
    del piece
    gc.collect()
    assert _mapped(addr, 2 * PAGE)  # the view keeps it
    del view
    gc.collect()
    assert not _mapped(addr) and not _mapped(addr + PAGE)


def test_close_gives_back_what_was_not_handed_out():
    p = _all_ready(Prefaulted(8 * PAGE, expires=None, piece=PAGE))
    kept = p.take(PAGE)
    assert kept is not None
    rest = kept.ctypes.data + PAGE
    assert _mapped(rest, 7 * PAGE)
    p.close()
    p.close()  # once is enough
    assert not any(_mapped(rest + i * PAGE) for i in range(7))
    kept[:] = 9  # the piece handed out is its owner's still
    assert (kept == 9).all()
    assert p.take(1) is None


def test_memory_nobody_takes_is_given_back_when_it_expires():
    p = Prefaulted(4 * PAGE, expires=0.05, piece=PAGE)
    wait_for(lambda: not _mapped(p._addr, p.nbytes))
    assert p.take(1) is None


def test_stop_leaves_only_what_was_faulted_in_to_take():
    p = Prefaulted(64 * PAGE, expires=None, piece=PAGE)
    ready = p.stop()
    assert ready % PAGE == 0 and ready == p.ready
    if ready:
        assert p.take(ready) is not None
    assert p.take(1) is None  # nothing more is faulted in, nor will be
    p.close()


def test_the_sizes_are_checked():
    for bad in ({"nbytes": 0}, {"nbytes": 1, "threads": 0}, {"nbytes": 1, "piece": 1}):
        with pytest.raises(ValueError, match="need nbytes"):
            Prefaulted(**bad)


def _fresh(n: int, flags: int = mmap.MAP_PRIVATE) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, n, flags=flags), dtype=np.uint8)


def test_written_pages_are_those_touched():
    src = _fresh(16 * PAGE)
    src[PAGE + 5] = 1
    src[2 * PAGE] = 2
    src[9 * PAGE : 11 * PAGE] = 3
    base = src.ctypes.data
    assert written_pages(base, 16 * PAGE) == [(PAGE, 2 * PAGE), (9 * PAGE, 2 * PAGE)]
    # a range that starts and ends inside pages: clipped to it, offsets from its start
    assert written_pages(base + PAGE + 100, 10 * PAGE) == [(0, 2 * PAGE - 100), (8 * PAGE - 100, 2 * PAGE)]
    assert written_pages(base, 0) == []


def test_memory_that_is_not_private_and_anonymous_cannot_be_told(tmp_path):
    shared = _fresh(4 * PAGE, mmap.MAP_SHARED)  # shared memory: its pages may be elsewhere
    assert written_pages(shared.ctypes.data, 4 * PAGE) is None
    f = tmp_path / "f"
    f.write_bytes(b"x" * 4 * PAGE)
    with open(f, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    fileview = np.frombuffer(m, dtype=np.uint8)  # never read: no page present, yet it holds x's
    assert written_pages(fileview.ctypes.data, 4 * PAGE) is None
    dst = _fresh(4 * PAGE)
    move_into(fileview.ctypes.data, 4 * PAGE, dst)
    assert dst.tobytes() == b"x" * 4 * PAGE


def test_move_into_copies_exactly_what_the_memory_holds():
    rng = np.random.default_rng(1)
    src = _fresh(32 * PAGE)
    for at in rng.choice(32 * PAGE - 64, 20, replace=False):
        src[at : at + 64] = rng.integers(1, 256, 64, dtype=np.uint8)
    n = 32 * PAGE - 777
    dst = _fresh(32 * PAGE)
    move_into(src.ctypes.data + 777, n, dst)
    assert dst[:n].tobytes() == src[777:].tobytes()
    assert not dst[n:].any()


def test_a_piece_that_fails_to_fault_in_stops_the_faulting_and_never_hangs(monkeypatch):
    import weightlift.memory.prefaulted as prefaulted

    calls = []

    def fault_in(arr):
        calls.append(arr.size)
        if len(calls) == 2:
            raise MemoryError("no more")
        arr[::PAGE] = 0

    monkeypatch.setattr(prefaulted, "fault_in", fault_in)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the thread's error, expected
    p = Prefaulted(8 * PAGE, expires=None, piece=PAGE)
    assert p.stop() == PAGE  # the first piece; nothing after the one that failed
    assert p.take(PAGE) is not None and p.take(1) is None
    p.close()
