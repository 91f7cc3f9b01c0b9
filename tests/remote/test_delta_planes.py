"""The PLANES encoding of the DELTA codec (XOR's bytes as byte planes): every dtype of two bytes
or more back byte for byte, its frame layout pinned against numpy's transpose, the estimate's
choice, malformed frames refused with nothing changed, and the scratch it takes within what a
server charges; then on loopback, PLANES only to a server of minor 4 (XOR to one of minor 3)."""

from __future__ import annotations

import struct

import blake3
import ml_dtypes
import numpy as np
import pytest
import zstandard

import weightlift.remote.protocol as P
from tests.remote.rawclient import Raw, _barrier
from tests.remote.test_update import _holds, _model
from tests.remote.test_update_delta import _applies_both_ways, _pair, _roundtrip, _unsized
from weightlift.dtypes import item_size
from weightlift.remote import delta as D
from weightlift.remote.client.client import Client
from weightlift.remote.protocol import Commit, CommitReply, Delta, DeltaEncoding, Update
from weightlift.remote.server.server import Server
from weightlift.remote.server.updates import delta as server_delta

# every dtype whose elements have two bytes or more, by its wire name
DTYPES = ["BF16", "F16", "F32", "F64", "I16", "I32", "I64", "U16", "U32", "U64", "C64"]


