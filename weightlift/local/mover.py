"""The mover: worker threads copying a plan's chunks from checkpoint files into a target.

Worker threads take chunks in file order (steps 4 and 5 of :mod:`weightlift.local.loader`'s
theory of operation). A host target's arena is read into with ``preadv``, or copied out of the
mapping (``engine="mmap"``). A target a memcpy cannot fill (a CUDA device) hands each worker a
private :class:`~weightlift.memory.targets.Stager` (two pinned slots): the read of one chunk
into one slot overlaps the device copy of the previous one out of the other. Tensors cast on
load go through the target's cast variant, one tensor at a time, straight out of the mapping.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any, Protocol

import numpy as np

from weightlift.disk.source import MAX_WARMERS, MappedFile, Warmer, evict_range
from weightlift.dtypes import DTYPES, dtype_info
from weightlift.errors import FileError, WeightliftError
from weightlift.formats import TensorInfo
from weightlift.memory.faulter import REGION, Faulter
from weightlift.memory.fresh import policy as fill_policy
from weightlift.memory.targets import WORKER_SLOT, Stager, Target, populate
from weightlift.plan import CHUNK, Chunk, Run, layout, make_chunks, make_runs
from weightlift.profile import Profiler

__all__ = ["Mover", "Landed", "LANDED_PIECE", "COLD_FAULT_WINDOW", "mapped_error"]

_PLAIN = {d.name for d in DTYPES}
# a verified load hashes what landed this much at a time, right after it lands, while it is in
# the CPU's cache (the last level's share of one core, on the machines measured)
LANDED_PIECE = 1024 * 1024
# how far the cold faulter's helpers may run ahead of the readers: the arena is allocated (and
# its size known) already, so this only bounds how soon faulted pages are used
COLD_FAULT_WINDOW = 256 * 1024 * 1024


class Landed(Protocol):
    """Told the bytes of ``file`` at ``offset`` as they landed (see :func:`~weightlift.local.loader.load_local`)."""

    def __call__(self, file: str, offset: int, data: Any, *, stable: bool = True) -> None: ...


class Mover:
    """Moves the selected tensors into their target with a pool of worker threads."""

    def __init__(
        self,
        infos: list[TensorInfo],
        target: Target,
        *,
        maps: dict[str, MappedFile],
        cast: str | None,
        threads: int,
        engine: str,
        evict: bool,
        cold: Mapping[str, bool],
        warm: bool | None,
        prof: Profiler,
        progress: Callable[[int], None] | None,
        on_landed: Landed | None = None,
    ):
        self.on_landed = on_landed
        self.infos = infos
        self.target = target
        self.maps = maps
        self.cast = cast
        self.threads = threads
        self.evict = evict
        self.cold = cold
        # Every file is read with preadv straight into the destination: warm, as fast as a copy
        # out of the mapping, and a file truncated under the load is a short read (FileError),
        # never SIGBUS. A cold one gets up to MAX_WARMERS readers (see _Gate): that matched the
        # best raw read, while a mapping copy behind the read-ahead warmer took about twice as long.
        self.engine = {f: (engine if engine != "auto" else "pread") for f in cold}
        self.cold_read = engine == "auto" and any(cold.values())
        # the separate warmer reads ahead of a mapping copy: only where a cold file is copied
        # out of its mapping, or where the caller asks for it
        self.warm = {f: (warm if warm is not None else (cold[f] and self.engine[f] == "mmap")) for f in cold}
        self.prof = prof
        self.progress = progress
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._faulter: Faulter | None = None
        self._warmers: dict[str, Warmer] = {}

    def _casts(self, t: TensorInfo) -> bool:
        return (
            self.cast is not None
            and t.dtype in _PLAIN
            and dtype_info(t.dtype).numpy.startswith(("float", "bfloat"))
            and t.dtype != self.cast
        )

    def run(self) -> dict[str, Any]:
        direct = [t for t in self.infos if not self._casts(t)]
        casted = [t for t in self.infos if self._casts(t)]
        out: dict[str, Any] = {}
        if direct:
            out.update(self._move(direct))
        if casted:
            out.update(self._convert(casted))
        return {t.name: out[t.name] for t in self.infos}

    # Copies of runs, through one arena whose layout mirrors the files.
    def _move(self, infos: list[TensorInfo]) -> dict[str, Any]:
        runs = make_runs(infos, align=self.target.align)  # a device's tensors start on its alignment
        starts, total = layout(runs, align=self.target.align)
        host = self.target.memcpy_ok
        chunks = make_chunks(runs, chunk=CHUNK if host else WORKER_SLOT)
        arena = self.target.arena(total)
        warmers = self._start_warmers(runs)
        self._faulter = self._start_faulter(arena) if host else None
        try:
            self._work(runs, starts, chunks, arena)
        finally:
            for w in warmers:
                w.stop()
            if self._faulter is not None:
                self._faulter.close()
        if self._error is not None:
            raise self._error
        return {
            t.name: self.target.view(arena, s + (t.offset - r.offset), t)
            for r, s in zip(runs, starts, strict=False)
            for t in r.tensors
        }

    def _start_faulter(self, arena: np.ndarray) -> Faulter | None:
        """Helper threads faulting the arena in ahead of cold readers.

        A cold reader spends most of its time waiting on the disk, so faulting the next chunks'
        fresh pages on otherwise idle cores hides that cost behind the reads, where a reader that
        faults its own chunk first pays both in series. Warm, the readers keep every core busy
        and the helpers would only take turns with them. ``WEIGHTLIFT_FAULT_HELPERS=0`` (the fill
        policy's helper count) turns them off."""
        if not self.cold_read:
            return None
        return Faulter.ahead(arena, window=COLD_FAULT_WINDOW, name="wl-load-fault")

    def _start_warmers(self, runs: list[Run]) -> list[Warmer]:
        """A warmer per file that wants one, over that file's runs; kept by file for the workers."""
        by_file: dict[str, list[tuple[int, int]]] = {}
        for r in runs:
            if self.warm.get(r.file):
                by_file.setdefault(r.file, []).append((r.offset, r.length))
        cb = self._warm_chunk if self.prof.enabled else None
        self._warmers = {f: Warmer(self.maps[f].fileno(), ranges, on_chunk=cb).start() for f, ranges in by_file.items()}
        return list(self._warmers.values())

    def _warm_chunk(self, off: int, n: int, t0: int, t1: int) -> None:
        self.prof.record("read", t0, t1, n, name="warm chunk", background=True)

    def _work(self, runs: list[Run], starts: list[int], chunks: list[Chunk], arena: Any) -> None:
        nxt = [0]
        # cold readers wait on the disk, not the CPU: let the gate try up to MAX_WARMERS of them
        # even on a machine with fewer cores
        limit = max(self.threads, MAX_WARMERS) if self.cold_read else self.threads
        workers = min(limit, max(1, len(chunks)))
        cold_files = [f for f, e in self.engine.items() if e == "pread" and self.cold.get(f)]
        dev = os.stat(cold_files[0]).st_dev if self.cold_read and cold_files else None
        gate = _Gate(workers, cold=self.cold_read, device=dev)

        def worker(k: int) -> None:
            stager: Stager | None = None
            try:
                if not self.target.memcpy_ok:
                    stager = self.target.stager(private=True)  # this worker's own staging
                while self._error is None and gate.admit(k):
                    with self._lock:
                        i = nxt[0]
                        nxt[0] += 1
                    if i >= len(chunks):
                        gate.close()  # releases workers the gate is holding back
                        break
                    c = chunks[i]
                    self._chunk(runs[c.run], c, starts[c.run] + c.start, arena, stager)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
                with self._lock:
                    if self._error is None:
                        self._error = mapped_error(e, "load")
                gate.close()
            finally:
                if stager is not None:
                    stager.close()  # waits for its copies

        if workers == 1:
            worker(0)
            return
        ts = [threading.Thread(target=worker, args=(k,), name=f"wl-load-{k}", daemon=True) for k in range(workers)]
        for t in ts:
            t.start()
        try:
            for t in ts:
                t.join()
        finally:
            gate.close()

    def _chunk(self, r: Run, c: Chunk, dst_off: int, arena: Any, stager: Stager | None) -> None:
        """One chunk of run ``r`` into the arena at ``dst_off``: read in place, or staged."""
        src_off = r.offset + c.start
        w = self._warmers.get(r.file)
        if w is not None:
            w.advance(src_off)
        if stager is not None:
            self._staged_chunk(r.file, src_off, c.length, arena, dst_off, stager)
        else:
            if self._faulter is not None:
                self._faulter.ready(REGION, dst_off, dst_off + c.length)
            with self.prof.phase("read", c.length):
                self._read_into(r.file, src_off, arena[dst_off : dst_off + c.length], self.on_landed)
            self.prof.count(calls=1)
        if self.evict:
            evict_range(r.file, src_off, c.length)
        if self.progress is not None:
            self.progress(c.length)

    def _read_into(self, file: str, off: int, dst: np.ndarray, landed: Landed | None = None) -> None:
        """Read ``dst.size`` bytes of ``file`` at ``off`` into ``dst``. ``landed``, if given, is
        called with each piece of at most LANDED_PIECE bytes right after it lands, while it is
        still in the CPU's cache (a verified load hashes it there: hashing a 32 MiB chunk
        after the fact would read it back from memory)."""
        m = self.maps[file]
        n = dst.size
        step = LANDED_PIECE if landed is not None else max(n, 1)
        if self.engine[file] == "mmap":
            for a in range(0, n, step):
                b = min(n, a + step)
                np.copyto(dst[a:b], np.frombuffer(m.buffer, dtype=np.uint8, count=b - a, offset=off + a))
                if landed is not None:
                    landed(file, off + a, dst[a:b])
            # drop this process's page-table entries for what was copied (the page cache keeps
            # the pages): otherwise the mapped file doubles the load's RSS
            m.advise(mmap.MADV_DONTNEED, off, n)
            return
        if self._faulter is None:  # else the helpers faulted it, or ready() did
            # faulted ahead of preadv where this machine's fill policy says it pays
            with self.prof.phase("stage", name="fault-in") if fill_policy().ahead else nullcontext():
                populate(dst)
        mv = dst.data
        done = 0
        while done < n:
            end = min(n, done + step)
            got = os.preadv(m.fileno(), [mv[done:end]], off + done)
            if got <= 0:
                raise FileError(f"file ended at byte {off + done} while reading tensors", file=file)
            if landed is not None:
                landed(file, off + done, dst[done : done + got])
            done += got

    def _staged_chunk(self, file: str, off: int, n: int, arena: Any, dst_off: int, stager: Stager) -> None:
        """Read into the stager's buffer, then land it in the arena (for a CUDA target: a pinned
        slot, copied to the device while the next chunk is read into the other slot)."""
        prof = self.prof
        with prof.phase("device"):
            buf = stager.take(n)  # waits for the copy out of this slot to finish
        assert len(buf) == n, "a chunk larger than its staging slot"
        with prof.phase("stage", n):
            self._read_into(file, off, buf)
        with prof.phase("device", n):
            stager.land(arena, dst_off)
        if self.on_landed is not None:  # the staging slot, read beside the device copy
            self.on_landed(file, off, buf, stable=False)
        prof.count(calls=1)

    # Cast targets: one conversion pass straight out of the mapping, per tensor.
    def _convert(self, infos: list[TensorInfo]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        assert self.cast is not None
        ct = self.target.casting(self.cast)  # one target (one set of staging) for all tensors
        for t in infos:
            src = self.maps[t.file].view(t.offset, t.length)
            with self.prof.phase("stage", t.length):
                if self.on_landed is not None:
                    self.on_landed(t.file, t.offset, src)
                dest = ct.empty(t.dtype, t.shape)
                ct.write(dest, 0, src)
                out[t.name] = ct.finish(dest)
            self.prof.count(calls=1)
            if self.progress is not None:
                self.progress(t.length)
        return out


class _Gate:
    """How many workers may read a cold file at once.

    Parallel readers help on striped, networked or SSD storage and can hurt on a single disk.
    The count comes from what is known of the device (:mod:`weightlift.disk.storage`: pinned by
    ``WEIGHTLIFT_COLD_READERS``, or recorded by ``weightlift bench --cold`` from its
    seconds-long raw-read baseline), else all readers, as measured best on this kind of machine.
    A probe inside the load was tried and dropped: sub-second windows on a shared virtual disk
    picked one reader about half the time where four were twice as fast.
    """

    def __init__(self, workers: int, *, cold: bool, device: int | None = None):
        self.allowed = workers
        if cold and device is not None:
            from weightlift.disk.storage import readers_for

            known = readers_for(device)
            if known is not None:
                self.allowed = max(1, min(workers, known))
        self._cond = threading.Condition()
        self._closed = False

    def admit(self, k: int) -> bool:
        """Wait until worker ``k`` may take a chunk; False once the load is over."""
        if k < self.allowed:
            return True
        with self._cond:
            while not self._closed:
                self._cond.wait()
            return False

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def mapped_error(e: BaseException, what: str) -> BaseException:
    if isinstance(e, WeightliftError):
        return e
    if isinstance(e, OSError):
        return FileError(f"{what} failed: {e.strerror or e}", errno=e.errno)
    return e
