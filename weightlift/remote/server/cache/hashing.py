"""Hashing bytes as they arrive for the cache: the choice of blake3's thread count, and
:class:`DigestCheck`, which proves a digest without keeping the bytes."""

from __future__ import annotations

import hmac

import blake3

from weightlift.digest.blake import PARALLEL_HASH_MIN, byte_view
from weightlift.env import cpus
from weightlift.errors import CacheError

__all__ = ["PARALLEL_PIECE_MIN", "PARALLEL_HASH_CPUS", "entry_hasher", "parallel_pays", "DigestCheck"]

#: The smallest piece for which blake3's thread pool pays: in smaller pieces its start-up costs
#: more than the parallel hashing saves (measured figures: bench/RESULTS.md).
PARALLEL_PIECE_MIN = 256 * 1024
#: The fewest cores on which blake3's thread pool is used on the receive and cache-read paths.
PARALLEL_HASH_CPUS = 4


def entry_hasher(length: int, piece: int, threads: int | None) -> blake3.blake3:
    """A hasher for ``length`` bytes fed in pieces of ``piece``: multithreaded where that pays,
    or with ``threads`` threads when given."""
    if threads is None:
        threads = blake3.blake3.AUTO if parallel_pays(length, piece) else 1
    return blake3.blake3(max_threads=threads)


def parallel_pays(length: int, piece: int) -> bool:
    """Whether blake3's thread pool pays for ``length`` bytes hashed in pieces of ``piece``.

    Not on a machine of fewer than :data:`PARALLEL_HASH_CPUS` cores: the bytes hashed on a
    server's receive or cache-read path are being received or read by the other core meanwhile,
    and the pool's threads then wait for the cores instead of sharing the work (profiled: several
    times the single-threaded hash's CPU time)."""
    return cpus() >= PARALLEL_HASH_CPUS and length >= PARALLEL_HASH_MIN and piece >= PARALLEL_PIECE_MIN


class DigestCheck:
    """Proves that bytes hash to a digest without storing them: the same ``write``, ``commit``
    and ``abort`` as a :class:`CacheWriter`, and no file (an entry already cached, or a connection
    holding its share of open files)."""

    def __init__(self, digest: bytes, length: int, threads: int | None = None):
        self.digest = bytes(digest)
        self.length = length
        self._threads = threads
        self._hasher: blake3.blake3 | None = None
        self.written = 0
        self.is_open = True

    def write(self, buf: object) -> None:
        view = byte_view(buf)
        if self.written + view.nbytes > self.length:
            self.is_open = False
            raise CacheError(f"more than the declared {self.length} bytes hashed")
        if self._hasher is None:
            self._hasher = entry_hasher(self.length, view.nbytes, self._threads)
        self._hasher.update(view)
        self.written += view.nbytes

    def commit(self) -> None:
        """CacheError unless exactly ``length`` bytes were written and they hash to the digest."""
        self.is_open = False
        actual = (self._hasher or blake3.blake3()).digest()
        if self.written != self.length or not hmac.compare_digest(actual, self.digest):
            raise CacheError(f"the bytes do not match the digest {self.digest.hex()[:16]}")

    def abort(self) -> None:
        self.is_open = False
