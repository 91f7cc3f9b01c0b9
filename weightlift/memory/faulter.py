"""Faulting fresh destination memory in ahead of the bytes that will land in it.

On a VM the host may back a fresh guest page only when it is first touched, slower than a
copy into touched memory, so faulting is work worth taking off the receiving thread. A receiver
therefore hands each fresh destination to a :class:`Faulter` as soon as it is allocated: helper
threads fault it in piece by piece (:func:`weightlift.memory.fresh.fault_in`), in the order
destinations were added, across tensor boundaries, while the socket fills the pieces already
done. The receiver asks for a range just before it writes into it (:meth:`Faulter.ready`): done
pieces cost nothing; a piece still queued is faulted by the receiver itself, only the part it
asked for (it never waits behind the queue), or left for the kernel copy to fault, as the fill
policy says is faster on this machine (:mod:`weightlift.memory.fresh`); a running
one is waited for. The region the receiver asked for last is the helpers' first choice, so a
destination written out of allocation order (or registered late) is not left behind the
others.

Bounded: the helpers stay at most ``window`` bytes ahead of what the receiver has taken, so a
peer that allocates and sends nothing makes the server touch at most that much memory (per
connection, besides the piece being received) beyond what it sent; the allocation itself was
already charged against its limit.

Safe to reuse memory afterwards: a helper may write a zero into the pages it faults, so before a
destination is freed, handed to someone else or filled by any other path, its owner calls
:meth:`Faulter.cancel`, which drops its queued pieces, waits for the running ones and lets go
of the memory.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable
from typing import Any

from weightlift.memory.fresh import fault_in, policy

__all__ = ["Faulter", "REGION"]

REGION = "arena"  # the key of the one region a Faulter made by Faulter.ahead holds

_QUEUED, _RUNNING, _DONE, _CANCELLED = 0, 1, 2, 3


class _Region:
    __slots__ = ("key", "view", "nbytes", "cancelled", "states", "running", "taken", "next")

    def __init__(self, key: Hashable, view: memoryview, pieces: int):
        self.key = key
        self.view: memoryview | None = view  # None once cancelled: nothing keeps the memory
        self.nbytes = len(view)
        self.cancelled = False
        self.states = bytearray(pieces)  # _QUEUED
        self.running = 0
        self.taken = bytearray(pieces)  # 1 once the receiver asked for (part of) the piece
        self.next = 0  # no queued piece before this one

    def first_queued(self) -> int | None:
        while self.next < len(self.states) and self.states[self.next] != _QUEUED:
            self.next += 1
        return self.next if self.next < len(self.states) else None


class Faulter:
    """Helper threads that fault registered regions in, piece by piece, in registration order."""

    def __init__(
        self,
        *,
        threads: int = 2,
        piece: int = 4 << 20,
        window: int = 32 << 20,
        name: str = "wl-fault",
        ahead: bool | None = None,
    ):
        if threads < 1 or piece < 1 or window < piece:
            raise ValueError("need threads >= 1 and window >= piece >= 1")
        self.piece, self.window, self._nthreads, self._name = piece, window, threads, name
        # whether the receiver faults a piece the helpers have not reached before its kernel
        # copy, or leaves it to the copy (weightlift.memory.fresh decides which is faster here)
        self._self_fault = policy().ahead if ahead is None else ahead
        self._cond = threading.Condition()
        # regions with pieces left for the helpers, in registration order; cancelled ones are
        # skipped (and dropped) by the helpers, so cancel() costs no scan of the queue
        self._queue: deque[_Region] = deque()
        self._urgent: _Region | None = None  # the region the receiver asked for last
        self._regions: dict[Hashable, _Region] = {}
        self._ahead = 0  # bytes done by the helpers and not yet taken by the receiver
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.faulted = 0  # bytes the helpers faulted (for tests and profiles)

    @classmethod
    def ahead(cls, buf: Any, *, window: int, name: str, piece: int = 4 << 20) -> Faulter | None:
        """Helpers faulting one region, ``buf``, in ahead of whoever fills it (registered as
        :data:`REGION`): as many as the fill policy's helper count, or None when that is 0 or
        ``buf`` is empty, and the filler faults its own pages."""
        helpers = policy().helpers
        if helpers < 1 or not memoryview(buf).nbytes:
            return None
        f = cls(threads=helpers, piece=piece, window=window, name=name)
        f.add(REGION, buf)
        return f

    # -- the receiver's side -------------------------------------------------------------------

    def add(self, key: Hashable, buf: Any) -> None:
        """Queue ``buf`` (a writable buffer, fresh memory) to be faulted in, piece by piece."""
        view = memoryview(buf).cast("B")
        if not len(view):
            return
        pieces = -(-len(view) // self.piece)
        with self._cond:
            if self._closed:
                return
            if key in self._regions:
                raise ValueError(f"{key!r} is registered already")
            r = self._regions[key] = _Region(key, view, pieces)
            self._queue.append(r)
            if len(self._threads) < self._nthreads:
                for k in range(len(self._threads), self._nthreads):
                    t = threading.Thread(target=self._work, name=f"{self._name}-{k}", daemon=True)
                    self._threads.append(t)
                    t.start()
            self._cond.notify_all()

    def ready(self, key: Hashable, begin: int, end: int) -> bool:
        """Make bytes ``[begin, end)`` of ``key``'s region faulted in before they are written.

        Returns False if ``key`` is not registered (the caller faults its memory itself)."""
        with self._cond:
            r = self._regions.get(key)
            if r is None:
                return False
            mine: list[int] = []
            moved = r is not self._urgent
            self._urgent = r
            for i in range(begin // self.piece, -(-end // self.piece)):
                while r.states[i] == _RUNNING:
                    self._cond.wait()
                if r.states[i] == _QUEUED:
                    r.states[i] = _RUNNING  # the helpers skip it
                    r.running += 1
                    mine.append(i)
                elif not r.taken[i]:
                    self._ahead -= self._size(r, i)
                    moved = True
                r.taken[i] = 1
            view = r.view
            if moved:
                self._cond.notify_all()  # the window moved on, or the helpers' first choice did
        if not mine:
            return True
        try:
            assert view is not None
            for i in mine if self._self_fault else ():  # only what was asked for: a 1-byte WRITE faults one page
                fault_in(view[max(begin, i * self.piece) : min(end, (i + 1) * self.piece)])
        finally:
            with self._cond:
                for i in mine:
                    r.states[i] = _DONE
                r.running -= len(mine)
                self._cond.notify_all()
        return True

    def cancel(self, key: Hashable) -> None:
        """Forget ``key``: its queued pieces are dropped, running ones waited for, its memory let
        go. Call it before the region's memory is freed, reused or written by anything but the
        receiver."""
        with self._cond:
            r = self._regions.pop(key, None)
            if r is None:
                return
            r.cancelled = True
            for i, s in enumerate(r.states):
                if s == _QUEUED:
                    r.states[i] = _CANCELLED
                elif s == _DONE and not r.taken[i]:
                    self._ahead -= self._size(r, i)
            while r.running:
                self._cond.wait()
            r.view = None
            if self._urgent is r:
                self._urgent = None
            self._cond.notify_all()

    def close(self) -> None:
        """Cancel everything and stop the helpers (waits for the pieces in progress)."""
        with self._cond:
            self._closed = True
            keys = list(self._regions)
        for k in keys:
            self.cancel(k)
        with self._cond:
            self._queue.clear()
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    # -- the helpers -----------------------------------------------------------------------------

    def _size(self, r: _Region, i: int) -> int:
        return min(self.piece, r.nbytes - i * self.piece)

    def _next_piece(self) -> tuple[_Region, int] | None:
        """The next piece for a helper (urgent region first), or None; under the lock."""
        u = self._urgent
        if u is not None:
            i = u.first_queued()
            if i is not None:
                return u, i
            self._urgent = None
        while self._queue:
            r = self._queue[0]
            i = r.first_queued()
            if i is not None:
                return r, i
            self._queue.popleft()  # done, taken by the receiver, or cancelled
        return None

    def _work(self) -> None:
        # No reference to a region survives a wait here: a cancelled region's memory must be
        # free to go back to its pool as soon as cancel() returns.
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    got = self._next_piece() if self._ahead + self.piece <= self.window else None
                    if got is not None:
                        break
                    self._cond.wait()
                r, i = got
                got = None
                r.states[i] = _RUNNING
                r.running += 1
                n = self._size(r, i)
                self._ahead += n  # counted now, so the helpers together stay within the window
                view = r.view
                assert view is not None  # a queued piece belongs to a region not cancelled
            try:
                fault_in(view[i * self.piece : (i + 1) * self.piece])
            finally:
                del view
                with self._cond:
                    r.states[i] = _DONE
                    r.running -= 1
                    self.faulted += n
                    if r.taken[i] or r.cancelled:
                        self._ahead -= n  # taken or cancelled meanwhile: it counts no more
                    r = None  # type: ignore[assignment]
                    self._cond.notify_all()
