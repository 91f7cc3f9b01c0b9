"""The content-addressed tensor cache of a tensor server.

Theory of operation
-------------------
An entry is the bytes of one tensor, named by their BLAKE3 digest: ``<root>/ab/abcdef...`` (the
full hex digest, in a folder named after its first two hex digits so no folder grows huge).
The rule that shapes everything here: **an entry is never wrong**. A client that names a digest
the server holds gets the server's bytes instead of sending its own, so a wrong entry would put
wrong weights in memory with nothing to show for it. Hence:

* Writes go to a temporary file in the entry's own folder (unique name, ``O_EXCL``) and are hashed
  as the bytes arrive, in the same pass that writes them: no second read, no staging copy just for
  the hash. :meth:`CacheWriter.commit` checks the length and the digest and only then
  ``os.replace``s the file into place, which is atomic: a reader sees the old entry, the new one,
  or none, never half of one. Two writers of the same digest each write their own temporary file
  and the last rename wins; both renamed the same verified bytes.
* Reads verify. :meth:`TensorCache.read_into` hashes what it reads in the same pass and checks the
  digest at the end; an entry that is missing, of the wrong size, unreadable or corrupt is deleted
  and :class:`CacheError` raised, and the caller asks the client for the bytes instead.
* No ``fsync`` by default. On a 100 GB push an fsync per entry forces every byte to the disk
  before the next tensor may land, which can cost more than the network. Without it a power loss
  may leave a committed entry short or full of zeros, and the verify on read catches exactly
  that. Writes use ``os.write`` with no user-space buffer, so at commit every byte is already in
  the kernel and visible to other processes. ``durable=True`` fsyncs the file and its folder for
  those who want entries to survive a crash.
* Write failures (ENOSPC, EDQUOT, EIO, anything) remove the temporary file and raise CacheError
  from the OSError; the caller may stop caching with a warning and go on without the cache.

Least-recently-used eviction under ``max_bytes`` orders entries by mtime, which commit sets and a
verified read refreshes. Temporary files do not count; ones left by a crashed writer are removed
when the cache is opened once they are :data:`STALE_TEMP_SECONDS` old (a live writer touches its
file with every write), and are otherwise ignored: they never have an entry's name.

Hashing runs with the GIL released (blake3 does so for large inputs) and uses blake3's
multithreaded mode for entries of at least 1 MiB fed in pieces of at least
:data:`PARALLEL_PIECE_MIN`, which about doubles the rate on two cores; smaller pieces stay
single-threaded, where the thread pool costs more than it gives.
"""

from __future__ import annotations

import errno
import hmac
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import blake3

from weightlift.digest.blake import DIGEST_SIZE, PARALLEL_HASH_MIN, byte_view, digest_hex
from weightlift.errors import CacheError, OptionError

__all__ = [
    "DIGEST_SIZE",
    "READ_CHUNK",
    "STALE_TEMP_SECONDS",
    "DISK_ERRNOS",
    "disk_unusable",
    "PARALLEL_PIECE_MIN",
    "digest_hex",
    "TensorCache",
    "CacheWriter",
]

#: Bytes read per ``readinto`` by :meth:`TensorCache.read_into`: large enough for the parallel
#: hasher, small enough that the bytes are still in cache when they are hashed.
READ_CHUNK = 4 * 1024 * 1024
#: A temporary file untouched this long belongs to a writer that died.
STALE_TEMP_SECONDS = 15 * 60
#: Write errors that mean the cache's disk is unusable (full, over quota, failing, read-only)
#: rather than one entry bad; see :func:`disk_unusable`.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})

#: The smallest piece for which blake3's thread pool pays: in smaller pieces its start-up costs
#: more than the parallel hashing saves (measured figures: bench/RESULTS.md).
PARALLEL_PIECE_MIN = 256 * 1024

_TEMP_PREFIX = ".tmp-"
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_HEX = frozenset("0123456789abcdef")


def disk_unusable(exc: BaseException) -> bool:
    """Whether a CacheError came from a disk that is full, over quota, failing or read-only.

    A server stops caching (with a warning) on these, rather than retrying for every tensor.
    """
    cause = exc.__cause__
    return isinstance(cause, OSError) and cause.errno in DISK_ERRNOS


def _is_entry_name(name: str) -> bool:
    return len(name) == 2 * DIGEST_SIZE and set(name) <= _HEX


