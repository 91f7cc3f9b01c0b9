"""Reading a cache entry into its destination: the caller and its helpers read and hash it.

A cache hit should cost what a local load of the same bytes costs. A local load reads with as
many ``preadv`` threads as there are cores, straight into the destination
(:mod:`weightlift.local.mover`); a hit must also hash every byte, in order, to prove the entry.
One thread reading a piece, hashing it, then reading the next leaves a core idle; a thread that
only hashes while others read adds one more runnable thread than there are cores, and a
wake-up on every piece. So here the work is shared by :data:`READERS` workers: the
calling thread and its helpers (a connection's :class:`Readers`, kept for its reads). Each
worker takes the next piece, ``preadv``\\ s it straight into the destination, and then, if that
piece is the next one the hash is waiting for and nobody is hashing, hashes it and every later
piece that has landed meanwhile, while it is still in the CPU's cache. A worker that lands a
piece out of order goes on to read the next one, so no worker waits for another while there is
a piece left to read, and no hand-off happens per piece: only the state under one lock
changes. The copies and the hash run with the GIL released.

The caller never waits for a helper to start: a helper that comes late finds the pieces taken
and leaves. When the caller has nothing left to take it waits only for the helpers still
inside the read, so that no helper is left writing into the destination when
:func:`fill_verified` returns or raises, and a read that a helper took up after that touches
nothing.

An entry smaller than :data:`PARALLEL_READ_MIN` is read and hashed piece by piece on the
calling thread: for it, sharing costs more than it saves.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from weightlift.remote.server.cache.folder import reason

__all__ = [
    "BadRead",
    "Readable",
    "Readers",
    "read_exact",
    "fill_verified",
    "reader_pool",
    "read_piece",
    "READERS",
    "PARALLEL_READ_MIN",
    "MIN_PIECE",
]

#: Workers of one entry's read: the caller and READERS - 1 helpers (as many as a local load's
#: readers, at most four).
READERS = max(2, min(4, os.cpu_count() or 1))
#: Entries at least this large are shared among the workers.
PARALLEL_READ_MIN = 512 * 1024
#: The smallest piece an entry is split into, so that a small entry still gives every worker a
#: piece or two without costing a lock round per few kilobytes.
MIN_PIECE = 256 * 1024
#: Pieces per worker an entry is split into at least (where MIN_PIECE allows).
PIECES_PER_READER = 2


class Readable(Protocol):
    """A file the cache reads an entry from: ``readinto`` and its descriptor."""

    def readinto(self, buf: memoryview, /) -> int | None: ...
    def fileno(self) -> int: ...


class BadRead(Exception):
    """A read of an entry failed or came up short."""


def read_piece(n: int, largest: int) -> int:
    """The piece an entry of ``n`` bytes is read in: ``largest`` at most, and small enough that
    each of :data:`READERS` workers gets :data:`PIECES_PER_READER` pieces (down to MIN_PIECE)."""
    share = -(-n // (READERS * PIECES_PER_READER))
    return max(1, min(largest, max(MIN_PIECE, share), n))


def read_exact(f: Readable, chunk: memoryview) -> None:
    """Fill ``chunk`` from ``f``'s position on; BadRead on an error or an early end."""
    got = 0
    n = len(chunk)
    while got < n:
        try:
            r = f.readinto(chunk[got:])
        except OSError as exc:
            raise BadRead(f"is unreadable ({reason(exc)})") from exc
        if not r:
            raise BadRead(f"ended early ({got} of {n} bytes)")
        got += r


def _pread_exact(fd: int, chunk: memoryview, offset: int) -> None:
    got = 0
    n = len(chunk)
    while got < n:
        try:
            r = os.preadv(fd, [chunk[got:]], offset + got)
        except OSError as exc:
            raise BadRead(f"is unreadable ({reason(exc)})") from exc
        if not r:
            raise BadRead(f"ended early ({offset + got} bytes in)")
        got += r


