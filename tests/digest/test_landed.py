"""Hashing what landed: pieces in any order, on any thread, from reused buffers."""

from __future__ import annotations

import threading

import blake3
import numpy as np
import pytest

from weightlift.digest.landed import LandedHasher
from weightlift.errors import IntegrityError
from weightlift.formats import TensorInfo


def _two(data: np.ndarray) -> tuple[list[TensorInfo], dict[str, bytes]]:
    ts = [TensorInfo("a", "U8", (3000,), "f", 100, 3000), TensorInfo("b", "U8", (6900,), "f", 3100, 6900)]
    return ts, {t.name: blake3.blake3(data[t.offset : t.end].tobytes()).digest() for t in ts}


def test_landed_pieces_in_any_order_and_reused_buffers():
    data = np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8)
    ts = [TensorInfo("a", "U8", (3000,), "f", 100, 3000), TensorInfo("b", "U8", (6900,), "f", 3100, 6900)]
    expected = {t.name: blake3.blake3(data[t.offset : t.end].tobytes()).digest() for t in ts}
    h = LandedHasher(ts, expected)
    pieces = [(o, min(o + 700, 10_000)) for o in range(0, 10_000, 700)]
    for a, b in reversed(pieces):  # every piece early but the last: all parked, then drained
        buf = data[a:b].copy()
        h.landed("f", a, buf, stable=False)
        buf[:] = 0  # a staging slot reused at once
    h.check()


def test_landed_from_many_threads():
    data = np.random.default_rng(2).integers(0, 256, 10_000, dtype=np.uint8)
    ts, expected = _two(data)
    h = LandedHasher(ts, expected)
    pieces = [(o, min(o + 333, 10_000)) for o in range(0, 10_000, 333)]
    workers = [
        threading.Thread(target=lambda k=k: [h.landed("f", a, data[a:b]) for a, b in pieces[k::4]]) for k in range(4)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    h.check()


def test_differing_and_incomplete_tensors_are_named():
    data = np.random.default_rng(3).integers(0, 256, 10_000, dtype=np.uint8)
    ts, expected = _two(data)
    h = LandedHasher(ts, expected)
    changed = data.copy()
    changed[200] ^= 1
    h.landed("f", 0, changed[:3100])  # all of a, changed
    h.landed("f", 3100, data[3100:5000])  # part of b
    h.landed("g", 0, data)  # another file: none of these tensors
    with pytest.raises(IntegrityError, match=r"2 tensor\(s\).*: a, b$"):
        h.check()


def test_empty_tensors_and_missing_digests():
    empty = TensorInfo("e", "U8", (0,), "f", 50, 0)
    LandedHasher([empty], {"e": blake3.blake3(b"").digest()}).check()  # lands no bytes, matches
    with pytest.raises(IntegrityError, match="no digest to verify 1 tensor"):
        LandedHasher([empty], {})
