"""A tensor sketch that composes over shards: ``S = sum_i x_i * r**i mod 2**64``.

Theory of operation. A tensor is read as a row-major sequence of *words*: its elements' bits
as little-endian unsigned integers, one word per element of 1 or 2 bytes, and each element of
4 or 8 bytes cut into 2-byte words (as if the tensor had one more, innermost dimension of 2 or
4 words). ``x_i`` is the i-th word, ``i`` its index in the *unsharded* tensor, and ``r`` an odd
64-bit multiplier derived from a seed and the tensor's name (:func:`sketch_base`). A rank that
holds any box of the tensor computes the part of ``S`` over that box from the box's words and
their global indices alone (:func:`sketch_part`), and parts of disjoint boxes add: whatever two
layouts cut a tensor, the senders' parts, the receivers' parts and the sketch of the whole
tensor agree. So a sharded copy is checked against the unsharded checkpoint (a published
manifest's ``sketch64``) without gathering anything but one 8-byte number per tensor and rank.

What it proves, and what it does not (docs/design.md has the comparison with LtHash and
chunked BLAKE3). ``r`` odd makes every ``r**i`` a unit mod 2**64, so any change confined to
one word changes ``S`` for every ``r``. Words of at most 16 bits keep every word difference
under 2**16: a change of many words is missed only when the difference polynomial
``sum_i d_i r**i`` vanishes mod 2**64, which, the ring not being a field, has no Schwartz-Zippel
bound; the known structure that vanishes for many ``r`` (``r**(2**m) - 1`` is divisible by
``2**(m+2)``) needs words ``2**m`` apart with ``m + 17 >= 64`` to vanish for all ``r``, and
misses a fraction ``2**(m + a + 2 - 64)`` of seeds for differences divisible by ``2**a``
(``a <= 15``, ``m`` at most log2 of the tensor's words). It is a check against faults (a
skipped tensor, a wrong slice, a flipped bit, a stale version), never against an adversary who
knows ``r``; BLAKE3 stays the proof of publication.

Cost: one integer matrix-vector product per block of rows (numpy's uint64 matmul wraps mod
2**64), about 3 GB/s of 2-byte words on one idle core; no I/O here.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from weightlift.errors import OptionError

__all__ = ["Box", "SKETCH_FIELD", "sketch_base", "sketch_part", "sketch", "sketch_bytes"]

#: A box of an unsharded tensor: ``[start, stop)`` per dimension.
Box = tuple[tuple[int, int], ...]
#: The name of the sketch in a published manifest's entries (a new algorithm gets a new name).
SKETCH_FIELD = "sketch64"
_MASK = (1 << 64) - 1
_WORD: dict[int, np.dtype[Any]] = {1: np.dtype("<u1"), 2: np.dtype("<u2")}


def sketch_base(name: str, seed: bytes = b"") -> int:
    """The odd 64-bit multiplier ``r`` of tensor ``name`` under ``seed``."""
    h = hashlib.blake2b(seed + b"\0" + name.encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") | 1


def _powers(base: int, start: int, step: int, n: int) -> np.ndarray:
    """``base**(start + j*step) mod 2**64`` for j < n, as uint64."""
    first = pow(base, start, 1 << 64)
    stepv = pow(base, step, 1 << 64)
    out = np.empty(n, dtype=np.uint64)
    if n == 0:
        return out
    out[0] = first
    # doubling: out[m:2m] = out[:m] * step**m, wrap-around native in uint64
    m, mul = 1, stepv
    with np.errstate(over="ignore"):
        while m < n:
            k = min(m, n - m)
            np.multiply(out[:k], np.uint64(mul), out=out[m : m + k])
            mul = mul * mul & _MASK
            m += k
    return out


def _words(a: np.ndarray, shape: Sequence[int], box: Box) -> tuple[np.ndarray, tuple[int, ...], Box]:
    """``a`` as words (see the module docstring), with the shape and box of the word tensor."""
    size = a.itemsize
    if size in _WORD:
        return a.view(_WORD[size]), tuple(shape), box
    if size not in (4, 8):
        raise OptionError(f"sketch: elements of {size} bytes are not supported (1, 2, 4 or 8)")
    w = size // 2
    words = np.ascontiguousarray(a).reshape(-1).view(np.uint8).view("<u2").reshape(a.shape + (w,))
    return words, (*shape, w), (*box, (0, w))


def sketch_part(array: Any, shape: Sequence[int], box: Box, r: int, *, rows_per_block: int = 0) -> int:
    """The sketch part of ``array`` (the elements of ``box`` of a tensor of ``shape``, any dtype
    of 1, 2, 4 or 8 bytes) under multiplier ``r``: add parts of disjoint boxes to compose."""
    a = np.ascontiguousarray(array)
    ext = tuple(hi - lo for lo, hi in box)
    if len(box) != len(shape) or a.size != math.prod(ext):
        raise OptionError(f"sketch: {a.shape} elements do not fill the box {list(box)} of a tensor of {list(shape)}")
    x, shape, box = _words(a.reshape(ext), shape, box)
    ext = tuple(hi - lo for lo, hi in box)
    nd = len(shape)
    if nd == 0:
        return int(x.reshape(-1)[0]) & _MASK if x.size else 0
    strides = [1] * nd
    for k in range(nd - 2, -1, -1):
        strides[k] = strides[k + 1] * shape[k + 1]
    if x.size == 0:
        return 0
    # weight of word g: prod_k r**(g_k * stride_k); contract the last dim, then the others
    inner = _powers(r, box[-1][0] * strides[-1], strides[-1], ext[-1])
    flat = x.reshape(-1, ext[-1])
    nrows = flat.shape[0]
    roww = np.ones(1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(nd - 1):
            pk = _powers(r, box[k][0] * strides[k], strides[k], ext[k])
            roww = np.multiply.outer(roww, pk).reshape(-1)
    # blocks of 2**16 words (512 KiB as uint64) stay in L2: 1.3x the rate of 2**20-word blocks
    step = rows_per_block or max(1, (1 << 16) // max(1, ext[-1]))
    total = np.uint64(0)
    buf = np.empty((min(step, nrows), ext[-1]), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(0, nrows, step):
            blk = flat[i : i + step]
            b = buf[: blk.shape[0]]
            b[...] = blk
            rs = b @ inner  # integer matmul wraps mod 2**64; twice the rate of multiply then sum
            rs *= roww[i : i + step]
            total = total + rs.sum(dtype=np.uint64)
    return int(total)


def sketch(array: Any, name: str, seed: bytes = b"") -> int:
    """The sketch of a whole (unsharded) tensor."""
    a = np.asarray(array)
    return sketch_part(a, a.shape, tuple((0, n) for n in a.shape), sketch_base(name, seed))


def sketch_bytes(raw: Any, itemsize: int, shape: Sequence[int], name: str, seed: bytes = b"") -> int:
    """The sketch of a whole tensor given as its raw bytes (``itemsize`` bytes an element)."""
    if itemsize not in (1, 2, 4, 8):
        raise OptionError(f"sketch of {name!r}: elements of {itemsize} bytes are not supported (1, 2, 4 or 8)")
    flat = raw.reshape(-1).view(np.uint8) if isinstance(raw, np.ndarray) else np.frombuffer(raw, dtype=np.uint8)
    return sketch(flat.view(f"<u{itemsize}").reshape(tuple(shape)), name, seed)
