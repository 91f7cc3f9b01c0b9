"""The ranged-read engine: a checkpoint's tensor bytes as many parallel ranged reads.

Theory of operation.

1. **Runs.** Selected tensors that lie back to back in an object (up to :data:`MAX_GAP` bytes
   of padding apart) form one run, so contiguous tensors cost one request per part, not one
   per tensor. Runs are laid out in one arena as they lie in the object (same offset modulo
   :data:`ALIGN`), so each tensor is a view of it.
2. **Parts.** Runs are cut into parts of the endpoint's part size
   (:mod:`weightlift.sources.tuning`); ``connections`` workers take parts in object order.
3. **Landing.** A host destination is read into in place: each part's body goes straight into
   its slice of the arena, piece by piece, with no staging copy. A destination a memcpy cannot
   fill (a CUDA device, anything off the heap) hands each worker its private staging
   (:meth:`~weightlift.memory.targets.Target.stager`); a part is received into it and landed from
   it, while the other workers receive theirs.
4. **Budget.** Host memory besides the destination is bounded by ``budget`` bytes: the staging
   of every worker (two parts each, as a CUDA stager's two slots) plus the pieces obstore holds
   while receiving (:data:`~weightlift.sources.store.PIECE` per connection). Where
   the budget cannot hold the asked connections, fewer run. Where something waits for parts in
   object order and keeps copies of those that came early (a digest, the hasher of a verified
   staged load), a worker may not start a part more than ``window`` parts ahead of the oldest
   still in flight, so what waits holds at most a window of parts; elsewhere no worker waits
   for another, and one slow request stalls nobody.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightlift.errors import OptionError
from weightlift.plan import ALIGN, MAX_GAP, Run, layout, make_runs
from weightlift.sources.store import PIECE

__all__ = ["Run", "Part", "make_runs", "layout", "make_parts", "Budget", "run_parts", "MAX_GAP", "ALIGN"]


@dataclass(frozen=True, slots=True)
class Part:
    """``length`` bytes of ``file`` at ``offset``, landing at ``dst`` in the arena."""

    index: int
    file: str
    offset: int
    length: int
    dst: int


def make_parts(runs: list[Run], starts: list[int], part: int) -> list[Part]:
    out: list[Part] = []
    for r, s in zip(runs, starts, strict=True):
        for a in range(0, r.length, part):
            out.append(Part(len(out), r.file, r.offset + a, min(part, r.length - a), s + a))
    return out


@dataclass(frozen=True)
class Budget:
    """Host memory a load may hold besides its destination, and what it allows."""

    nbytes: int
    part: int
    connections: int

    @staticmethod
    def fit(nbytes: int | None, *, part: int, connections: int, staged: bool) -> Budget:
        """The connections and part size that fit ``nbytes`` (None: the default for these)."""
        if connections < 1:
            raise OptionError("connections must be at least 1")
        per = (2 * part if staged else 0) + PIECE
        if nbytes is None:
            nbytes = connections * per
        if nbytes < PIECE + (2 * 64 * 1024 if staged else 0):
            raise OptionError(f"a budget of {nbytes} bytes cannot hold even one connection's pieces ({PIECE} bytes)")
        if staged and nbytes < per:  # one connection at least: shrink its parts to fit
            part = max(64 * 1024, (nbytes - PIECE) // 2)
            per = 2 * part + PIECE
        return Budget(nbytes, part, max(1, min(connections, nbytes // per)))

    @property
    def window(self) -> int:
        """Parts a worker may run ahead of the oldest in flight: the budget's staging, in parts."""
        return max(self.connections, self.nbytes // max(1, self.part))


class _Cursor:
    """Hands out parts in order, never more than ``window`` past the oldest unfinished one."""

    def __init__(self, n: int, window: int):
        self.n = n
        self.window = max(1, window)
        self.next = 0
        self.finished: set[int] = set()
        self.low = 0
        self.failed = False
        self._cond = threading.Condition()

    def take(self) -> int | None:
        with self._cond:
            while not self.failed and self.next < self.n and self.next >= self.low + self.window:
                self._cond.wait()
            if self.failed or self.next >= self.n:
                return None
            i = self.next
            self.next += 1
            return i

    def done(self, i: int) -> None:
        with self._cond:
            self.finished.add(i)
            while self.low in self.finished:
                self.finished.discard(self.low)
                self.low += 1
            self._cond.notify_all()

    def fail(self) -> None:
        with self._cond:
            self.failed = True
            self._cond.notify_all()


def run_parts(
    parts: list[Part],
    work: Callable[[Any, Part], None],
    *,
    connections: int,
    window: int,
    worker_state: Callable[[], Any] = lambda: None,
    close_state: Callable[[Any], None] = lambda s: None,
) -> None:
    """Run ``work(state, part)`` over every part on ``connections`` threads, each with the
    ``state`` ``worker_state()`` makes (its staging); the first error is raised here."""
    cursor = _Cursor(len(parts), window)
    errors: list[BaseException] = []

    def worker() -> None:
        state = None
        try:
            state = worker_state()
            while (i := cursor.take()) is not None:
                work(state, parts[i])
                cursor.done(i)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            errors.append(e)
            cursor.fail()
        finally:
            if state is not None:
                close_state(state)

    n = max(1, min(connections, len(parts)))
    if n == 1:
        worker()
    else:
        ts = [threading.Thread(target=worker, name=f"wl-source-{k}", daemon=True) for k in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    if errors:
        raise errors[0]
