"""The pieces both ends of a DELTA share: the chunking, the payload's head, the encodings'
numbers, one worker pool and each thread's zstandard objects, the limits a payload is checked
against (:mod:`weightlift.remote.delta` describes the payload and the passes).

The sizes here are read at call time by every pass (a test or a benchmark sets them on this
module): :data:`CHUNK_BYTES` how the encoder cuts a tensor, :data:`BLOCK_BYTES` how much of it a
pass works on while it is in a core's cache.
"""

from __future__ import annotations

import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from weightlift.env import cpus as cores
from weightlift.errors import WeightliftError

__all__ = [
    "CHUNK_BYTES",
    "BLOCK_BYTES",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "LEVEL",
    "WINDOW_MAX",
    "SAME",
    "SPARSE",
    "XOR",
    "PLANES",
    "HEAD",
    "U32",
    "DeltaError",
    "available",
    "cores",
    "workers",
    "zstd",
    "elements",
    "block_size",
    "split_planes",
    "join_planes",
    "chunk_size",
    "whole_pass",
    "payload_bound",
    "copy",
]


CHUNK_BYTES = 4 << 20  # tensor bytes per chunk: enough to compress well, small enough to spread over cores
BLOCK_BYTES = 256 << 10  # bytes compared, changed and hashed at once: they stay in a core's cache between passes
MAX_CHUNK_BYTES = 64 << 20  # the largest chunk a payload may state (what one worker decompresses at once)
# the smallest chunk a payload may state, unless it is the whole tensor: a chunk costs a table
# entry and a zstd call, so that tiny chunks would make a small payload cost the server much CPU
# and bookkeeping. The encoder's chunks are CHUNK_BYTES less a part of an element, never smaller.
MIN_CHUNK_BYTES = 64 << 10
LEVEL = 1  # zstd's fastest standard level: deltas are cut on the sender's critical path
# The largest window a frame may name where it is not decoded in one pass into its stated output
# (a frame cut short): zstd then decodes through a window buffer of that size, which it keeps
# in the thread's decompressor afterwards, charged nowhere. A whole frame is decoded in one pass
# and may name any window (ours name at most 512 KiB, level 1's).
WINDOW_MAX = 1 << 20

SAME, SPARSE, XOR, PLANES = 0, 1, 2, 3  # DeltaEncoding values (the protocol's enum; kept numeric here)
HEAD = struct.Struct("<II")
U32 = struct.Struct("<I")
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class DeltaError(WeightliftError):
    """A DELTA payload that does not decode against its base (malformed, or lengths that disagree)."""


def available() -> bool:
    """Whether this process can encode and apply deltas (the zstandard package is installed)."""
    try:
        import zstandard  # noqa: F401
    except ImportError:
        return False
    return True


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_local = threading.local()


def _forget_workers() -> None:
    """In a forked child: the parent's pool has none of its threads here (a job handed to it would
    wait forever), and its lock may have been held at the fork. The child makes its own."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


def workers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=cores(), thread_name_prefix="weightlift-delta")
        return _pool


def zstd() -> tuple[Any, Any]:
    """This thread's compressor and decompressor (zstandard's objects are not shared between threads)."""
    pair = getattr(_local, "zstd", None)
    if pair is None:
        import zstandard

        pair = _local.zstd = (
            zstandard.ZstdCompressor(level=LEVEL),
            zstandard.ZstdDecompressor(max_window_size=WINDOW_MAX),
        )
    return pair


def elements(buf: np.ndarray, item: int) -> np.ndarray:
    """``buf`` (uint8) as one row per element: an unsigned integer where one is that wide."""
    kind = UINT.get(item)
    return buf.view(kind) if kind is not None else buf.reshape(-1, item)


def split_planes(x: np.ndarray, planes: np.ndarray, at: int, item: int) -> None:
    """Byte ``k`` of each ``item``-byte element of ``x`` into row ``k`` of ``planes``, from column ``at``."""
    rows = x.reshape(-1, item)
    for k in range(item):  # a strided copy a plane: numpy's one 2-D transposed copy is slower, joining far slower
        np.copyto(planes[k, at : at + len(rows)], rows[:, k])


def join_planes(planes: np.ndarray, at: int, x: np.ndarray, item: int) -> None:
    """:func:`split_planes` undone: ``x``'s elements from ``planes``' columns from ``at``."""
    rows = x.reshape(-1, item)
    for k in range(item):
        np.copyto(rows[:, k], planes[k, at : at + len(rows)])


def payload_bound(nbytes: int) -> int:
    """The most bytes a payload for a tensor of ``nbytes`` may take: never more than sending it
    whole (a client would send it whole), and the head and table of the smallest chunks."""
    return nbytes + HEAD.size + U32.size * (nbytes // MIN_CHUNK_BYTES + 1)


def copy(dest: np.ndarray, src: np.ndarray) -> None:
    """``dest[:] = src`` for two uint8 arrays of one length, a chunk per core."""
    jobs = [
        workers().submit(np.copyto, dest[s : s + CHUNK_BYTES], src[s : s + CHUNK_BYTES])
        for s in range(0, src.nbytes, CHUNK_BYTES)
    ]
    wait(jobs)  # every chunk done before an error is raised: none writes into ``dest`` after
    for j in jobs:
        j.result()


def block_size(item: int) -> int:
    """The bytes a pass works on at once for ``item``-byte elements: a whole number of them."""
    return max(item, BLOCK_BYTES - BLOCK_BYTES % item)


def chunk_size(item: int) -> int:
    """The bytes the encoder puts in a chunk for ``item``-byte elements: a whole number of them."""
    return max(item, CHUNK_BYTES - CHUNK_BYTES % item)


def whole_pass(new: np.ndarray, base: np.ndarray, hasher: Any, update: bool) -> None:
    """No frame: only hash ``new`` and, with ``update``, copy it into ``base``, block by block."""
    for o in range(0, new.nbytes, BLOCK_BYTES):
        nb = new[o : o + BLOCK_BYTES]
        if hasher is not None:
            hasher.update(nb)
        if update:
            np.copyto(base[o : o + BLOCK_BYTES], nb)
