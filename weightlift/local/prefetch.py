"""Reading a checkpoint into the page cache ahead of its load.

:func:`prefetch` starts a background read of a checkpoint's cold files for the time a process
spends before its load (imports, mostly); a load of the same files waits for it
(:func:`await_prefetches`) instead of reading them again. :func:`read_in_views` is the
foreground read a ``copy=False`` load does before it hands out views of the mapping.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

from weightlift import env
from weightlift.checkpoint import Checkpoint, Select, open_checkpoint
from weightlift.disk.residency import mapping_fraction
from weightlift.disk.source import MAX_WARMERS, RESIDENT_THRESHOLD, MappedFile, resident_fraction
from weightlift.disk.source import prefetch as read_in
from weightlift.formats import TensorInfo
from weightlift.memory.fresh import map_in
from weightlift.plan import make_runs
from weightlift.profile import Profiler

__all__ = ["Prefetch", "prefetch", "await_prefetches", "read_in_views"]


class Prefetch:
    """Files of a checkpoint being read into the page cache on a thread of their own (see
    :func:`prefetch`). A load of the same files waits for it instead of reading them again."""

    def __init__(
        self,
        files: list[str],
        thread: threading.Thread | None,
        *,
        awaited: bool = True,
        after: list[Prefetch] | None = None,
    ):
        self.files = files
        self._thread = thread
        self.error: BaseException | None = None
        #: whether a load of the same files waits for it (not for one through mappings of its own)
        self.awaited = awaited
        self._after = after or []  # the prefetches reading the selected files it left to them
        self._own: dict[str, MappedFile] = {}  # keep=False: its own mappings, while it reads

    @property
    def done(self) -> bool:
        return (self._thread is None or not self._thread.is_alive()) and all(j.done for j in self._after)

    def wait(self) -> None:
        """Wait until the files are read in (also those left to another prefetch already reading
        them); a read error is raised here (and by the load)."""
        if self._thread is not None:
            self._thread.join()
        for j in self._after:
            j.wait()
        if self.error is not None:
            raise self.error


_prefetches: dict[str, Prefetch] = {}  # by file: the prefetch reading it now
_prefetch_lock = threading.Lock()


def prefetch(path: str | os.PathLike[str] | Checkpoint, *, select: Select = None, keep: bool = True) -> Prefetch:
    """Start reading the selected bytes of a checkpoint's cold files into the page cache, on a
    background thread, and return at once.

    For the time a process spends before its load: importing torch and transformers takes
    seconds, and a cold checkpoint's read can run under it (:func:`~weightlift.memory.fresh.map_in`
    on this process's mapping of each file: the readers wait on the disk in ``madvise``, without
    the GIL, and touch each page once, which on a VM is a fault of its own). Call it first
    thing, then import, then load: the load waits for whatever the prefetch has not finished and
    reads nothing twice. Files already resident are left alone. Headers are parsed now, so a
    missing or malformed checkpoint raises here.

    A store URL is opened (headers read, credentials and endpoint resolved) and nothing more:
    it has no page cache to fill, and reading ahead would hold the checkpoint in host memory,
    outside the load's budget.

    Files another prefetch of this process is reading are left to it. ``keep=False`` reads
    through mappings of the prefetch's own, unmapped when it ends, instead of the process's one
    mapping of each file: for a process that will not read the files itself (vLLM's front end,
    whose engine loads in another process) or a loader that maps them its own way. The page
    cache keeps the pages, touched once (on a VM the first touch of a page just read in is a
    fault of its own), and the process keeps no mapping of them. A load does not wait for such
    a prefetch (:func:`await_prefetches`): it reads what is still cold itself, the page cache
    sharing the reads between them; :meth:`Prefetch.wait` does."""
    ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    infos = ckpt.select(select)
    if ckpt.source is not None:
        return Prefetch([], None)
    with _prefetch_lock:  # a file another prefetch is reading now: its read is this one's
        selected = list(dict.fromkeys(t.file for t in infos))
        files = [f for f in selected if f not in _prefetches]
        after = list({id(j): j for f in selected if (j := _prefetches.get(f)) is not None}.values())
    maps = {f: ckpt.mapped(f, own=not keep) for f in files}
    cold = [f for f in files if _resident(f, maps[f], keep) < RESIDENT_THRESHOLD]
    if not cold:
        return Prefetch([], None, after=after)
    job = Prefetch(cold, None, awaited=keep, after=after)
    job._own = {} if keep else maps

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
            for f in cold if keep else ():
                resident_fraction(f, refresh=True)  # what the load will see
            with _prefetch_lock:
                job._own = {}
                for f in cold:
                    if _prefetches.get(f) is job:
                        del _prefetches[f]

    job._thread = threading.Thread(target=run, args=(maps,), name="wl-prefetch", daemon=True)
    with _prefetch_lock:
        for f in cold:
            _prefetches[f] = job
    job._thread.start()
    return job


def _forget_in_child() -> None:
    """In a child forked while prefetches ran: their threads are gone there, so are their
    reads. Their files are no longer taken as being read, the lock (which one of them may have
    held at the fork) is made anew, and their own mappings (keep=False) are let go, which the
    threads' frames would otherwise hold for the child's life (vLLM forks its engine core from
    the process reading ahead)."""
    global _prefetch_lock
    jobs = list({id(j): j for j in _prefetches.values()}.values())
    _prefetches.clear()
    _prefetch_lock = threading.Lock()
    for j in jobs:
        own, j._own = j._own, {}
        for m in own.values():
            with contextlib.suppress(BufferError):  # nothing here borrows from them; if so, it stays
                m.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _resident(file: str, m: MappedFile, keep: bool) -> float:
    """The fraction of ``file`` (mapped at ``m``) in the page cache, through the process's memo
    where ``m`` is the process's mapping."""
    if keep:
        return resident_fraction(file, refresh=True)
    return 1.0 if m.size == 0 else mapping_fraction(m.address(), m.size)


def _prefetch_threads() -> int:
    """One core fewer than the process may run on, at most MAX_WARMERS: a prefetch runs beside the
    imports it hides under, which take a core of their own."""
    return max(1, min(env.cpus() - 1, MAX_WARMERS))


def await_prefetches(files: list[str]) -> None:
    """Wait for prefetches still reading any of ``files`` (their reads are this load's)."""
    with _prefetch_lock:
        jobs = {id(j): j for f in files if (j := _prefetches.get(f)) is not None and j.awaited}
    for j in jobs.values():
        j.wait()


def read_in_views(
    infos: list[TensorInfo],
    maps: dict[str, MappedFile],
    files: list[str],
    prof: Profiler,
    progress: Callable[[int], None] | None,
) -> None:
    """Bring the selected bytes of cold files into the page cache before views of them are
    handed out (``copy=False``), with as many readers as the storage is known to like."""
    from weightlift.disk.storage import readers_for

    def on_chunk(off: int, n: int, t0: int, t1: int) -> None:
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
            on_chunk=on_chunk if prof.enabled or progress is not None else None,
        )
