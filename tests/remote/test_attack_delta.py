"""DELTA and in-place updates attacked through a hand-driven client: lies and orders a client
would not send, each ending in a refusal that changes nothing and leaves the account exact."""

from __future__ import annotations

import contextlib
import struct
import time

import blake3
import numpy as np
import pytest

from tests.remote.rawclient import Raw, _barrier, _commit_traced, _f32
from weightlift.remote import delta as D
from weightlift.remote.client.client import Client
from weightlift.remote.protocol import Alloc, Commit, CommitReply, Delta, DeltaEncoding, Update, WriteHeader
from weightlift.remote.server.server import Server

N = 1 << 18  # elements of F32: 1 MiB a tensor


def _sparse(a: np.ndarray, seed: int) -> tuple[np.ndarray, bytes]:
    """``a`` with one element changed, and the SPARSE payload that makes it from ``a``."""
    new = a.copy()
    new[seed % a.size] += 1.0
    return new, b"".join(D.encode(D.SPARSE, new.view(np.uint8), a.view(np.uint8), 4))


def _digest(a: np.ndarray) -> bytes:
    return blake3.blake3(a.tobytes()).digest()


def _pushed_then_delta(raw: Raw, i: int) -> np.ndarray | None:
    """In the open update: tensor ``w{i}`` sent whole, then a DELTA of it against what was just
    sent (the base the update itself holds). Returns the bytes the DELTA makes, or None (and
    sends no DELTA) where the tensor sent whole was refused."""
    a = _f32(N, seed=i)
    raw.send(Alloc(2 * i, f"w{i}", "F32", a.shape, a.nbytes, None, True))  # verify: its digest is kept
    raw.send(WriteHeader(2 * i, 0, a.nbytes), a.tobytes())
    if _barrier(raw).errors:  # did not fit
        return None
    new, payload = _sparse(a, i)
    raw.send(
        Delta(
            2 * i + 1, f"w{i}", "F32", a.shape, a.nbytes, DeltaEncoding.SPARSE, _digest(a), _digest(new), len(payload)
        ),
        payload,
    )
    return new


def test_an_in_place_delta_against_a_tensor_its_update_holds_stays_charged():
    """A tensor the open update holds is a DELTA's base; in an in-place update the DELTA is kept
    for the switch. The held tensor's memory is still referenced (the kept DELTA applies into it),
    so it must still count against max_memory: otherwise one connection holds any amount of
    memory past the limit, a tensor at a time, until its update ends."""
    limit = 8 << 20
    with Server(max_memory=limit) as srv:
        raw = Raw.connected(srv.address)
        raw.send(Update(Update.FLAG_IN_PLACE))
        count = 16  # twice the limit in tensors
        held = 0  # tensors the update holds: each one sent whole and kept, or the DELTA's result
        for i in range(count):
            held += _pushed_then_delta(raw, i) is not None
            _barrier(raw)
        assert held < count  # the limit refused some ...
        assert srv.memory_used >= held * N * 4  # ... and every one held is charged
        assert srv.memory_used <= limit
        raw.send(Commit(Commit.FLAG_ABORT))
        assert isinstance(raw.recv(), CommitReply)
        raw.close()


def test_an_in_place_delta_against_a_tensor_its_update_holds_switches_in_its_result():
    """Sent whole, then changed by a DELTA in the same in-place update: the switch publishes the
    DELTA's result (no other client is there to have replaced anything)."""
    with Server() as srv:
        raw = Raw.connected(srv.address)
        raw.send(Update(Update.FLAG_IN_PLACE))
        want = {f"w{i}": _pushed_then_delta(raw, i) for i in range(2)}
        assert _barrier(raw).errors == ()
        raw.send(Commit())
        commit = raw.recv()
        assert isinstance(commit, CommitReply) and commit.ok, commit.message
        got = srv.tensors()
        assert {k: got[k].tobytes() for k in want} == {k: v.tobytes() for k, v in want.items()}
        raw.close()


