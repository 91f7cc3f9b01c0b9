"""weightlift.faulter: fresh memory faulted in ahead of the receiver, within a window, never after cancel."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import weightlift.faulter as faulter_mod
from weightlift.faulter import Faulter

PIECE = 4096


@pytest.fixture
def log(monkeypatch):
    """Each populate call as (thread name, first byte address), after it has written."""
    calls: list[tuple[str, int]] = []
    lock = threading.Lock()
    real = faulter_mod.populate

    def recording(buf):
        real(buf)
        with lock:
            calls.append((threading.current_thread().name, np.frombuffer(buf, np.uint8).ctypes.data))

    monkeypatch.setattr(faulter_mod, "populate", recording)
    return calls


def _wait(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_helpers_fault_in_registration_order_within_the_window(log):
    f = Faulter(threads=1, piece=PIECE, window=3 * PIECE)
    a, b = np.ones(2 * PIECE, np.uint8), np.ones(4 * PIECE, np.uint8)
    f.add("a", a)
    f.add("b", b)
    _wait(lambda: len(log) == 3)
    time.sleep(0.05)
    assert len(log) == 3  # the window: three pieces ahead of the receiver, no more
    base_a, base_b = a.ctypes.data, b.ctypes.data
    assert [addr for _, addr in log] == [base_a, base_a + PIECE, base_b]  # across tensors, in order
    assert a.sum() == 2 * PIECE - 2 and b.sum() == 4 * PIECE - 1  # a zero written into each page (4 KiB) faulted
    assert f.ready("a", 0, 2 * PIECE)  # done: taking them moves the window on
    _wait(lambda: len(log) == 5)
    assert f.faulted == 5 * PIECE
    f.close()


def test_receiver_takes_a_queued_piece_itself_instead_of_waiting(log):
    f = Faulter(threads=1, piece=PIECE, window=PIECE)
    a, b = np.ones(PIECE, np.uint8), np.ones(3 * PIECE, np.uint8)
    f.add("a", a)
    f.add("b", b)
    _wait(lambda: len(log) == 1)  # the helper did a's piece and waits for the window
    assert f.ready("b", PIECE + 10, 3 * PIECE)  # b's pieces 1 and 2, out of order
    me = threading.current_thread().name
    assert [t for t, _ in log[1:]] == [me, me]
    assert f.ready("a", 0, 1)
    _wait(lambda: len(log) == 4)  # b's piece 0 is left for the helper
    assert log[-1] == (log[0][0], b.ctypes.data)
    assert f.faulted == 2 * PIECE
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

    monkeypatch.setattr(faulter_mod, "populate", slow)
    f = Faulter(threads=1, piece=PIECE, window=8 * PIECE)
    f.add("a", np.ones(4 * PIECE, np.uint8))
    assert started.wait(5)
    cancelled = threading.Event()
    t = threading.Thread(target=lambda: (f.cancel("a"), cancelled.set()))
    t.start()
    time.sleep(0.05)
    assert not cancelled.is_set()  # a piece is being written: cancel waits for it
    release.set()
    t.join(5)
    assert cancelled.is_set() and done == [PIECE]
    time.sleep(0.05)
    assert done == [PIECE]  # the queued pieces were dropped, not faulted after the cancel
    assert f.ready("a", 0, PIECE) is False
    f.add("b", np.ones(PIECE, np.uint8))  # the window was given back
    _wait(lambda: len(done) == 2)
    f.close()


def test_close_stops_the_helpers_and_later_adds_are_ignored(log):
    f = Faulter(threads=2, piece=PIECE, window=2 * PIECE)
    f.add("a", np.ones(10 * PIECE, np.uint8))
    _wait(lambda: len(log) == 2)
    f.close()
    f.add("b", np.ones(PIECE, np.uint8))
    assert f.ready("b", 0, PIECE) is False
    assert len(log) == 2


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        Faulter(piece=PIECE, window=PIECE - 1)
    with pytest.raises(ValueError):
        Faulter(threads=0)
