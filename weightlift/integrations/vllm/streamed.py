"""The files' tensors handed to vLLM's weight loaders while the rest are still made ready.

Every tensor is a view of a private copy-on-write mapping of its file (as safetensors hands
out, :func:`weightlift.hf.mapped.private_mapping`). One thread makes the mapped bytes ready to
read in file order, a few pieces at a time (read in where cold, mapped, touched once:
:func:`weightlift.memory.fresh.map_in`), and a tensor is handed out as soon as the pieces under
it are ready: the loaders copy the first layers while the last are still being read, so a load
takes about the longer of the two instead of their sum. Files already wholly in the page cache
are handed out at once: the loaders' copies map them faster than a second pass would.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from weightlift.checkpoint import Checkpoint
from weightlift.disk.residency import file_fraction
from weightlift.disk.source import MAX_WARMERS
from weightlift.hf.mapped import private_mapping
from weightlift.local.prefetch import await_prefetches
from weightlift.memory.fresh import MAP_IN_PIECE, map_in

__all__ = ["streamed_tensors"]


def streamed_tensors(ck: Checkpoint, *, threads: int | None = None) -> Iterator[tuple[str, Any]]:
    """``(name, torch.Tensor)`` for every tensor of ``ck`` in file order, each once its bytes are
    ready to read. The mappings stay alive as long as a tensor views them."""
    threads = threads or min(os.cpu_count() or 1, MAX_WARMERS)
    await_prefetches(ck.files)  # a prefetch still reading these files: its reads are ours
    sizes = {f: ck.mapped(f).size for f in ck.files}  # FormatError if a file changed since its header
    storages, out = private_mapping(ck, sizes)
    step = threads * MAP_IN_PIECE  # one map_in call keeps every thread busy
    order = sorted(ck.tensors, key=lambda t: (ck.files.index(t.file), t.offset))
    with ThreadPoolExecutor(1, thread_name_prefix="weightlift-map-in") as pool:
        ready: dict[str, list[Future[int]]] = {}
        for f, st in storages.items():
            if file_fraction(f) >= 1.0:
                ready[f] = []
                continue
            base, n = st.data_ptr(), st.nbytes()
            ready[f] = [
                pool.submit(map_in, [(base + o, min(step, n - o), f)], threads=threads) for o in range(0, n, step)
            ]
        try:
            for t in order:
                if t.length:
                    for fut in ready[t.file][: (t.offset + t.length - 1) // step + 1]:
                        fut.result()
                yield t.name, out[t.name]
        finally:
            for futs in ready.values():
                for fut in futs:
                    fut.cancel()
