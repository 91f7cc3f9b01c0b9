"""A load plan: which bytes move, in what order, in how many copies.

Tensors are taken in file order. Tensors that lie back to back in a file (allowing the few
bytes of alignment padding GGUF puts between them) and go to the same kind of target form one
*run*, moved as one copy: the experts of an MoE layer or a stack of layers then cost one call
instead of hundreds. Runs are then cut into chunks for the worker threads; a chunk never
spans two runs, so every chunk is one contiguous source range and one contiguous destination.

A host arena mirrors the file: each tensor as aligned in memory as in the file. A device arena
asks more (``align``, :data:`weightlift.memory.targets.DEVICE_ALIGN`): safetensors packs its
tensors at 8 bytes, so half of all files would put every device tensor at 8 mod 16, where the
fast GEMM kernels want 16. There every tensor starts on ``align``: a run keeps only tensors at a
multiple of ``align`` from its first, and every run starts on ``align``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from weightlift.dtypes import DTYPES
from weightlift.formats import TensorInfo

__all__ = ["Run", "Chunk", "make_runs", "make_chunks", "layout", "MAX_GAP", "CHUNK"]

MAX_GAP = 256  # padding we copy rather than break a run for (GGUF aligns tensors to 32 bytes)
CHUNK = 32 * 1024 * 1024
ALIGN = 64

_ITEMSIZE = {d.name: max(1, d.bits // 8) for d in DTYPES}


@dataclass(frozen=True, slots=True)
class Run:
    """Tensors lying back to back in one file: the bytes [offset, offset + length)."""

    file: str
    offset: int
    length: int
    tensors: tuple[TensorInfo, ...]
    kind: Hashable = None

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class Chunk:
    """One unit of work: ``length`` bytes of ``run`` starting ``start`` bytes into it."""

    run: int
    start: int
    length: int


def make_runs(
    tensors: Iterable[TensorInfo],
    *,
    kind: Callable[[TensorInfo], Hashable] = lambda t: None,
    coalesce: bool = True,
    max_gap: int = MAX_GAP,
    align: int = 0,
) -> list[Run]:
    """Group tensors into runs; ``kind`` names the target kind (runs never mix kinds). ``align``
    (a device arena's): a tensor joins a run only at a multiple of ``align`` from its start."""
    order = sorted(tensors, key=lambda t: (t.file, t.offset))
    runs: list[Run] = []
    cur: list[TensorInfo] = []
    cur_kind: Hashable = None

    def flush() -> None:
        if cur:
            start = cur[0].offset
            end = max(t.end for t in cur)
            runs.append(Run(cur[0].file, start, end - start, tuple(cur), cur_kind))
            cur.clear()

    for t in order:
        k = kind(t)
        if (
            coalesce
            and cur
            and k == cur_kind
            and t.file == cur[-1].file
            and 0 <= t.offset - cur[-1].end <= max_gap
            and _aligned(t)
            and _aligned(cur[0])
            and (not align or (t.offset - cur[0].offset) % align == 0)
        ):
            cur.append(t)
            continue
        flush()
        cur.append(t)
        cur_kind = k
    flush()
    return runs


def _aligned(t: TensorInfo) -> bool:
    # a run keeps its tensors at their file offsets modulo ALIGN; that is only a valid element
    # alignment for tensors that sit at a multiple of their item size in the file
    return t.offset % _ITEMSIZE.get(t.dtype, 1) == 0


def layout(runs: list[Run], *, align: int = 0) -> tuple[list[int], int]:
    """Destination offsets for each run in one arena, and the arena's size.

    A run starts at the same offset modulo ALIGN as in the file, so every tensor inside it is as
    aligned in memory as it was in the file; a lone misaligned tensor starts on ALIGN. With
    ``align`` (runs made with the same ``align``), every run starts on ``align`` instead, and so
    does every tensor.
    """
    pos, out = 0, []
    for r in runs:
        mis = len(r.tensors) == 1 and not _aligned(r.tensors[0])
        base = -(-pos // max(ALIGN, align)) * max(ALIGN, align)
        start = base if mis or align else base + r.offset % ALIGN
        out.append(start)
        pos = start + r.length
    return out, pos


def make_chunks(runs: list[Run], *, chunk: int = CHUNK) -> list[Chunk]:
    """Cut runs into chunks of at most ``chunk`` bytes, in file order."""
    out = []
    for i, r in enumerate(runs):
        for s in range(0, r.length, chunk):
            out.append(Chunk(i, s, min(chunk, r.length - s)))
    return out
