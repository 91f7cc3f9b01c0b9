"""The delta of a reshard update (weightlift.distributed.deltas): sizes, payloads and a pair's
stream, taken in one byte at a time, and every malformed size or index refused."""

from __future__ import annotations

import numpy as np
import pytest

from weightlift.distributed import deltas
from weightlift.errors import IntegrityError


def _pieces(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """(old, new, item) of four pieces: unchanged, a few elements changed, all changed, bytes."""
    rng = np.random.default_rng(seed)
    out = []
    for item, n, changed in ((2, 64, 0), (4, 256, 3), (2, 32, 32), (1, 40, 1)):
        old = rng.integers(0, 256, n * item, dtype=np.uint8)
        new = old.copy()
        idx = rng.choice(n, changed, replace=False)
        new.view(f"<u{item}")[idx] ^= 1
        out.append((old, new, item))
    return out


def test_sizes_pick_the_smallest_encoding():
    assert deltas.size_of(128, 0, 2) == 0
    assert deltas.size_of(1024, 3, 4) == 4 + 3 * 8
    assert deltas.size_of(64, 32, 2) == 64  # 32 changes of 2 bytes: the piece whole is smaller
    assert [deltas.kind_of(s, 1024, 4) for s in (0, 28, 1024)] == [deltas.SAME, deltas.SPARSE, deltas.WHOLE]
    for bad in (5, 27, 2000):
        with pytest.raises(IntegrityError, match="cannot encode"):
            deltas.kind_of(bad, 1024, 4)


def test_a_stream_fed_a_byte_at_a_time_rebuilds_every_piece():
    pieces = _pieces()
    sizes = [deltas.size_of(new.nbytes, len(deltas.changed(new, old, item)), item) for old, new, item in pieces]
    assert [deltas.kind_of(s, new.nbytes, item) for s, (_, new, item) in zip(sizes, pieces, strict=True)] == [
        deltas.SAME, deltas.SPARSE, deltas.WHOLE, deltas.SPARSE
    ]  # fmt: skip
    stream = np.concatenate(
        [np.asarray(sizes, "<u4").view(np.uint8)]
        + [deltas.encode(new, old, item, s) for s, (old, new, item) in zip(sizes, pieces, strict=True) if s]
    )
    st = deltas.Stream([(new.nbytes, item) for _, new, item in pieces], stream.nbytes, "test")
    got = [old.copy() for old, _, _ in pieces]
    for b in range(stream.nbytes):
        for k, kind, payload in st.feed(stream[b : b + 1]):
            if kind == deltas.SPARSE:
                deltas.apply(got[k], payload, pieces[k][2])
            elif kind == deltas.WHOLE:
                got[k][:] = payload
    st.finish()
    assert [g.tobytes() for g in got] == [new.tobytes() for _, new, _ in pieces]


def test_malformed_streams_are_refused():
    old, new, item = _pieces()[1]
    size = deltas.size_of(new.nbytes, len(deltas.changed(new, old, item)), item)
    payload = deltas.encode(new, old, item, size)
    bad = payload.copy()
    bad[4:8] = np.frombuffer(np.uint32(new.nbytes // item).tobytes(), np.uint8)  # an index past the piece
    with pytest.raises(IntegrityError, match="outside"):
        deltas.apply(old.copy(), bad, item)
    with pytest.raises(IntegrityError, match="states"):
        deltas.apply(old.copy(), payload[:-1], item)
    with pytest.raises(IntegrityError, match="changed while"):
        deltas.encode(new, new, item, size)  # the sender's bytes moved between measuring and sending
    table = np.asarray([size], "<u4").view(np.uint8)
    st = deltas.Stream([(new.nbytes, item)], 4 + size + 1, "a pair")  # a stated length the table does not fill
    with pytest.raises(IntegrityError, match="do not fill"):
        list(st.feed(table))
    st = deltas.Stream([(new.nbytes, item)], 4 + size, "a pair")
    list(st.feed(table))
    with pytest.raises(IntegrityError, match="ended after"):
        st.finish()
    with pytest.raises(IntegrityError, match="more than"):
        list(st.feed(np.zeros(size + 1, np.uint8)))
