"""Read and write gates per tensor memory: who may read a tensor's bytes while who changes them.

Theory of operation. A READ sending host bytes, a fill copying from stored memory and a DELTA
reading its base hold the *read* side of the gate of exactly the memory they read; an in-place
commit holds the *write* side of exactly the memory it changes. Memory is known by identity (the
array object the store's entry holds; every reader and writer goes through that same object), so
a reader stalled on one tensor holds off only the commits that change that tensor, and only the
readers of the tensors such a commit changes.

Why nothing deadlocks: a set of gates is taken all at once under one condition, never one
after another (what a fixed order of taking them would guarantee, without the order). A writer
first *claims* its whole set, only once no other writer claims any of it (so two commits of
overlapping sets take turns), then waits for the readers of it to finish. A claimed gate lets no
new reader in (a writer is not starved by a stream of readers), and a reader of several tensors
enters only when none of them is claimed. The only wait made while holding anything is a
writer's, for readers already inside, and those wait for no gate (or, reading again inside a
read, only for a writer that waits for nothing: see below): no wait can close a cycle.

Why a reader is not starved either: each caller draws a ticket as it comes, and a writer does not
claim memory that a reader with an earlier ticket is waiting to read while that reader waits
only for writers already changing their memory (their readers gone: they finish at the speed of
memory). Otherwise writers of ``a`` and of ``b`` taking turns (each claim made while the other's
is still held) would keep a reader of both out for as long as they went on. A reader that waits
for a writer still waiting for its own readers (which may be a stalled peer's READ) is not
waited for: a writer of ``b`` would then wait on a READ of ``a``. Such a waiting writer only
waits on writers that wait for nothing: still no cycle.

Why a thread may read again inside its own read (a nested ``Server.reading``): a writer that
claimed memory waits for its readers, who may include this thread; had the thread's second read
waited for that claim, each would wait for the other. So a thread already inside a read waits
only for writers changing their memory now, which wait for nothing; it goes in beside a claim
still waiting for readers, which then waits for this read too. Memory is still never read while
it changes, and the only waits made while holding a read are for writers that wait for nothing.

Why a writer's wait is bounded: a reader may hold its gate as long as its peer takes the reply
(the I/O timeout plus the size at the minimum rate: hours for a large tensor at a trickle). A
writer that waits past its bound gives its claim up (the readers that waited on it go in) and
raises :class:`GateTimeout`, having changed nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

__all__ = ["Gates", "GateTimeout", "READ_AGAIN"]

READ_AGAIN = 3  # times a reader of a set takes it again when a switch changed it meanwhile


class GateTimeout(Exception):
    """An in-place change waited past its bound for the memory it changes; nothing changed."""


class Gates:
    """The gates of every memory read or changed in place right now (``timeout``: how long a
    writer waits for its gates before it gives up; None: as long as it takes)."""

    def __init__(self, timeout: float | None = None):
        self.timeout = timeout
        self._cond = threading.Condition(threading.Lock())
        self._readers: dict[int, int] = {}  # id(memory) -> READs of it in progress
        self._claimed: dict[int, str] = {}  # id(memory) -> the name a writer changes it as
        self._changing: set[int] = set()  # claimed ids whose writer's readers are gone
        self._ticket = 0  # the last ticket drawn, in the order callers came
        self._queued: dict[int, tuple[int, ...]] = {}  # ticket -> ids a reader waits to read
        self._inside: dict[int, int] = {}  # threading.get_ident() -> reads the thread is inside now
        # the memory of every gate in use, so that no id is reused while it names a gate
        self._memory: dict[int, Any] = {}

    def _unclaim(self, held: dict[int, tuple[str, Any]]) -> list[Any]:
        # give a writer's claim up and wake who waits on it; the condition is held
        for k in held:
            del self._claimed[k]
            self._changing.discard(k)
        self._cond.notify_all()
        return self._free(held)

    def _free(self, keys: Iterable[int]) -> list[Any]:
        # forget gates nobody uses any more; the condition is held. The memory is returned, to be
        # let go outside it: a last reference going may run a finalizer that takes other locks.
        gone = []
        for k in keys:
            if k not in self._readers and k not in self._claimed:
                gone.append(self._memory.pop(k, None))
        return gone

    @contextmanager
    def reading(self, *memories: Any) -> Iterator[None]:
        """Read ``memories`` (none changes meanwhile); waits while a writer claims any of them
        (inside another read of this thread: only while a writer changes any of them now)."""
        held = {id(m): m for m in memories}
        me = threading.get_ident()
        with self._cond:
            # a claim still waiting for its readers may be waiting for this thread's other read
            barred = self._changing if me in self._inside else self._claimed
            if any(k in barred for k in held):  # queued: later writers of it wait for it
                self._ticket += 1
                ticket = self._ticket
                self._queued[ticket] = tuple(held)
                try:
                    self._cond.wait_for(lambda: not any(k in barred for k in held))
                finally:
                    del self._queued[ticket]
                    self._cond.notify_all()
            for k, m in held.items():
                self._readers[k] = self._readers.get(k, 0) + 1
                self._memory[k] = m
            self._inside[me] = self._inside.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                if self._inside[me] > 1:
                    self._inside[me] -= 1
                else:
                    del self._inside[me]
                for k in held:
                    n = self._readers[k] - 1
                    if n:
                        self._readers[k] = n
                    else:
                        del self._readers[k]
                gone = self._free(held)
                self._cond.notify_all()
            del gone

    @contextmanager
    def reading_current(self, snapshot: Callable[[], Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
        """Read the memory (``.tensor``) of the entries ``snapshot()`` gives, and give the entries.

        The snapshot is taken again once the gates are held, and its entries are given: one
        switched in place meanwhile is another entry over the same memory, held, and so is given
        as it is now. One that came to hold other memory (or went) is not held, so the whole
        set is taken again, a few times at most, then only the entries whose memory is held
        are given."""
        for attempt in range(READ_AGAIN):
            entries = dict(snapshot())
            with self.reading(*(e.tensor for e in entries.values())):
                now = snapshot()
                held = {n: e for n, e in now.items() if n in entries and e.tensor is entries[n].tensor}
                if len(held) == len(entries) or attempt + 1 == READ_AGAIN:
                    yield held
                    return
        raise AssertionError("unreachable")  # pragma: no cover

    @contextmanager
    def exclusive(self, memories: Mapping[str, Any]) -> Iterator[None]:
        """Change ``memories`` (name -> memory) alone: no READ of any of them runs meanwhile.

        Waits for other writers of any of them, then for their readers; GateTimeout past the
        bound (the claim given up, nothing held)."""
        held = {id(m): (name, m) for name, m in memories.items()}
        if not held:
            yield
            return
        why = self._claim(held, None if self.timeout is None else time.monotonic() + self.timeout)
        if why is not None:
            raise GateTimeout(why)
        try:
            yield
        finally:
            with self._cond:
                gone = self._unclaim(held)
            del gone

    def busy(self) -> tuple[int, int]:
        """(memories being read, memories claimed by a writer) right now."""
        with self._cond:
            return len(self._readers), len(self._claimed)

    def _free_to_claim(self, held: dict[int, tuple[str, Any]], ticket: int) -> bool:
        # no other writer claims any of ``held``, nor does a reader that came first, and that
        # waits only for writers changing their memory now, wait to read any of it
        if any(k in self._claimed for k in held):
            return False
        return not any(
            t < ticket and any(k in held for k in keys) and all(k in self._changing for k in keys if k in self._claimed)
            for t, keys in self._queued.items()
        )

    def _claim(self, held: dict[int, tuple[str, Any]], deadline: float | None) -> str | None:
        """Claim ``held``, then wait for its readers; None once it is the writer's, else why not
        (its claim given up, the readers that waited on it let in)."""
        with self._cond:
            self._ticket += 1
            ticket = self._ticket
            if not self._cond.wait_for(lambda: self._free_to_claim(held, ticket), _left(deadline)):
                busy = next((self._claimed[k] for k in held if k in self._claimed), None)
                if busy is None:
                    return f"a READ that came first waited for longer than {self.timeout:g} s"
                return f"another in-place update of {busy!r} held it for longer than {self.timeout:g} s"
            for k, (name, m) in held.items():
                self._claimed[k] = name
                self._memory[k] = m
            try:
                if self._cond.wait_for(lambda: not any(k in self._readers for k in held), _left(deadline)):
                    self._changing.update(held)
                    return None
            except BaseException:  # interrupted while waiting: the claim must not outlive it
                gone = self._unclaim(held)
                raise
            busy = next(held[k][0] for k in held if k in self._readers)
            gone = self._unclaim(held)
        del gone
        return f"a READ of {busy!r} was still sending its bytes after {self.timeout:g} s"


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
