"""A one-line progress bar on a terminal, for transfers that take more than a moment; silent on a pipe.

A load counts bytes as they land (:meth:`Progress.update`); a push or a pull reports how far it
is as ``(done, total)`` through the callback its library call takes (:meth:`Progress.__call__`),
so the library itself never draws. :func:`terminal` gives a bar only where stderr is a terminal:
a pipe, a log file or a script's captured output gets nothing.
"""

from __future__ import annotations

import sys
import threading
import time

__all__ = ["Progress", "terminal", "DELAY"]

#: Seconds before the first draw: a transfer done sooner never draws at all.
DELAY = 0.5


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _eta(seconds: float) -> str:
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """Counts bytes done of ``total``; draws ``label: pct  done/total  rate  ETA`` to stderr at
    most ten times a second, after the first :data:`DELAY` seconds, and a last time when done.

    ``total`` may be 0 when it is not known yet: a call ``progress(done, total)`` sets both."""

    def __init__(self, total: int = 0, *, label: str = "loading", delay: float | None = None):
        self.total = total
        self.done = 0
        self.label = label
        self._t0 = time.perf_counter()
        self._delay = DELAY if delay is None else delay
        self._last = 0.0
        self._drawn = False
        self._finished = False
        self._lock = threading.Lock()

    def update(self, n: int) -> None:
        """``n`` more bytes are done."""
        with self._lock:
            self._draw(self.done + n, self.total)

    def __call__(self, done: int, total: int) -> None:
        """``done`` of ``total`` bytes are done: the callback a push or a pull takes."""
        with self._lock:
            self._draw(done, total)

    def _draw(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        now = time.perf_counter()
        finished = done >= total
        if self._finished or now - self._t0 < self._delay or (now - self._last < 0.1 and not finished):
            return
        self._last = now
        el = now - self._t0
        rate = done / el if el > 0 else 0.0
        pct = 100.0 * done / total if total > 0 else 100.0
        eta = f"ETA {_eta((total - done) / rate)}" if rate > 0 and not finished else f"in {_eta(el)}"
        line = f"{self.label}: {pct:5.1f}%  {_size(done)} / {_size(total)}  {rate / 1e9:6.2f} GB/s  {eta}"
        sys.stderr.write(f"\r{line}\x1b[K")  # erase what a longer line before left
        self._drawn = True
        if finished:
            self._finished = True
            sys.stderr.write("\n")
        sys.stderr.flush()


def terminal(label: str, *, enabled: bool = True) -> Progress | None:
    """A :class:`Progress` labelled ``label`` where stderr is a terminal (and ``enabled``), else None."""
    if not enabled or not sys.stderr.isatty():
        return None
    return Progress(label=label)
