"""The local loader: runs a plan from checkpoint files into host or device memory.

Theory of operation.

1. **Open and select.** Headers are parsed and validated (:mod:`weightlift.checkpoint`); the
   selection picks tensors; nothing else is read yet.
2. **Probe once.** For each file, :func:`~weightlift.disk.source.resident_fraction` says how much is
   already in the page cache (memoized per process). At 90 % or more the warmer is skipped.
3. **Plan.** Tensors become runs of back-to-back bytes going to the same kind of target, runs
   become one arena whose layout mirrors the file (so each run is one copy and each tensor a
   view), and the arena is cut into chunks for the worker threads.
4. **Move** (:mod:`.mover`). Worker threads take chunks in file order. Host targets in the checkpoint's dtype
   are read with ``preadv`` straight into the arena (no staging copy): warm, that matched a
   copy out of the file's mapping (bench/RESULTS.md, wl.numpy.pread), and a file truncated
   under the load then ends in a short read, a FileError naming the file, where a copy out of
   the mapping would kill the process with SIGBUS. ``engine="mmap"`` keeps the mapping copy
   (its page-table entries dropped behind it so the file does not count twice in RSS). A target
   a memcpy cannot fill (CUDA) gets the same reads into the staging it hands each worker (for
   CUDA two pinned slots), so the disk or page-cache read of one chunk overlaps the device copy
   of the previous one. A cast target converts straight out of the
   mapping in its own fill step. While the workers copy, warmers read ahead of them on cold files.
5. **Page cache.** Kept, unless it competes with the destination for RAM (a unified-memory
   device, or ``page_cache="evict"``): then each chunk is dropped from the cache once copied.

``copy=False`` skips 3-5 for host targets: tensors are read-only views of the mapping, the
cold bytes read in first (:mod:`.prefetch`, which also reads ahead of a load in the background).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from weightlift import env
from weightlift.checkpoint import Checkpoint, open_checkpoint
from weightlift.disk.source import RESIDENT_THRESHOLD, MappedFile, page_eviction_override, resident_fraction
from weightlift.formats import TensorInfo
from weightlift.local.mover import Landed, Mover
from weightlift.local.prefetch import Prefetch, await_prefetches, prefetch, read_in_views
from weightlift.memory.targets import Target, as_bytes, quantized, target_for, tensor_view
from weightlift.options import LoadOptions
from weightlift.profile import Profiler

__all__ = ["load_local", "prefetch", "Prefetch", "Landed", "DEFAULT_THREADS"]

DEFAULT_THREADS = max(1, min(8, os.cpu_count() or 1))
_OFF = Profiler(enabled=False)  # what a load records into with the profiler off: nothing


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
    (a verified load hashes them there, while they are in the cache). For a CUDA destination it
    is called once per tensor after the load, with the tensor's bytes read back from the device;
    for a dtype cast ``data`` is the source bytes the conversion read; for ``copy=False`` the views.
    """
    opts = opts if opts is not None else LoadOptions()
    t_start = time.perf_counter()
    ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    infos = ckpt.select(opts.select)
    prof = _profiler(opts.profile)
    nbytes = sum(t.length for t in infos)
    if ckpt.source is not None:  # objects in a store: its ranged-read engine, no mapping
        from weightlift.sources.load import load_objects

        out = load_objects(
            ckpt.source, infos, opts, prof=prof, progress=_progress(opts.progress, nbytes), on_landed=on_landed
        )
        return _dequantize_all(infos, out, opts.framework) if opts.dequantize else out
    prof.count(tensors=len(infos), nbytes=nbytes)  # tensor bytes, not the padding runs copy along
    files = list(dict.fromkeys(t.file for t in infos))
    maps = {f: ckpt.mapped(f) for f in files}  # one mapping per file for the whole load
    await_prefetches(files)
    resident = {f: resident_fraction(f) for f in files}
    if not opts.copy:
        out = _views(infos, maps, resident, opts, prof, on_landed)
    else:
        target = target_for(opts.placement)
        # device memory (no memcpy, no cast): what is proven is read back from the device after
        # the load, since the host staging the bytes passed through would prove a copy that then
        # landed wrong (a race on the device); it costs a read back, one tensor at a time
        on_device = on_landed if on_landed is not None and not target.memcpy_ok and opts.cast is None else None
        mover = Mover(
            infos,
            target,
            maps=maps,
            cast=opts.cast,
            threads=DEFAULT_THREADS if opts.threads is None else opts.threads,
            engine=opts.engine,
            evict=_evict_policy(opts.page_cache, target),
            cold={f: resident[f] < RESIDENT_THRESHOLD for f in files},
            warm=opts.warm,
            prof=prof,
            progress=_progress(opts.progress, nbytes),
            on_landed=on_landed if on_device is None else None,
        )
        out = mover.run()
        if on_device is not None:
            for t in infos:
                on_device(t.file, t.offset, as_bytes(out[t.name]))
        if opts.dequantize:
            out = _dequantize_all(infos, out, opts.framework)
    if opts.report is not None:
        seconds = time.perf_counter() - t_start
        opts.report.update(
            tensors=len(infos),
            bytes=nbytes,
            seconds=seconds,
            gbps=nbytes / seconds / 1e9 if seconds > 0 else 0.0,
            resident_before=(sum(resident[f] * maps[f].size for f in files) / max(1, sum(maps[f].size for f in files))),
            files=len(files),
            copy=opts.copy,
            device=opts.device,
            framework=opts.framework,
        )
        if prof.enabled:
            opts.report["profile"] = prof.report()
    return out


