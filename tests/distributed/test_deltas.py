"""The delta of a reshard update (weightlift.distributed.deltas): kinds and sizes, payloads and a
pair's stream, taken in one byte at a time, and every malformed size or index refused."""

from __future__ import annotations

import numpy as np
import pytest

from weightlift.distributed import deltas
from weightlift.errors import IntegrityError

zstd = pytest.importorskip("zstandard", reason="compressed pieces need zstandard")


def _pieces(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """(old, new, item) of five pieces: unchanged, a few elements changed, all changed (random
    bytes: nothing to compress), bytes, and all changed a little (an optimizer's step)."""
    rng = np.random.default_rng(seed)
    out = []
    for item, n, changed in ((2, 64, 0), (4, 256, 3), (2, 32, 32), (1, 40, 1)):
        old = rng.integers(0, 256, n * item, dtype=np.uint8)
        new = old.copy()
        idx = rng.choice(n, changed, replace=False)
        new.view(f"<u{item}")[idx] ^= 1
        out.append((old, new, item))
    w = rng.standard_normal(8192).astype(np.float32)
    step = (w * (1 + 1e-3 * rng.standard_normal(w.size).astype(np.float32))).astype(np.float32)
    out.append((w.view(np.uint8), step.view(np.uint8), 4))
    return out


def test_each_piece_gets_the_smallest_encoding_tried():
    got = [deltas.measure(new, old, item, pack=True) for old, new, item in _pieces()]
    assert [k for k, _ in got] == [deltas.SAME, deltas.SPARSE, deltas.WHOLE, deltas.SPARSE, deltas.PLANES]
    assert got[1][1] == 4 + 3 * 8 and got[2][1] == 64
    assert got[4][1] < 0.8 * 8192 * 4  # dense small changes: signs and exponents compress away
    assert deltas.measure(*_pieces()[4][1::-1], 4, pack=False)[0] == deltas.WHOLE  # no zstd: whole
    deltas.check(deltas.SPARSE, 28, 1024, 4)
    for kind, bad in ((deltas.SAME, 5), (deltas.SPARSE, 27), (deltas.WHOLE, 1000), (deltas.PLANES, 2000), (9, 8)):
        with pytest.raises(IntegrityError, match="cannot encode"):
            deltas.check(kind, bad, 1024, 4)


def _stream(pieces):
    kinds = [deltas.measure(new, old, item, pack=True) for old, new, item in pieces]
    body = [deltas.encode(new, old, item, k, s) for (k, s), (old, new, item) in zip(kinds, pieces, strict=True) if s]
    table = [np.asarray([s for _, s in kinds], "<u4").view(np.uint8), np.asarray([k for k, _ in kinds], np.uint8)]
    return np.concatenate(table + body)


def test_a_stream_fed_a_byte_at_a_time_rebuilds_every_piece():
    pieces = _pieces()
    stream = _stream(pieces)
    st = deltas.Stream([(new.nbytes, item) for _, new, item in pieces], stream.nbytes, "test")
    got = [old.copy() for old, _, _ in pieces]
    for b in range(stream.nbytes):
        for k, kind, payload in st.feed(stream[b : b + 1]):
            if kind == deltas.WHOLE:
                got[k][:] = payload
            elif kind != deltas.SAME:
                deltas.apply(got[k], payload, pieces[k][2], kind)
    st.finish()
    assert [g.tobytes() for g in got] == [new.tobytes() for _, new, _ in pieces]


def test_malformed_streams_are_refused():
    old, new, item = _pieces()[1]
    kind, size = deltas.measure(new, old, item)
    payload = deltas.encode(new, old, item, kind, size)
    bad = payload.copy()
    bad[4:8] = np.frombuffer(np.uint32(new.nbytes // item).tobytes(), np.uint8)  # an index past the piece
    with pytest.raises(IntegrityError, match="outside"):
        deltas.apply(old.copy(), bad, item)
    with pytest.raises(IntegrityError, match="states"):
        deltas.apply(old.copy(), payload[:-1], item)
    with pytest.raises(IntegrityError, match="changed while"):
        deltas.encode(new, new, item, kind, size)  # the sender's bytes moved between measuring and sending
    old4, new4, _ = _pieces()[4]
    k4, s4 = deltas.measure(new4, old4, 4, pack=True)
    with pytest.raises(IntegrityError, match="changed while"):
        deltas.encode(old4, old4, 4, k4, s4)
    packed = deltas.encode(new4, old4, 4, k4, s4).copy()
    packed[-3] ^= 0xFF  # a compressed frame damaged on the way
    with pytest.raises(IntegrityError, match="does not apply"):
        deltas.apply(old4.copy(), packed, 4, deltas.PLANES)
    table = np.concatenate([np.asarray([size], "<u4").view(np.uint8), np.asarray([kind], np.uint8)])
    st = deltas.Stream([(new.nbytes, item)], 5 + size + 1, "a pair")  # a stated length the table does not fill
    with pytest.raises(IntegrityError, match="do not fill"):
        list(st.feed(table))
    st = deltas.Stream([(new.nbytes, item)], 5 + size, "a pair")
    list(st.feed(table))
    with pytest.raises(IntegrityError, match="ended after"):
        st.finish()
    with pytest.raises(IntegrityError, match="more than"):
        list(st.feed(np.zeros(size + 1, np.uint8)))
