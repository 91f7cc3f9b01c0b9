"""The local loader: runs a plan from checkpoint files into host or device memory.

Theory of operation.

1. **Open and select.** Headers are parsed and validated (:mod:`weightlift.checkpoint`); the
   selection picks tensors; nothing else is read yet.
2. **Probe once.** For each file, :func:`~weightlift.disk.source.resident_fraction` says how much is
   already in the page cache (memoized per process). At 90 % or more the warmer is skipped.
3. **Plan.** Tensors become runs of back-to-back bytes going to the same kind of target, runs
   become one arena whose layout mirrors the file (so each run is one copy and each tensor a
   view), and the arena is cut into chunks for the worker threads.
4. **Move.** Worker threads take chunks in file order. Host targets in the checkpoint's dtype
   are read with ``preadv`` straight into the arena (no staging copy): warm, that matched a
   copy out of the file's mapping (bench/RESULTS.md, wl.numpy.pread), and a file truncated
   under the load then ends in a short read, a FileError naming the file, where a copy out of
   the mapping would kill the process with SIGBUS. ``engine="mmap"`` keeps the mapping copy
   (its page-table entries dropped behind it so the file does not count twice in RSS). A CUDA
   target gets the same reads into pinned slots, each
   worker double-buffering its own two slots so the disk or page-cache read of one chunk
   overlaps the device copy of the previous one. A cast target converts straight out of the
   mapping in its own fill step. While the workers copy, warmers read ahead of them on cold files.
5. **Page cache.** Kept, unless it competes with the destination for RAM (a unified-memory
   device, or ``page_cache="evict"``): then each chunk is dropped from the cache once copied.

``copy=False`` skips 3-5 for host targets: tensors are read-only views of the mapping.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from weightlift import env
from weightlift.checkpoint import Checkpoint, Select, open_checkpoint
from weightlift.disk.source import (
    MAX_WARMERS,
    RESIDENT_THRESHOLD,
    MappedFile,
    Warmer,
    evict_range,
    page_eviction_override,
    resident_fraction,
)
from weightlift.disk.source import (
    prefetch as read_in,
)
from weightlift.dtypes import DTYPES, dtype_info
from weightlift.errors import FileError, WeightliftError
from weightlift.formats import TensorInfo
from weightlift.local.plan import CHUNK, Run, layout, make_chunks, make_runs
from weightlift.memory.faulter import REGION, Faulter
from weightlift.memory.fresh import map_in
from weightlift.memory.fresh import policy as _fill_policy
from weightlift.memory.targets import CastTarget, CudaTarget, Target, fresh_host, make_target, populate, view_as
from weightlift.options import LoadOptions

__all__ = ["load_local", "prefetch", "Prefetch", "Landed", "DEFAULT_THREADS"]

DEFAULT_THREADS = max(1, min(8, os.cpu_count() or 1))
_PLAIN = {d.name for d in DTYPES}


class Landed(Protocol):
    """Told the bytes of ``file`` at ``offset`` as they landed (see :func:`load_local`)."""

    def __call__(self, file: str, offset: int, data: Any, *, stable: bool = True) -> None: ...


def load_local(
    path: str | os.PathLike[str] | Checkpoint,
    opts: LoadOptions | None = None,
    *,
    on_landed: Landed | None = None,
) -> dict[str, Any]:
    """Load tensors from a checkpoint into this process's memory; returns ``{name: array}`` in file order.

    ``opts`` holds :func:`weightlift.load`'s options (see there); only the local ones are read
    here: the split and distributed loads are dispatched by :mod:`weightlift.api` before they
    reach this function.

    ``on_landed(file, offset, data, stable=...)`` is called by the worker that landed them with
    the bytes of ``file`` at ``offset`` as they now are in the destination, right after the copy
    (a verified load hashes them there, while they are in the cache). For a CUDA destination
    ``data`` is the host-side pinned staging buffer, reused after the call (``stable=False``);
    for a dtype cast it is the source bytes the conversion read; for ``copy=False`` the views.
    """
    opts = opts if opts is not None else LoadOptions()
    t_start = time.perf_counter()
    ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    infos = ckpt.select(opts.select)
    cast = opts.cast
    device, framework, copy, warm, progress = opts.device, opts.framework, opts.copy, opts.warm, opts.progress
    dequantize, report = opts.dequantize, opts.report
    nthreads = DEFAULT_THREADS if opts.threads is None else opts.threads
    prof = _profiler(opts.profile)
    nbytes = sum(t.length for t in infos)
    if prof is not None:
        # tensor bytes, not the padding a coalesced run copies along with them
        prof.count(tensors=len(infos), nbytes=nbytes)
    files = list(dict.fromkeys(t.file for t in infos))
    maps = {f: ckpt.mapped(f) for f in files}  # one mapping per file for the whole load
    await_prefetches(files)
    resident = {f: resident_fraction(f) for f in files}
    if not copy:
        want = files if warm else [] if warm is False else [f for f in files if resident[f] < RESIDENT_THRESHOLD]
        if want:
            _prefetch(infos, maps, want, prof, _progress(progress, nbytes))
        out = _borrow(infos, maps, framework, dequantize)
        if on_landed is not None:
            for t in infos:
                on_landed(t.file, t.offset, maps[t.file].view(t.offset, t.length))
    else:
        target = make_target(device, framework, None)
        evict = _evict_policy(opts.page_cache, target)
        mover = _Mover(
            infos,
            target,
            maps=maps,
            framework=framework,
            cast=cast,
            threads=nthreads,
            engine=opts.engine,
            evict=evict,
            cold={f: resident[f] < RESIDENT_THRESHOLD for f in files},
            warm=warm,
            prof=prof,
            progress=_progress(progress, nbytes),
            on_landed=on_landed,
        )
        out = mover.run()
        if dequantize:
            out = {t.name: _dequantized(t, out[t.name], framework) if _quantized(t) else out[t.name] for t in infos}
    if report is not None:
        seconds = time.perf_counter() - t_start
        report.update(
            tensors=len(infos),
            bytes=nbytes,
            seconds=seconds,
            gbps=nbytes / seconds / 1e9 if seconds > 0 else 0.0,
            resident_before=(sum(resident[f] * maps[f].size for f in files) / max(1, sum(maps[f].size for f in files))),
            files=len(files),
            copy=copy,
            device=str(device),
            framework=framework,
        )
        if prof is not None:
            report["profile"] = prof.report()
    return out


# -- options -------------------------------------------------------------------------------


def _profiler(profile: Any) -> Any:
    if profile is False or (profile is None and not env.load_profile()):
        return None  # the one check a load pays with the profiler off
    from weightlift.profile import Profiler

    if isinstance(profile, Profiler):
        return profile if profile.enabled else None
    p = Profiler(enabled=True if profile is True else None)
    return p if p.enabled else None


def _evict_policy(page_cache: str | None, target: Target) -> bool:
    if page_cache is not None:
        return page_cache == "evict"
    env = page_eviction_override()
    if env is not None:
        return env
    return _unified_memory(target)


def _unified_memory(target: Target) -> bool:
    # On an integrated GPU the page cache and the "device" memory are the same RAM: keeping the
    # cache would hold the checkpoint twice.
    if not isinstance(target, CudaTarget):
        return False
    import torch

    try:
        return bool(getattr(torch.cuda.get_device_properties(torch.device(target.device)), "is_integrated", False))
    except Exception:  # noqa: BLE001 - a property query that fails means a discrete device
        return False


def _progress(progress: bool | None, total: int) -> Callable[[int], None] | None:
    if progress is False or (progress is None and not sys.stderr.isatty()):
        return None
    from weightlift.progress import Progress

    return Progress(total).update


# -- views and conversions -----------------------------------------------------------------


def _quantized(t: TensorInfo) -> bool:
    return t.dtype not in _PLAIN


def _raw_view(raw: np.ndarray, t: TensorInfo, framework: str) -> Any:
    if not _quantized(t):
        return view_as(raw, t.dtype, t.shape, framework)
    shaped = raw.reshape(t.extra.get("raw_shape", (raw.size,)))
    if framework == "numpy":
        return shaped
    return view_as(shaped, "U8", shaped.shape, "torch")


def _dequantized(t: TensorInfo, raw: Any, framework: str) -> Any:
    from weightlift.formats.gguf import dequantize

    arr = raw if isinstance(raw, np.ndarray) else raw.cpu().numpy()
    out = dequantize(arr, t.ggml_type)  # type: ignore[arg-type]
    if framework == "numpy":
        return out
    import torch

    res = torch.from_numpy(np.ascontiguousarray(out))
    return res if isinstance(raw, np.ndarray) or raw.device.type == "cpu" else res.to(raw.device)


class Prefetch:
    """Files of a checkpoint being read into the page cache on a thread of their own (see
    :func:`prefetch`). A load of the same files waits for it instead of reading them again."""

    def __init__(self, files: list[str], thread: threading.Thread | None):
        self.files = files
        self._thread = thread
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Wait until the files are read in; a read error is raised here (and by the load)."""
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error


