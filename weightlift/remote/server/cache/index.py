"""What the cache holds, in memory: each entry's charge in disk bytes, least recently used first.

The index is built once, when the cache opens (one walk of the folder, :func:`scan_entries`,
which also tidies it), and kept up to date by
the cache's own commits, verified reads and drops, so eviction past the cap takes entries off
the front of the index and never walks or stats the folder again.

An entry is charged :func:`charge` bytes: its size rounded up to whole :data:`BLOCK` blocks, at
least one, which is what a file system with 4 KiB blocks (ext4, XFS, btrfs and tmpfs by default)
allocates for it. File sizes alone would let many tiny entries fill a disk far past the cap (an
8-byte entry takes a 4 KiB block), and ``st_blocks`` of a file just written is no steadier a
measure (delayed allocation, speculative preallocation).
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator

from weightlift.digest.blake import DIGEST_SIZE
from weightlift.remote.server.cache.folder import ENTRY_MODE, names_in, open_folder, remove_tree

__all__ = ["BLOCK", "STALE_TEMP_SECONDS", "TEMP_PREFIX", "charge", "scan_entries", "LruIndex"]

#: The block an entry's size is rounded up to when it is charged against the cap.
BLOCK = 4096
#: A temporary file untouched this long belongs to a writer that died.
STALE_TEMP_SECONDS = 15 * 60
#: How a writer's temporary file is named (never like an entry: those are 64 hex digits).
TEMP_PREFIX = ".tmp-"

_HEX = frozenset("0123456789abcdef")


def charge(size: int) -> int:
    """The disk bytes an entry of ``size`` bytes is counted as: whole BLOCKs, at least one."""
    return max(1, -(-size // BLOCK)) * BLOCK


def _is_entry_name(name: str) -> bool:
    return len(name) == 2 * DIGEST_SIZE and set(name) <= _HEX


def _folders(root: int) -> Iterator[int]:
    """Each fan-out folder's descriptor (closed when the next is asked for). A link in a fan-out
    folder's place is removed (the link, not its target); a file or another user's folder is left
    alone and not read."""
    for name in sorted(names_in(root)):
        if len(name) != 2 or not set(name) <= _HEX:
            continue
        fd = open_folder(root, name, create=False)
        if fd is None:
            _drop_link(root, name)
            continue
        try:
            yield fd
        finally:
            os.close(fd)


def scan_entries(root: int, *, sweep: bool) -> list[tuple[bytes, int]]:
    """Every entry under the open root with its charge, least recently used (oldest mtime) first.

    Narrows entries to mode 0600 and skips what no writer of this user's made (other users'
    files, anything not a file under an entry's name), removing only links; with ``sweep``, also
    removes this user's temporary files older than STALE_TEMP_SECONDS.
    """
    euid = os.geteuid()
    cutoff = time.time() - STALE_TEMP_SECONDS
    found: list[tuple[int, bytes, int]] = []
    for fd in _folders(root):
        for name in names_in(fd):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            mine = stat.S_ISREG(st.st_mode) and st.st_uid == euid
            if stat.S_ISLNK(st.st_mode):
                _drop_link(fd, name)
            elif name.startswith(TEMP_PREFIX):
                if mine and sweep and st.st_mtime < cutoff:
                    remove_tree(fd, name)
            elif _is_entry_name(name):
                if not mine:
                    continue
                if stat.S_IMODE(st.st_mode) != ENTRY_MODE:
                    _chmod_quiet(name, fd)
                found.append((st.st_mtime_ns, bytes.fromhex(name), charge(st.st_size)))
    found.sort()
    return [(digest, cost) for _, digest, cost in found]


def _drop_link(folder: int, name: str) -> None:
    """Remove ``name`` under ``folder`` if it is a symlink (never what it points to)."""
    try:
        if stat.S_ISLNK(os.lstat(name, dir_fd=folder).st_mode):
            os.unlink(name, dir_fd=folder)
    except OSError:
        pass


def _chmod_quiet(name: str, folder: int) -> None:
    try:
        os.chmod(name, ENTRY_MODE, dir_fd=folder)
    except OSError:
        pass


class LruIndex:
    """Entries by digest with their charge, oldest use first. Thread-safe.

    ``entries`` seeds it, oldest first.
    """

    def __init__(self, entries: Iterable[tuple[bytes, int]] = ()):
        self._lock = threading.Lock()
        self._items: OrderedDict[bytes, int] = OrderedDict(entries)
        self._total = sum(self._items.values())

    @property
    def total(self) -> int:
        """The charge of every entry indexed."""
        return self._total

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, digest: object) -> bool:
        return digest in self._items

    def put(self, digest: bytes, cost: int) -> None:
        """Index an entry (or replace its charge) as the most recently used."""
        with self._lock:
            self._total += cost - self._items.pop(digest, 0)
            self._items[digest] = cost

    def touch(self, digest: bytes, cost: int) -> None:
        """Mark an entry most recently used; one found on disk but not yet indexed is added."""
        with self._lock:
            if digest in self._items:
                self._items.move_to_end(digest)
                return
            self._items[digest] = cost
            self._total += cost

    def remove(self, digest: bytes) -> int:
        """Forget an entry; returns its charge (0 if it was not indexed)."""
        with self._lock:
            cost = self._items.pop(digest, 0)
            self._total -= cost
            return cost

    def over(self, cap: int) -> list[tuple[bytes, int]]:
        """Take the least recently used entries off until at most ``cap`` remain; returns them."""
        taken: list[tuple[bytes, int]] = []
        with self._lock:
            while self._total > cap and self._items:
                digest, cost = self._items.popitem(last=False)
                self._total -= cost
                taken.append((digest, cost))
        return taken

    def replace_all(self, entries: Iterable[tuple[bytes, int]]) -> None:
        """Start afresh from ``entries``, oldest first (after a rescan of the folder)."""
        items = OrderedDict(entries)
        with self._lock:
            self._items = items
            self._total = sum(items.values())
