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

The folder is the server's own (:mod:`.folder`): a root owned by another user or writable
by group or others is refused, folders are 0700 and entries 0600 whatever the umask, and
everything below the root is opened by descriptor without following links.

The size cap
------------
``max_bytes`` caps the disk bytes the entries take, each counted as whole 4 KiB blocks
(:func:`.index.charge`), so that many tiny entries cannot fill a disk far past the cap.
The default, ``"auto"``, is :data:`DEFAULT_MAX_FRACTION` (half) of the space the cache could
use when it opens: what its entries already take plus the free space of its file system
(``f_bavail``), so a cache never takes more than half of what was left to it. ``None`` means no
cap. Past the cap, each commit evicts the least recently used entries (commit and a verified read
count as a use) from an in-memory index built by one walk of the folder when the cache opens;
eviction never walks the folder again. The index knows what this process committed, read or
found at open: processes sharing one root each hold their own cap, and :meth:`TensorCache.evict`
rescans the folder to count the others' entries too. Entry mtimes carry the order across
restarts (to within :data:`TOUCH_GRAIN_NS`).

Temporary files do not count; ones left by a crashed writer are removed when the cache is opened
once they are :data:`STALE_TEMP_SECONDS` old (a live writer touches its file with every write),
and are otherwise ignored: they never have an entry's name.

Hashing runs with the GIL released (blake3 does so for large inputs) and uses blake3's
multithreaded mode for entries of at least 1 MiB fed in pieces of at least
:data:`PARALLEL_PIECE_MIN` on machines of at least ``PARALLEL_HASH_CPUS`` cores
(:func:`.hashing.parallel_pays`); smaller pieces, and smaller machines, whose other core is
busy receiving or reading the bytes, stay single-threaded.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Literal

from weightlift.digest.blake import DIGEST_SIZE, byte_view, digest_hex
from weightlift.errors import CacheError, OptionError
from weightlift.remote.server.cache.behind import WriteBehind
from weightlift.remote.server.cache.folder import (
    ENTRY_MODE,
    open_folder,
    open_root,
    reason,
    remove_tree,
    reopen_root,
)
from weightlift.remote.server.cache.hashing import PARALLEL_PIECE_MIN, DigestCheck, Hasher, entry_hasher, piece_hasher
from weightlift.remote.server.cache.index import STALE_TEMP_SECONDS, TEMP_PREFIX, LruIndex, charge, scan_entries
from weightlift.remote.server.cache.read import BadRead, Readable, Readers, fill_verified, read_exact, read_piece

__all__ = [
    "DIGEST_SIZE",
    "READ_CHUNK",
    "STALE_TEMP_SECONDS",
    "DEFAULT_MAX_FRACTION",
    "DISK_ERRNOS",
    "disk_unusable",
    "PARALLEL_PIECE_MIN",
    "digest_hex",
    "default_max_bytes",
    "TensorCache",
    "CacheWriter",
    "DigestCheck",
]

#: Bytes read per ``readinto`` by :meth:`TensorCache.read_into`: large enough for the parallel
#: hasher, small enough that the bytes are still in cache when they are hashed.
READ_CHUNK = 4 * 1024 * 1024
#: A verified read sets an entry's mtime (its place in the order a restart rebuilds) only when
#: it is older than this (or ahead of the clock): the index holds the exact order while the
#: process runs, and a hit on a hot entry costs no inode write.
TOUCH_GRAIN_NS = 60 * 10**9
#: How long :meth:`TensorCache.has` waits for an entry of its digest being written behind.
BEHIND_WAIT_S = 30.0
#: How long :meth:`TensorCache.close` goes on writing the entries queued behind.
BEHIND_CLOSE_S = 60.0
#: The default cap (``max_bytes="auto"``): this fraction of what the entries take plus the free
#: space of the cache's file system, measured when the cache opens.
DEFAULT_MAX_FRACTION = 0.5
#: Write errors that mean the cache's disk is unusable (full, over quota, failing, read-only)
#: rather than one entry bad; see :func:`disk_unusable`.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


