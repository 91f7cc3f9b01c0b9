"""The files' tensors handed to vLLM's weight loaders while the rest are still made ready.

Every tensor is a view of a private copy-on-write mapping of its file (as safetensors hands
out, :func:`weightlift.hf.mapped.private_mapping`). One thread makes the mapped bytes ready to
read in file order, a few pieces at a time (read in where cold, mapped, touched once:
:func:`weightlift.memory.fresh.map_in`), and a tensor is handed out as soon as the pieces under
it are ready: the loaders copy the first layers while the last are still being read, so a load
takes about the longer of the two instead of their sum.

A file mostly in the page cache already (a warm start; a busy machine's cache loses pages here
and there) gets no pass of its own: the loaders' copies map resident pages faster than a second
pass would, and the pages missing are asked for with ``POSIX_FADV_WILLNEED`` (read ahead in the
background, nothing mapped). How much of a file is resident is judged from a few windows spread
over it (:func:`resident_fraction`): asking ``mincore`` about every page walks the page cache
page by page, a visible part of a warm load, where the choice needs only whether most pages are
there. In a file mostly cold, each piece is asked whole as the reads reach it (on the reading
thread), and only the cold pieces are mapped in.

With ``touch=False`` (tensor parallelism: each rank keeps a slice of most tensors) nothing is
read ahead: each rank's loaders fault in only the pages under the slices they copy.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from weightlift import env, libc
from weightlift.checkpoint import Checkpoint
from weightlift.disk.residency import PAGE, mapping_fraction
from weightlift.disk.source import MAX_WARMERS
from weightlift.hf.mapped import private_mapping
from weightlift.local.prefetch import await_prefetches
from weightlift.memory.fresh import MAP_IN_PIECE, map_in

__all__ = ["streamed_tensors", "file_order", "resident_fraction", "RESIDENT"]

#: a piece with at least this fraction of its pages in the page cache is left to the loaders
RESIDENT = 0.5
#: a file's residency is judged from this many windows of ``PROBE`` bytes, spread evenly over it
PROBES = 64
PROBE = 16 * PAGE


def file_order(ck: Checkpoint) -> list[str]:
    """The names of ``ck``'s tensors in the order :func:`streamed_tensors` hands them out."""
    return [t.name for t in sorted(ck.tensors, key=lambda t: (ck.files.index(t.file), t.offset))]


def resident_fraction(addr: int, n: int) -> float:
    """About the fraction of the ``n`` mapped bytes at ``addr`` that are in the page cache: every
    page asked where ``n`` is at most ``PROBES`` windows, else ``PROBES`` windows spread evenly
    (pages dropped here and there, or a file read in up to some point, show in proportion)."""
    if n <= PROBES * PROBE:
        return mapping_fraction(addr, n)
    stride = n // PROBES // PAGE * PAGE
    return sum(mapping_fraction(addr + i * stride, PROBE) for i in range(PROBES)) / PROBES


def _read_ahead(fd: int, offset: int, n: int) -> None:
    """Ask for the pages of a file's range that are not in the page cache, in the background."""
    libc.posix_fadvise(fd, offset, n, os.POSIX_FADV_WILLNEED)


def _make_ready(addr: int, n: int, file: str, offset: int, fd: int, threads: int) -> int:
    """Ready one piece of a mapping (``n`` bytes at ``addr``, ``offset`` in ``file``) for the
    loaders: mapped in where mostly cold, else read ahead where pages are missing; returns the
    bytes mapped in."""
    if mapping_fraction(addr, n) >= RESIDENT:
        _read_ahead(fd, offset, n)
        return 0
    return map_in([(addr, n, file)], threads=threads)


def streamed_tensors(ck: Checkpoint, *, threads: int | None = None, touch: bool = True) -> Iterator[tuple[str, Any]]:
    """``(name, torch.Tensor)`` for every tensor of ``ck`` in file order, each once its bytes are
    ready to read (at once with ``touch=False``). The mappings stay alive as long as a tensor
    views them."""
    threads = threads or min(env.cpus(), MAX_WARMERS)
    await_prefetches(ck.files)  # a prefetch still reading these files: its reads are ours
    sizes = {f: ck.mapped(f).size for f in ck.files}  # FormatError if a file changed since its header
    storages, out = private_mapping(ck, sizes)
    step = threads * MAP_IN_PIECE  # one map_in call keeps every thread busy
    by_name = {t.name: t for t in ck.tensors}
    with ThreadPoolExecutor(1, thread_name_prefix="weightlift-map-in") as pool:
        ready: dict[str, list[Future[int]]] = {f: [] for f in storages}
        for f, st in storages.items() if touch else ():
            base, n, fd = st.data_ptr(), st.nbytes(), ck.mapped(f).fileno()
            if resident_fraction(base, n) >= RESIDENT:
                # no pass of our own: another thread running beside the loaders' copy threads
                # slows them more than the few missing pages cost
                _read_ahead(fd, 0, n)
                continue
            ready[f] = [
                pool.submit(_make_ready, base + o, min(step, n - o), f, o, fd, threads) for o in range(0, n, step)
            ]
        try:
            for name in file_order(ck):
                t = by_name[name]
                if t.length:
                    for fut in ready[t.file][: (t.offset + t.length - 1) // step + 1]:
                        fut.result()
                yield name, out[name]
        finally:
            for futs in ready.values():
                for fut in futs:
                    fut.cancel()
