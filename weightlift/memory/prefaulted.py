"""Fresh memory faulted in ahead, before anyone knows how it will be cut up.

A process that is about to allocate many tensors and fill them at once (vLLM's parameters,
built empty and then copied into by the weight loaders) pays for the first touch of every page
inside the fill: on these machines that fault costs more than the copy itself. Where there is
time before the fill, and a core with nothing to do (an engine's start-up is mostly one thread
importing and building), :class:`Prefaulted` faults in one mapping of about the right size on
background threads, piece by piece from its start; when the fill begins, :meth:`Prefaulted.take`
hands the part already done out in page-aligned pieces, each the sole owner of its pages: a
piece is unmapped on its own when the last array (or tensor) viewing it dies, so memory that a
consumer frees or replaces later (vLLM repacks linear weights after loading on its CPU build) is
given back as it would have been from the allocator. What is not handed out, the pieces still
unfaulted included, is unmapped by :meth:`Prefaulted.close`, which also runs by itself when
nobody has taken anything ``expires`` seconds after the faulting finished.

The memory reads as zeros, as fresh memory does: a consumer that moves a tensor's contents into
a piece copies only the pages of the tensor's own memory that were ever touched
(:meth:`PageMap.move_into`), so that moving memory nobody wrote costs no faults.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
import time
from typing import Any

import numpy as np

from weightlift import libc
from weightlift.memory.fresh import fault_in, policy

__all__ = ["Prefaulted", "PAGE", "PageMap", "written_pages", "move_into"]

PAGE = mmap.PAGESIZE
PIECE = 64 << 20  # faulted at a time, so that stop() waits for at most one such piece a thread
_DONE, _FAILED = 1, 2  # a piece's state once a thread is through with it


class _Pages:
    """An array interface over ``n`` bytes at ``addr``; ``owned``: unmap ``span`` bytes there when
    the last array viewing it is gone."""

    def __init__(self, addr: int, n: int, span: int = 0):
        self.__array_interface__ = {"data": (addr, False), "shape": (n,), "typestr": "|u1", "version": 3}
        self._addr, self._span = addr, span

    def __del__(self) -> None:
        if self._span:
            libc.unmap(self._addr, self._span)


def _array(addr: int, n: int, span: int = 0) -> np.ndarray:
    return np.asarray(_Pages(addr, n, span))


class Prefaulted:
    """``nbytes`` (rounded up to pages) of fresh private memory, faulted in from its start on
    ``threads`` background threads as soon as it is made (the fill policy's way: populated, or
    touched a page at a time)."""

    def __init__(self, nbytes: int, *, threads: int = 1, expires: float | None = 120.0, piece: int = PIECE):
        if nbytes < 1 or threads < 1 or piece < PAGE:
            raise ValueError("need nbytes >= 1, threads >= 1 and piece >= a page")
        self.nbytes = -(-nbytes // PAGE) * PAGE
        self._piece = -(-piece // PAGE) * PAGE
        self._addr = libc.map_file(
            -1, self.nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        try:
            libc.madvise(self._addr, self.nbytes, mmap.MADV_HUGEPAGE if policy().huge else mmap.MADV_NOHUGEPAGE)
        except (AttributeError, OSError):
            pass  # no THP here
        npieces = -(-self.nbytes // self._piece)
        self._done = bytearray(npieces)
        self._next = 0  # the next piece to fault
        self._ready = 0  # bytes faulted in, contiguous from the start
        self._cursor = 0  # bytes handed out (take) or given back (close), from the start
        self._stopped = self._closed = False
        self._cond = threading.Condition()
        self._expires = expires
        #: ``time.monotonic()`` when the faulting began, and when the last piece was done (None
        #: until then; stays None where it was stopped first)
        self.started: float = time.monotonic()
        self.finished: float | None = None
        self._threads = [
            threading.Thread(target=self._work, name=f"wl-prefault-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    @property
    def ready(self) -> int:
        """Bytes faulted in so far, contiguous from the start (what :meth:`take` can hand out)."""
        with self._cond:
            return self._ready

    def _work(self) -> None:
        while True:
            with self._cond:
                if self._stopped or self._next == len(self._done):
                    break
                i = self._next
                self._next += 1
            lo = i * self._piece
            try:
                fault_in(_array(self._addr + lo, min(self._piece, self.nbytes - lo)))
            except BaseException:
                with self._cond:  # the pieces before it stay ready; nothing after it becomes so
                    self._done[i] = _FAILED
                    self._stopped = True
                    self._cond.notify_all()
                raise
            with self._cond:
                self._done[i] = _DONE
                while self._ready < self.nbytes and self._done[self._ready // self._piece] == _DONE:
                    self._ready = min(self._ready + self._piece, self.nbytes)
                if self._ready == self.nbytes:
                    self.finished = time.monotonic()
                self._cond.notify_all()
        if self._expires is None or threading.current_thread() is not self._threads[0]:
            return
        with self._cond:  # nobody took anything in time after the last piece: the memory goes back
            self._cond.wait_for(lambda: self._stopped or self.finished is not None)
            if self._cond.wait_for(lambda: self._stopped, timeout=self._expires):
                return
        self.close()

    def stop(self) -> int:
        """Stop faulting (waiting for the pieces being faulted now); returns :attr:`ready`."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: all(self._done[i] for i in range(self._next)))
            return self._ready

    def take(self, n: int) -> np.ndarray | None:
        """The next ``n`` bytes as a uint8 array that owns its pages (the rest of the last page
        too); None where fewer than that are faulted in. Stops the faulting."""
        self.stop()
        span = -(-n // PAGE) * PAGE
        with self._cond:
            if self._closed or n < 1 or self._cursor + span > self._ready:
                return None
            addr = self._addr + self._cursor
            self._cursor += span
        return _array(addr, n, span)

    def close(self) -> None:
        """Unmap everything not handed out (idempotent); pieces handed out unmap themselves."""
        self.stop()
        with self._cond:
            if self._closed:
                return
            self._closed = True
            lo, self._cursor = self._cursor, self.nbytes
        if lo < self.nbytes:
            libc.unmap(self._addr + lo, self.nbytes - lo)


class PageMap:
    """This process's private anonymous mappings as ``/proc/self/maps`` lists them now, and its
    ``/proc/self/pagemap``, for many questions about memory mapped already: one read of the map
    list and one descriptor, not one of each a question (a vLLM process maps hundreds of ranges)."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int]] = []  # merged, sorted (lo, hi) of private anonymous memory
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    fields = line.split()
                    name = fields[5] if len(fields) > 5 else ""
                    if fields[1][3] != "p" or fields[4] != "0" or (name and not name.startswith(("[heap", "[anon"))):
                        continue  # a shared mapping, or a file's
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    if self._ranges and self._ranges[-1][1] == lo:
                        self._ranges[-1] = (self._ranges[-1][0], hi)
                    else:
                        self._ranges.append((lo, hi))
        except (OSError, ValueError, IndexError):
            self._ranges = []
        try:
            self._fd: int | None = os.open("/proc/self/pagemap", os.O_RDONLY)
        except OSError:
            self._fd = None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> PageMap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _private_anonymous(self, addr: int, n: int) -> bool:
        i = bisect.bisect_right(self._ranges, (addr, float("inf"))) - 1
        return i >= 0 and self._ranges[i][0] <= addr and addr + n <= self._ranges[i][1]

    def written(self, addr: int, n: int) -> list[tuple[int, int]] | None:
        """The ``(offset, length)`` runs of ``[addr, addr + n)`` whose pages this process has
        written or read, or has in swap (pagemap: present or swapped); the rest of private
        anonymous memory has never been touched and reads as zeros. None where that cannot be
        told: no pagemap, or memory that is not private and anonymous (a file's pages read as
        zeros there until faulted in, yet hold the file's bytes)."""
        if n < 1:
            return []
        if self._fd is None or not self._private_anonymous(addr, n):
            return None
        lo = addr // PAGE
        pages = (addr + n - 1) // PAGE - lo + 1
        try:
            raw = os.pread(self._fd, pages * 8, lo * 8)
        except OSError:
            return None
        if len(raw) != pages * 8:
            return None
        held = ((np.frombuffer(raw, dtype="<u8") >> np.uint64(62)) != 0).astype(np.int8)  # bit 63 present, 62 swap
        edges = np.flatnonzero(np.diff(np.concatenate(([0], held, [0])).astype(np.int8)))
        out = []
        for a, b in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
            begin, end = max((lo + a) * PAGE, addr), min((lo + b) * PAGE, addr + n)
            out.append((begin - addr, end - begin))
        return out

    def move_into(self, src_addr: int, n: int, dst: Any) -> None:
        """Copy what the ``n`` bytes at ``src_addr`` hold into ``dst`` (a fresh uint8 array of at
        least ``n`` bytes, reading as zeros): the pages ever touched (:meth:`written`), or all of
        them where that cannot be told."""
        runs = self.written(src_addr, n)
        for off, length in [(0, n)] if runs is None else runs:
            dst[off : off + length] = _array(src_addr + off, length)


def written_pages(addr: int, n: int) -> list[tuple[int, int]] | None:
    """:meth:`PageMap.written` on a map of this process taken now."""
    with PageMap() as pages:
        return pages.written(addr, n)


def move_into(src_addr: int, n: int, dst: Any) -> None:
    """:meth:`PageMap.move_into` on a map of this process taken now."""
    with PageMap() as pages:
        pages.move_into(src_addr, n, dst)