def _adam_step(n: int, lr: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(base, new) bf16 bytes: weights and the same weights after an Adam-like step of ``lr``."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(n, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    stepped = (w.astype(np.float32) + lr * rng.standard_normal(n, dtype=np.float32)).astype(ml_dtypes.bfloat16)
    return w.view(np.uint8), stepped.view(np.uint8)


def _frames_of(payload: bytes) -> list[bytes]:
    chunk, count = struct.unpack_from("<II", payload)
    lengths = struct.unpack_from(f"<{count}I", payload, 8)
    pos, out = 8 + 4 * count, []
    for n in lengths:
        out.append(zstandard.ZstdDecompressor().decompress(payload[pos : pos + n]) if n else b"")
        pos += n
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("frac", [0.0, 0.001, 0.3, 1.0])
def test_every_dtype_of_two_bytes_or_more_comes_back_byte_for_byte(dtype, frac):
    item = item_size(dtype)
    base, new = _pair(item, 1_000_003 // item, frac, seed=item)  # an odd count: the last chunk is short
    size = _roundtrip(D.PLANES, base, new, item)
    _applies_both_ways(
        D.PLANES, memoryview(b"".join(D.encode(D.PLANES, new, base, item, limit=1 << 40))), base, new, item
    )
    if frac == 0.0:
        assert size == 8 + 4 * -(-base.nbytes // D.chunk_size(item))  # nothing changed: the head and an empty table


@pytest.mark.parametrize("item", [2, 3, 4, 8, 16])
def test_a_frame_is_the_xor_as_planes_in_byte_order(monkeypatch, item):
    """The layout docs/protocol.md states, built here with numpy's transpose: plane k is byte k
    of every element of the chunk, the planes one after another."""
    monkeypatch.setattr(D.chunks, "CHUNK_BYTES", 1 << 16)
    monkeypatch.setattr(D.chunks, "BLOCK_BYTES", 1 << 12)  # a chunk split a block at a time
    base, new = _pair(item, 70_001, 0.3, seed=item)
    payload = b"".join(D.encode(D.PLANES, new, base, item, limit=1 << 40))
    chunk = D.chunk_size(item)
    x = np.bitwise_xor(new, base)
    want = [x[s : s + chunk].reshape(-1, item).T.tobytes() for s in range(0, x.nbytes, chunk)]
    assert _frames_of(payload) == want


@pytest.mark.parametrize("item", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("frac", [0.0, 0.002, 0.3, 1.0])
def test_a_planes_scan_is_encode_and_hash_and_refreshes_a_kept_base(monkeypatch, item, frac):
    monkeypatch.setattr(D.chunks, "CHUNK_BYTES", 1 << 16)
    monkeypatch.setattr(D.chunks, "BLOCK_BYTES", 1 << 12)
    base, new = _pair(item, 50_003, frac, seed=item)
    kept = base.copy()
    parts, digest = D.scan(D.PLANES, new, kept, item, limit=1 << 40, update=True)
    assert parts is not None
    assert b"".join(parts) == b"".join(D.encode(D.PLANES, new, base, item, limit=1 << 40))
    assert digest == blake3.blake3(new).digest()
    assert kept.tobytes() == new.tobytes()
    untouched = base.copy()
    assert D.scan(D.PLANES, new, untouched, item, limit=1 << 40)[1] == digest
    assert untouched.tobytes() == base.tobytes()


def test_nan_payloads_survive_bit_for_bit():
    n = 50_001
    base = np.zeros(n, np.uint16)
    base[::7] = 0x7FC1
    new = base.copy()
    new[::7] = 0x7FC2  # another bf16 NaN payload
    new[1::11] = 0xFF81  # a negative NaN where a zero was
    _roundtrip(D.PLANES, base.view(np.uint8), new.view(np.uint8), 2)
    f = np.zeros(n, np.uint32)
    f[::3] = 0x7FC00001
    g = f.copy()
    g[::3] = 0xFFC00002  # f32 NaNs of other signs and payloads
    g[1::5] = 0x7F800001  # a signalling NaN
    _roundtrip(D.PLANES, f.view(np.uint8), g.view(np.uint8), 4)


def test_choose_takes_planes_where_the_receiver_applies_it():
    base, stepped = _adam_step(1 << 20, 1e-4)
    assert D.choose(stepped, base, 2) == D.XOR  # a receiver of an older minor: XOR
    assert D.choose(stepped, base, 2, planes=True) == D.PLANES
    sparse_base, sparse = _pair(2, 1 << 20, 0.01)
    assert D.choose(sparse, sparse_base, 2, planes=True) == D.SPARSE
    noise = np.random.default_rng(2).integers(0, 256, base.nbytes, dtype=np.uint8)
    assert D.choose(noise, base, 2, planes=True) is None
    one = np.bitwise_xor(base, np.uint8(1))  # one-byte elements: one plane is XOR itself
    assert D.choose(one, base, 1, planes=True) == D.XOR


def test_planes_is_smaller_than_xor_on_an_adam_step():
    base, new = _adam_step(1 << 21, 1e-4, seed=3)
    xor = sum(map(len, D.encode(D.XOR, new, base, 2, limit=1 << 40)))
    planes = sum(map(len, D.encode(D.PLANES, new, base, 2, limit=1 << 40)))
    assert planes < 0.95 * xor


def test_planes_needs_elements_of_two_bytes():
    base, new = _pair(1, 4096, 0.3)
    with pytest.raises(D.DeltaError, match="encoding"):
        D.encode(D.PLANES, new, base, 1)
    with pytest.raises(D.DeltaError, match="encoding"):
        D.scan(D.PLANES, new, base, 1)
    payload = memoryview(b"".join(D.encode(D.XOR, new, base, 1, limit=1 << 40)))
    for apply in (D.apply, D.apply_hashed):
        with pytest.raises(D.DeltaError, match="encoding"):
            apply(D.PLANES, payload, base, np.empty_like(base), 1)


def _one_frame(nbytes: int, raw: bytes, **kw) -> memoryview:
    frame = zstandard.ZstdCompressor(level=1, **kw).compress(raw)
    return memoryview(struct.pack("<III", nbytes, 1, len(frame)) + frame)


@pytest.mark.parametrize("fused", [False, True])
def test_malformed_planes_frames_are_refused_and_change_nothing(fused):
    apply = D.apply_hashed if fused else D.apply
    base = np.arange(64, dtype=np.uint8)
    cases = [
        (_one_frame(64, bytes(63)), 2, "not the chunk"),  # a plane a byte short
        (_one_frame(64, bytes(65)), 2, "more than"),  # a byte more than the chunk
        (_one_frame(64, bytes(1 << 20), write_content_size=False), 2, "not state"),  # size not stated: refused
        (_one_frame(64, bytes(64)), 3, "whole number"),  # a chunk of 64 is no whole number of 3-byte elements
        (memoryview(struct.pack("<III", 64, 1, 5) + b"\x00" * 5), 2, "decompress"),
    ]
    for payload, item, match in cases:
        out = np.full_like(base, 0x5A)
        with pytest.raises(D.DeltaError, match=match):
            apply(D.PLANES, payload, base, out, item)
        inplace, undo = base.copy(), D.Undo()
        with pytest.raises(D.DeltaError, match=match):
            apply(D.PLANES, payload, inplace, inplace, item, undo=undo)
        assert inplace.tobytes() == base.tobytes() and not undo.steps  # refused before it wrote


def test_a_tensor_not_of_whole_elements_is_refused():
    base = np.zeros(65, np.uint8)  # a 2-byte dtype cannot have 65 bytes: a base of another size
    with pytest.raises(D.DeltaError):
        D.apply(D.PLANES, _one_frame(66, bytes(66)), base, np.empty_like(base), 2)
    with pytest.raises(D.DeltaError, match="whole number"):
        D.apply(D.PLANES, _one_frame(65, bytes(65)), base, np.empty_like(base), 2)


def test_a_planes_frame_that_inflates_past_its_chunk_is_refused_before_it_is_inflated():
    import tracemalloc

    payload = _one_frame(64, bytes(64 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(D.DeltaError, match="more than"):
            D.apply_hashed(D.PLANES, payload, np.zeros(64, np.uint8), np.empty(64, np.uint8), 2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize("item", [2, 4, 8])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_planes_delta_decodes_within_its_stated_scratch(monkeypatch, item, in_place):
    import tracemalloc

    monkeypatch.setattr(D.chunks, "CHUNK_BYTES", 1 << 18)
    base, new = _pair(item, (4 << 20) // item, 1.0, seed=item)  # 16 chunks, out to the workers
    payload = memoryview(b"".join(D.encode(D.PLANES, new, base, item, limit=1 << 40)))
    bound = D.scratch_bound(D.PLANES, payload, base.nbytes, item)
    assert bound == D.applying._in_flight(base.nbytes, 1 << 18) * ((1 << 18) + D.chunks.block_size(item))
    out, undo = (base, D.Undo()) if in_place else (np.empty_like(base), None)
    tracemalloc.start()
    try:
        digest = D.apply_hashed(D.PLANES, payload, base, out, item, undo=undo)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert digest == blake3.blake3(new).digest() and out.tobytes() == new.tobytes()
    assert peak <= bound + (64 << 10)
    if undo is not None:
        assert undo.nbytes == (1 << 18) + D.chunks.block_size(item)  # nothing kept: one frame decoded again at a time
        undo.run()
        assert base.tobytes() == _pair(item, (4 << 20) // item, 1.0, seed=item)[0].tobytes()


# -- on loopback -------------------------------------------------------------------------------------


def _bf16_model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f"layer.{i}": (rng.standard_normal(1 << 18, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        for i in range(3)
    }


def _stepped(v: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        n: (a.astype(np.float32) + 1e-4 * rng.standard_normal(a.shape, dtype=np.float32)).astype(ml_dtypes.bfloat16)
        for n, a in v.items()
    }


def _sent_encodings(monkeypatch) -> list[int]:
    """The encoding of every DELTA the servers of this test receive."""
    seen: list[int] = []
    real = server_delta.Deltas.delta

    def delta(self, d):
        seen.append(d.encoding)
        return real(self, d)

    monkeypatch.setattr(server_delta.Deltas, "delta", delta)
    return seen


@pytest.mark.parametrize("server_minor", [P.PROTOCOL_MINOR, 3])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_new_client_sends_planes_only_to_a_server_of_minor_four(monkeypatch, server_minor, in_place):
    seen = _sent_encodings(monkeypatch)
    v0 = _bf16_model()
    v1 = _stepped(v0, 1)
    with Server(protocol_minor=server_minor) as srv, Client(srv.address, keep_base=True) as c:
        assert c.server_hello.minor == server_minor
        c.push(v0)
        r = c.push(v1, in_place=in_place, verify=not in_place)
        assert r.deltas == len(v1)
        _holds(srv, v1)
    want = DeltaEncoding.PLANES if server_minor >= 4 else DeltaEncoding.XOR
    assert seen == [want] * len(v1)


def test_a_minor_three_client_sends_xor_to_a_new_server(monkeypatch):
    seen = _sent_encodings(monkeypatch)
    v0 = _bf16_model()
    v1 = _stepped(v0, 1)
    with Server() as srv, Client(srv.address, protocol_minor=3, keep_base=True) as c:
        c.push(v0)
        assert c.push(v1, verify=True).deltas == len(v1)
        _holds(srv, v1)
    assert seen == [DeltaEncoding.XOR] * len(v1)


@pytest.mark.parametrize("flags", [0, Update.FLAG_IN_PLACE])
def test_a_server_refuses_planes_on_a_minor_three_connection(flags):
    """A server speaking minor 3 with this peer answers PLANES as a server of minor 3 would: the
    tensor fails and nothing changes."""
    v0 = _model()
    name = "layer.1"
    old, new = v0[name], v0[name].copy()
    new.view(np.uint16)[::3] ^= 1
    payload = b"".join(D.encode(D.PLANES, new.view(np.uint8), old.view(np.uint8), 2, limit=1 << 40))
    d0, d1 = blake3.blake3(old.tobytes()).digest(), blake3.blake3(new.tobytes()).digest()
    delta = Delta(1, name, "BF16", old.shape, old.nbytes, DeltaEncoding.PLANES, d0, d1, len(payload))
    with Server() as srv, Client(srv.address) as c:
        first = c.push(v0)
        raw = Raw(srv.address, minor=3)
        raw.hello()
        raw.send(Update(flags))
        raw.sock.sendall(P.send(delta, minor=4) + payload)  # what no minor-3 client of ours sends
        reply = _barrier(raw)
        assert reply.errors and "PLANES" in reply.errors[0]
        raw.send(Commit())
        commit = raw.recv()
        assert isinstance(commit, CommitReply) and commit.tensors == 0  # nothing kept to switch in
        _holds(srv, v0)
        assert srv.set_digest(v0) == first.set_digest
        raw.close()


@pytest.mark.parametrize("flags", [0, Update.FLAG_IN_PLACE])
def test_a_server_refuses_frames_that_do_not_state_their_size(flags):
    """On loopback: a PLANES DELTA whose frame states no size fails before it is decoded; in
    place, the whole update fails at COMMIT and the delta applied before it is undone."""
    v0 = _model()
    with Server() as srv, Client(srv.address) as c:
        first = c.push(v0)
        raw = Raw(srv.address)
        raw.hello()
        raw.send(Update(flags))
        for tid, name in enumerate(["layer.0", "layer.1"], 1):
            old, new = v0[name], v0[name].copy()
            new.view(np.uint16)[::3] ^= 0x101
            payload = memoryview(b"".join(D.encode(D.PLANES, new.view(np.uint8), old.view(np.uint8), 2, limit=1 << 40)))
            body = bytes(_unsized(payload) if tid == 2 else payload)
            d0, d1 = blake3.blake3(old.tobytes()).digest(), blake3.blake3(new.tobytes()).digest()
            raw.sock.sendall(
                P.send(Delta(tid, name, "BF16", old.shape, old.nbytes, DeltaEncoding.PLANES, d0, d1, len(body))) + body
            )
        reply = _barrier(raw)
        raw.send(Commit(0 if flags else Commit.FLAG_ABORT))
        commit = raw.recv()
        assert isinstance(commit, CommitReply) and not commit.ok
        why = commit.message if flags else reply.errors[0]
        assert "does not state its decompressed size" in why
        _holds(srv, v0)
        assert srv.set_digest(v0) == first.set_digest
        raw.close()


@pytest.mark.parametrize("flags", [0, Update.FLAG_IN_PLACE])
@pytest.mark.parametrize("bad", ["one-byte planes", "short table"])
def test_a_delta_that_cannot_apply_is_refused_as_it_arrives_in_place_too(flags, bad):
    """PLANES of one-byte elements, or a payload whose chunk table does not fit its tensor, is
    refused at the BARRIER that follows it, in place too (where it was kept for the switch and
    failed only at COMMIT): the tensor fails, nothing is kept to switch in, v0 stays."""
    v0 = _model()
    v0["bytes"] = np.arange(1 << 16, dtype=np.uint8)
    name, dtype = ("bytes", "U8") if bad == "one-byte planes" else ("layer.1", "BF16")
    old, new = v0[name], v0[name].copy()
    new.view(np.uint8)[::5] ^= 1
    encoding = DeltaEncoding.PLANES if bad == "one-byte planes" else DeltaEncoding.XOR
    payload = b"".join(D.encode(D.XOR, new.view(np.uint8), old.view(np.uint8), 1, limit=1 << 40))
    if bad == "short table":
        payload = payload[:-1]
    d0, d1 = blake3.blake3(old.tobytes()).digest(), blake3.blake3(new.tobytes()).digest()
    delta = Delta(1, name, dtype, old.shape, old.nbytes, encoding, d0, d1, len(payload))
    with Server() as srv, Client(srv.address) as c:
        first = c.push(v0)
        raw = Raw(srv.address)
        raw.hello()
        raw.send(Update(flags))
        raw.sock.sendall(P.send(delta) + payload)
        reply = _barrier(raw)
        assert reply.errors and name in reply.errors[0]
        assert ("PLANES" in reply.errors[0]) == (bad == "one-byte planes")
        raw.send(Commit())
        commit = raw.recv()
        assert isinstance(commit, CommitReply) and commit.tensors == 0
        _holds(srv, v0)
        assert srv.set_digest(v0) == first.set_digest
        raw.close()