def _views(
    infos: list[TensorInfo],
    maps: dict[str, MappedFile],
    resident: dict[str, float],
    opts: LoadOptions,
    prof: Profiler,
    on_landed: Landed | None,
) -> dict[str, Any]:
    """``copy=False``: read-only views of the mappings, the cold files read in first (unless
    ``warm=False``), so the views are ready without further I/O."""
    files, warm = list(maps), opts.warm
    want = files if warm else [] if warm is False else [f for f in files if resident[f] < RESIDENT_THRESHOLD]
    if want:
        read_in_views(infos, maps, want, prof, _progress(opts.progress, sum(t.length for t in infos)))
    out = _borrow(infos, maps, opts.framework, opts.dequantize)
    if on_landed is not None:
        for t in infos:
            on_landed(t.file, t.offset, maps[t.file].view(t.offset, t.length))
    return out


# -- options -------------------------------------------------------------------------------


def _profiler(profile: object) -> Profiler:
    if profile is False or (profile is None and not env.load_profile()):
        return _OFF  # the one check a load pays with the profiler off
    if isinstance(profile, Profiler):
        return profile if profile.enabled else _OFF
    p = Profiler(enabled=True if profile is True else None)
    return p if p.enabled else _OFF


def _evict_policy(page_cache: str | None, target: Target) -> bool:
    if page_cache is not None:
        return page_cache == "evict"
    env = page_eviction_override()
    if env is not None:
        return env
    return target.unified_memory


def _progress(progress: bool | None, total: int) -> Callable[[int], None] | None:
    if progress is False or (progress is None and not sys.stderr.isatty()):
        return None
    from weightlift.progress import Progress

    return Progress(total).update


# -- views and conversions -----------------------------------------------------------------


def _dequantize_all(infos: list[TensorInfo], out: dict[str, Any], framework: str) -> dict[str, Any]:
    return {t.name: _dequantized(t, out[t.name], framework) if quantized(t) else out[t.name] for t in infos}


def _dequantized(t: TensorInfo, raw: Any, framework: str) -> Any:
    from weightlift.formats.gguf import dequantize

    arr = raw if isinstance(raw, np.ndarray) else raw.cpu().numpy()
    out = dequantize(arr, t.ggml_type, file=t.file, tensor=t.name)  # type: ignore[arg-type]
    if framework == "numpy":
        return out
    import torch

    res = torch.from_numpy(np.ascontiguousarray(out))
    return res if isinstance(raw, np.ndarray) or raw.device.type == "cpu" else res.to(raw.device)


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
        v = tensor_view(raw, t, framework)
        out[t.name] = _dequantized(t, v, framework) if dequantize and quantized(t) else v
    return out
