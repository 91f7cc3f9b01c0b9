"""A tensor in flight on one connection, and the hash its bytes pass through as they arrive.

A :class:`Pending` tensor holds its destination, its charge and which of its bytes have arrived;
its ``writer`` (a cache writer, a digest check, or a :class:`StreamHash` for a tensor ALLOCated
with VERIFY) is fed the bytes in order as they land (:func:`feed`), so that the digest is known
when the last byte is in.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable
from typing import Any

import blake3

from weightlift.digest.blake import PARALLEL_HASH_MIN, byte_view
from weightlift.errors import CacheError
from weightlift.profile import Profiler
from weightlift.remote.protocol import Alloc
from weightlift.remote.server.cache.hashing import parallel_pays
from weightlift.remote.server.store import Charge

__all__ = ["Pending", "StreamHash", "feed", "MAX_RANGES"]

MAX_RANGES = 4096  # disjoint byte ranges one pending tensor's WRITEs may leave


class StreamHash:
    """The digest of bytes fed in order, for a tensor ALLOCated with VERIFY that no cache writer
    hashes: the same ``write``, ``commit`` and ``abort`` as one, and ``value`` at the end."""

    def __init__(self, length: int):
        self.length = length
        self._hasher: Any = None
        self.is_open = True

    def write(self, buf: Any) -> None:
        view = byte_view(buf)
        if self._hasher is None:  # as for the cache: threads pay only on large pieces, on enough cores
            big = parallel_pays(self.length, view.nbytes) and min(self.length, view.nbytes) >= PARALLEL_HASH_MIN
            self._hasher = blake3.blake3(max_threads=blake3.blake3.AUTO if big else 1)
        self._hasher.update(view)

    def commit(self) -> None:
        self.is_open = False

    def abort(self) -> None:
        self.is_open = False

    @property
    def value(self) -> bytes:
        return (self._hasher or blake3.blake3()).digest()


class Pending:
    """A tensor being filled by one connection: its destination and which bytes have arrived.

    The arrived bytes are kept as sorted, disjoint, non-touching ranges ``[starts[i], ends[i])``;
    a WRITE merges in with two binary searches, so a tensor written in many pieces in any order
    costs O(log n) per WRITE plus the ranges it joins, never a rebuild of the list.
    """

    __slots__ = (
        "name",
        "dtype",
        "shape",
        "nbytes",
        "cost",
        "charge",
        "deferred",
        "dest",
        "digest",
        "starts",
        "ends",
        "writer",
        "hashed",
        "proven",
        "verify",
        "behind",
        "fresh",
    )

    def __init__(self, a: Alloc, cost: int, charge: Charge, deferred: int = 0):
        self.name, self.dtype, self.shape, self.nbytes = a.name, a.dtype, a.shape, a.nbytes
        self.cost = cost
        self.charge: Charge | None = charge  # None once released or published
        self.deferred = deferred  # data bytes not charged yet (allocated while the server was full)
        self.dest: Any = None
        self.digest = a.digest
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.writer: Any = None
        self.hashed = 0
        self.proven = False  # the bytes in dest are known to hash to digest
        self.verify = a.verify  # report the digest of what was stored at the next barrier
        self.behind = False  # its cache entry is to be written behind, from memory, once published
        self.fresh = False  # dest is memory never touched (its pages need faulting in), not reused

    def _span(self, begin: int, end: int) -> tuple[int, int]:
        # Ranges i..j-1 overlap or touch [begin, end): those before i end before it begins,
        # those from j on start after it ends.
        i = bisect_left(self.ends, begin)
        return i, bisect_right(self.starts, end, lo=i)

    def can_add(self, begin: int, end: int) -> bool:
        """Whether adding [begin, end) keeps the ranges within MAX_RANGES."""
        if begin == end or len(self.starts) < MAX_RANGES:
            return True
        i, j = self._span(begin, end)
        return i < j

    def add(self, begin: int, end: int) -> None:
        if begin == end:
            return
        i, j = self._span(begin, end)
        if i < j:
            begin, end = min(begin, self.starts[i]), max(end, self.ends[j - 1])
        self.starts[i:j] = [begin]
        self.ends[i:j] = [end]

    def clear(self) -> None:
        self.starts, self.ends = [], []

    def fill(self) -> None:
        self.starts, self.ends = [0], [self.nbytes]

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.starts, self.ends, strict=False))

    @property
    def complete(self) -> bool:
        return self.nbytes == 0 or (len(self.starts) == 1 and self.starts[0] == 0 and self.ends[0] == self.nbytes)

    def release(self) -> None:
        """Give the tensor's charge back (it will not complete)."""
        if self.charge is not None:
            self.charge.release()
            self.charge = None


def feed(p: Pending, chunk: memoryview, prof: Profiler, on_cache_error: Callable[[CacheError], None]) -> None:
    """Feed bytes that just landed to ``p``'s writer, if it has one; a cache writer that fails is
    dropped (``on_cache_error`` decides whether the cache goes too) and the tensor goes on."""
    if p.writer is None:
        return
    with prof.phase("hash", len(chunk), name=p.name):
        try:
            p.writer.write(chunk)
            p.hashed += len(chunk)
        except CacheError as e:
            p.writer = None
            on_cache_error(e)
