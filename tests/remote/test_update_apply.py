"""Applying DELTAs on the codec's workers: many chunks at once byte for byte and hashed in order,
a bad chunk among good ones refused with nothing changed, and the memory an in-place switch
keeps to undo itself charged before it is taken. Codec-level first, then on loopback."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import signal
import struct
import time
import tracemalloc

import blake3
import numpy as np
import pytest
import zstandard

import weightlift.remote.protocol as P
from tests.remote.rawclient import Raw, _barrier, _commit_traced
from tests.remote.test_update import _holds, _model, _step
from tests.remote.test_update_delta import _applies_both_ways, _every_element_changed, _pair
from weightlift.remote import delta as D
from weightlift.remote.client.client import Client
from weightlift.remote.protocol import Commit, CommitReply, Delta, DeltaEncoding, Update
from weightlift.remote.server.server import Server
from weightlift.remote.server.store import MemoryFull

CHUNK = 2 * D.MIN_CHUNK_BYTES  # small chunks: cut to whole elements of any size, they stay above the minimum


@pytest.fixture
def many_chunks(monkeypatch):
    """Small chunks, several of them out to the workers at once."""
    monkeypatch.setattr(D.chunks, "CHUNK_BYTES", CHUNK)
    monkeypatch.setattr(D.chunks, "BLOCK_BYTES", 1 << 13)
    monkeypatch.setattr(D.applying, "APPLY_AHEAD", 4)


def _frames(payload: bytes) -> tuple[int, list[bytes]]:
    """(chunk_bytes, every chunk's frame, b"" where unchanged) of a payload."""
    chunk, count = struct.unpack_from("<II", payload)
    lengths = struct.unpack_from(f"<{count}I", payload, 8)
    pos, frames = 8 + 4 * count, []
    for n in lengths:
        frames.append(payload[pos : pos + n])
        pos += n
    return chunk, frames


def _payload(chunk: int, frames: list[bytes]) -> bytes:
    return struct.pack(f"<II{len(frames)}I", chunk, len(frames), *map(len, frames)) + b"".join(frames)


def _encoded(encoding: int, new: np.ndarray, base: np.ndarray, item: int) -> bytes:
    parts = D.encode(encoding, new, base, item, limit=1 << 40)
    assert parts is not None
    return b"".join(parts)


def _bad_middle(encoding: int, payload: bytes) -> bytes:
    """The payload with its middle chunk's frame replaced by one a byte short of the chunk."""
    chunk, frames = _frames(payload)
    mid = len(frames) // 2
    short = bytes(chunk - 1) if encoding != D.SPARSE else struct.pack("<I", 1) + bytes(4)  # SPARSE: no element
    frames[mid] = zstandard.ZstdCompressor(level=1).compress(short)
    return _payload(chunk, frames)


# -- the codec ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "encoding,item", [(e, i) for e in (D.SPARSE, D.XOR, D.PLANES) for i in (1, 2, 3, 4, 8) if e != D.PLANES or i > 1]
)
def test_many_chunks_on_the_workers_give_the_bytes_and_their_digest(many_chunks, encoding, item):
    base, new = _pair(item, (40 * CHUNK) // item + 7, 0.01, seed=item)  # 41 chunks, a short last one
    new[5 * CHUNK : 9 * CHUNK] = base[5 * CHUNK : 9 * CHUNK]
    payload = memoryview(_encoded(encoding, new, base, item))
    assert len(_frames(bytes(payload))[1]) == 41 and not _frames(bytes(payload))[1][6]  # unchanged chunks
    _applies_both_ways(encoding, payload, base, new, item)


@pytest.mark.parametrize("encoding", [D.SPARSE, D.XOR, D.PLANES])
def test_a_bad_chunk_among_good_ones_is_refused_and_undone(many_chunks, encoding):
    base, new = _pair(2, 30 * CHUNK // 2, 0.05, seed=7)
    bad = memoryview(_bad_middle(encoding, _encoded(encoding, new, base, 2)))
    with pytest.raises(D.DeltaError, match="chunk"):
        D.apply_hashed(encoding, bad, base, np.empty_like(base), 2)
    inplace, undo = base.copy(), D.Undo()
    with pytest.raises(D.DeltaError, match="chunk"):
        D.apply_hashed(encoding, bad, inplace, inplace, 2, undo=undo)
    assert undo.steps  # chunks on either side of the bad one were applied before it was found
    undo.run()
    time.sleep(0.05)  # a worker still writing after the error was raised would show here
    assert inplace.tobytes() == base.tobytes()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX only")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")  # what the test is about
def test_a_forked_child_applies_on_workers_of_its_own(many_chunks, monkeypatch):
    """A process forked after the codec's workers started (a trainer that pushed, then forked an
    inference engine's workers that serve) has none of their threads: its DELTAs apply on a pool
    of its own instead of waiting forever for workers that do not exist in it."""
    monkeypatch.setattr(D.applying, "cores", lambda: 4)  # the chunks go to the workers, whatever this machine
    base, new = _pair(2, 12 * CHUNK // 2, 0.05, seed=3)
    payload = memoryview(_encoded(D.XOR, new, base, 2))  # the parent's workers run and go idle
    want = blake3.blake3(new).digest()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 3
        try:
            signal.alarm(10)  # a child waiting for workers that do not exist ends here, killed
            out = np.empty_like(base)
            code = 0 if D.apply_hashed(D.XOR, payload, base, out, 2) == want and out.tobytes() == new.tobytes() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the child ended with status {status}"


def test_cores_where_the_affinity_cannot_be_read(monkeypatch):
    """A sandbox that refuses sched_getaffinity (EPERM, EINVAL) still gives the pool its cores:
    the count of them is taken when the codec is imported, and an error there would leave
    DELTAs unusable."""

    def refused(pid: int) -> set[int]:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_getaffinity", refused, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert D.chunks.cores() == 3


def test_the_undo_is_charged_before_it_is_taken(many_chunks):
    """A reserve that refuses stops the chunk before it copies its old elements out or changes
    any; the chunks applied before it are undone exactly."""
    nbytes = 1 << 20
    payload = _every_element_changed(nbytes, 1)  # one chunk: its undo is as large as the tensor, and more
    base = np.full(nbytes, 0xAB, np.uint8)

    def refuse(n: int) -> None:
        raise MemoryFull(f"{n} bytes would exceed the server's memory limit")

    undo = D.Undo(reserve=refuse)
    tracemalloc.start()
    try:
        with pytest.raises(MemoryFull):
            D.apply_hashed(D.SPARSE, payload, base, base, 1, undo=undo)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (base == 0xAB).all() and undo.nbytes == 0 and not undo.steps
    assert peak <= D.scratch_bound(D.SPARSE, payload, nbytes, 1) + (64 << 10)  # no undo copy was taken
    old, new = _pair(1, 20 * CHUNK, 0.3, seed=2)
    many = memoryview(_encoded(D.SPARSE, new, old, 1))
    granted: list[int] = []

    def some(n: int) -> None:
        if len(granted) == 5:
            raise MemoryFull("the sixth chunk's undo does not fit")
        granted.append(n)

    work, undo = old.copy(), D.Undo(reserve=some)
    with pytest.raises(MemoryFull):
        D.apply_hashed(D.SPARSE, many, work, work, 1, undo=undo)
    assert undo.nbytes == sum(granted) and len(undo.steps) == len(granted) == 5
    undo.run()
    assert work.tobytes() == old.tobytes()


@pytest.mark.parametrize("in_place", [False, True])
def test_many_chunks_decode_within_the_scratch_charged(many_chunks, in_place):
    """Every chunk of a SPARSE payload changes every element (the largest frames a payload can
    decode to): what applying holds at once, on every worker and waiting for the hash, stays
    within scratch_bound, and in place what the undo keeps within Undo.nbytes."""
    nbytes = 16 * CHUNK
    base = np.full(nbytes, 0xAB, np.uint8)
    payload = memoryview(_encoded(D.SPARSE, np.zeros_like(base), base, 1))
    bound = D.scratch_bound(D.SPARSE, payload, nbytes, 1)
    assert bound < 4 * 10 * CHUNK  # four chunks out at once, each about ten times its size decoded
    out, undo = (base, D.Undo()) if in_place else (np.empty_like(base), None)
    tracemalloc.start()
    try:
        digest = D.apply_hashed(D.SPARSE, payload, base, out, 1, undo=undo)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert digest == blake3.blake3(bytes(nbytes)).digest() and not out.any()
    assert peak <= bound + (undo.nbytes if undo is not None else 0) + (64 << 10)


def test_the_scratch_charged_covers_the_chunks_out_at_once(monkeypatch):
    monkeypatch.setattr(D.applying, "APPLY_AHEAD", 4)
    payload = memoryview(struct.pack("<II", 1 << 20, 16) + bytes(64))
    assert D.scratch_bound(D.XOR, payload, 16 << 20, 2) == 4 << 20  # four chunks' frames decoded at once
    one = memoryview(struct.pack("<II", 16 << 20, 1) + bytes(4))
    assert D.scratch_bound(D.XOR, one, 16 << 20, 2) == 16 << 20  # one chunk: one frame


# -- on loopback --------------------------------------------------------------------------------------


@pytest.mark.parametrize("in_place", [False, True])
def test_deltas_of_many_chunks_apply_byte_for_byte(many_chunks, in_place):
    v0 = _model()
    v1 = _step(v0, 0.01, seed=1)
    v2 = _step(v1, 0.2, seed=2)  # PLANES (XOR to a server of minor 3)
    with Server() as srv, Client(srv.address, keep_base=True) as c:
        c.push(v0)
        for v in (v1, v2):
            r = c.push(v, in_place=in_place, verify=True)
            assert r.deltas == len(v)
            _holds(srv, v)


def _raw_update(srv: Server, flags: int) -> Raw:
    raw = Raw(srv.address)
    raw.hello()
    raw.send(Update(flags))
    return raw


def _delta_of(name: str, old: np.ndarray, new: np.ndarray, payload: bytes, tid: int = 1) -> Delta:
    d0, d1 = blake3.blake3(old.tobytes()).digest(), blake3.blake3(new.tobytes()).digest()
    return Delta(tid, name, "BF16", old.shape, old.nbytes, DeltaEncoding.XOR, d0, d1, len(payload))


@pytest.mark.parametrize("flags", [0, Update.FLAG_IN_PLACE])
def test_a_bad_chunk_in_the_middle_of_a_delta_changes_nothing(many_chunks, flags):
    v0 = _model()
    v1 = _step(v0, 0.2, seed=3)
    name = "layer.2"
    old, new = v0[name].view(np.uint8), v1[name].view(np.uint8)
    bad = _bad_middle(D.XOR, _encoded(D.XOR, new, old, 2))
    with Server() as srv, Client(srv.address) as c:
        first = c.push(v0)
        gen = srv.generation
        raw = _raw_update(srv, flags)
        raw.send(_delta_of(name, v0[name], v1[name], bad), bad)
        reply = _barrier(raw)
        raw.send(Commit())
        commit = raw.recv()
        assert isinstance(commit, CommitReply)
        if flags:  # kept encoded until the switch, which refuses it whole
            assert not commit.ok and name in commit.message and "chunk" in commit.message
            assert srv.generation == gen
        else:
            assert reply.errors and "chunk" in reply.errors[0]
        _holds(srv, v0)
        assert srv.set_digest(v0) == first.set_digest
        raw.close()


def _xor_deltas(v0: dict, v1: dict, names: tuple[str, ...]):
    """``(tensor id, DELTA, payload)`` taking each of ``names`` from v0 to v1 as XOR."""
    for tid, name in enumerate(names, 1):
        payload = _encoded(D.XOR, v1[name].view(np.uint8), v0[name].view(np.uint8), 2)
        yield tid, _delta_of(name, v0[name], v1[name], payload, tid), payload


def test_a_client_killed_mid_delta_leaves_the_old_version(many_chunks):
    v0 = _model()
    v1 = _step(v0, 0.2, seed=4)
    with Server() as srv, Client(srv.address) as c:
        first = c.push(v0)
        gen = srv.generation
        raw = _raw_update(srv, Update.FLAG_IN_PLACE)
        for tid, d, payload in _xor_deltas(v0, v1, ("layer.0", "layer.1")):
            if tid == 1:
                raw.send(d, payload)  # whole: kept for the switch
            else:
                raw.sock.sendall(P.send(d) + payload[: len(payload) // 2])  # cut mid-payload
        raw.sock.close()
        deadline = time.monotonic() + 10
        while srv.stats().open_connections > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        _holds(srv, v0)
        assert srv.generation == gen and srv.set_digest(v0) == first.set_digest


def test_an_in_place_switch_whose_undo_does_not_fit_is_refused_within_its_charge():
    """A small hostile DELTA whose in-place undo would be five times its tensor: the switch is
    refused for memory before the undo is taken, so the server never holds more than it
    charged; the tensor is as it was."""
    nbytes = 4 << 20
    v0 = {"w": np.full(nbytes, 0xAB, np.uint8)}
    payload = _every_element_changed(nbytes, 1)
    scratch = D.scratch_bound(D.SPARSE, payload, nbytes, 1)
    with Server(max_memory=nbytes + scratch + len(payload) + (8 << 20)) as srv, Client(srv.address) as c:
        c.push(v0)
        raw = _raw_update(srv, Update.FLAG_IN_PLACE)
        d0 = blake3.blake3(v0["w"]).digest()
        raw.send(
            Delta(1, "w", "U8", (nbytes,), nbytes, DeltaEncoding.SPARSE, d0, bytes(32), len(payload)), bytes(payload)
        )
        assert _barrier(raw).errors == ()
        commit, peak = _commit_traced(raw)
        assert isinstance(commit, CommitReply) and not commit.ok and "memory limit" in commit.message
        assert peak <= scratch + (256 << 10)  # the old elements (4 MiB) were never copied out
        _holds(srv, v0)
        raw.close()


def test_an_undo_step_that_fails_leaves_the_others_run():
    """Taking an in-place application back goes on past a step that raises (a chunk's frame
    decoded again without memory for it): every other chunk is put back, then the error is
    raised."""
    a = np.zeros(4, np.uint8)
    undo = D.Undo()
    undo.add(lambda: a.__setitem__(0, 1))

    def fails() -> None:
        raise MemoryError("no memory to decode the frame again")

    undo.add(fails)
    undo.add(lambda: a.__setitem__(1, 1))
    with pytest.raises(MemoryError):
        undo.run()
    assert a.tolist() == [1, 1, 0, 0] and not undo.steps and undo.nbytes == 0


def test_a_switch_whose_undo_fails_gives_every_charge_back(many_chunks, monkeypatch):
    """An in-place switch refused (a digest that does not match) whose undo then fails: what
    the update held (the kept DELTAs' payloads, what the undo kept) is given back all the same,
    also after the connection ends; it was leaked for good."""
    v0 = _model()
    v1 = _step(v0, 0.2, seed=5)
    undoing = D.applying._apply_xor

    def xor(frame, base, out, hasher=None):  # the undo decodes a chunk's frame again: the first fails
        if hasher is None and base is out and not failed:
            failed.append(1)
            raise MemoryError("no memory to decode the frame again")
        return undoing(frame, base, out, hasher)

    failed: list[int] = []
    with Server() as srv, Client(srv.address) as c:
        c.push(v0)
        used = srv.memory_used
        raw = _raw_update(srv, Update.FLAG_IN_PLACE)
        for tid, d, payload in _xor_deltas(v0, v1, ("layer.0", "layer.1")):
            if tid == 2:  # the switch applies both, then refuses: the second does not give its digest
                d = dataclasses.replace(d, digest=bytes(32))
            raw.send(d, payload)
        assert _barrier(raw).errors == ()  # both kept for the switch
        monkeypatch.setattr(D.applying, "_apply_xor", xor)
        # the connection's failure is logged with its traceback, which holds the dropped tensors:
        # a test's log capture would keep them (and their charge) alive past the test's checks
        monkeypatch.setattr(logging.getLogger("weightlift.remote.server"), "disabled", True)
        with contextlib.suppress(Exception):
            raw.send(Commit())
            raw.recv()
        raw.close()
        deadline = time.monotonic() + 10
        while srv.stats().open_connections > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert failed
        held = srv.tensors()  # what the undo could not restore is gone, never torn bytes
        assert "layer.0" not in held and "layer.1" not in held
        gc.collect()  # the failed undo's traceback held the dropped tensors in a cycle
        srv.trim()
        assert srv.memory_used < used  # their memory given back ...
        c.push({n: v0[n] for n in ("layer.0", "layer.1")})
        srv.trim()
        assert srv.memory_used == used  # ... and nothing the update held still charged


def test_a_chunked_copy_that_fails_raises_only_once_no_chunk_writes(monkeypatch):
    """``copy`` (a kept base refreshed a chunk per core) raises after every chunk is done: a
    chunk still writing after it raised could change the caller's memory behind its back."""
    import threading

    chunk = D.chunks.CHUNK_BYTES
    src = np.arange(3 * chunk, dtype=np.uint8)
    dest = np.zeros_like(src)
    real, first = np.copyto, threading.Event()

    def copyto(d, s):
        if not first.is_set():
            first.set()
            raise MemoryError("the first chunk fails at once")
        time.sleep(0.2)  # the others are still writing when it does
        real(d, s)

    monkeypatch.setattr(D.chunks.np, "copyto", copyto)
    with pytest.raises(MemoryError):
        D.chunks.copy(dest, src)
    done = [bool((dest[s : s + chunk] == src[s : s + chunk]).all()) for s in range(0, src.nbytes, chunk)]
    assert done.count(True) == 2  # both other chunks had landed when it raised