@pytest.mark.parametrize("freed", [False, True])
def test_a_tensor_filled_from_its_own_memory_and_switched_in_place_by_another_client_keeps_no_stale_digest(
    tmp_path, freed
):
    """B's update fills ``w`` from the memory the server already holds for it (the same memory,
    published again at B's switch). Before B commits, A's in-place update changes that memory.
    B's switch then publishes the memory holding A's bytes: it may not name them by the digest B
    proved before they changed (the set digest B is told, HAVE, and fills of that digest would
    all rest on bytes that are not there); nor when A also freed ``w`` before B's switch."""
    from weightlift.digest.setdigest import set_digest
    from weightlift.remote.client.client import Client
    from weightlift.remote.protocol import FillFromCache

    v0 = {"w": _f32(N, seed=1)}
    v1 = {"w": _sparse(v0["w"], 3)[0]}
    d0, d1 = _digest(v0["w"]), _digest(v1["w"])
    with Server(cache_dir=tmp_path / "cache") as srv:
        with Client(srv.address) as c:
            c.push(v0)
        b = Raw.connected(srv.address)
        b.send(Update())
        b.send(Alloc(1, "w", "F32", (N,), N * 4, d0))
        b.send(FillFromCache(1, d0))
        assert _barrier(b).errors == ()  # filled from the memory of the w the server holds
        with Client(srv.address) as a:
            assert a.push(v1, base=v0, in_place=True).deltas == 1  # A's switch changed that memory
            if freed:
                a.free(["w"])
        b.send(Commit())
        commit = b.recv()
        assert isinstance(commit, CommitReply)
        held = _digest(srv.tensors()["w"])
        assert held in (d0, d1)
        if commit.ok and commit.root != bytes(32):  # what B is told it switched in is what is held
            assert commit.root == set_digest({"w": held})  # (zeros: the server knows no digest for it)
        # a later fill by d0 gets v0's bytes or asks for them, never A's bytes under d0's name
        z = Raw.connected(srv.address)
        z.send(Alloc(2, "z", "F32", (N,), N * 4, d0))
        z.send(FillFromCache(2, d0))
        reply = _barrier(z)
        if 2 not in reply.need and not reply.errors:
            assert _digest(srv.tensors()["z"]) == d0
        b.close()
        z.close()


def test_an_in_place_sparse_delta_charges_what_its_undo_keeps_before_it_takes_it():
    """A SPARSE payload of a few kilobytes may name every element of a tensor. Applied in place,
    the undo keeps each changed element's old value and position: five times a U8 tensor. That
    memory must be charged before the server takes it (or chunk by chunk as it grows), so the
    server never holds much more than ``max_memory`` at any moment, and the update is refused."""

    import zstandard

    from weightlift.remote.client.client import Client

    limit, nbytes, chunk = 24 << 20, 8 << 20, 1 << 20
    v0 = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    raw_chunk = b"".join(
        [
            struct.pack("<I", chunk),
            np.concatenate([[0], np.ones(chunk - 1)]).astype("<u4").tobytes(),  # every element
            bytes([255]) * chunk,
        ]
    )
    frame = zstandard.ZstdCompressor(level=3).compress(raw_chunk)
    count = nbytes // chunk
    payload = struct.pack("<II", chunk, count) + struct.pack("<I", len(frame)) * count + frame * count
    with Server(max_memory=limit) as srv:
        with Client(srv.address) as c:
            c.push({"w": v0})
        used = srv.memory_used
        raw = Raw.connected(srv.address)
        raw.send(Update(Update.FLAG_IN_PLACE))
        raw.send(
            Delta(1, "w", "U8", (nbytes,), nbytes, DeltaEncoding.SPARSE, _digest(v0), bytes(32), len(payload)), payload
        )
        assert _barrier(raw).errors == ()  # kept for the switch
        commit, peak = _commit_traced(raw)
        assert isinstance(commit, CommitReply) and not commit.ok
        assert srv.tensors()["w"].tobytes() == v0.tobytes()
        # what the commit took: within what the limit had left, and one chunk's undo besides
        assert peak <= limit - used + 5 * chunk + (2 << 20), (peak, limit - used)
        raw.close()


def test_a_fill_from_another_names_memory_never_copies_it_while_an_in_place_switch_changes_it(tmp_path, monkeypatch):
    """``z`` is filled by digest from the memory of ``w`` (proven to hold it). Another client's
    in-place switch of ``w`` runs between the fill's choice of ``w`` and its copy: the copy must
    read one version of ``w`` and publish ``z`` only with bytes that hash to the digest it names."""
    import threading

    from weightlift.remote.client.client import Client
    from weightlift.remote.protocol import FillFromCache
    from weightlift.remote.server.receive import Destinations

    v0 = {"w": _f32(N, seed=5)}
    v1 = {"w": _sparse(v0["w"], 9)[0]}
    d0 = _digest(v0["w"])
    real, other = Destinations.ensure, {}

    def racing(self, p, **kw):
        real(self, p, **kw)
        if p.name == "z" and "thread" not in other:  # w chosen, z's memory made, nothing copied yet

            def switch() -> None:
                with Client(srv.address) as a:
                    other["deltas"] = a.push(v1, base=v0, in_place=True).deltas

            t = other["thread"] = threading.Thread(target=switch)
            t.start()
            t.join(2)  # the switch runs now, unless it waits for the copy

    with Server(cache_dir=tmp_path / "cache") as srv:
        with Client(srv.address) as c:
            c.push(v0)
        monkeypatch.setattr(Destinations, "ensure", racing)
        z = Raw.connected(srv.address)
        z.send(Alloc(2, "z", "F32", (N,), N * 4, d0))
        z.send(FillFromCache(2, d0))
        reply = _barrier(z)
        other["thread"].join(30)
        assert other["deltas"] == 1  # the switch did run
        if 2 not in reply.need:
            assert reply.errors == () and _digest(srv.tensors()["z"]) == d0
        z.close()