class _ReadJob:
    """One entry's read, shared by the caller and the helpers that join it in time.

    Everything below ``lock`` changes under it: which piece is taken next, which have landed,
    which the hash reached and whether a worker is hashing now. The bytes move outside it."""

    def __init__(self, fd: int, out: memoryview, piece: int, hasher: Any, before: Callable[[int, int], None] | None):
        self.fd, self.piece, self.hasher, self.before = fd, piece, hasher, before
        self.out: memoryview | None = out
        self.n = out.nbytes
        self.pieces = -(-self.n // piece)
        self.lock = threading.Lock()
        self.taken = 0  # pieces handed out
        self.landed = bytearray(self.pieces)
        self.hashed = 0  # pieces hashed, in order
        self.hashing = False
        self.error: BaseException | None = None
        self.closed = False  # the caller is done: a helper that comes now touches nothing
        self.inside = 0  # helpers working on it now
        self.left = threading.Lock()  # held while any helper is inside

    def join(self) -> bool:
        """A helper joins (False: too late, the caller closed it)."""
        with self.lock:
            if self.closed:
                return False
            if not self.inside:
                self.left.acquire()
            self.inside += 1
            return True

    def leave(self) -> None:
        with self.lock:
            self.inside -= 1
            if not self.inside:
                self.left.release()

    def work(self) -> None:
        """Read (and hash, in turn) pieces until none is left or the read failed; what fails
        is kept for the caller to raise."""
        try:
            self._work()
        except BaseException as exc:
            with self.lock:
                if self.error is None:
                    self.error = exc

    def _work(self) -> None:
        out = self.out
        assert out is not None
        piece = self.piece
        while True:
            with self.lock:
                i = self.taken
                if i >= self.pieces or self.error is not None:
                    return
                self.taken = i + 1
            begin = i * piece
            chunk = out[begin : begin + piece]
            if self.before is not None:
                self.before(begin, begin + len(chunk))
            _pread_exact(self.fd, chunk, begin)
            del chunk
            with self.lock:
                self.landed[i] = 1
                if self.hashing or self.hashed != i:
                    continue  # out of order, or another worker is hashing: it takes this one too
                self.hashing = True
            self._hash_landed(out)

    def _hash_landed(self, out: memoryview) -> None:
        """Hash the next piece and every later one that has landed, in order."""
        piece = self.piece
        while True:
            k = self.hashed
            self.hasher.update(out[k * piece : (k + 1) * piece])
            with self.lock:
                self.hashed = k = k + 1
                if k < self.pieces and self.landed[k] and self.error is None:
                    continue
                self.hashing = False
                return

    def finish(self) -> None:
        """The caller's end: no helper joins any more; wait for those inside to leave, then
        raise what any worker raised."""
        with self.lock:
            self.closed = True
            wait = self.inside > 0
        if wait:
            self.left.acquire()
            self.left.release()
        self.out = self.before = self.hasher = None  # a late helper holds no destination alive
        if self.error is not None:
            raise self.error
        if self.hashed != self.pieces:
            raise AssertionError(f"cache read hashed {self.hashed} of {self.pieces} pieces")


class Readers:
    """Helper threads for one connection's cache reads (:meth:`close` when the connection ends).

    Each takes the reads handed to it in order; a read it reaches after its caller is done is
    skipped."""

    def __init__(self, helpers: int = READERS - 1):
        self._queue: queue.SimpleQueue[_ReadJob | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"weightlift-cache-read_{k}", daemon=True)
            for k in range(max(1, helpers))
        ]
        for t in self._threads:
            t.start()

    def offer(self, job: _ReadJob) -> None:
        for _ in self._threads:
            self._queue.put(job)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.join():
                try:
                    job.work()
                finally:
                    job.leave()
            del job

    def close(self) -> None:
        """Stop the helpers once they are done with what they were handed."""
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()


def reader_pool() -> Readers:
    """Helper threads for one connection's cache reads (closed when the connection ends)."""
    return Readers()


def fill_verified(
    f: Readable,
    out: memoryview,
    piece: int,
    hasher: Any,
    before: Callable[[int, int], None] | None = None,
    readers: Readers | None = None,
) -> None:
    """Read all of ``out`` from ``f`` (at its start), hashing it into ``hasher`` in order;
    ``before(begin, end)`` runs before each piece is read into ``out[begin:end]``. ``readers``:
    a connection's helpers to share the read with, or None (helpers made for this read where
    the entry is large enough to pay for them). BadRead when the file cannot be read to the
    end; whatever ``before`` raises passes through."""
    n = out.nbytes
    if n < PARALLEL_READ_MIN or n <= piece:
        for off in range(0, n, piece):
            chunk = out[off : off + piece]
            if before is not None:
                before(off, off + len(chunk))
            read_exact(f, chunk)
            hasher.update(chunk)
        return
    own = readers is None
    helpers = Readers() if readers is None else readers
    try:
        job = _ReadJob(f.fileno(), out, piece, hasher, before)
        helpers.offer(job)
        try:
            job.work()
        finally:
            job.finish()
    finally:
        if own:
            helpers.close()