_prefetches: dict[str, Prefetch] = {}  # by file: the prefetch reading it now
_prefetch_lock = threading.Lock()


def prefetch(path: str | os.PathLike[str] | Checkpoint, *, select: Select = None) -> Prefetch:
    """Start reading the selected bytes of a checkpoint's cold files into the page cache, on a
    background thread, and return at once.

    For the time a process spends before its load: importing torch and transformers takes
    seconds, and a cold checkpoint's read can run under it (:func:`~weightlift.memory.fresh.map_in`
    on this process's mapping of each file: the readers wait on the disk in ``madvise``, without
    the GIL, and touch each page once, which on a VM is a fault of its own). Call it first
    thing, then import, then load: the load waits for whatever the prefetch has not finished and
    reads nothing twice. Files already resident are left alone. Headers are parsed now, so a
    missing or malformed checkpoint raises here."""
    ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    infos = ckpt.select(select)
    files = list(dict.fromkeys(t.file for t in infos))
    maps = {f: ckpt.mapped(f) for f in files}
    cold = [f for f in files if resident_fraction(f, refresh=True) < RESIDENT_THRESHOLD]
    if not cold:
        return Prefetch([], None)
    job = Prefetch(cold, None)

    regions = [(maps[r.file].address() + r.offset, r.length, r.file) for r in make_runs(infos) if r.file in cold]
    from weightlift.disk.storage import readers_for

    threads = min(_prefetch_threads(), *(readers_for(maps[f].identity.dev) or MAX_WARMERS for f in cold))

    def run(held: dict[str, MappedFile]) -> None:
        # ``held``: the mappings stay mapped while map_in reads them by address, even if the
        # file changes and the process's cache of mappings lets go of them
        try:
            map_in(regions, threads=threads)
        except BaseException as e:  # noqa: BLE001 - kept for wait() and the load
            job.error = e
        finally:
            for f in cold:
                resident_fraction(f, refresh=True)  # what the load will see
            with _prefetch_lock:
                for f in cold:
                    if _prefetches.get(f) is job:
                        del _prefetches[f]

    job._thread = threading.Thread(target=run, args=(maps,), name="wl-prefetch", daemon=True)
    with _prefetch_lock:
        for f in cold:
            _prefetches[f] = job
    job._thread.start()
    return job


