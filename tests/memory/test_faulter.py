"""weightlift.memory.faulter: fresh memory faulted in ahead of the receiver, within a window, never after cancel."""

from __future__ import annotations

import gc
import mmap
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import pytest

import weightlift.memory.faulter as faulter_mod
import weightlift.memory.fresh as fresh
from weightlift.memory.faulter import Faulter

PIECE = 4096


@dataclass
class Log:
    """Each populate call, after it has written: thread name, first byte address, length."""

    calls: list[tuple[str, int, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __len__(self) -> int:
        return len(self.calls)

    def addrs(self, start: int = 0) -> list[int]:
        return [a for _, a, _ in self.calls[start:]]


@pytest.fixture(autouse=True)
def receiver_faults_ahead(monkeypatch):
    """These tests pin the receiver's side to faulting a piece the helpers have not reached;
    the other policy has a test of its own."""
    monkeypatch.setenv("WEIGHTLIFT_FAULT_AHEAD", "1")
    monkeypatch.setenv("WEIGHTLIFT_FAULT_METHOD", "touch")  # one zero written per page shows each fault
    fresh.reset_policy()
    yield
    fresh.reset_policy()


@pytest.fixture
def log(monkeypatch):
    out = Log()
    real = faulter_mod.fault_in

    def recording(buf):
        real(buf)
        with out.lock:
            out.calls.append((threading.current_thread().name, np.frombuffer(buf, np.uint8).ctypes.data, len(buf)))

    monkeypatch.setattr(faulter_mod, "fault_in", recording)
    return out


def _wait(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def _ones(n: int) -> np.ndarray:
    """``n`` bytes of ones, page-aligned (as the server's destinations are): one zero per page
    shows each page faulted."""
    a = np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)
    a[:] = 1
    return a


def _settled(f: Faulter) -> None:
    """Give the helpers a moment to go on if they (wrongly) could."""
    time.sleep(0.05)


def test_helpers_fault_in_registration_order_within_the_window(log):
    f = Faulter(threads=1, piece=PIECE, window=3 * PIECE)
    a, b = _ones(2 * PIECE), _ones(4 * PIECE)
    f.add("a", a)
    f.add("b", b)
    _wait(lambda: len(log) == 3)
    _settled(f)
    assert len(log) == 3  # the window: three pieces ahead of the receiver, no more
    base_a, base_b = a.ctypes.data, b.ctypes.data
    assert log.addrs() == [base_a, base_a + PIECE, base_b]  # across tensors, in order
    assert a.sum() == 2 * PIECE - 2 and b.sum() == 4 * PIECE - 1  # a zero written into each page (4 KiB) faulted
    assert f.ready("a", 0, 2 * PIECE)  # done: taking them moves the window on
    _wait(lambda: len(log) == 5)
    assert f.faulted == 5 * PIECE
    assert f.ready("b", 0, 4 * PIECE)
    assert f._ahead == 0
    f.close()


def test_receiver_takes_a_queued_piece_itself_and_only_what_it_asks_for(log):
    f = Faulter(threads=1, piece=PIECE, window=PIECE, ahead=True)
    a, b = _ones(PIECE), _ones(3 * PIECE)
    f.add("a", a)
    f.add("b", b)
    _wait(lambda: len(log) == 1)  # the helper did a's piece and waits for the window
    assert f.ready("b", PIECE + 10, 3 * PIECE)  # b's pieces 1 and 2, out of order
    me = threading.current_thread().name
    assert [(t, n) for t, _, n in log.calls[1:]] == [(me, PIECE - 10), (me, PIECE)]  # from byte 10 of piece 1 on
    assert log.addrs(1) == [b.ctypes.data + PIECE + 10, b.ctypes.data + 2 * PIECE]
    assert f.ready("a", 0, 1)
    _wait(lambda: len(log) == 4)  # b's piece 0 is left for the helper
    assert log.calls[-1][:2] == (log.calls[0][0], b.ctypes.data)
    assert f.faulted == 2 * PIECE
    f.close()


def test_receiver_leaves_a_queued_piece_to_its_copy_when_the_policy_says_so(log):
    # ahead=False: a kernel copy faults fresh pages as cheaply as anything here, so a piece the
    # helpers have not reached is taken as it is; the helpers never touch it afterwards
    f = Faulter(threads=1, piece=PIECE, window=PIECE, ahead=False)
    a, b = _ones(PIECE), _ones(3 * PIECE)
    f.add("a", a)
    f.add("b", b)
    _wait(lambda: len(log) == 1)
    assert f.ready("b", PIECE + 10, 3 * PIECE)
    assert len(log) == 1 and b[PIECE:].min() == 1  # nothing faulted by the receiver
    assert f.ready("a", 0, 1)
    _wait(lambda: len(log) == 2)  # b's piece 0 is the helper's
    _settled(f)
    assert log.addrs(1) == [b.ctypes.data] and b[PIECE:].min() == 1
    f.close()


def test_the_region_asked_for_last_goes_first(log):
    f = Faulter(threads=1, piece=PIECE, window=2 * PIECE)
    a, b, c = (_ones(k * PIECE) for k in (2, 4, 4))
    f.add("a", a)
    f.add("b", b)
    f.add("c", c)  # registered last, but written first
    _wait(lambda: len(log) == 2)  # a0, a1: the window is full
    assert f.ready("c", 0, PIECE)  # the receiver does c0 itself
    _settled(f)
    assert len(log) == 3
    f.cancel("a")  # gives the window back: c, not b, is the helpers' first choice
    _wait(lambda: len(log) == 5)
    assert log.addrs(3) == [c.ctypes.data + PIECE, c.ctypes.data + 2 * PIECE]
    f.close()


def test_ready_on_an_unknown_key_leaves_the_faulting_to_the_caller():
    f = Faulter(piece=PIECE, window=PIECE)
    assert f.ready("nobody", 0, 10) is False
    f.close()


def test_cancel_drops_queued_pieces_and_waits_for_the_running_one(monkeypatch):
    started, release = threading.Event(), threading.Event()
    done: list[int] = []

    def slow(buf):
        started.set()
        release.wait(5)
        done.append(len(buf))

    monkeypatch.setattr(faulter_mod, "fault_in", slow)
    f = Faulter(threads=1, piece=PIECE, window=PIECE)
    f.add("a", _ones(4 * PIECE))
    assert started.wait(5)
    cancelled = threading.Event()
    t = threading.Thread(target=lambda: (f.cancel("a"), cancelled.set()))
    t.start()
    _settled(f)
    assert not cancelled.is_set()  # a piece is being written: cancel waits for it
    release.set()
    t.join(5)
    assert cancelled.is_set() and done == [PIECE]
    _settled(f)
    assert done == [PIECE]  # the queued pieces were dropped, not faulted after the cancel
    assert f.ready("a", 0, PIECE) is False
    assert f._ahead == 0  # the one-piece window was given back ...
    f.add("b", _ones(PIECE))
    _wait(lambda: len(done) == 2)  # ... so b's piece is faulted
    f.close()


def test_cancel_lets_go_of_the_memory(log):
    f = Faulter(threads=2, piece=PIECE, window=2 * PIECE)
    a = _ones(8 * PIECE)
    ref = weakref.ref(a)
    f.add("a", a)
    _wait(lambda: len(log) == 2)
    assert f.ready("a", 0, 10)
    f.cancel("a")
    del a
    gc.collect()
    assert ref() is None  # no helper, queue entry or region still holds it
    assert f._ahead == 0
    f.close()


def test_close_stops_the_helpers_and_later_adds_are_ignored(log):
    f = Faulter(threads=2, piece=PIECE, window=2 * PIECE)
    f.add("a", _ones(10 * PIECE))
    _wait(lambda: len(log) == 2)
    f.close()
    assert f._threads and not any(t.is_alive() for t in f._threads)
    f.add("b", _ones(PIECE))
    assert f.ready("b", 0, PIECE) is False
    assert len(log) == 2


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        Faulter(piece=PIECE, window=PIECE - 1)
    with pytest.raises(ValueError):
        Faulter(threads=0)
