"""The mapped path of :func:`weightlift.hf.from_pretrained`: parameters that view a private
copy-on-write mapping of each file, as transformers' own loader hands out, with the mapped bytes
made ready to read while the model is built (see the package's theory of operation)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from weightlift.api import run_load
from weightlift.checkpoint import Checkpoint
from weightlift.disk.source import MAX_WARMERS
from weightlift.local.prefetch import await_prefetches
from weightlift.memory.fresh import map_in
from weightlift.options import LoadOptions

__all__ = ["read_and_map", "private_mapping", "MAPPED_OPTIONS"]


#: ``from_pretrained`` options that the mapped path honours itself; any other (``verify``,
#: ``engine``, ``page_cache``, ``warm``, a progress bar...) sends the files through
#: :func:`weightlift.load` first.
MAPPED_OPTIONS = frozenset({"threads", "progress"})
_PLACED = frozenset({"device", "framework", "report"})  # from_pretrained's own, not the caller's


def read_and_map(ckpt: Checkpoint, opts: LoadOptions) -> dict[str, Any]:
    """Every tensor as a view of a private mapping of its file, with the mapped bytes made
    ready to read: in the page cache, mapped, touched once (:func:`weightlift.memory.fresh.map_in`),
    so that the first forward pass neither waits on storage nor faults page by page.
    ``opts.report`` gets the load's figures."""
    report: dict[str, Any] = opts.report if opts.report is not None else {}
    t0 = time.perf_counter()
    if set(opts.given()) - _PLACED - MAPPED_OPTIONS or opts.progress:
        # weightlift's reader, for its options
        run_load(ckpt, replace(opts, device="cpu", framework="numpy", copy=False, report=report))
    else:
        await_prefetches(ckpt.files)  # a prefetch still reading these files: its reads are ours
    sizes = {f: ckpt.mapped(f).size for f in ckpt.files}  # FormatError if a file changed since its header
    storages, out = private_mapping(ckpt, sizes)
    if opts.warm is not False:  # warm=False: views left lazy, as weightlift.load's are
        threads = opts.threads or min(os.cpu_count() or 1, MAX_WARMERS)
        map_in([(st.data_ptr(), st.nbytes(), f) for f, st in storages.items()], threads=threads)
    report.setdefault("tensors", len(ckpt.tensors))
    report.setdefault("bytes", sum(t.length for t in ckpt.tensors))
    report["seconds"] = time.perf_counter() - t0
    return out


def private_mapping(ckpt: Checkpoint, sizes: Mapping[str, int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every tensor of ``ckpt`` as a view of a private copy-on-write mapping of its file, and
    the mappings (torch storages) by file.

    This is the mapping transformers' own loader (through safetensors) hands out: lazy, shared
    with the page cache until a page is written. A tensor whose offset does not suit its element
    size (safetensors does not promise alignment) is copied out instead.
    """
    import torch

    from weightlift.dtypes import torch_dtype

    storages = {f: torch.UntypedStorage.from_file(f, shared=False, nbytes=n) for f, n in sizes.items() if n}
    out: dict[str, Any] = {}
    for t in ckpt.tensors:
        dt = torch_dtype(t.dtype)
        if not t.length:
            out[t.name] = torch.empty(t.shape, dtype=dt)
            continue
        raw = torch.empty(0, dtype=torch.uint8).set_(storages[t.file], t.offset, (t.length,))
        if t.offset % dt.itemsize:
            raw = raw.clone()
        out[t.name] = raw.view(dt).reshape(t.shape)
    return storages, out
