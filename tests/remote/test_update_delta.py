"""The DELTA codec (weightlift.remote.delta) and the set digest, with no sockets: every encoding
back byte for byte, in place and undone, the estimate's choices, and malformed payloads refused."""

from __future__ import annotations

import os
import struct
import threading

import blake3
import ml_dtypes
import numpy as np
import pytest

from weightlift.digest.setdigest import leaf_digest, set_digest
from weightlift.remote import delta as D

ITEMS = {"U8": 1, "BF16": 2, "F32": 4, "F64": 8, "C64": 8}


def _pair(item: int, n: int, frac: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(base, new) as uint8 arrays of ``n`` elements of ``item`` bytes, ``frac`` of them changed."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, n * item, dtype=np.uint8)
    new = base.copy()
    k = int(n * frac)
    if k:
        idx = rng.choice(n, k, replace=False)
        rows = new.reshape(n, item)
        rows[idx, 0] ^= rng.integers(1, 256, k, dtype=np.uint8)  # each chosen element really changes
    return base, new


def _roundtrip(encoding: int, base: np.ndarray, new: np.ndarray, item: int) -> int:
    parts = D.encode(encoding, new, base, item, limit=1 << 40)
    assert parts is not None
    payload = memoryview(b"".join(parts))
    out = np.full_like(base, 0xA5)
    D.apply(encoding, payload, base, out, item)
    assert out.tobytes() == new.tobytes()
    inplace, undo = base.copy(), D.Undo()
    D.apply(encoding, payload, inplace, inplace, item, undo=undo)
    assert inplace.tobytes() == new.tobytes()
    undo.run()
    assert inplace.tobytes() == base.tobytes()  # an in-place application taken back exactly
    return len(payload)


@pytest.mark.parametrize("encoding", [D.SPARSE, D.XOR])
@pytest.mark.parametrize("item", sorted(set(ITEMS.values())))
@pytest.mark.parametrize("frac", [0.0, 0.001, 0.3, 1.0])
def test_every_encoding_gives_the_new_bytes_back(encoding, item, frac):
    base, new = _pair(item, 300_001, frac)  # an odd count: the last chunk is short
    size = _roundtrip(encoding, base, new, item)
    if frac == 0.0:
        chunks = -(-base.nbytes // max(item, D.chunks.CHUNK_BYTES - D.chunks.CHUNK_BYTES % item))
        assert size == 8 + 4 * chunks  # nothing changed: the head and an empty table


def test_chunks_across_many_cores_and_an_unaligned_tail(monkeypatch):
    monkeypatch.setattr(D.chunks, "CHUNK_BYTES", D.MIN_CHUNK_BYTES)  # the smallest chunks a payload may have
    base, new = _pair(2, 300_007, 0.02, seed=3)
    _roundtrip(D.SPARSE, base, new, 2)
    _roundtrip(D.XOR, base, new, 2)


def test_nan_payloads_survive_bit_for_bit():
    # bfloat16 NaNs with different payloads compare unequal to everything, themselves included:
    # the codec compares bits, never values
    n = 50_000
    base = np.zeros(n, np.uint16)
    base[::7] = 0x7FC1
    new = base.copy()
    new[::7] = 0x7FC2  # another NaN payload
    new[1::11] = 0xFF81  # a negative NaN where a zero was
    assert np.isnan(new.view(ml_dtypes.bfloat16).astype(np.float32)[::7]).all()
    b8, n8 = base.view(np.uint8), new.view(np.uint8)
    for encoding in (D.SPARSE, D.XOR):
        _roundtrip(encoding, b8, n8, 2)


def test_choose_by_the_sampled_changes():
    base, sparse = _pair(2, 1 << 20, 0.01)
    assert D.choose(sparse, base, 2) == D.SPARSE
    # an Adam-like step on every value: only low mantissa bits move, so XOR compresses well
    w = (np.random.default_rng(1).standard_normal(1 << 20, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    stepped = (w.astype(np.float32) * (1 + 2**-6)).astype(ml_dtypes.bfloat16)
    assert D.choose(stepped.view(np.uint8), w.view(np.uint8), 2) == D.XOR
    noise = np.random.default_rng(2).integers(0, 256, base.nbytes, dtype=np.uint8)
    assert D.choose(noise, base, 2) is None  # new bytes with nothing in common: sent whole
    assert D.choose(sparse, base, 0) is None  # sub-byte dtypes always travel whole


def test_encode_gives_up_past_its_limit():
    base = np.zeros(1 << 16, np.uint8)
    noise = np.random.default_rng(0).integers(0, 256, base.nbytes, dtype=np.uint8)
    assert D.encode(D.XOR, noise, base, 1) is None
    assert D.encode(D.XOR, noise, base, 1, limit=1 << 30) is not None


def _good(item: int = 2) -> tuple[np.ndarray, np.ndarray, bytes]:
    base, new = _pair(item, 10_000, 0.05)
    return base, new, b"".join(D.encode(D.SPARSE, new, base, item, limit=1 << 30))


def _sparse_payload(nbytes: int, chunk_blob: bytes) -> bytes:
    import zstandard

    frame = zstandard.ZstdCompressor().compress(chunk_blob)
    return struct.pack("<II", nbytes, 1) + struct.pack("<I", len(frame)) + frame


@pytest.mark.parametrize(
    "mangle,match",
    [
        (lambda p: p[:5], "no head"),
        (lambda p: struct.pack("<II", 3, 1) + p[8:], "whole number"),
        (lambda p: struct.pack("<II", 1 << 30, 1) + p[8:], "whole number"),
        (lambda p: p[:4] + struct.pack("<I", 7) + p[8:], "chunks"),
        (lambda p: p[:-1], "chunks take"),
        (lambda p: p + b"x", "chunks take"),
        (lambda p: p[:12] + bytes(len(p) - 12), "decompress"),
    ],
)
def test_malformed_payloads_are_refused(mangle, match):
    base, _, payload = _good()
    out = np.empty_like(base)
    with pytest.raises(D.DeltaError, match=match):
        D.apply(D.SPARSE, memoryview(mangle(payload)), base, out, 2)


def test_sparse_positions_are_checked():
    base = np.zeros(64, np.uint8)  # 32 two-byte elements in one chunk
    out = np.empty_like(base)
    past = struct.pack("<II", 1, 40) + b"\x01\x00"
    repeated = struct.pack("<III", 2, 3, 0) + b"\x01\x00\x02\x00"
    short = struct.pack("<II", 5, 1)
    for blob, match in ((past, "past"), (repeated, "increasing"), (short, "does not hold")):
        with pytest.raises(D.DeltaError, match=match):
            D.apply(D.SPARSE, memoryview(_sparse_payload(64, blob)), base, out, 2)
    with pytest.raises(D.DeltaError, match="encoding"):
        D.apply(7, memoryview(_sparse_payload(64, past)), base, out, 2)
    with pytest.raises(D.DeltaError, match="no payload"):
        D.apply(D.SAME, memoryview(b"x"), base, out, 2)


def test_an_xor_chunk_must_be_the_chunks_length():
    import zstandard

    base = np.zeros(64, np.uint8)
    frame = zstandard.ZstdCompressor().compress(bytes(63))
    payload = struct.pack("<III", 64, 1, len(frame)) + frame
    with pytest.raises(D.DeltaError, match="not the chunk"):
        D.apply(D.XOR, memoryview(payload), base, np.empty_like(base), 1)


# -- the set digest ------------------------------------------------------------------------------


def _h(*parts: bytes) -> bytes:
    return blake3.blake3(b"".join(parts)).digest()


def test_set_digest_is_the_documented_merkle_tree():
    d = {n: _h(n.encode()) for n in ("b", "a", "c")}
    leaves = [_h(b"\x00", struct.pack("<H", 1), n.encode(), d[n]) for n in ("a", "b", "c")]
    assert leaves[0] == leaf_digest("a", d["a"])
    root = _h(b"\x01", _h(b"\x01", leaves[0], leaves[1]), leaves[2])  # c moves up unpaired
    assert set_digest(d) == root
    assert set_digest(list(d.items())[::-1]) == root  # the order given does not matter
    assert set_digest({}) == _h(b"\x02")
    assert set_digest({"a": d["a"]}) == leaves[0]


def test_set_digest_binds_each_digest_to_its_name():
    d1, d2 = _h(b"1"), _h(b"2")
    assert set_digest({"x": d1, "y": d2}) != set_digest({"x": d2, "y": d1})
    assert set_digest({"x": d1}) != set_digest({"x": d1, "y": d2})
    # names order by their UTF-8 bytes, not by Python's code points on surrogates or case rules
    names = ["\u00e9", "z", "Z", "\U0001f600"]
    assert set_digest({n: d1 for n in names}) == set_digest({n: d1 for n in reversed(names)})


# -- the one-pass scan and the fused apply -----------------------------------------------------------


@pytest.mark.parametrize("encoding", [D.SPARSE, D.XOR])
@pytest.mark.parametrize("item", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("frac", [0.0, 0.002, 0.3, 1.0])
def test_a_scan_is_encode_and_hash_and_refreshes_a_kept_base(monkeypatch, encoding, item, frac):
    monkeypatch.setattr(D.chunks, "CHUNK_BYTES", 1 << 16)  # several chunks, each of several blocks
    monkeypatch.setattr(D.chunks, "BLOCK_BYTES", 1 << 12)
    base, new = _pair(item, 50_003, frac, seed=item)  # an odd count: a tail of less than a word
    kept = base.copy()
    parts, digest = D.scan(encoding, new, kept, item, limit=1 << 40, update=True)
    assert parts is not None
    assert b"".join(parts) == b"".join(D.encode(encoding, new, base, item, limit=1 << 40))
    assert digest == blake3.blake3(new).digest()
    assert kept.tobytes() == new.tobytes()  # the kept base is the new version now
    untouched = base.copy()
    assert D.scan(encoding, new, untouched, item, limit=1 << 40)[1] == digest
    assert untouched.tobytes() == base.tobytes()  # without update the base is only read


@pytest.mark.parametrize("encoding", [D.SPARSE, D.XOR])
@pytest.mark.parametrize("item", [1, 2, 4, 8, 16])
def test_the_fused_apply_gives_the_bytes_and_their_digest(monkeypatch, encoding, item):
    monkeypatch.setattr(D.chunks, "CHUNK_BYTES", 1 << 16)
    monkeypatch.setattr(D.chunks, "BLOCK_BYTES", 1 << 12)
    base, new = _pair(item, 70_001, 0.01, seed=5)
    new[: 1 << 17] = base[: 1 << 17]  # the first chunks unchanged: no frame, the base's bytes
    payload = memoryview(b"".join(D.encode(encoding, new, base, item, limit=1 << 40)))
    _applies_both_ways(encoding, payload, base, new, item)
    same = np.empty_like(base)
    assert D.apply_hashed(D.SAME, memoryview(b""), base, same, item) == blake3.blake3(base).digest()
    assert same.tobytes() == base.tobytes()


def test_a_scan_past_its_limit_still_hashes_and_refreshes(monkeypatch):
    monkeypatch.setattr(D.chunks, "CHUNK_BYTES", 1 << 14)  # the limit passed a few chunks in
    base = np.zeros(1 << 18, np.uint8)
    noise = np.random.default_rng(0).integers(0, 256, base.nbytes, dtype=np.uint8)
    kept = base.copy()
    parts, digest = D.scan(D.XOR, noise, kept, 1, update=True)
    assert parts is None  # sent whole
    assert digest == blake3.blake3(noise).digest() and kept.tobytes() == noise.tobytes()
    kept = base.copy()
    assert D.scan(None, noise, kept, 1, update=True) == (None, digest)
    assert kept.tobytes() == noise.tobytes()


def test_the_fused_apply_refuses_what_apply_refuses():
    base, _, payload = _good()
    out = np.empty_like(base)
    with pytest.raises(D.DeltaError, match="chunks take"):
        D.apply_hashed(D.SPARSE, memoryview(payload[:-1]), base, out, 2)
    with pytest.raises(D.DeltaError, match="no payload"):
        D.apply_hashed(D.SAME, memoryview(b"x"), base, out, 2)
    with pytest.raises(D.DeltaError, match="encoding"):
        D.apply_hashed(7, memoryview(payload), base, out, 2)


@pytest.mark.parametrize("encoding", [D.SPARSE, D.XOR])
@pytest.mark.parametrize("fused", [False, True])
def test_a_frame_that_inflates_past_its_chunk_is_refused_before_it_is_inflated(encoding, fused):
    """A hostile frame whose header states far more bytes than its chunk can hold: refused from
    the header, with no allocation of the stated size (zstd sizes its output from the header)."""
    import tracemalloc

    import zstandard

    base = np.zeros(64, np.uint8)
    frame = zstandard.ZstdCompressor(level=1).compress(bytes(64 << 20))  # 64 MiB of zeros: a small frame
    payload = memoryview(struct.pack("<III", 64, 1, len(frame)) + frame)
    apply = D.apply_hashed if fused else D.apply
    tracemalloc.start()
    try:
        with pytest.raises(D.DeltaError, match="more than"):
            apply(encoding, payload, base, np.empty_like(base), 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_a_frame_without_its_size_is_bounded_as_it_inflates():
    import zstandard

    base = np.zeros(64, np.uint8)
    frame = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(1 << 20))
    payload = memoryview(struct.pack("<III", 64, 1, len(frame)) + frame)
    with pytest.raises(D.DeltaError):
        D.apply(D.XOR, payload, base, np.empty_like(base), 1)


def _unsized(payload: memoryview) -> memoryview:
    """``payload`` with every frame compressed again as a hostile client may: no content size in
    its header and the largest window zstd decodes by default (128 MiB)."""
    import zstandard

    chunk, count = struct.unpack_from("<II", payload)
    lengths = struct.unpack_from(f"<{count}I", payload, 8)
    params = zstandard.ZstdCompressionParameters.from_level(1, window_log=27, write_content_size=False)
    pos, frames = 8 + 4 * count, []
    for n in lengths:
        raw = zstandard.ZstdDecompressor().decompress(payload[pos : pos + n]) if n else b""
        frames.append(zstandard.ZstdCompressor(compression_params=params).compress(raw) if n else b"")
        pos += n
    head = struct.pack(f"<II{count}I", chunk, count, *(len(f) for f in frames))
    return memoryview(head + b"".join(frames))


@pytest.mark.parametrize("encoding", [D.SPARSE, D.XOR, D.PLANES])
@pytest.mark.parametrize("fused", [False, True])
def test_a_frame_that_does_not_state_its_size_is_refused(encoding, fused):
    """zstd decodes such a frame through a window buffer of the size its header names, beside the
    output, and keeps that buffer in the thread's decompressor afterwards: memory no scratch
    bound charges. Every frame an encoder of ours makes states its size."""
    base, new = _pair(2, 300_001, 0.01 if encoding == D.SPARSE else 0.3, seed=5)
    payload = memoryview(b"".join(D.encode(encoding, new, base, 2, limit=1 << 40)))
    _applies_both_ways(encoding, payload, base, new, 2)  # stated, as the encoder writes them
    hostile = _unsized(payload)
    apply = D.apply_hashed if fused else D.apply
    with pytest.raises(D.DeltaError, match="does not state"):
        apply(encoding, hostile, base, np.empty_like(base), 2)
    inplace, undo = base.copy(), D.Undo()
    with pytest.raises(D.DeltaError, match="does not state"):
        apply(encoding, hostile, inplace, inplace, 2, undo=undo)
    undo.run()
    assert inplace.tobytes() == base.tobytes()


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory read from /proc")
@pytest.mark.parametrize("encoding", [D.XOR, D.PLANES])
def test_a_frame_cut_short_leaves_no_window_buffer_behind(encoding):
    """A frame that states its size but is cut short is not decoded in one pass: zstd decodes it
    through a window buffer as large as its header names (up to 128 MiB), fills it up to the cut,
    and keeps it in the thread's decompressor after the error: memory no scratch bound charges."""
    import zstandard

    nbytes = 32 << 20
    x = np.random.default_rng(7).integers(0, 4, nbytes, dtype=np.uint8).tobytes()  # compresses, never to nothing
    params = zstandard.ZstdCompressionParameters.from_level(1, window_log=25)
    frame = zstandard.ZstdCompressor(compression_params=params).compress(x)[:-1]
    del x
    payload = memoryview(struct.pack("<III", nbytes, 1, len(frame)) + frame)
    base, out = np.zeros(nbytes, np.uint8), np.ones(nbytes, np.uint8)  # resident before it is measured
    got: list[object] = []

    def on_a_new_thread() -> None:  # its own decompressor, as a worker's first chunk has
        before = _resident()
        try:
            D.apply_hashed(encoding, payload, base, out, 2)  # one chunk: decoded on this thread
        except D.DeltaError as e:
            got.append(e)
        got.append(_resident() - before)

    t = threading.Thread(target=on_a_new_thread)
    t.start()
    t.join()
    error, grown = got
    assert isinstance(error, D.DeltaError) and "decompress" in str(error)
    assert isinstance(grown, int) and grown < 8 << 20


@pytest.mark.parametrize("encoding", [D.XOR, D.PLANES])
@pytest.mark.parametrize("fused", [False, True])
def test_an_undo_that_decodes_its_frames_again_charges_that_before_it_applies(monkeypatch, encoding, fused):
    """XOR and PLANES are undone by applying each chunk's frame again, a chunk at a time: what one
    such step takes is reserved (a server's charge, held until the switch is done) before the
    first chunk changes, and the undo runs within it."""
    import tracemalloc

    monkeypatch.setattr(D.chunks, "CHUNK_BYTES", 1 << 18)
    base, new = _pair(2, (4 << 20) // 2 + 7, 1.0, seed=6)  # 17 chunks, the last short
    payload = memoryview(b"".join(D.encode(encoding, new, base, 2, limit=1 << 40)))
    reserved: list[int] = []
    undo, inplace = D.Undo(reserve=reserved.append), base.copy()
    apply = D.apply_hashed if fused else D.apply
    apply(encoding, payload, inplace, inplace, 2, undo=undo)
    assert inplace.tobytes() == new.tobytes()
    step = (1 << 18) + (D.chunks.block_size(2) if encoding == D.PLANES else 0)
    assert sum(reserved) == undo.nbytes == step  # the largest step once: they run one at a time
    tracemalloc.start()
    try:
        undo.run()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert inplace.tobytes() == base.tobytes() and undo.nbytes == 0
    assert peak <= step + (64 << 10)

    def full(nbytes: int) -> None:
        raise MemoryError("no memory for the undo")

    refused = base.copy()
    with pytest.raises(MemoryError):
        apply(encoding, payload, refused, refused, 2, undo=D.Undo(reserve=full))
    assert refused.tobytes() == base.tobytes()  # refused before any chunk changed


@pytest.mark.parametrize("fused", [False, True])
def test_chunks_below_the_minimum_are_refused_before_the_table_is_read(fused):
    """A hostile payload of one-byte chunks (a table entry and a zstd call per byte of the tensor):
    refused from its head, with nothing sized from its count; a chunk under the minimum that is
    the whole tensor is fine, and the encoder never cuts chunks under the minimum."""
    import tracemalloc

    nbytes = 1 << 20
    base = np.zeros(nbytes, np.uint8)
    payload = memoryview(struct.pack("<II", 1, nbytes) + bytes(4 * nbytes))  # every chunk its base's bytes
    assert len(payload) > D.payload_bound(nbytes)  # a server drains it unread, from the DELTA's header
    apply, out = D.apply_hashed if fused else D.apply, np.empty_like(base)
    tracemalloc.start()
    try:
        with pytest.raises(D.DeltaError, match="below"):
            apply(D.XOR, payload, base, out, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 16
    small = np.zeros(4096, np.uint8)
    new = small.copy()
    new[7] = 1
    whole = memoryview(b"".join(D.encode(D.SPARSE, new, small, 1, limit=1 << 30)))
    assert struct.unpack_from("<II", whole) == (D.chunks.CHUNK_BYTES, 1)
    out = np.empty_like(small)
    apply(D.SPARSE, whole, small, out, 1)
    assert out.tobytes() == new.tobytes()
    for item in (1, 2, 3, 8, 16, 3 << 20, 5 << 20):
        assert D.chunk_size(item) >= D.MIN_CHUNK_BYTES


def _every_element_changed(nbytes: int, item: int) -> memoryview:
    """A hostile SPARSE payload: one chunk in which every element changed (to zero), the largest
    a SPARSE frame may decode to, from a frame of a few hundred bytes."""
    import zstandard

    n = nbytes // item
    blob = struct.pack("<I", n) + np.ones(n, "<u4").tobytes() + bytes(nbytes)
    blob = blob[:4] + bytes(4) + blob[8:]  # the first position is 0, each other one more
    frame = zstandard.ZstdCompressor(level=1).compress(blob)
    return memoryview(struct.pack("<III", nbytes, 1, len(frame)) + frame)


@pytest.mark.parametrize("item", [1, 2, 4, 8])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_sparse_frame_decodes_within_its_stated_scratch(item, in_place):
    """What applying a SPARSE frame takes besides its inputs and its output stays within
    scratch_bound (which a server charges before it applies), a small multiple of the chunk; in
    place, what the undo keeps is counted in Undo.nbytes."""
    import tracemalloc

    nbytes = 1 << 20
    payload = _every_element_changed(nbytes, item)
    bound = D.scratch_bound(D.SPARSE, payload, nbytes, item)
    assert bound <= (1 + 10 / item) * nbytes + 64
    base = np.full(nbytes, 0xAB, np.uint8)
    out, undo = (base, D.Undo()) if in_place else (np.empty_like(base), None)
    tracemalloc.start()
    try:
        digest = D.apply_hashed(D.SPARSE, payload, base, out, item, undo=undo)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert digest == blake3.blake3(bytes(nbytes)).digest() and not out.any()
    kept = undo.nbytes if undo is not None else 0
    assert peak <= bound + kept + (64 << 10)
    if undo is not None:
        assert kept == (4 + item) * (nbytes // item)  # the old elements and their positions
        undo.run()
        assert (base == 0xAB).all()


def _applies_both_ways(encoding: int, payload: memoryview, base: np.ndarray, new: np.ndarray, item: int) -> None:
    """``payload`` applied to ``base`` gives ``new`` and its digest, into fresh memory and in place,
    and the in-place undo gives ``base`` back."""
    want = blake3.blake3(new).digest()
    out = np.full_like(base, 0x5A)
    assert D.apply_hashed(encoding, payload, base, out, item) == want
    assert out.tobytes() == new.tobytes()
    inplace, undo = base.copy(), D.Undo()
    assert D.apply_hashed(encoding, payload, inplace, inplace, item, undo=undo) == want
    assert inplace.tobytes() == new.tobytes()
    undo.run()
    assert inplace.tobytes() == base.tobytes()