def _hasher(length: int, piece: int, threads: int | None) -> Any:
    if threads is None:
        parallel = length >= PARALLEL_HASH_MIN and piece >= PARALLEL_PIECE_MIN
        threads = blake3.blake3.AUTO if parallel else 1
    return blake3.blake3(max_threads=threads)


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


class TensorCache:
    """Tensors by BLAKE3 digest under ``root`` (created if missing).

    ``max_bytes`` caps the bytes held in entries, evicting the least recently used after each
    commit. ``durable`` fsyncs each entry and its folder at commit. ``hash_threads`` forces blake3's
    thread count (1: single-threaded); None chooses by the size of each piece hashed. Safe to use
    from several threads and by several processes sharing one root.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        durable: bool = False,
        hash_threads: int | None = None,
    ):
        if max_bytes is not None and max_bytes < 0:
            raise OptionError(f"max_bytes must be >= 0, got {max_bytes}")
        self.root = os.path.abspath(os.fspath(root))
        self.max_bytes = max_bytes
        self.durable = durable
        self.hash_threads = hash_threads
        self._lock = threading.Lock()
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cannot create cache folder {self.root}: {_reason(exc)}") from exc
        self._total = self._sweep()

    # -- layout ------------------------------------------------------------------------------

    def path_for(self, digest: bytes) -> str:
        """The path of the entry for ``digest`` (which may not exist)."""
        hx = digest_hex(digest)
        return os.path.join(self.root, hx[:2], hx)

    def _walk(self) -> Iterator[tuple[os.DirEntry[str], os.stat_result]]:
        """Every file in the fan-out folders, with its lstat; vanished files are skipped."""
        for sub in _scandir(self.root):
            if len(sub.name) == 2 and sub.is_dir(follow_symlinks=False):
                for e in _scandir(sub.path):
                    try:
                        yield e, e.stat(follow_symlinks=False)
                    except OSError:
                        continue

    def _sweep(self) -> int:
        """Remove stale temporary files; return the bytes held in entries."""
        total = 0
        cutoff = time.time() - STALE_TEMP_SECONDS
        for e, st in self._walk():
            if e.name.startswith(_TEMP_PREFIX):
                if st.st_mtime < cutoff:
                    _unlink_quiet(e.path)
            elif _is_entry_name(e.name) and stat.S_ISREG(st.st_mode):
                total += st.st_size
        return total

    @property
    def total_bytes(self) -> int:
        """Bytes held in entries as this process knows it (rescanned at open and on eviction)."""
        return self._total

    # -- queries -----------------------------------------------------------------------------

    def has(self, digest: bytes, length: int | None = None) -> bool:
        """Whether an entry exists for ``digest`` (of ``length`` bytes, when given). A stat, no read.

        A True here is a promise worth making, not a guarantee: the read verifies again.
        """
        try:
            st = os.stat(self.path_for(digest))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and (length is None or st.st_size == length)

    # -- writing -----------------------------------------------------------------------------

    def writer(self, digest: bytes, length: int) -> CacheWriter:
        """A writer that fills the entry for ``digest``, which must come to ``length`` bytes."""
        if length < 0:
            raise OptionError(f"length must be >= 0, got {length}")
        if self.max_bytes is not None and length > self.max_bytes:
            raise CacheError(f"a {length}-byte entry does not fit a {self.max_bytes}-byte cache")
        return CacheWriter(self, digest, length)

    def _committed(self, added: int, replaced: int) -> None:
        with self._lock:
            self._total += added - replaced
            over = self.max_bytes is not None and self._total > self.max_bytes
        if over:
            self.evict()

    def evict(self, target: int | None = None) -> int:
        """Remove least recently used entries until at most ``target`` bytes (default ``max_bytes``) remain.

        Returns the bytes removed. Rescans the folder, so entries other processes wrote count too.
        """
        if target is None:
            if self.max_bytes is None:
                return 0
            target = self.max_bytes
        with self._lock:
            entries = [
                (st.st_mtime_ns, e.path, st.st_size)
                for e, st in self._walk()
                if _is_entry_name(e.name) and stat.S_ISREG(st.st_mode)
            ]
            total = sum(size for _, _, size in entries)
            removed = 0
            entries.sort()
            for _, path, size in entries:
                if total <= target:
                    break
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                except OSError:
                    continue
                total -= size
                removed += size
            self._total = total
            return removed

    # -- reading -----------------------------------------------------------------------------

    def read_into(self, digest: bytes, dest: Any, *, before: Callable[[int, int], None] | None = None) -> None:
        """Fill the writable buffer ``dest`` with the entry for ``digest`` and verify it.

        ``dest`` must be exactly the entry's length. The bytes go straight from the file into
        ``dest`` in :data:`READ_CHUNK` pieces and are hashed as they land; ``before(begin, end)``,
        if given, runs before each piece is read into ``dest[begin:end]`` (a server faults fresh
        memory in there). If the entry is missing, of another size, unreadable or corrupt, it is
        deleted, CacheError is raised, and what is in ``dest`` is undefined.
        """
        out = byte_view(dest)
        if out.readonly:
            raise OptionError("read_into needs a writable buffer")
        n = out.nbytes
        piece = min(READ_CHUNK, n) or 1

        def fill(f: Any, hasher: Any) -> None:
            off = 0
            while off < n:
                chunk = out[off : off + piece]
                if before is not None:
                    before(off, off + len(chunk))
                _read_exact(f, chunk)
                hasher.update(chunk)
                off += len(chunk)

        self._verified_read(digest, n, piece, fill)

    def read_into_target(
        self,
        digest: bytes,
        length: int,
        write: Callable[[int, memoryview], None],
        staging: bytearray | memoryview,
    ) -> None:
        """Feed the entry for ``digest`` to ``write(offset, chunk)`` through the reused ``staging`` buffer.

        For destinations that cannot take a plain memcpy (a CUDA device): each piece is read into
        ``staging``, hashed, and handed to ``write``, which must be done with the chunk when it
        returns. The digest is checked at the end; on CacheError (the entry is deleted, as in
        :meth:`read_into`) the caller must discard everything ``write`` was given.
        """
        stage = byte_view(staging)
        if stage.readonly or stage.nbytes == 0:
            raise OptionError("staging must be a writable, non-empty buffer")
        piece = stage.nbytes

        def fill(f: Any, hasher: Any) -> None:
            off = 0
            while off < length:
                chunk = stage[: min(piece, length - off)]
                _read_exact(f, chunk)
                hasher.update(chunk)
                write(off, chunk)
                off += len(chunk)

        self._verified_read(digest, length, piece, fill)

    def _verified_read(self, digest: bytes, length: int, piece: int, fill: Callable[[Any, Any], None]) -> None:
        path = self.path_for(digest)
        hx = os.path.basename(path)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError as exc:
            raise CacheError(f"cache entry {hx} is missing") from exc
        except OSError as exc:
            self._drop(path, None)
            raise CacheError(f"cache entry {hx} is unreadable ({_reason(exc)}); dropped") from exc
        with f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                self._drop(path, st)
                raise CacheError(f"cache entry {hx} is not a regular file; dropped")
            if st.st_size != length:
                self._drop(path, st)
                raise CacheError(f"cache entry {hx} holds {st.st_size} bytes, expected {length}; dropped")
            hasher = _hasher(length, piece, self.hash_threads)
            try:
                fill(f, hasher)
            except _BadRead as exc:
                # Only the entry's own read errors land here; whatever ``write`` raises is the
                # caller's and passes through with the entry kept.
                self._drop(path, st)
                raise CacheError(f"cache entry {hx} {exc}; dropped") from exc.__cause__
            if not hmac.compare_digest(hasher.digest(), bytes(digest)):
                self._drop(path, st)
                raise CacheError(f"cache entry {hx} does not match its digest; dropped")
            try:
                now = time.time_ns()
                os.utime(f.fileno(), ns=(now, now))  # recently used, for eviction
            except OSError:
                pass

    def _drop(self, path: str, st: os.stat_result | None) -> None:
        """Delete a bad entry, unless a writer has meanwhile renamed a fresh one into its place."""
        try:
            cur = os.lstat(path)
        except OSError:
            return
        if st is not None and (cur.st_ino, cur.st_dev) != (st.st_ino, st.st_dev):
            return
        if stat.S_ISDIR(cur.st_mode):
            shutil.rmtree(path, ignore_errors=True)
            return
        try:
            os.unlink(path)
        except OSError:
            return
        if stat.S_ISREG(cur.st_mode):
            with self._lock:
                self._total = max(0, self._total - cur.st_size)


class _BadRead(Exception):
    """A read of an entry failed or came up short."""


def _read_exact(f: Any, chunk: memoryview) -> None:
    got = 0
    n = len(chunk)
    while got < n:
        try:
            r = f.readinto(chunk[got:])
        except OSError as exc:
            raise _BadRead(f"is unreadable ({_reason(exc)})") from exc
        if not r:
            raise _BadRead(f"ended early ({got} of {n} bytes)")
        got += r


def _scandir(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class DigestCheck:
    """Proves that bytes hash to a digest without storing them: the same ``write``, ``commit``
    and ``abort`` as a :class:`CacheWriter`, and no file (an entry already cached, or a connection
    holding its share of open files)."""

    def __init__(self, digest: bytes, length: int, threads: int | None = None):
        self.digest = bytes(digest)
        self.length = length
        self._threads = threads
        self._hasher: Any = None
        self.written = 0
        self.is_open = True

    def write(self, buf: Any) -> None:
        view = byte_view(buf)
        if self.written + view.nbytes > self.length:
            self.is_open = False
            raise CacheError(f"more than the declared {self.length} bytes hashed")
        if self._hasher is None:
            self._hasher = _hasher(self.length, view.nbytes, self._threads)
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


class CacheWriter:
    """Writes one entry: ``write`` pieces as they arrive, then ``commit`` or ``abort``.

    As a context manager it aborts on leaving unless :meth:`commit` was called, so an exception
    never leaves a temporary file behind.
    """

    def __init__(self, cache: TensorCache, digest: bytes, length: int):
        self._cache = cache
        self.digest = bytes(digest)
        self.length = length
        self.path = cache.path_for(digest)
        folder = os.path.dirname(self.path)
        self._tmp = os.path.join(
            folder, f"{_TEMP_PREFIX}{os.path.basename(self.path)[:16]}-{os.getpid()}-{secrets.token_hex(6)}"
        )
        try:
            os.makedirs(folder, exist_ok=True)
            self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
        except OSError as exc:
            raise CacheError(f"cannot create a cache file in {folder}: {_reason(exc)}") from exc
        # blake3 fixes its thread count when the hasher is made, and whether threads pay depends on
        # the size of the pieces, which only the first write tells.
        self._hasher: Any = None
        self.written = 0
        self._open = True

    def write(self, buf: Any) -> None:
        """Hash and append ``buf`` (any contiguous buffer). CacheError, with the file removed, on failure."""
        if not self._open:
            raise CacheError("write on a cache writer that is already closed")
        view = byte_view(buf)
        n = view.nbytes
        if self.written + n > self.length:
            self.abort()
            raise CacheError(f"more than the declared {self.length} bytes written to cache entry")
        if self._hasher is None:
            self._hasher = _hasher(self.length, n, self._cache.hash_threads)
        self._hasher.update(view)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self.abort()
            raise CacheError(f"cache write failed in {self._cache.root}: {_reason(exc)}") from exc
        self.written += n

    def commit(self) -> None:
        """Check length and digest, then rename into place; CacheError (nothing left behind) if either is wrong."""
        if not self._open:
            raise CacheError("commit on a cache writer that is already closed")
        hx = os.path.basename(self.path)
        if self.written != self.length:
            self.abort()
            raise CacheError(f"cache entry {hx}: {self.written} bytes written, {self.length} declared")
        actual = (self._hasher or blake3.blake3()).digest()
        if not hmac.compare_digest(actual, self.digest):
            self.abort()
            raise CacheError(f"cache entry {hx}: the bytes do not match the digest")
        try:
            now = time.time_ns()
            os.utime(self._fd, ns=(now, now))
            if self._cache.durable:
                os.fsync(self._fd)
            fd, self._fd = self._fd, -1
            os.close(fd)
            try:
                replaced = os.lstat(self.path).st_size
            except FileNotFoundError:
                replaced = 0
            os.replace(self._tmp, self.path)
            if self._cache.durable:
                _fsync_dir(os.path.dirname(self.path))
        except OSError as exc:
            self.abort()
            raise CacheError(f"cache entry {hx}: commit failed: {_reason(exc)}") from exc
        self._open = False
        self._cache._committed(self.length, replaced)

    @property
    def is_open(self) -> bool:
        """Whether it still holds its temporary file (neither committed nor aborted)."""
        return self._open

    def abort(self) -> None:
        """Discard what was written. Safe to call more than once."""
        if not self._open:
            return
        self._open = False
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1
        _unlink_quiet(self._tmp)

    def __enter__(self) -> CacheWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    def __del__(self) -> None:
        if getattr(self, "_open", False):
            self.abort()


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