_Fill = Callable[[Readable, Hasher], None]


def disk_unusable(exc: BaseException) -> bool:
    """Whether a CacheError came from a disk that is full, over quota, failing or read-only.

    A server stops caching (with a warning) on these, rather than retrying for every tensor.
    """
    cause = exc.__cause__
    return isinstance(cause, OSError) and cause.errno in DISK_ERRNOS


def default_max_bytes(root_fd: int, held: int) -> int:
    """The cap ``max_bytes="auto"`` stands for: DEFAULT_MAX_FRACTION of ``held`` (the disk bytes the
    entries take) plus the free space of the file system of the open folder ``root_fd``."""
    st = os.fstatvfs(root_fd)
    return int((held + st.f_bavail * st.f_frsize) * DEFAULT_MAX_FRACTION)


class TensorCache:
    """Tensors by BLAKE3 digest under ``root`` (created, mode 0700, if missing).

    ``max_bytes`` caps the disk bytes held in entries, evicting the least recently used after
    each commit: ``"auto"`` (the default) is :func:`default_max_bytes` at open, None no cap.
    ``durable`` fsyncs each entry and its folder at commit. ``hash_threads`` forces blake3's
    thread count (1: single-threaded); None chooses by the size of each piece hashed. CacheError
    if ``root`` cannot be made, or is another user's or writable by group or others. Safe to use
    from several threads and by several processes of one user sharing one root.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_bytes: int | Literal["auto"] | None = "auto",
        durable: bool = False,
        hash_threads: int | None = None,
    ):
        if max_bytes != "auto" and max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
            raise OptionError(f"max_bytes must be >= 0, 'auto' or None, got {max_bytes!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.durable = durable
        self.hash_threads = hash_threads
        self._lock = threading.Lock()  # eviction's unlinks against commits' renames
        self._counts = {"folder_scans": 1, "evicted": 0, "bytes_evicted": 0}  # the scan at open
        self._behind: WriteBehind | None = None
        fd = open_root(self.root)
        try:
            st = os.fstat(fd)
            self._ident = (st.st_dev, st.st_ino)
            self._index = LruIndex(scan_entries(fd, sweep=True))
            self.max_bytes: int | None = default_max_bytes(fd, self._index.total) if max_bytes == "auto" else max_bytes
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _root(self) -> Iterator[int]:
        """The root's descriptor for one operation (checked again; CacheError if it fails)."""
        fd = reopen_root(self.root, self._ident)
        try:
            yield fd
        finally:
            os.close(fd)

    # -- layout ------------------------------------------------------------------------------

    def path_for(self, digest: bytes) -> str:
        """The path of the entry for ``digest`` (which may not exist)."""
        hx = digest_hex(digest)
        return os.path.join(self.root, hx[:2], hx)

    @property
    def total_bytes(self) -> int:
        """Disk bytes held in entries as this process knows it (whole 4 KiB blocks per entry)."""
        return self._index.total

    def stats(self) -> dict[str, int]:
        """``entries`` and ``bytes`` (disk bytes) indexed now; since open: ``folder_scans`` (full
        walks of the folder: one at open, one per :meth:`evict`), ``evicted`` entries and
        ``bytes_evicted``."""
        return {"entries": len(self._index), "bytes": self._index.total, **self._counts}

    # -- queries -----------------------------------------------------------------------------

    def has(self, digest: bytes, length: int | None = None, *, wait: bool = True) -> bool:
        """Whether an entry exists for ``digest`` (of ``length`` bytes, when given). A stat, no read.

        An entry of ``digest`` being written behind is waited for first (at most
        :data:`BEHIND_WAIT_S`), unless ``wait`` is False. A True here is a promise worth making,
        not a guarantee: the read verifies again.
        """
        behind = self._behind
        if wait and behind is not None:
            behind.wait_for(bytes(digest), BEHIND_WAIT_S)
        try:
            st = os.stat(self.path_for(digest), follow_symlinks=False)
        except OSError:
            return False
        mine = st.st_uid == os.geteuid()  # what another user planted is never offered
        return stat.S_ISREG(st.st_mode) and mine and (length is None or st.st_size == length)

    # -- writing -----------------------------------------------------------------------------

    def writer(self, digest: bytes, length: int, *, hashed: bool = True) -> CacheWriter:
        """A writer that fills the entry for ``digest``, which must come to ``length`` bytes.

        ``hashed=False`` is for bytes already proven to hash to ``digest`` (the write-behind of a
        sealed tensor): they are written without hashing them again, and only the length is
        checked at commit."""
        if length < 0:
            raise OptionError(f"length must be >= 0, got {length}")
        if self.max_bytes is not None and charge(length) > self.max_bytes:
            raise CacheError(f"a {length}-byte entry does not fit a {self.max_bytes}-byte cache")
        return CacheWriter(self, digest, length, hashed=hashed)

    @property
    def behind(self) -> WriteBehind:
        """The background writer of entries from published tensors (:mod:`.behind`)."""
        with self._lock:
            if self._behind is None:
                self._behind = WriteBehind(lambda d, n, h: self.writer(d, n, hashed=h))
            return self._behind

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the entries queued behind are written; False on timeout."""
        return self._behind is None or self._behind.flush(timeout)

    def close(self, timeout: float | None = BEHIND_CLOSE_S) -> None:
        """Write the entries queued behind (for at most ``timeout`` seconds; the rest are not
        cached), then take no more."""
        if self._behind is not None:
            self._behind.close(timeout)

    def _folder_for_write(self, hx: str) -> int:
        """The descriptor of the fan-out folder ``hx`` names, made (or remade) as needed."""
        with self._root() as root:
            fd = open_folder(root, hx[:2], create=True)
        assert fd is not None
        return fd

    def _commit(self, digest: bytes, tmp: str, folder: int, cost: int) -> None:
        hx = digest.hex()
        with self._lock:
            os.replace(tmp, hx, src_dir_fd=folder, dst_dir_fd=folder)
            self._index.put(digest, cost)

    def _committed(self) -> None:
        """Evict past the cap after a commit. Never raises: the entry is in place and its digest
        proven, which is what a commit reports (a folder gone bad shows at the next writer)."""
        if self.max_bytes is not None and self._index.total > self.max_bytes:
            with self._lock, contextlib.suppress(CacheError, OSError):
                self._evict_locked(self.max_bytes)

    def _evict_locked(self, target: int) -> int:
        """Unlink the least recently used entries past ``target``, by the index alone."""
        victims = self._index.over(target)
        with self._root() as root:
            for digest, _ in victims:
                hx = digest.hex()
                fd = open_folder(root, hx[:2], create=False)
                if fd is None:
                    continue
                try:
                    os.unlink(hx, dir_fd=fd)
                except OSError:
                    pass  # gone already, or not removable: either way no longer counted
                finally:
                    os.close(fd)
        removed = sum(cost for _, cost in victims)
        self._counts["evicted"] += len(victims)
        self._counts["bytes_evicted"] += removed
        return removed

    def evict(self, target: int | None = None) -> int:
        """Remove least recently used entries until at most ``target`` disk bytes (default
        ``max_bytes``) remain; returns the disk bytes removed.

        Rescans the folder first, so entries other processes wrote count too.
        """
        if target is None:
            if self.max_bytes is None:
                return 0
            target = self.max_bytes
        with self._lock:
            with self._root() as root:
                self._index.replace_all(scan_entries(root, sweep=False))
                self._counts["folder_scans"] += 1
            return self._evict_locked(target)

    # -- reading -----------------------------------------------------------------------------

    def read_into(
        self,
        digest: bytes,
        dest: object,
        *,
        before: Callable[[int, int], None] | None = None,
        readers: Readers | None = None,
    ) -> None:
        """Fill the writable buffer ``dest`` with the entry for ``digest`` and verify it.

        ``dest`` must be exactly the entry's length. The bytes go straight from the file into
        ``dest`` in pieces of at most :data:`READ_CHUNK`, read by the caller and helper threads
        (:mod:`.read`), each hashed right after it lands; ``before(begin, end)``, if
        given, runs before each piece is read into ``dest[begin:end]`` (a server faults fresh
        memory in there), on whichever thread reads it. ``readers``: the helpers to share with
        (:func:`.read.reader_pool`). If the entry is missing, of another size, unreadable
        or corrupt, it is deleted, CacheError is raised, and what is in ``dest`` is undefined.
        """
        out = byte_view(dest)
        if out.readonly:
            raise OptionError("read_into needs a writable buffer")
        n = out.nbytes
        piece = read_piece(n, READ_CHUNK)

        def fill(f: Readable, hasher: Hasher) -> None:
            fill_verified(f, out, piece, hasher, before, readers)

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

        def fill(f: Readable, hasher: Hasher) -> None:
            off = 0
            while off < length:
                chunk = stage[: min(piece, length - off)]
                read_exact(f, chunk)
                hasher.update(chunk)
                write(off, chunk)
                off += len(chunk)

        self._verified_read(digest, length, piece, fill)

    def _verified_read(self, digest: bytes, length: int, piece: int, fill: _Fill) -> None:
        hx = digest_hex(digest)
        with self._root() as root:
            folder = open_folder(root, hx[:2], create=False)
        if folder is None:
            self._index.remove(bytes(digest))
            raise CacheError(f"cache entry {hx} is missing")
        try:
            self._read_entry(folder, bytes(digest), length, piece, fill)
        finally:
            os.close(folder)

    def _read_entry(self, folder: int, digest: bytes, length: int, piece: int, fill: _Fill) -> None:
        hx = digest.hex()
        try:
            # no link is followed; O_NONBLOCK so that a FIFO in an entry's place cannot hang the read
            fd = os.open(hx, os.O_RDONLY | os.O_NONBLOCK | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=folder)
        except FileNotFoundError as exc:
            self._index.remove(digest)
            raise CacheError(f"cache entry {hx} is missing") from exc
        except OSError as exc:
            self._drop(folder, digest, None)
            raise CacheError(f"cache entry {hx} is unreadable ({reason(exc)}); dropped") from exc
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            self._drop(folder, digest, st)
            raise CacheError(f"cache entry {hx} is not a regular file; dropped")
        try:
            f = open(fd, "rb", buffering=0)
        except BaseException:
            os.close(fd)
            raise
        with f:
            if st.st_size != length:
                self._drop(folder, digest, st)
                raise CacheError(f"cache entry {hx} holds {st.st_size} bytes, expected {length}; dropped")
            hasher = entry_hasher(length, piece, self.hash_threads)
            try:
                fill(f, hasher)
            except BadRead as exc:
                # only the entry's own read errors: what ``write`` raises passes, the entry kept
                self._drop(folder, digest, st)
                raise CacheError(f"cache entry {hx} {exc}; dropped") from exc.__cause__
            if not hmac.compare_digest(hasher.digest(), digest):
                self._drop(folder, digest, st)
                raise CacheError(f"cache entry {hx} does not match its digest; dropped")
            try:
                now = time.time_ns()
                if not 0 <= now - st.st_mtime_ns <= TOUCH_GRAIN_NS:  # used now, for a restart's order
                    os.utime(f.fileno(), ns=(now, now))
                if os.fstat(f.fileno()).st_nlink == 0:  # evicted while it was read: not to be indexed again
                    return
            except OSError:
                pass
            self._index.touch(digest, charge(length))

    def _drop(self, folder: int, digest: bytes, st: os.stat_result | None) -> None:
        """Delete a bad entry, unless a writer has meanwhile renamed a fresh one into its place."""
        hx = digest.hex()
        try:
            cur = os.stat(hx, dir_fd=folder, follow_symlinks=False)
        except OSError:
            self._index.remove(digest)
            return
        if st is not None and (cur.st_ino, cur.st_dev) != (st.st_ino, st.st_dev):
            return
        remove_tree(folder, hx)
        self._index.remove(digest)


class CacheWriter:
    """Writes one entry: ``write`` pieces as they arrive, then ``commit`` or ``abort``.

    The temporary file is made (mode 0600, ``O_EXCL``, no link followed) in the entry's fan-out
    folder, opened by descriptor; the writer holds that folder's descriptor too, so the rename
    lands in the folder the bytes were written in. As a context manager it aborts on leaving
    unless :meth:`commit` was called, so an exception never leaves a temporary file behind.
    """

    def __init__(self, cache: TensorCache, digest: bytes, length: int, *, hashed: bool = True):
        self._cache = cache
        self._hashed = hashed
        self.digest = bytes(digest)
        self.length = length
        self.path = cache.path_for(digest)
        hx = os.path.basename(self.path)
        self._tmp = f"{TEMP_PREFIX}{hx[:16]}-{os.getpid()}-{secrets.token_hex(6)}"
        self._folder = self._fd = -1
        self._open = False
        try:
            self._folder = cache._folder_for_write(hx)
            self._fd = os.open(
                self._tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC,
                ENTRY_MODE,
                dir_fd=self._folder,
            )
            self._open = True
            os.fchmod(self._fd, ENTRY_MODE)  # exactly 0600, whatever the umask
        except OSError as exc:
            self.abort()
            raise CacheError(f"cannot create a cache file in {os.path.dirname(self.path)}: {reason(exc)}") from exc
        # blake3 fixes its thread count when the hasher is made, and whether threads pay depends on
        # the size of the pieces, which only the first write tells.
        self._hasher: Hasher | None = None
        self.written = 0

    def write(self, buf: object) -> None:
        """Hash and append ``buf`` (any contiguous buffer). CacheError, with the file removed, on failure."""
        if not self._open:
            raise CacheError("write on a cache writer that is already closed")
        view = byte_view(buf)
        n = view.nbytes
        if self.written + n > self.length:
            self.abort()
            raise CacheError(f"more than the declared {self.length} bytes written to cache entry")
        if self._hashed:
            if self._hasher is None:
                self._hasher = entry_hasher(self.length, n, self._cache.hash_threads)
            self._hasher.update(view)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self.abort()
            raise CacheError(f"cache write failed in {self._cache.root}: {reason(exc)}") from exc
        self.written += n

    def commit(self) -> None:
        """Check length and digest, then rename into place; CacheError (nothing left behind) if either is wrong."""
        if not self._open:
            raise CacheError("commit on a cache writer that is already closed")
        hx = os.path.basename(self.path)
        if self.written != self.length:
            self.abort()
            raise CacheError(f"cache entry {hx}: {self.written} bytes written, {self.length} declared")
        actual = (self._hasher or piece_hasher()).digest() if self._hashed else self.digest
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
            self._cache._commit(self.digest, self._tmp, self._folder, charge(self.length))
            if self._cache.durable:
                os.fsync(self._folder)
        except OSError as exc:
            self.abort()
            raise CacheError(f"cache entry {hx}: commit failed: {reason(exc)}") from exc
        self._open = False
        self._close_folder()
        self._cache._committed()

    @property
    def is_open(self) -> bool:
        """Whether it still holds its temporary file (neither committed nor aborted)."""
        return self._open

    def abort(self) -> None:
        """Discard what was written. Safe to call more than once."""
        was, self._open = self._open, False
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1
        if was and self._folder >= 0:
            try:
                os.unlink(self._tmp, dir_fd=self._folder)
            except OSError:
                pass
        self._close_folder()

    def _close_folder(self) -> None:
        fd, self._folder = self._folder, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> CacheWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    def __del__(self) -> None:
        if getattr(self, "_folder", -1) >= 0 or getattr(self, "_open", False):
            self.abort()
