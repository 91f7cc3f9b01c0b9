"""Reading a cache entry into its destination: several readers, one hash that follows them.

A cache hit should cost what a local load of the same bytes costs. A local load reads with
several ``preadv`` threads straight into the destination (:mod:`weightlift.local.mover`); one
thread reading a piece, hashing it, then reading the next leaves the copy of one piece waiting
on the hash of the one before. Here :data:`READERS` threads (a connection's, shut down with it, or made for one large read, so
that no idle thread stays behind) ``preadv`` the entry's pieces, in
order and at most :data:`WINDOW` pieces ahead, straight into the destination, and the calling
thread hashes each piece as soon as it has landed, while it is still in the CPU's cache; the
copies run with the GIL released, so reads and hash overlap.

An entry of one piece (without a connection's readers: smaller than :data:`PARALLEL_READ_MIN`)
is read and hashed piece by piece on the calling thread: for it, handing pieces to threads costs
more than it saves. Either way no reader is
left writing into the destination when :func:`fill_verified` returns or raises.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

from weightlift.remote.server.cache_folder import reason

__all__ = ["BadRead", "read_exact", "fill_verified", "reader_pool", "READERS", "WINDOW", "PARALLEL_READ_MIN"]

READERS = 2  # reader threads of one entry's read
WINDOW = 6  # pieces read ahead of the hash at most
PARALLEL_READ_MIN = 16 * 1024 * 1024  # entries at least this large are read by the readers


class _Readable(Protocol):
    def readinto(self, buf: memoryview, /) -> int | None: ...
    def fileno(self) -> int: ...


class BadRead(Exception):
    """A read of an entry failed or came up short."""


def read_exact(f: _Readable, chunk: memoryview) -> None:
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


def fill_verified(
    f: _Readable,
    out: memoryview,
    piece: int,
    hasher: Any,
    before: Callable[[int, int], None] | None = None,
    readers: Executor | None = None,
) -> None:
    """Read all of ``out`` from ``f`` (at its start), hashing it into ``hasher`` in order;
    ``before(begin, end)`` runs before each piece is read into ``out[begin:end]``. ``readers``:
    the threads to read with (a connection's, kept for its reads), or None (threads made for
    this read where the entry is large enough to pay for them). BadRead when the file cannot be
    read to the end; whatever ``before`` raises passes through."""
    n = out.nbytes
    if n < (2 * piece if readers is not None else PARALLEL_READ_MIN):
        for off in range(0, n, piece):
            chunk = out[off : off + piece]
            if before is not None:
                before(off, off + len(chunk))
            read_exact(f, chunk)
            hasher.update(chunk)
        return
    if readers is None:
        with ThreadPoolExecutor(READERS, thread_name_prefix="weightlift-cache-read") as pool:
            _parallel(f.fileno(), out, piece, hasher, before, pool)
    else:
        _parallel(f.fileno(), out, piece, hasher, before, readers)


def _parallel(
    fd: int, out: memoryview, piece: int, hasher: Any, before: Callable[[int, int], None] | None, pool: Executor
) -> None:
    def read(off: int, chunk: memoryview) -> None:
        if before is not None:
            before(off, off + len(chunk))
        _pread_exact(fd, chunk, off)

    n = out.nbytes
    ahead: deque[tuple[memoryview, Future[None]]] = deque()
    nxt = 0
    try:
        while nxt < n or ahead:
            while nxt < n and len(ahead) < WINDOW:
                chunk = out[nxt : nxt + piece]
                ahead.append((chunk, pool.submit(read, nxt, chunk)))
                nxt += len(chunk)
            chunk, fut = ahead.popleft()
            fut.result()
            hasher.update(chunk)
    finally:
        for _, fut in ahead:  # nothing may write into out once this returns: cancel, or wait
            if not fut.cancel():
                wait([fut])


def reader_pool() -> ThreadPoolExecutor:
    """Reader threads for one connection's cache reads (shut down when the connection ends)."""
    return ThreadPoolExecutor(READERS, thread_name_prefix="weightlift-cache-read")