def test_a_reader_stalled_on_one_tensor_holds_no_in_place_switch_or_read_of_another():
    """A client stalls inside a READ of ``big`` (it takes one byte and stops; the server may keep
    its send open for io_timeout + size / min_frame_rate: minutes to hours for a large tensor at
    a trickle). Another client's in-place update of ``small`` must not wait for it, and while it
    could wait it must not hold every other READ off: a third client's READ of ``small`` is
    answered while the stalled reader still holds ``big``."""
    import threading

    from tests.remote.rawclient import _stalled_reader
    from weightlift.remote.client.client import Client
    from weightlift.remote.protocol import Read, ReadReply

    small0 = {"small": _f32(1 << 16, seed=2)}
    small1 = {"small": _sparse(small0["small"], 1)[0]}
    with Server() as srv:
        with Client(srv.address) as c:
            c.push({"big": _f32(4 << 20, seed=3), **small0})
        stalled = _stalled_reader(srv.address, "big", 16 << 20)
        done: dict = {}

        def update() -> None:
            with Client(srv.address) as a:
                done["deltas"] = a.push(small1, base=small0, in_place=True).deltas

        t = threading.Thread(target=update, daemon=True)
        t.start()
        t.join(2)
        try:
            reader = Raw.connected(srv.address)
            reader.sock.settimeout(2)
            reader.send(Read("small", 0, small0["small"].nbytes))
            try:
                reply = reader.recv()
            except TimeoutError:
                reply = None
            assert isinstance(reply, ReadReply), "a READ of another tensor waited for the stalled reader"
            assert "deltas" in done, "an in-place switch of another tensor waited for the stalled reader"
            reader.close()
        finally:
            stalled.close()
            t.join(30)


def test_an_in_place_switch_never_publishes_memory_another_client_replaced_meanwhile(monkeypatch):
    """A's in-place update of ``w`` checks that ``w`` is still the memory its DELTA applies to,
    then applies it there. B's plain update replaces ``w`` (new memory: a pointer swap, which
    holds no gate) after that check and before A's switch. A's switch must then be refused:
    publishing the memory it changed would put back v0 + A's delta over B's v2, which B was
    told it switched in (a lost update: in no serial order is A's DELTA against v0 applied
    after B's switch, its base is gone)."""
    import threading

    from weightlift.remote.client.client import Client
    from weightlift.remote.server.updates import switch as switch_mod

    v0 = {"w": _f32(N, seed=1)}
    v1 = {"w": _sparse(v0["w"], 3)[0]}
    v2 = {"w": _f32(N, seed=9)}
    real = switch_mod.codec.apply_hashed
    fired = threading.Event()

    with Server() as srv:

        def apply_then_replaced(*args, **kw):
            got = real(*args, **kw)
            if not fired.is_set():  # B's whole push lands between A's check and A's switch
                fired.set()
                with Client(srv.address) as b:
                    b.push(v2)
            return got

        with Client(srv.address) as c:
            c.push(v0)
        monkeypatch.setattr(switch_mod.codec, "apply_hashed", apply_then_replaced)
        with Client(srv.address) as a:
            try:
                a.push(v1, base=v0, in_place=True)
            except Exception:  # noqa: BLE001 - refused: what is asserted is what the server holds
                pass
        assert fired.is_set()
        assert _digest(srv.tensors()["w"]) == _digest(v2["w"]), "A's switch put its stale base back over B's update"


def test_a_delta_payload_without_host_memory_gives_its_charge_back(monkeypatch):
    """The payload's buffer cannot be made (ENOMEM, an address-space limit below max_memory): the
    bytes charged for it go back. Kept, each such DELTA would shrink what the server may hold
    for good, and a client repeating it would leave no room for anyone."""
    import weightlift.remote.server.updates.delta as server_delta

    a = _f32(N, seed=1)
    new, payload = _sparse(a, 1)

    class _NoMemory:  # numpy as the handler sees it, except a buffer of the payload's size
        def __getattr__(self, name: str):
            return getattr(np, name)

        def empty(self, shape, *args, **kw):
            if shape == len(payload):
                raise MemoryError(f"cannot allocate {shape} bytes")
            return np.empty(shape, *args, **kw)

    with Server() as srv:
        with Client(srv.address) as c:
            c.push({"w": a})
        used = srv.memory_used
        monkeypatch.setattr(server_delta, "np", _NoMemory())
        raw = Raw.connected(srv.address)
        d = Delta(1, "w", "F32", a.shape, a.nbytes, DeltaEncoding.SPARSE, _digest(a), _digest(new), len(payload))
        with contextlib.suppress(OSError):  # the server may close before it reads the payload
            raw.send(d, payload)
        deadline = time.monotonic() + 10
        while srv.stats().open_connections and time.monotonic() < deadline:  # the handler gave up on it
            time.sleep(0.01)
        raw.close()
        assert srv.memory_used == used
        assert srv.tensors()["w"].tobytes() == a.tobytes()
