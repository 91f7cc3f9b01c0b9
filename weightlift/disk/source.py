"""File access: one mapping per file, pread, the residency probe, page-cache policy, the warmer.

Theory of operation. A checkpoint's bytes reach the caller along one of two paths:

* **mapping** (the default): each file is mapped once per process, read-only, and tensors are
  copied straight out of the mapping (borrowed slices; no staging copy in between). When the
  file is already in the page cache this costs one memcpy per byte.
* **pread**: ``os.preadv`` straight into the destination; used where the mapping is off, and on
  a cold file, where several readers can beat the kernel's serial fault-in readahead.

The page cache is kept by default: on a machine whose destination is separate memory (a
discrete GPU, or host arrays that the caller keeps) a second load then costs no disk time. It is
evicted (``posix_fadvise(DONTNEED)`` over what was read) where it competes with the
destination for the same RAM: a unified-memory device, or a host load asked to keep its
footprint at one copy. ``WEIGHTLIFT_PAGE_EVICTION=1``/``0`` overrides the choice both ways.

Before a load, :func:`resident_fraction` asks ``mincore`` how much of each file is already in
memory; it runs once per file per process (memoized on the file's identity), never per tensor.
When less than :data:`RESIDENT_THRESHOLD` is resident, a :class:`Warmer` reads ahead of the copy
cursor in large chunks on worker threads, so a cold load is not serial on disk latency. The
number of readers adapts: it starts with one and adds another only while that raises the
throughput, since on some disks parallel readers are slower than one.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from weightlift import env
from weightlift.disk import residency
from weightlift.errors import FileError, NotFoundError, os_error

__all__ = [
    "MappedFile",
    "mapped",
    "resident_fraction",
    "evict",
    "evict_range",
    "Warmer",
    "prefetch",
    "page_eviction_override",
    "RESIDENT_THRESHOLD",
    "WARM_CHUNK",
]

RESIDENT_THRESHOLD = 0.90
WARM_CHUNK = 16 * 1024 * 1024
MAX_WARMERS = 4
PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class _Identity:
    dev: int
    ino: int
    size: int
    mtime_ns: int


def _identity(path: str) -> tuple[str, _Identity]:
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except FileNotFoundError:
        raise NotFoundError("no such file", file=str(path)) from None
    except OSError as e:
        raise os_error(e, path, "cannot stat") from None
    return real, _Identity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class MappedFile:
    """A read-only mapping of one whole file, kept alive for as long as anything borrows from it."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise os_error(e, path, "cannot open") from None
        # the descriptor lives as long as this object (arrays borrowing the mapping keep the
        # mmap itself alive, which does not need it)
        self._close_fd = weakref.finalize(self, os.close, self._fd)
        st = os.fstat(self._fd)  # the identity of what was opened, not of what the path names now
        self.identity = _Identity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        self.size = st.st_size
        if self.size:
            self._mmap: mmap.mmap | None = mmap.mmap(self._fd, self.size, access=mmap.ACCESS_READ)
            self.buffer = memoryview(self._mmap)
        else:  # an empty file cannot be mapped
            self._mmap = None
            self.buffer = memoryview(b"")

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        """Unmap the file and close its descriptor now, not at the last reference: for a mapping
        that nothing borrows from any more but something still references (BufferError where a
        view of it is still alive: it stays mapped)."""
        if self._mmap is not None:
            self.buffer.release()
            try:
                self._mmap.close()
            except BufferError:
                self.buffer = memoryview(self._mmap)
                raise
            self._mmap, self.buffer = None, memoryview(b"")
        self._close_fd()

    def view(self, offset: int, length: int) -> memoryview:
        """A borrowed slice of the mapping: no copy. An empty range may start anywhere (a GGUF
        tensor of no elements may name an offset past the end of its file)."""
        if length == 0 and offset >= 0:
            return self.buffer[0:0]
        if offset < 0 or length < 0 or offset + length > self.size:
            raise FileError(f"range [{offset}, {offset + length}) is outside the file", file=self.path)
        return self.buffer[offset : offset + length]

    def address(self) -> int:
        """The mapping's base address (for mincore and madvise)."""
        if self._mmap is None:
            return 0
        import numpy as np

        return int(np.frombuffer(self._mmap, dtype=np.uint8).ctypes.data)

    def advise(self, advice: int, offset: int = 0, length: int | None = None) -> None:
        if self._mmap is None:
            return
        start = offset - offset % PAGE
        end = self.size if length is None else min(self.size, offset + length)
        try:
            self._mmap.madvise(advice, start, end - start)
        except (OSError, ValueError):
            pass  # advice is a hint; a kernel without it loads the same bytes


_maps: dict[str, MappedFile] = {}
_maps_lock = threading.Lock()


def mapped(path: str | os.PathLike[str]) -> MappedFile:
    """The process's one mapping of ``path``; remapped only if the file changed on disk."""
    real, ident = _identity(os.fspath(path))
    with _maps_lock:
        m = _maps.get(real)
        if m is None or m.identity != ident:
            m = MappedFile(real)
            _maps[real] = m
        return m