def _prefetch_threads() -> int:
    """One core fewer than the machine has, at most MAX_WARMERS: a prefetch runs beside the
    imports it hides under, which take a core of their own."""
    return max(1, min((os.cpu_count() or 1) - 1, MAX_WARMERS))


def await_prefetches(files: list[str]) -> None:
    """Wait for prefetches still reading any of ``files`` (their reads are this load's)."""
    with _prefetch_lock:
        jobs = {id(j): j for f in files if (j := _prefetches.get(f)) is not None}
    for j in jobs.values():
        j.wait()


def _prefetch(
    infos: list[TensorInfo],
    maps: dict[str, MappedFile],
    files: list[str],
    prof: Any,
    progress: Callable[[int], None] | None,
) -> None:
    """Bring the selected bytes of cold files into the page cache before views of them are
    handed out (``copy=False``), with as many readers as the storage is known to like."""
    from weightlift.disk.storage import readers_for

    def on_chunk(off: int, n: int, t0: int, t1: int) -> None:
        if prof is not None:
            prof.record("read", t0, t1, n, name="prefetch")
        if progress is not None:
            progress(n)

    runs = make_runs(infos)
    for f in files:
        ranges = [(r.offset, r.length) for r in runs if r.file == f]
        m = maps[f]
        read_in(
            m,
            ranges,
            readers=readers_for(m.identity.dev) or MAX_WARMERS,
            on_chunk=on_chunk if prof is not None or progress is not None else None,
        )


