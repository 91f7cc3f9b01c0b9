"""Encoding a DELTA (the sender's side of :mod:`weightlift.remote.delta`): the estimate that
picks an encoding, and the one pass that hashes the new bytes, finds the changes, refreshes a
kept base and hands each chunk to the workers to compress."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import blake3
import numpy as np

from weightlift.remote.delta.chunks import (
    HEAD,
    PLANES,
    SPARSE,
    U32,
    UINT,
    XOR,
    DeltaError,
    available,
    block_size,
    chunk_size,
    elements,
    split_planes,
    whole_pass,
    workers,
    zstd,
)

__all__ = ["SPARSE_MAX", "DENSE_RATIO_MAX", "COMPRESS_AHEAD", "choose", "encode", "scan"]

SPARSE_MAX = 0.05  # changed fraction of the sampled elements up to which SPARSE is chosen
DENSE_RATIO_MAX = 0.75  # XOR is chosen where the sample compresses at least this well, else the tensor goes whole
SAMPLE_BLOCKS = 64  # the estimate looks at this many evenly spaced blocks ...
SAMPLE_BLOCK = 1024  # ... of this many bytes (64 KiB in all: a small part of a tensor worth a delta)
COMPRESS_AHEAD = 8  # chunks of one scan waiting for (or in) compression at once


def _sample(new: np.ndarray, base: np.ndarray, item: int) -> tuple[np.ndarray, np.ndarray]:
    n = new.nbytes
    block = max(item, SAMPLE_BLOCK - SAMPLE_BLOCK % item)
    if n <= SAMPLE_BLOCKS * block:
        return new, base
    step = (n - block) // (SAMPLE_BLOCKS - 1)
    step -= step % item
    starts = [i * step for i in range(SAMPLE_BLOCKS)]
    return (np.concatenate([new[s : s + block] for s in starts]), np.concatenate([base[s : s + block] for s in starts]))


def choose(new: np.ndarray, base: np.ndarray, item: int, *, planes: bool = False) -> int | None:
    """The encoding a sample of the tensor suggests (SPARSE, XOR or PLANES), or None: send it whole.

    ``new`` and ``base`` are the tensor's bytes as uint8 arrays of one length; ``item`` its
    element size in bytes (0 for sub-byte dtypes, which are always sent whole). ``planes``: the
    receiver applies PLANES, which then takes XOR's place for elements of two bytes or more
    (it compresses smaller and faster); the estimate is then made of the sample's planes."""
    if item < 1 or new.nbytes != base.nbytes or new.nbytes == 0 or not available():
        return None
    s_new, s_base = _sample(new, base, item)
    changed = elements(s_new, item) != elements(s_base, item)
    if changed.ndim > 1:
        changed = changed.any(axis=1)
    if changed.mean() <= SPARSE_MAX:
        return SPARSE
    x = np.bitwise_xor(s_new, s_base)
    dense = XOR
    if planes and item >= 2:
        dense, split = PLANES, np.empty((item, x.nbytes // item), np.uint8)
        split_planes(x, split, 0, item)
        x = split
    packed = zstd()[0].compress(x)
    return dense if len(packed) <= DENSE_RATIO_MAX * s_new.nbytes else None


def _changes(new: np.ndarray, base: np.ndarray, item: int, update: bool) -> tuple[np.ndarray, np.ndarray]:
    """The elements of ``new`` that differ from ``base`` in one block (in cache): their
    indices and their new values; with ``update``, ``base`` takes the new values.

    Where elements tile 64-bit words, the block is compared a word at a time and only the
    words that differ are looked at element by element: at a few percent of changes that is
    one pass over each input and no temporary of the block's size but a bool per word."""
    n = new.nbytes
    whole = n - n % 8 if 8 % item == 0 else 0
    where: list[np.ndarray] = []
    values: list[np.ndarray] = []
    if whole:
        a, b = new[:whole].view(np.uint64), base[:whole].view(np.uint64)
        words = np.flatnonzero(a != b)
        if len(words):
            aw = a[words]
            if item == 8:
                where.append(words)
                values.append(aw)
            else:
                shift = (8 // item).bit_length() - 1  # elements per word: 2, 4 or 8
                j = np.flatnonzero((aw ^ b[words]).view(UINT[item]))
                where.append((words[j >> shift] << shift) | (j & ((1 << shift) - 1)))
                values.append(aw.view(UINT[item])[j])
            if update:
                b[words] = aw
    if whole < n:
        ne, be = elements(new[whole:], item), elements(base[whole:], item)
        rest = ne != be
        if rest.ndim > 1:
            rest = rest.any(axis=1)
        pos = np.flatnonzero(rest)
        vals = ne[pos]
        if update:
            be[pos] = vals
        where.append(pos + whole // item)
        values.append(vals.reshape(-1).view(np.uint8) if vals.ndim > 1 else vals)
    if len(where) == 1:
        return where[0], values[0]
    if not where:
        return np.empty(0, np.int64), np.empty(0, np.uint8)
    return np.concatenate(where), np.concatenate([v.view(np.uint8) for v in values])


def _sparse_body(new: np.ndarray, base: np.ndarray, item: int, hasher: Any, update: bool) -> bytes | None:
    """A SPARSE chunk before compression (None: unchanged), block by block: each block hashed
    (``hasher``), compared and, with ``update``, its changed elements written into ``base``
    while it is in cache."""
    block = block_size(item)
    where, values = [], []
    for o in range(0, new.nbytes, block):
        nb, bb = new[o : o + block], base[o : o + block]
        if hasher is not None:
            hasher.update(nb)
        pos, vals = _changes(nb, bb, item, update)
        if len(pos):
            where.append(pos + o // item)
            values.append(vals)
    if not where:
        return None
    pos = np.concatenate(where)
    gaps = np.diff(pos, prepend=0).astype("<u4")  # small numbers: they compress far better than positions
    return b"".join([U32.pack(len(pos)), gaps.tobytes(), *(v.tobytes() for v in values)])


def _xor_body(new: np.ndarray, base: np.ndarray, item: int, hasher: Any, update: bool) -> np.ndarray | None:
    """An XOR chunk before compression (None: unchanged), hashed and refreshed as SPARSE's."""
    block = block_size(item)
    x = np.empty(new.nbytes, np.uint8)
    for o in range(0, new.nbytes, block):
        nb, bb = new[o : o + block], base[o : o + block]
        if hasher is not None:
            hasher.update(nb)
        np.bitwise_xor(nb, bb, out=x[o : o + block])
        if update:
            np.copyto(bb, nb)
    return x if x.any() else None


def _planes_body(new: np.ndarray, base: np.ndarray, item: int, hasher: Any, update: bool) -> np.ndarray | None:
    """A PLANES chunk before compression (None: unchanged): XOR's bytes with byte ``k`` of every
    element in plane ``k``, split a block at a time while the block's XOR is in cache."""
    block = block_size(item)
    planes = np.empty((item, new.nbytes // item), np.uint8)
    x = np.empty(min(block, new.nbytes), np.uint8)
    for o in range(0, new.nbytes, block):
        nb, bb = new[o : o + block], base[o : o + block]
        if hasher is not None:
            hasher.update(nb)
        xb = x[: nb.nbytes]
        np.bitwise_xor(nb, bb, out=xb)
        split_planes(xb, planes, o // item, item)
        if update:
            np.copyto(bb, nb)
    return planes if planes.any() else None


def _compress(body: Any) -> bytes:
    """A chunk's frame: its body compressed (any thread: each has its own compressor)."""
    return b"" if body is None else bytes(zstd()[0].compress(body))


_BODIES: dict[int, Callable[[np.ndarray, np.ndarray, int, Any, bool], Any]] = {
    SPARSE: _sparse_body,
    XOR: _xor_body,
    PLANES: _planes_body,
}


def _check(encoding: int, item: int) -> None:
    if encoding not in _BODIES or item < (2 if encoding == PLANES else 1):
        raise DeltaError(f"DELTA encoding {encoding} does not encode {item}-byte elements")


def _payload(frames: list[bytes], chunk: int) -> list[bytes]:
    head = HEAD.pack(chunk, len(frames)) + b"".join(U32.pack(len(f)) for f in frames)
    return [head, *(f for f in frames if f)]


def encode(
    encoding: int, new: np.ndarray, base: np.ndarray, item: int, *, limit: int | None = None
) -> list[bytes] | None:
    """The payload of ``new`` against ``base`` in ``encoding``, as parts to send in order; None
    where it would take more than ``limit`` bytes (default: :data:`DENSE_RATIO_MAX` of the
    tensor), so that the tensor goes whole instead. Its chunks are encoded on every core."""
    _check(encoding, item)
    n = new.nbytes
    limit = int(DENSE_RATIO_MAX * n) if limit is None else limit
    chunk = chunk_size(item)
    body = _BODIES[encoding]
    frames = list(
        workers().map(
            lambda s: _compress(body(new[s : s + chunk], base[s : s + chunk], item, None, False)), range(0, n, chunk)
        )
    )
    parts = _payload(frames, chunk)
    return parts if sum(len(p) for p in parts) <= limit else None


def scan(
    encoding: int | None,
    new: np.ndarray,
    base: np.ndarray,
    item: int,
    *,
    limit: int | None = None,
    update: bool = False,
) -> tuple[list[bytes] | None, bytes]:
    """One pass over ``new`` and ``base``: the payload (as :func:`encode`; None where
    ``encoding`` is None or the payload passes ``limit``) and the BLAKE3 digest of ``new``.

    ``update``: ``base`` becomes ``new`` on the way, its changed elements written while they are
    in cache (a kept base refreshed for the next update without a copy of the tensor). The pass
    runs on the calling thread (a tensor's digest is one sequential pass; callers scan several
    tensors on several threads); each chunk's compression goes to the codec's workers meanwhile."""
    if encoding is not None:
        _check(encoding, item)
    n = new.nbytes
    limit = int(DENSE_RATIO_MAX * n) if limit is None else limit
    chunk = chunk_size(max(item, 1))
    hasher = blake3.blake3(max_threads=1)
    frames: list[Future[bytes]] = []
    for s in range(0, n, chunk):
        nb, bb = new[s : s + chunk], base[s : s + chunk]
        if encoding is None:
            whole_pass(nb, bb, hasher, update)
            continue
        if len(frames) >= COMPRESS_AHEAD:
            frames[-COMPRESS_AHEAD].result()  # bounds the bodies held waiting for a worker
        frames.append(workers().submit(_compress, _BODIES[encoding](nb, bb, item, hasher, update)))
    digest = hasher.digest()
    if encoding is None:
        return None, digest
    parts = _payload([f.result() for f in frames], chunk)
    return (parts if sum(len(p) for p in parts) <= limit else None), digest