# -- residency -----------------------------------------------------------------------------

_resident_memo: dict[tuple[str, _Identity], float] = {}


def resident_fraction(path: str | os.PathLike[str], *, refresh: bool = False) -> float:
    """Fraction of the file's pages in the page cache, by ``mincore`` over its mapping.

    Memoized per file identity for the life of the process: the probe walks the whole file, and
    asking it per tensor or per layer would cost more than it saves. ``refresh=True`` asks again.
    """
    real, ident = _identity(os.fspath(path))
    key = (real, ident)
    if not refresh and key in _resident_memo:
        return _resident_memo[key]
    frac = _probe(mapped(real))
    _resident_memo[key] = frac
    return frac


def _probe(m: MappedFile) -> float:
    if m.size == 0:
        return 1.0
    try:
        return residency.mapping_fraction(m.address(), m.size)
    except OSError:
        return 0.0  # unknown: treat as cold, which only costs a warmer


def evict(path: str | os.PathLike[str]) -> None:
    """Drop the whole file from the page cache; dirty pages are written back first, since the
    kernel cannot drop a page that has not reached the disk (a just-written checkpoint)."""
    p = os.fspath(path)
    try:
        residency.drop(p)
    except OSError as e:
        raise os_error(e, p, "cannot open") from None
    _resident_memo.clear()


def evict_range(path: str, offset: int, length: int) -> None:
    try:
        residency.drop(path, offset, length, write_back=False)
    except OSError as e:
        raise os_error(e, path, "cannot open") from None


def page_eviction_override() -> bool | None:
    """WEIGHTLIFT_PAGE_EVICTION: "1" forces eviction, "0" forbids it, unset leaves the default."""
    return env.page_eviction()


# -- prefetch ------------------------------------------------------------------------------


def prefetch(
    m: MappedFile,
    ranges: list[tuple[int, int]],
    *,
    readers: int,
    chunk: int = WARM_CHUNK,
    on_chunk: Callable[[int, int, int, int], None] | None = None,
) -> int:
    """Read ``ranges`` of a mapped file into the page cache on ``readers`` threads, and wait.

    For ``copy=False`` loads of a cold file: the views handed out are then ready without further
    I/O, and the pages came in as large reads at the storage's best parallelism instead of page
    faults one readahead window at a time. Each reader ``sendfile``s its share to ``/dev/null``:
    the kernel fills the page cache and copies nothing out (cold, 2 GiB, 4 readers, six settled
    rounds: 1.26-1.62 s, against 1.49-2.22 s for ``preadv`` into a buffer per reader); where
    that is refused, ``preadv`` into a small reused buffer. Page-cache pages cost no fresh
    anonymous memory, which on a VM is the expensive kind. A read error or a file shorter than
    its header says raises, naming the file: a mapping of missing bytes would otherwise kill
    the process with SIGBUS at first touch.
    """
    chunks = [(o + i, min(chunk, n - i)) for o, n in ranges for i in range(0, n, chunk)]
    if not chunks:
        return 0
    shares = _shares(chunks, readers)
    errors: list[BaseException] = []
    try:
        sink: int | None = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        sink = None
    try:
        if len(shares) == 1:
            _read_share(m, shares[0], sink, errors, on_chunk)
        else:
            ts = [
                threading.Thread(
                    target=_read_share, args=(m, mine, sink, errors, on_chunk), name=f"wl-prefetch-{i}", daemon=True
                )
                for i, mine in enumerate(shares)
            ]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
    finally:
        if sink is not None:
            os.close(sink)
    if errors:
        raise errors[0]
    return sum(n for _, n in chunks)