def _borrow(infos: list[TensorInfo], maps: dict[str, MappedFile], framework: str, dequantize: bool) -> dict[str, Any]:
    out = {}
    for t in infos:
        m = maps[t.file]
        raw = (
            np.frombuffer(m.buffer, dtype=np.uint8, count=t.length, offset=t.offset)
            if t.length
            else np.empty(0, np.uint8)
        )
        if not t.length:
            raw.flags.writeable = False
        v = _raw_view(raw, t, framework)
        out[t.name] = _dequantized(t, v, framework) if dequantize and _quantized(t) else v
    return out


# -- the mover -----------------------------------------------------------------------------


class _Mover:
    """Moves the selected tensors into their target with a pool of worker threads."""

    def __init__(
        self,
        infos: list[TensorInfo],
        target: Target,
        *,
        maps: dict[str, MappedFile],
        framework: str,
        cast: str | None,
        threads: int,
        engine: str,
        evict: bool,
        cold: Mapping[str, bool],
        warm: bool | None,
        prof: Any,
        progress: Callable[[int], None] | None,
        on_landed: Landed | None = None,
    ):
        self.on_landed = on_landed
        self.infos = infos
        self.target = target
        self.maps = maps
        self.framework = framework
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

    # Host or device copies of runs, through the arena.
    def _move(self, infos: list[TensorInfo]) -> dict[str, Any]:
        runs = make_runs(infos)
        starts, total = layout(runs)
        device = isinstance(self.target, CudaTarget)
        chunk = CHUNK if not device else _DEVICE_CHUNK
        chunks = make_chunks(runs, chunk=chunk)
        if device:
            import torch

            arena_dev = torch.empty(total, dtype=torch.uint8, device=self.target.device)
            arena = None
        else:
            arena = fresh_host(total)
        warmers = self._start_warmers(runs)
        self._faulter = self._start_faulter(arena)
        try:
            self._work(runs, starts, chunks, arena, arena_dev if device else None)
        finally:
            for w in warmers:
                w.stop()
            if self._faulter is not None:
                self._faulter.close()

        if self._error is not None:
            raise self._error
        out = {}
        for r, s in zip(runs, starts, strict=False):
            for t in r.tensors:
                a = s + (t.offset - r.offset)
                if device:
                    out[t.name] = _device_view(arena_dev, a, t)
                else:
                    out[t.name] = _raw_view(arena[a : a + t.length], t, self.framework)  # type: ignore[index]
        return out

    def _start_faulter(self, arena: Any) -> Faulter | None:
        """Helper threads faulting the arena in ahead of cold readers.

        A cold reader spends most of its time waiting on the disk, so faulting the next chunks'
        fresh pages on otherwise idle cores hides that cost behind the reads, where a reader that
        faults its own chunk first pays both in series. Warm, the readers keep every core busy
        and the helpers would only take turns with them. ``WEIGHTLIFT_FAULT_HELPERS=0`` (the fill
        policy's helper count) turns them off."""
        if arena is None or not self.cold_read:
            return None
        return Faulter.ahead(arena, window=COLD_FAULT_WINDOW, name="wl-load-fault")

    def _start_warmers(self, runs: list[Run]) -> list[Warmer]:
        """A warmer per file that wants one, over that file's runs; kept by file for the workers."""
        by_file: dict[str, list[tuple[int, int]]] = {}
        for r in runs:
            if self.warm.get(r.file):
                by_file.setdefault(r.file, []).append((r.offset, r.length))
        cb = self._warm_chunk if self.prof is not None else None
        self._warmers = {f: Warmer(self.maps[f].fileno(), ranges, on_chunk=cb).start() for f, ranges in by_file.items()}
        return list(self._warmers.values())

    def _warm_chunk(self, off: int, n: int, t0: int, t1: int) -> None:
        self.prof.record("read", t0, t1, n, name="warm chunk", background=True)

    def _work(self, runs: list[Run], starts: list[int], chunks: list[Any], arena: Any, arena_dev: Any) -> None:
        nxt = [0]
        # cold readers wait on the disk, not the CPU: let the gate try up to MAX_WARMERS of them
        # even on a machine with fewer cores
        limit = max(self.threads, MAX_WARMERS) if self.cold_read else self.threads
        workers = min(limit, max(1, len(chunks)))
        device = arena_dev is not None
        cold_files = [f for f, e in self.engine.items() if e == "pread" and self.cold.get(f)]
        dev = os.stat(cold_files[0]).st_dev if self.cold_read and cold_files else None
        gate = _Gate(workers, cold=self.cold_read, device=dev)

        def worker(k: int) -> None:
            slots = _pinned_get(self.target.device) if device else None
            flip = 0
            try:
                while self._error is None:
                    if not gate.admit(k):
                        break
                    with self._lock:
                        i = nxt[0]
                        nxt[0] += 1
                    if i >= len(chunks):
                        gate.close()  # releases workers the gate is holding back
                        break
                    c = chunks[i]
                    r = runs[c.run]
                    src_off = r.offset + c.start
                    dst_off = starts[c.run] + c.start
                    w = self._warmers.get(r.file)
                    if w is not None:
                        w.advance(src_off)
                    if device:
                        flip ^= 1
                        self._device_chunk(r.file, src_off, c.length, arena_dev, dst_off, slots, flip)
                    else:
                        if self._faulter is not None:
                            self._faulter.ready(REGION, dst_off, dst_off + c.length)
                        self._host_chunk(r.file, src_off, c.length, arena[dst_off : dst_off + c.length])
                    if self.evict:
                        evict_range(r.file, src_off, c.length)
                    if self.progress is not None:
                        self.progress(c.length)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
                with self._lock:
                    if self._error is None:
                        self._error = _mapped_error(e, "load")
                gate.close()
            finally:
                if slots is not None:
                    _pinned_put(slots)

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
        prof = self.prof
        t0 = time.perf_counter_ns() if prof is not None else 0
        if self._faulter is None:  # else the helpers faulted it, or ready() did
            populate(dst)  # faulted ahead of preadv where this machine's fill policy says it pays
        if prof is not None and _fill_policy().ahead:
            prof.record("stage", t0, time.perf_counter_ns(), 0, name="fault-in")
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

    def _host_chunk(self, file: str, off: int, n: int, dst: np.ndarray) -> None:
        prof = self.prof
        t0 = time.perf_counter_ns() if prof is not None else 0
        self._read_into(file, off, dst, self.on_landed)
        if prof is not None:
            prof.record("read", t0, time.perf_counter_ns(), n)
            prof.count(calls=1)

    def _device_chunk(self, file: str, off: int, n: int, arena_dev: Any, dst_off: int, slots: Any, k: int) -> None:
        bufs, nps, events, stream, _ = slots
        prof = self.prof
        if events[k] is not None:
            t0 = time.perf_counter_ns() if prof is not None else 0
            events[k].synchronize()
            if prof is not None:
                prof.record("device", t0, time.perf_counter_ns(), 0)
        t0 = time.perf_counter_ns() if prof is not None else 0
        self._read_into(file, off, nps[k][:n])
        t1 = time.perf_counter_ns() if prof is not None else 0
        import torch

        with torch.cuda.stream(stream):
            arena_dev[dst_off : dst_off + n].copy_(bufs[k][:n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        events[k] = ev
        if self.on_landed is not None:  # the staging slot, read beside the device copy
            self.on_landed(file, off, nps[k][:n], stable=False)
        if prof is not None:
            prof.record("stage", t0, t1, n)
            prof.record("device", t1, time.perf_counter_ns(), n)
            prof.count(calls=1)

    # Cast targets: one conversion pass straight out of the mapping, per tensor.
    def _convert(self, infos: list[TensorInfo]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if isinstance(self.target, CudaTarget):
            ct = CudaTarget(self.target.device, self.cast)  # one set of pinned slots for all tensors
            for t in infos:
                if self.on_landed is not None:
                    self.on_landed(t.file, t.offset, self.maps[t.file].view(t.offset, t.length))
                dest = ct.empty(t.dtype, t.shape)
                ct.write(dest, 0, self.maps[t.file].view(t.offset, t.length))
                out[t.name] = ct.finish(dest)
            return out
        cast = CastTarget(self.framework, self.cast)  # type: ignore[arg-type]
        for t in infos:
            prof = self.prof
            t0 = time.perf_counter_ns() if prof is not None else 0
            if self.on_landed is not None:
                self.on_landed(t.file, t.offset, self.maps[t.file].view(t.offset, t.length))
            out[t.name] = cast.convert(self.maps[t.file].view(t.offset, t.length), t.dtype, t.shape)
            if prof is not None:
                prof.record("stage", t0, time.perf_counter_ns(), t.length)
                prof.count(calls=1)
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


_DEVICE_CHUNK = 16 * 1024 * 1024
# a verified load hashes what landed this much at a time, right after it lands, while it is in
# the CPU's cache (the last level's share of one core, on the machines measured)
LANDED_PIECE = 1024 * 1024
# how far the cold faulter's helpers may run ahead of the readers: the arena is allocated (and
# its size known) already, so this only bounds how soon faulted pages are used
COLD_FAULT_WINDOW = 256 * 1024 * 1024
_pinned_pool: dict[str, list[Any]] = {}
_pinned_lock = threading.Lock()


def _pinned_get(device: str) -> tuple[list[Any], list[np.ndarray], list[Any], Any, str]:
    """Two pinned slots and a stream on ``device`` for one worker, reused across loads.

    Pinning memory costs far more than using it, so slots outlive a load. The stream belongs to
    the target device (its copies and the events behind them must be on one device), so the
    pool is kept per device.
    """
    import torch

    with _pinned_lock:
        pool = _pinned_pool.setdefault(device, [])
        if pool:
            bufs, stream = pool.pop()
        else:
            bufs = [torch.empty(_DEVICE_CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            stream = torch.cuda.Stream(device=torch.device(device))
    return (bufs, [b.numpy() for b in bufs], [None, None], stream, device)


def _pinned_put(slots: tuple[list[Any], list[np.ndarray], list[Any], Any, str]) -> None:
    bufs, _, events, stream, device = slots
    for ev in events:
        if ev is not None:
            ev.synchronize()
    with _pinned_lock:
        _pinned_pool.setdefault(device, []).append((bufs, stream))


def _device_view(arena: Any, a: int, t: TensorInfo) -> Any:
    from weightlift.dtypes import torch_dtype

    raw = arena[a : a + t.length]
    if _quantized(t):
        return raw.reshape(t.extra.get("raw_shape", (t.length,)))
    if dtype_info(t.dtype).bits % 8:
        return raw
    return raw.view(torch_dtype(t.dtype)).reshape(t.shape)


def _mapped_error(e: BaseException, what: str) -> BaseException:
    if isinstance(e, WeightliftError):
        return e
    if isinstance(e, OSError):
        return FileError(f"{what} failed: {e.strerror or e}", errno=e.errno)
    return e
