"""Every hash the server takes, in one place: the other modules call these and never blake3.

* :func:`digest_of` and :func:`tensor_digest` hash a whole buffer (or a stored tensor) in place;
  :func:`set_digest` combines tensors' digests into the set digest an update reports.
* :func:`piece_hasher` hashes bytes fed a piece at a time on one thread (a device tensor read
  back through a staging buffer); :func:`entry_hasher` is the same for bytes that arrive or are
  read in pieces, with blake3's thread pool where that pays (:func:`parallel_pays`).
* :class:`DigestCheck` proves a digest without keeping the bytes; :class:`StreamHash` takes the
  digest of a tensor ALLOCated with VERIFY as its bytes arrive.
"""

from __future__ import annotations

import hmac
from typing import Any

import blake3

from weightlift.digest.blake import PARALLEL_HASH_MIN, byte_view, hash_buffer
from weightlift.digest.setdigest import set_digest
from weightlift.env import cpus
from weightlift.errors import CacheError
from weightlift.memory.targets import as_bytes

__all__ = [
    "PARALLEL_PIECE_MIN",
    "PARALLEL_HASH_CPUS",
    "Hasher",
    "digest_of",
    "tensor_digest",
    "set_digest",
    "piece_hasher",
    "entry_hasher",
    "parallel_pays",
    "DigestCheck",
    "StreamHash",
]

#: The smallest piece for which blake3's thread pool pays: in smaller pieces its start-up costs
#: more than the parallel hashing saves (measured figures: bench/RESULTS.md).
PARALLEL_PIECE_MIN = 256 * 1024
#: The fewest cores on which blake3's thread pool is used on the receive and cache-read paths.
PARALLEL_HASH_CPUS = 4

#: An incremental hasher: ``update(bytes)``, then ``digest()``.
Hasher = blake3.blake3


def digest_of(buf: Any) -> bytes:
    """The digest of a whole contiguous buffer, hashed in place."""
    return hash_buffer(buf)


def tensor_digest(tensor: Any) -> bytes:
    """The digest of a stored tensor's bytes (host memory)."""
    return hash_buffer(as_bytes(tensor))


def piece_hasher() -> Hasher:
    """A one-thread hasher for bytes fed a piece at a time (also the digest of no bytes)."""
    return blake3.blake3()


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
        actual = (self._hasher or piece_hasher()).digest()
        if self.written != self.length or not hmac.compare_digest(actual, self.digest):
            raise CacheError(f"the bytes do not match the digest {self.digest.hex()[:16]}")

    def abort(self) -> None:
        self.is_open = False


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
        return (self._hasher or piece_hasher()).digest()
