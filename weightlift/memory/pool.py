"""Host memory that has been touched once, kept for reuse by a long-lived process (the server).

Theory of operation. On many machines the first touch of fresh anonymous memory costs more
than the copy into it (a virtual machine whose host backs guest memory lazily pays a fault in
the host too), and a host that takes freed guest memory back makes freeing and allocating again
pay the full price again.
A tensor server that replaces its weights (a weight update: the same tensors, new values)
would pay it on every update. The pool keeps the mappings of tensors the server no longer holds
and hands them out again for tensors of the same size class, pages already backed.

Memory goes back to the pool only when nothing can see it any more: each array handed out
carries a ``weakref.finalize`` that returns its mapping when the array itself is collected,
which CPython does the moment the last view of it (a numpy view, a torch tensor made with
``from_numpy``, a dict a reader kept) is gone. A reader that keeps a tensor keeps its memory;
nothing is ever reused under it.

Idle pooled memory is still memory: the owner counts :attr:`HostPool.idle_bytes` against its
limit and calls :meth:`HostPool.trim` to give it back to the system when it needs the room.

:meth:`HostPool.reserve` readies memory before any tensor asks for it: one mapping, faulted in
by a background thread while the process does other things (a worker starting up), from which
new tensors are carved once it is faulted. A carve never reaches past what the thread has
faulted, and the thread never touches what was carved, so the two never meet.

Tensors from :data:`MAPPED_MIN` up to :data:`POOL_MIN` get a mapping of their own (see
:meth:`HostPool.take_marked`), and every such mapping can be one more entry against the kernel's
per-process limit (``vm.max_map_count``, 65530 by default), past which ``mmap`` fails: a push of
a hundred thousand small tensors would reach it. So they are counted, across every pool of the
process, and past :data:`MAPPINGS_BOUND` live ones a tensor of that size comes from malloc's
shared arenas instead. Either way the owner charges the pages such a tensor takes
(:func:`held_bytes`), not its bytes.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections import deque

import numpy as np

from weightlift.memory.fresh import fault_in, new_mapping

__all__ = ["HostPool", "POOL_MIN", "MAPPED_MIN", "MAPPINGS_BOUND", "size_class", "held_bytes", "own_mappings"]

POOL_MIN = 2 * 1024 * 1024  # below this, not pooled: np.empty, or a mapping of its own
_CLASS = 2 * 1024 * 1024
MAPPED_MIN = 128 * 1024  # from here up to POOL_MIN, a mapping of its own (see take_marked)
_PAGE = mmap.PAGESIZE
DEFAULT_MAX_MAP_COUNT = 65530  # the kernel's default, where /proc does not say


def _mappings_bound() -> int:
    """A quarter of the process's mapping limit: the rest stays for everything else the process
    maps (libraries, pooled tensors, the reserve, other mid-sized mappings that do not merge)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
    except (OSError, ValueError):
        limit = DEFAULT_MAX_MAP_COUNT
    return max(1, limit // 4)


#: Live mappings of their own (tensors from MAPPED_MIN to POOL_MIN) the process holds at most;
#: past it such tensors come from malloc. A module constant, read at each take.
MAPPINGS_BOUND = _mappings_bound()


class _Live:
    """The count of live mappings of their own, in the whole process. Released mappings are
    queued without a lock (a finalizer may run inside the garbage collector in a thread that
    holds the lock) and counted off under it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._gone: deque[None] = deque()

    def _drain(self) -> None:
        while self._gone:
            self._gone.popleft()
            self._count -= 1

    def take(self) -> bool:
        """Count one more if the bound allows it."""
        with self._lock:
            self._drain()
            if self._count >= MAPPINGS_BOUND:
                return False
            self._count += 1
            return True

    def release(self) -> None:
        self._gone.append(None)

    def count(self) -> int:
        with self._lock:
            self._drain()
            return self._count


_LIVE = _Live()


def own_mappings() -> int:
    """Mappings of their own alive in this process now (tensors from MAPPED_MIN to POOL_MIN)."""
    return _LIVE.count()


def size_class(nbytes: int) -> int:
    """The mapping size a tensor of ``nbytes`` gets: whole 2 MiB classes, so a released mapping
    fits the next tensor of about its size (and huge pages, where the policy uses them)."""
    return -(-nbytes // _CLASS) * _CLASS


def held_bytes(nbytes: int) -> int:
    """The host memory a :meth:`HostPool.take` of ``nbytes`` holds, as its owner charges it:
    whole size classes from POOL_MIN, whole pages from MAPPED_MIN (a mapping of its own, or
    malloc's pages past the bound), the bytes themselves below."""
    if nbytes >= POOL_MIN:
        return size_class(nbytes)
    if nbytes >= MAPPED_MIN:
        return -(-nbytes // _PAGE) * _PAGE
    return nbytes


class HostPool:
    """Mappings of released tensors, by size class, handed out again before any fresh one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # Released blocks land here without a lock: a finalizer may run inside the garbage
        # collector in a thread that already holds _lock. Drained under the lock before use.
        # A block is (mapping, offset, size): a whole mapping of its own (offset None) or a
        # slice of the reserve.
        self._returned: deque[tuple[mmap.mmap, int | None, int]] = deque()
        self._free: dict[int, list[tuple[mmap.mmap, int | None]]] = {}
        self._idle = 0
        self._closed = False
        self.reused = 0  # arrays served from the pool or the reserve (for stats and tests)
        self.unmapped = 0  # mid-sized arrays taken from malloc past MAPPINGS_BOUND (for stats and tests)
        # The reserve: [0, _bump) carved, [_bump, _end) not, [0, _faulted) faulted in by the
        # reserve thread, which is writing [_faulted, _inflight) right now (when _inflight).
        self._arena: mmap.mmap | None = None
        self._bump = self._faulted = self._end = self._inflight = 0
        self._faulting = False
        self._stop_faulting = threading.Event()
        self._faulter: threading.Thread | None = None

    @property
    def idle_bytes(self) -> int:
        """Bytes of mappings in the pool and of the uncarved reserve, waiting for use."""
        with self._lock:
            self._drain()
            return self._idle

    def _drain(self) -> None:
        # _lock held
        while self._returned:
            m, off, size = self._returned.popleft()
            if not self._closed:
                self._free.setdefault(size, []).append((m, off))
                self._idle += size

    def servable(self, nbytes: int) -> int:
        """The idle bytes a :meth:`take` of ``nbytes`` would use now (0: it would map fresh
        memory): an owner counting idle memory against a limit must not count these twice."""
        if nbytes < POOL_MIN:
            return 0
        size = size_class(nbytes)
        with self._lock:
            self._drain()
            if self._free.get(size) or (self._arena is not None and self._bump + size <= self._end):
                return size
        return 0

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes``: pooled memory of its size class, else a slice
        of the reserve, else fresh."""
        return self.take_marked(nbytes)[0]

    def take_marked(self, nbytes: int) -> tuple[np.ndarray, bool]:
        """:meth:`take`, and whether the memory is a fresh mapping nobody has touched yet (a
        pooled size class; below POOL_MIN the answer is always False)."""
        if nbytes < POOL_MIN:
            return self._unpooled(nbytes), False
        size = size_class(nbytes)
        m: mmap.mmap | None = None
        off: int | None = None
        with self._cond:
            self._drain()
            free = self._free.get(size)
            if free:
                m, off = free.pop()
                self._idle -= size
                self.reused += 1
            elif self._arena is not None and self._bump + size <= self._end:
                m, off = self._arena, self._bump
                self._bump += size
                self._idle -= size
                self.reused += 1
                # The slice must be past the reserve thread before anything is written into it
                # (the thread writes a zero into each page it faults). Waiting costs no more than
                # faulting fresh memory here would; a stopped thread writes nothing more.
                while self._faulting and self._faulted < off + size:
                    self._cond.wait()
        fresh = m is None
        if m is None:
            m = new_mapping(size)
        arr = np.frombuffer(m, dtype=np.uint8, count=nbytes, offset=off or 0)
        weakref.finalize(arr, self._give_back, m, off, size)
        return arr, fresh

    def _unpooled(self, nbytes: int) -> np.ndarray:
        # From MAPPED_MIN, a mapping of its own, unmapped when the array goes: from malloc,
        # memory freed by one thread stays in that thread's arena, and a server's many threads
        # would hold many such arenas of freed tensors beyond what is charged to them. Past the
        # bound on live ones, malloc all the same: a failed mmap would fail the tensor. Never
        # marked fresh, as malloc's memory is not: the copy into it faults its pages, and no
        # helper faults in one ahead of bytes that may never come.
        if nbytes < MAPPED_MIN:
            return np.empty(nbytes, dtype=np.uint8)
        if not _LIVE.take():
            with self._lock:
                self.unmapped += 1
            return np.empty(nbytes, dtype=np.uint8)
        try:
            m = new_mapping(held_bytes(nbytes))
        except BaseException:
            _LIVE.release()
            raise
        arr = np.frombuffer(m, dtype=np.uint8, count=nbytes)
        weakref.finalize(arr, _LIVE.release)
        return arr

    def _give_back(self, m: mmap.mmap, off: int | None, size: int) -> None:
        # Runs when the last reference to the array is dropped, in whichever thread dropped it
        # (deque.append is atomic; no lock here). After close, dropping the reference frees the
        # mapping (or, for a slice of the reserve, the whole reserve once its last slice goes).
        if not self._closed:
            self._returned.append((m, off, size))

    def reserve(self, nbytes: int) -> None:
        """Fault ``nbytes`` of memory in on a background thread, for the tensors to come; it
        counts as idle until carved. Once per pool."""
        if nbytes <= 0:
            return
        size = size_class(nbytes)
        with self._lock:
            if self._arena is not None or self._closed:
                return
            self._arena = new_mapping(size)
            self._end = size
            self._idle += size
            self._faulting = True
            self._faulter = threading.Thread(
                target=self._fault_reserve, args=(self._arena,), name="wl-reserve", daemon=True
            )
            self._faulter.start()

    def _fault_reserve(self, arena: mmap.mmap) -> None:
        view = np.frombuffer(arena, dtype=np.uint8)
        piece = 64 * 1024 * 1024
        try:
            while not self._stop_faulting.is_set():
                with self._lock:
                    a, b = self._faulted, min(self._end, self._faulted + piece)
                    if a >= b:
                        return
                    self._inflight = b
                fault_in(view[a:b])  # nothing in [_faulted, _inflight) is written by anyone else
                with self._cond:
                    self._faulted, self._inflight = b, 0
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._faulting, self._inflight = False, 0
                self._cond.notify_all()

    @property
    def reserved(self) -> tuple[int, int]:
        """(bytes of the reserve faulted in so far, bytes reserved and not given back)."""
        with self._lock:
            return min(self._faulted, self._end), self._end

    def trim(self, keep: int = 0) -> int:
        """Give idle memory back to the system until at most ``keep`` bytes stay idle: the
        uncarved end of the reserve first, then pooled blocks, the largest first. Returns the
        bytes given back."""
        dropped: list[tuple[mmap.mmap, int | None, int]] = []
        with self._cond:
            self._drain()
            while self._arena is not None and self._idle > keep:
                cut = max(self._bump, self._end - (self._idle - keep))
                cut = -(-cut // _CLASS) * _CLASS
                if cut >= self._end:
                    break
                if self._inflight > cut:  # the reserve thread is faulting there: let it finish the piece
                    self._cond.wait()
                    continue
                dropped.append((self._arena, cut, self._end - cut))
                self._idle -= self._end - cut
                self._end = cut
                break
            for size in sorted(self._free, reverse=True):  # the largest first: fewest unmaps
                free = self._free[size]
                while free and self._idle > keep:
                    m, off = free.pop()
                    dropped.append((m, off, size))
                    self._idle -= size
            self._free = {s: f for s, f in self._free.items() if f}
        freed = 0
        for m, off, size in dropped:
            freed += size
            try:
                if off is None:
                    m.close()
                else:  # a slice of the reserve: its pages go back, the address range stays
                    m.madvise(mmap.MADV_DONTNEED, off, size)
            except (BufferError, ValueError, OSError):
                pass  # the last array is still being torn down in another thread: it frees the mapping
        return freed

    def close(self) -> None:
        """Free everything idle; arrays still alive keep their memory and free it themselves."""
        self._stop_faulting.set()
        t = self._faulter
        if t is not None and t is not threading.current_thread():
            t.join()
        self.trim(0)
        with self._lock:
            self._closed = True
            self._arena = None  # the carved slices still alive hold the reserve's mapping
            self._free.clear()
            self._idle = 0
