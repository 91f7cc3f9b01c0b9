"""Reading slices of tensors: contiguous ranges, strided rows, and scatter reads for other ranks.

Every byte a distributed load takes from a checkpoint goes through :class:`SliceReader`, which
counts it (``bytes_read``: what this rank asked storage, or the page cache, for), so a test or
a benchmark can check that a group reads each byte once. The path per slice:

* **resident file** (the page cache holds it): a copy out of the file's one mapping, strided
  or not, touching only the slice's own bytes.
* **cold file, contiguous slice**: ``preadv`` straight into the destination.
* **cold file, rows of at least** :data:`ROW_READ_MIN` **bytes**: one ``preadv`` per row straight
  into its destination row; only the slice's own bytes are read.
* **cold file, smaller rows**: per-row requests would be latency-bound, so the whole span is
  read sequentially, with ``preadv`` scattering each row into its destination row and the bytes
  between rows into one reused sink buffer. Storage reads the span, and ``bytes_read`` says so.
  (A group load sends such tensors through an owner rank instead: see :mod:`.group`.)

:data:`ROW_READ_MIN` is the row size from which per-row reads of a cold file beat reading the
whole span at every world size, measured on an evicted file (figures in bench/RESULTS.md); small
rows at a short stride lose to the span because each request pays the device's latency
(``WEIGHTLIFT_ROW_READ_MIN`` overrides it; a group load needs the same value on every rank).
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence

import numpy as np

from weightlift import env
from weightlift.disk.source import RESIDENT_THRESHOLD, MappedFile, resident_fraction
from weightlift.distributed.shard import Rows
from weightlift.errors import FileError, OptionError
from weightlift.memory.targets import populate
from weightlift.options import ENGINES

__all__ = ["SliceReader", "ROW_READ_MIN", "row_read_min", "IOV_MAX"]

ROW_READ_MIN = 1 << 20
try:
    IOV_MAX = max(16, min(1024, os.sysconf("SC_IOV_MAX")))
except (ValueError, OSError, AttributeError):
    IOV_MAX = 1024
_SINK = 1 << 20


def row_read_min() -> int:
    """:data:`ROW_READ_MIN`, or ``WEIGHTLIFT_ROW_READ_MIN`` where set."""
    return env.row_read_min(ROW_READ_MIN)


class SliceReader:
    """Reads :class:`Rows` of checkpoint files into host buffers, counting the bytes read.

    ``engine`` is "auto" (mapping copy for resident files, ``preadv`` for cold ones), "mmap" or
    "pread". ``maps`` holds the one mapping per file the load checked against its headers.
    """

    def __init__(self, maps: dict[str, MappedFile], *, engine: str = "auto"):
        if engine not in ENGINES:
            raise OptionError(f"engine must be 'auto', 'pread' or 'mmap', not {engine!r}")
        self.maps = maps
        self._mmap: dict[str, bool] = {}
        self._engine = engine
        self.row_min = row_read_min()
        self.bytes_read = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._sink: memoryview | None = None

    def _use_mmap(self, file: str) -> bool:
        got = self._mmap.get(file)
        if got is None:
            got = self._engine == "mmap" or (self._engine == "auto" and resident_fraction(file) >= RESIDENT_THRESHOLD)
            self._mmap[file] = got
        return got

    def _count(self, n: int, requests: int) -> None:
        with self._lock:
            self.bytes_read += n
            self.requests += requests

    def read(self, rows: Rows, dst: np.ndarray) -> None:
        """Fill ``dst`` (uint8, ``rows.nbytes`` long) with the rows, packed one after another."""
        if dst.size != rows.nbytes:
            raise AssertionError(f"destination of {dst.size} bytes for {rows.nbytes} bytes of rows")
        if not rows.nbytes:
            return
        m = self.maps[rows.file]
        if self._use_mmap(rows.file):
            src = strided(m, rows)
            np.copyto(dst.reshape(rows.count, rows.seg), src)
            # the page cache keeps the pages; dropping this process's entries keeps RSS at one copy
            m.advise(mmap.MADV_DONTNEED, rows.offset, rows.span)
            self._count(rows.nbytes, 1)
            return
        populate(dst)  # faulting fresh pages inside preadv costs several times more
        mv = dst.data
        if rows.contiguous:
            self._count(_pread_full(m, [mv], rows.offset), 1)
        elif rows.seg >= self.row_min:
            for i in range(rows.count):
                _pread_full(m, [mv[i * rows.seg : (i + 1) * rows.seg]], rows.offset + i * rows.stride)
            self._count(rows.nbytes, rows.count)
        else:
            gap = rows.stride - rows.seg
            sink = self._sink_for(gap)
            iovs: list[memoryview] = []
            for i in range(rows.count):
                iovs.append(mv[i * rows.seg : (i + 1) * rows.seg])
                if i + 1 < rows.count:
                    iovs.append(sink[:gap])
            self._count(_scatter(m, iovs, rows.offset), -(-len(iovs) // IOV_MAX))

    def scatter(self, file: str, offset: int, count: int, segs: Sequence[int], dsts: Sequence[np.ndarray]) -> None:
        """Read ``count`` rows from ``offset``, each made of ``len(segs)`` back-to-back segments, the
        k-th ``segs[k]`` bytes long, into ``dsts[k]`` (``count * segs[k]`` bytes, rows packed).

        The whole span is read once: an owner rank reading a tensor for every rank's slice of it.
        """
        m = self.maps[file]
        stride = sum(segs)
        if not count or not stride:
            return
        if self._use_mmap(file):
            col = 0
            for seg, dst in zip(segs, dsts, strict=False):
                if seg:
                    np.copyto(dst.reshape(count, seg), strided(m, Rows(file, offset + col, seg, stride, count)))
                col += seg
            m.advise(mmap.MADV_DONTNEED, offset, count * stride)
            self._count(count * stride, 1)
            return
        views = []
        for seg, dst in zip(segs, dsts, strict=False):
            populate(dst)
            views.append((seg, dst.data))
        iovs = [v[i * seg : (i + 1) * seg] for i in range(count) for seg, v in views if seg]
        self._count(_scatter(m, iovs, offset), -(-len(iovs) // IOV_MAX))

    def _sink_for(self, gap: int) -> memoryview:
        if self._sink is None or len(self._sink) < gap:
            self._sink = memoryview(bytearray(max(gap, _SINK)))
        return self._sink


def strided(m: MappedFile, rows: Rows) -> np.ndarray:
    """The rows as a (count, seg) strided view of the mapping: no copy."""
    base = np.frombuffer(m.view(rows.offset, rows.span), dtype=np.uint8)
    return np.lib.stride_tricks.as_strided(
        base, shape=(rows.count, rows.seg), strides=(rows.stride, 1), writeable=False
    )


def _pread_full(m: MappedFile, iovs: list[memoryview], offset: int) -> int:
    """``preadv`` until every buffer is full; a short file is an error naming it."""
    total = sum(len(v) for v in iovs)
    done = 0
    fd = m.fileno()
    while done < total:
        # resume after a short read: drop what is filled, trim the buffer it stopped in
        skip, rest = done, []
        for v in iovs:
            if skip >= len(v):
                skip -= len(v)
                continue
            rest.append(v[skip:])
            skip = 0
        try:
            got = os.preadv(fd, rest, offset + done)
        except OSError as e:
            raise FileError(f"read error at byte {offset + done}: {e.strerror}", file=m.path, errno=e.errno) from None
        if got <= 0:
            raise FileError(f"file ended at byte {offset + done} while reading tensors", file=m.path)
        done += got
    return total


def _scatter(m: MappedFile, iovs: list[memoryview], offset: int) -> int:
    """Read the file's bytes from ``offset`` into ``iovs`` in order, :data:`IOV_MAX` buffers a call."""
    done = 0
    for i in range(0, len(iovs), IOV_MAX):
        batch = iovs[i : i + IOV_MAX]
        done += _pread_full(m, batch, offset + done)
    return done
