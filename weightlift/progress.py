"""A one-line progress bar on a terminal, for loads that take more than a moment; silent on a pipe."""

from __future__ import annotations

import sys
import threading
import time

__all__ = ["Progress"]


class Progress:
    """Counts bytes done; draws to stderr at most ten times a second, after the first half second."""

    def __init__(self, total: int, *, label: str = "loading", delay: float = 0.5):
        self.total = max(1, total)
        self.done = 0
        self.label = label
        self._t0 = time.perf_counter()
        self._delay = delay
        self._last = 0.0
        self._drawn = False
        self._lock = threading.Lock()

    def update(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.perf_counter()
            finished = self.done >= self.total
            if now - self._t0 < self._delay or (now - self._last < 0.1 and not finished):
                return
            self._last = now
            el = now - self._t0
            rate = self.done / el / 1e9 if el > 0 else 0.0
            pct = 100.0 * self.done / self.total
            sys.stderr.write(f"\r{self.label}: {pct:5.1f}%  {self.done / 2**30:7.2f} GiB  {rate:6.2f} GB/s")
            self._drawn = True
            if finished:
                sys.stderr.write("\n")
            sys.stderr.flush()