def _shares(chunks: list[tuple[int, int]], readers: int) -> list[list[tuple[int, int]]]:
    """Each reader's one contiguous share of the chunks, in file order, as the raw-read baseline
    does: a reader's stream stays sequential for the kernel and the disk."""
    k = max(1, min(readers, len(chunks)))
    total = sum(n for _, n in chunks)
    shares: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    acc = 0
    for c in chunks:
        shares[min(k - 1, acc * k // total)].append(c)
        acc += c[1]
    return shares


def _read_share(
    m: MappedFile,
    mine: list[tuple[int, int]],
    sink: int | None,
    errors: list[BaseException],
    on_chunk: Callable[[int, int, int, int], None] | None,
) -> None:
    """One reader's share into the page cache; the first error is kept in ``errors`` (all stop)."""
    out, buf = sink, None
    size = max((k for _, k in mine), default=0)
    for off, n in mine:
        if errors:
            return
        t0 = time.perf_counter_ns()
        try:
            out, buf = _read_chunk(m, off, n, out, buf, size)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            errors.append(e)
            return
        if on_chunk is not None:
            on_chunk(off, n, t0, time.perf_counter_ns())


def _read_chunk(
    m: MappedFile, off: int, n: int, out: int | None, buf: memoryview | None, size: int
) -> tuple[int | None, memoryview | None]:
    """Bytes [off, off+n) of ``m`` into the page cache: ``sendfile`` to ``out`` (the null sink),
    or ``preadv`` into ``buf`` (made of ``size`` bytes at need) where splicing is refused.
    Returns the sink and buffer to go on with."""
    done = 0
    try:
        while done < n:
            if out is not None:
                try:
                    got = os.sendfile(out, m.fileno(), off + done, n - done)
                except OSError as e:
                    if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        raise
                    out = None  # this file or kernel cannot splice: read into a buffer
                    continue
            else:
                if buf is None:
                    buf = memoryview(bytearray(size))
                got = os.preadv(m.fileno(), [buf[: n - done]], off + done)
            if got <= 0:
                raise FileError(f"file ended at byte {off + done} while reading tensors", file=m.path)
            done += got
    except FileError:  # ours (an OSError too): the file ended
        raise
    except OSError as e:
        raise FileError(f"read error at byte {off + done}: {e.strerror}", file=m.path, errno=e.errno) from None
    return out, buf


# -- warmer --------------------------------------------------------------------------------


class Warmer:
    """Worker threads that read ranges of a file ahead of the copy cursor into the page cache.

    ``ranges`` are (offset, length) in the order the loader will copy them. Readers claim chunks
    in that order, skip whatever the cursor (``advance``) has already passed, and stay at most
    ``lead`` bytes ahead of it so that warmed pages are not evicted before use on a small-memory
    machine. Stopped by :meth:`stop` (or the context manager) when the load ends or fails.
    """

    def __init__(
        self,
        fd: int,
        ranges: list[tuple[int, int]],
        *,
        chunk: int = WARM_CHUNK,
        max_readers: int = MAX_WARMERS,
        lead: int = 1 << 30,
        on_chunk: Callable[[int, int, int, int], None] | None = None,
    ):
        self._fd = fd
        self._chunks = [(o + i, min(chunk, n - i)) for o, n in ranges for i in range(0, n, chunk)]
        self._chunk = chunk
        self._next = 0
        self._cursor_chunk = 0
        self._lead_chunks = max(1, lead // chunk)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._max = max(1, max_readers)
        self._on_chunk = on_chunk
        self.bytes_read = 0
        self.readers = 0
        self._started_at = 0.0
        self._adapter: threading.Thread | None = None

    def start(self) -> Warmer:
        self._started_at = time.perf_counter()
        self._spawn()
        if self._max > 1:
            self._adapter = threading.Thread(target=self._adapt, name="wl-warm-adapt", daemon=True)
            self._adapter.start()
        return self

    def _spawn(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return  # stopped while the adapter decided to add a reader
        t = threading.Thread(target=self._run, name=f"wl-warm-{len(self._threads)}", daemon=True)
        self._threads.append(t)
        self.readers = len(self._threads)
        t.start()

    def _adapt(self) -> None:
        # Add a reader while the last one raised throughput by at least a tenth; on storage where
        # parallel readers interfere (one spinning disk, a throttled volume) we stay at one.
        window = 0.25
        last_bytes, last_rate = 0, 0.0
        while not self._stop.wait(window):
            with self._lock:
                done = self._next >= len(self._chunks)
                total = self.bytes_read
            if done:
                return
            rate = (total - last_bytes) / window
            last_bytes = total
            if len(self._threads) < self._max and rate > last_rate * 1.10:
                last_rate = rate
                self._spawn()
            elif rate < last_rate * 0.9 and len(self._threads) > 1:
                return  # the added reader did not pay; keep what runs (readers are cheap to idle)

    def advance(self, offset_done: int) -> None:
        """The loader has copied everything up to ``offset_done``: don't warm behind it."""
        with self._lock:
            i = self._cursor_chunk
            while i < len(self._chunks) and self._chunks[i][0] + self._chunks[i][1] <= offset_done:
                i += 1
            self._cursor_chunk = i
            if self._next < i:
                self._next = i
            self._wake.notify_all()

    def _run(self) -> None:
        buf = bytearray(self._chunk)
        mv = memoryview(buf)
        while not self._stop.is_set():
            with self._lock:
                while self._next - self._cursor_chunk >= self._lead_chunks and not self._stop.is_set():
                    self._wake.wait(0.05)
                if self._next >= len(self._chunks) or self._stop.is_set():
                    return
                off, n = self._chunks[self._next]
                self._next += 1
            t0 = time.perf_counter_ns()
            try:
                got = os.preadv(self._fd, [mv[:n]], off)
            except OSError:
                return  # warming is best effort; the copy itself will report a real read error
            if self._on_chunk is not None:
                self._on_chunk(off, got, t0, time.perf_counter_ns())
            with self._lock:
                self.bytes_read += got

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._wake.notify_all()
        if self._adapter is not None:
            self._adapter.join()
        for t in list(self._threads):
            t.join()

    def __enter__(self) -> Warmer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
