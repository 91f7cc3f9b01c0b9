"""Weight updates on loopback: pushes from memory, DELTAs against the version the server holds,
sets switched in at once and proven by the set digest, and peers of the previous minor."""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from collections.abc import Iterator

import blake3
import ml_dtypes
import numpy as np
import pytest

import weightlift.remote.protocol as P
from tests.checkpoints import write
from tests.devices import needs_cuda
from tests.remote.rawclient import Raw, _barrier
from weightlift.digest.setdigest import set_digest
from weightlift.dtypes import DTYPES, numpy_dtype
from weightlift.errors import IntegrityError, LocalProtocolError, OptionError, RemoteProtocolError, TransportError
from weightlift.remote import delta as D
from weightlift.remote.client.client import Client
from weightlift.remote.client.connection import Replaced
from weightlift.remote.protocol import Alloc, Commit, CommitReply, Delta, DeltaEncoding, Update, WriteHeader
from weightlift.remote.server.server import Server

WHOLE_BYTE_DTYPES = [d.name for d in DTYPES if d.numpy and d.bits % 8 == 0]


def _bytes(a) -> bytes:
    if isinstance(a, np.ndarray):
        return a.tobytes()
    import torch

    return a.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def _holds(server: Server, tensors: dict) -> None:
    got = server.tensors()
    assert sorted(got) == sorted(tensors)
    for n, t in tensors.items():
        assert got[n].tobytes() == _bytes(t), n


def _digests(tensors: dict) -> dict[str, bytes]:
    return {n: blake3.blake3(_bytes(t)).digest() for n, t in tensors.items()}


def _random(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    raw = np.random.default_rng(seed).integers(0, 256, int(np.prod(shape)) * numpy_dtype(dtype).itemsize, np.uint8)
    return raw.view(numpy_dtype(dtype)).reshape(shape)  # every bit pattern: NaNs, denormals, anything


def _model(seed: int = 0, n: int = 1 << 18) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = {f"layer.{i}": (rng.standard_normal(n, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16) for i in range(4)}
    w["norm"] = rng.standard_normal(64).astype(np.float32)
    return w


def _step(w: dict[str, np.ndarray], frac: float, seed: int) -> dict[str, np.ndarray]:
    """An optimizer-like step: ``frac`` of each tensor's elements changed."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, a in w.items():
        b = a.copy()
        bits = b.reshape(-1).view(np.uint8 if b.itemsize == 1 else f"u{b.itemsize}")
        k = int(bits.size * frac)
        if k:
            idx = rng.choice(bits.size, k, replace=False)
            bits[idx] ^= 1  # the lowest mantissa bit: an Adam step at a small learning rate
        out[name] = b
    return out


# -- pushes from memory ---------------------------------------------------------------------------


@pytest.mark.parametrize("minor", [P.PROTOCOL_MINOR, 2])
def test_every_dtype_from_numpy_arrives_byte_for_byte(minor):
    tensors = {f"t.{d}": _random(d, (3, 5), i) for i, d in enumerate(WHOLE_BYTE_DTYPES)}
    tensors["scalar"] = np.array(7, np.int64)
    tensors["empty"] = np.zeros((0, 4), np.float32)
    tensors["strided"] = np.arange(40, dtype=np.float32).reshape(5, 8)[:, ::2]  # not contiguous: copied once
    with Server(protocol_minor=minor) as srv, Client(srv.address) as c:
        r = c.push(tensors, verify=True)
        _holds(srv, tensors)
        assert r.tensors == len(tensors) and r.verified == len(tensors)
        for n, t in tensors.items():
            assert srv.tensors()[n].shape == t.shape and srv.tensors()[n].dtype == t.dtype
        assert (r.set_digest is not None) == (minor >= 3)


def test_every_dtype_from_torch_arrives_byte_for_byte():
    torch = pytest.importorskip("torch")
    from weightlift.dtypes import dtype_info, torch_dtype

    tensors = {}
    for i, d in enumerate(WHOLE_BYTE_DTYPES):
        if not dtype_info(d).torch:
            continue
        raw = np.random.default_rng(i).integers(0, 256, 4 * 6 * (dtype_info(d).bits // 8), np.uint8)
        if d == "BOOL":
            raw %= 2  # torch copies a bool as 0 or 1
        tensors[f"t.{d}"] = torch.from_numpy(raw).view(torch_dtype(d)).reshape(4, -1)
    tensors["strided"] = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    with Server(framework="torch") as srv, Client(srv.address, keep_base=True) as c:
        c.push(tensors, verify=True)
        got = srv.tensors()
        for n, t in tensors.items():
            assert _bytes(got[n]) == _bytes(t), n
        again = {n: t.clone() for n, t in tensors.items()}
        again["t.F32"].view(torch.int32)[0, 0] ^= 1
        r = c.push(again)
        assert r.deltas == len(again)
        assert _bytes(srv.tensors()["t.F32"]) == _bytes(again["t.F32"])


@needs_cuda
def test_a_cuda_tensor_goes_through_a_staging_copy():
    import torch

    t = torch.arange(1 << 16, dtype=torch.bfloat16, device="cuda")
    with Server() as srv, Client(srv.address, keep_base=True) as c:
        c.push({"w": t})
        t[::100] += 1
        r = c.push({"w": t})
        assert r.deltas == 1
        assert srv.tensors()["w"].tobytes() == _bytes(t)


def test_select_and_the_options_of_a_file_push_apply(tmp_path):
    tensors = _model()
    token = "s3cret-token-of-16-bytes-or-more"
    with Server(token=token) as srv, Client(srv.address, token=token, keep_base=True) as c:
        assert c.connections[0].protected
        c.push(tensors, select="layer.*", verify=True)
        assert sorted(srv.tensors()) == sorted(n for n in tensors if n.startswith("layer."))
        stepped = _step(tensors, 0.01, seed=3)
        r = c.push(stepped, select="layer.*")  # DELTAs on a protected connection: their payloads MACed too
        assert r.deltas == 4
        _holds(srv, {n: a for n, a in stepped.items() if n.startswith("layer.")})
        with pytest.raises(OptionError):
            c.push(tensors, to=["127.0.0.1:1"], relay="direct")
        with pytest.raises(OptionError, match="base"):
            c.push(tensors, to=["127.0.0.1:1"], base=tensors)
        path = write(tmp_path / "m.safetensors", [("x", "U8", (3,), b"abc")])
        with pytest.raises(OptionError):
            c.push(path, base=tensors)
        c.push(path)  # a file push as it always was
        assert srv.tensors()["x"].tobytes() == b"abc"


# -- deltas -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("frac", [0.0, 0.01, 0.3, 1.0])
@pytest.mark.parametrize("in_place", [False, True])
def test_deltas_apply_byte_for_byte(frac, in_place):
    v0 = _model()
    v1 = _step(v0, frac, seed=1)
    with Server() as srv, Client(srv.address, keep_base=True) as c:
        first = c.push(v0)
        assert first.deltas == 0
        r = c.push(v1, in_place=in_place, verify=True)
        _holds(srv, v1)
        assert r.deltas == len(v1)
        assert r.set_digest == set_digest(_digests(v1))
        whole = sum(a.nbytes for a in v1.values())
        if frac <= 0.01:
            assert r.bytes_sent < whole / 20
        assert c.bases is not None and c.bases.nbytes == whole  # the kept copy: one more of each tensor
        v2 = _step(v1, 0.01, seed=2)
        c.push(v2, in_place=in_place)
        _holds(srv, v2)


def test_nan_payloads_in_a_delta_arrive_bit_for_bit():
    base = np.zeros(1 << 16, np.uint16)
    base[::5] = 0x7FC1
    new = base.copy()
    new[::5] = 0x7FA3  # another NaN's payload
    new[1::9] = 0xFFFF
    with Server() as srv, Client(srv.address, keep_base=True) as c:
        c.push({"w": base.view(ml_dtypes.bfloat16)})
        r = c.push({"w": new.view(ml_dtypes.bfloat16)})
        assert r.deltas == 1
        assert srv.tensors()["w"].tobytes() == new.tobytes()


def test_dense_changes_that_do_not_compress_go_whole():
    v0 = {"w": _random("U8", (1 << 18,), 0)}
    v1 = {"w": _random("U8", (1 << 18,), 1)}
    with Server() as srv, Client(srv.address, keep_base=True) as c:
        c.push(v0)
        r = c.push(v1)
        assert r.deltas == 0 and r.bytes_sent == v1["w"].nbytes
        _holds(srv, v1)


def test_an_explicit_base_is_used_and_a_wrong_one_refused():
    v0 = _model()
    v1 = _step(v0, 0.01, seed=1)
    with Server() as srv, Client(srv.address) as c:
        c.push(v0)
        r = c.push(v1, base=v0)
        assert r.deltas == len(v1) and c.bases is None
        _holds(srv, v1)
        # the caller's "previous" tensors are not what the server holds: refused, sent whole
        r = c.push(_step(v1, 0.01, seed=2), base=_step(v0, 0.5, seed=9))
        assert r.deltas == 0 and r.bytes_sent > sum(a.nbytes for a in v1.values())  # the attempt, then whole
        _holds(srv, _step(v1, 0.01, seed=2))
        assert r.set_digest == set_digest(_digests(_step(v1, 0.01, seed=2)))


@pytest.mark.parametrize("in_place", [False, True])
def test_a_base_replaced_by_another_client_is_refused_and_resent_whole(in_place):
    # in place too: the tensor sent whole keeps the allocation its DELTA made, without a digest
    # due in the BARRIER (the set digest proves it, as it proves the DELTAs)
    v0 = _model()
    with Server() as srv, Client(srv.address, keep_base=True) as a, Client(srv.address) as b:
        a.push(v0)
        other = dict(v0, **{"layer.0": _step(v0, 0.2, seed=5)["layer.0"]})
        b.push({"layer.0": other["layer.0"]})  # replaced behind a's back
        v1 = _step(v0, 0.01, seed=1)
        r = a.push(v1, in_place=in_place)
        assert r.deltas == len(v1) - 1  # layer.0 came back in the need list and went whole
        assert r.verified == len(v1)
        _holds(srv, v1)
        assert r.set_digest == set_digest(_digests(v1))


def test_a_sub_byte_tensor_is_never_delta_applied():
    packed = bytes(range(64))
    digest = blake3.blake3(packed).digest()
    with Server() as srv:
        raw = Raw(srv.address)
        raw.hello()
        raw.send(Alloc(1, "q", "F4", (128,), 64, digest, True))
        raw.send(WriteHeader(1, 0, 64), packed)
        assert _barrier(raw).errors == ()
        new = bytes(reversed(packed))
        payload = b"".join(D.encode(D.XOR, np.frombuffer(new, np.uint8), np.frombuffer(packed, np.uint8), 1))
        nd = blake3.blake3(new).digest()
        raw.send(Delta(2, "q", "F4", (128,), 64, DeltaEncoding.XOR, digest, nd, len(payload)), payload)
        reply = _barrier(raw)
        assert reply.need == (2,) and reply.errors == ()  # the client sends it whole instead
        raw.send(WriteHeader(2, 0, 64), new)
        assert _barrier(raw).errors == ()
        assert srv.tensors()["q"].tobytes() == new


def test_a_delta_whose_result_is_not_its_digest_fails_and_leaves_the_base():
    v0 = np.arange(1 << 12, dtype=np.float32)
    with Server() as srv, Client(srv.address) as c:
        c.push({"w": v0})
        d0 = blake3.blake3(v0.tobytes()).digest()
        new = v0.copy()
        new[5] = -1
        payload = b"".join(D.encode(D.SPARSE, new.view(np.uint8), v0.view(np.uint8), 4))
        for flags in (0, Update.FLAG_IN_PLACE):
            raw = Raw(srv.address)
            raw.hello()
            raw.send(Update(flags))
            raw.send(
                Delta(1, "w", "F32", v0.shape, v0.nbytes, DeltaEncoding.SPARSE, d0, bytes(32), len(payload)), payload
            )
            reply = _barrier(raw)
            raw.send(Commit())
            commit = raw.recv()
            assert isinstance(commit, CommitReply)
            if flags:  # kept until the switch, where it fails: nothing is switched
                assert not commit.ok and "digest" in commit.message
            else:
                assert reply.errors and "does not hash" in reply.errors[0]
            assert srv.tensors()["w"].tobytes() == v0.tobytes()
            raw.close()


# -- switching a set at once ------------------------------------------------------------------------


def test_a_client_killed_mid_update_leaves_the_old_version_visible():
    v0 = _model()
    with Server() as srv, Client(srv.address, keep_base=True) as c:
        first = c.push(v0)
        gen = srv.generation
        raw = Raw(srv.address)
        raw.hello()
        raw.send(Update())
        new = _step(v0, 0.3, seed=4)
        a = new["layer.1"]
        raw.send(Alloc(1, "layer.1", "BF16", a.shape, a.nbytes, None, False))
        raw.send(WriteHeader(1, 0, a.nbytes), a.tobytes())  # complete, held back for the switch
        raw.send(Alloc(2, "layer.2", "BF16", a.shape, a.nbytes))
        raw.sock.sendall(P.send(WriteHeader(2, 0, a.nbytes)) + new["layer.2"].tobytes()[:1000])  # cut mid-tensor
        raw.sock.close()
        deadline = time.monotonic() + 10
        while srv.stats().open_connections > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        _holds(srv, v0)
        assert srv.generation == gen
        assert srv.set_digest(v0) == first.set_digest
        with Client(srv.address) as lister:
            assert {t.name for t in lister.list()} == set(v0)


def test_commit_refuses_without_an_update_and_with_tensors_in_flight():
    with Server() as srv:
        raw = Raw(srv.address)
        raw.hello()
        raw.send(Update())
        raw.send(Alloc(1, "x", "U8", (8,), 8))
        raw.send(Commit())
        reply = raw.recv()
        assert isinstance(reply, CommitReply) and not reply.ok and "in flight" in reply.message
        raw.send(Commit())  # no update open
        assert isinstance(raw.recv(), P.Error)
        assert srv.tensors() == {}


def test_an_aborted_update_changes_nothing():
    with Server() as srv, Client(srv.address) as c:
        c.push({"x": np.ones(8, np.uint8)})
        raw = Raw(srv.address)
        raw.hello()
        raw.send(Update())
        raw.send(Alloc(1, "x", "U8", (8,), 8))
        raw.send(WriteHeader(1, 0, 8), bytes(8))
        _barrier(raw)
        raw.send(Commit(Commit.FLAG_ABORT))
        reply = raw.recv()
        assert isinstance(reply, CommitReply) and not reply.ok
        assert srv.tensors()["x"].tobytes() == bytes([1] * 8)


class _MixSoak:
    """A server holding version 0 of ``count`` tensors of ``n`` bytes, version v
    being every byte v (a reader that finds two values in one set saw a mix), and the client
    that pushed it, keeping its base. Readers run until ``stop`` and add what they saw to
    ``seen``."""

    def __init__(self, srv: Server, writer: Client, count: int = 6, n: int = 1 << 16):
        self.srv, self.writer, self.n = srv, writer, n
        self.names = [f"t{i}" for i in range(count)]
        self.stop = threading.Event()
        self.seen: list[str] = []

    def version(self, v: int) -> dict[str, np.ndarray]:
        return {name: np.full(self.n, v, np.uint8) for name in self.names}

    def run(self, readers, *, in_place: bool) -> None:
        """``readers`` on threads while the writer switches versions in for two seconds; then
        every reader has ended, none saw a mix, and the server holds the last version."""
        threads = [threading.Thread(target=f, daemon=True) for f in readers]
        for t in threads:
            t.start()
        v, end = 0, time.monotonic() + 2.0
        while time.monotonic() < end:
            v = (v + 1) % 250
            assert self.writer.push(self.version(v), in_place=in_place).deltas == len(self.names)
        self.stop.set()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        assert not self.seen, self.seen[:3]
        _holds(self.srv, self.version(v))


@contextlib.contextmanager
def _mix_soak() -> Iterator[_MixSoak]:
    """The set-up of a soak of readers against a writer of :class:`_MixSoak`'s versions."""
    with Server() as srv, Client(srv.address, keep_base=True) as writer:
        soak = _MixSoak(srv, writer)
        writer.push(soak.version(0))
        yield soak


@pytest.mark.parametrize("in_place", [False, True])
def test_readers_never_see_a_mix_of_two_versions(in_place):
    """Each version v fills every tensor with the byte v: a reader that finds two values in one
    snapshot (tensors()) or in one READ saw a mix."""
    with _mix_soak() as soak:
        names, n, stop, seen = soak.names, soak.n, soak.stop, soak.seen

        def snapshots() -> None:
            while not stop.is_set():
                got = soak.srv.tensors()
                values = {int(got[name][0]) for name in names} | {int(got[name][-1]) for name in names}
                if len(values) != 1:
                    seen.append(f"tensors() saw versions {sorted(values)}")

        def reads() -> None:
            with Client(soak.srv.address) as reader:
                conn = reader.connections[0]
                buf = np.empty(n, np.uint8)
                while not stop.is_set():
                    for name in names:
                        conn.send(conn.frame(P.Read(name, 0, n)))
                        conn.expect(P.ReadReply)
                        conn.recv_payload(memoryview(buf))
                        if buf.min() != buf.max():
                            seen.append(f"READ of {name} saw a torn tensor")

        soak.run((reads,) if in_place else (snapshots, reads), in_place=in_place)


def test_the_set_digest_matches_the_servers_own():
    v0 = _model()
    with Server() as srv, Client(srv.address) as c:
        r = c.push(v0)
        assert r.set_digest == set_digest(_digests(v0)) == srv.set_digest(v0)
        assert srv.set_digest() == set_digest(_digests(v0))  # every tensor the server holds
        gen = srv.generation
        c.push(_step(v0, 0.01, seed=1))
        assert srv.generation == gen + 1


def test_a_server_stating_another_set_digest_is_caught(monkeypatch):
    from weightlift.remote.server.updates import switch

    real = switch.set_digest
    monkeypatch.setattr(switch, "set_digest", lambda d: real({**d, "extra": bytes(32)}))
    with Server() as srv, Client(srv.address) as c:
        with pytest.raises(IntegrityError, match="set digest"):
            c.push(_model())


# -- previous-minor peers ---------------------------------------------------------------------------


def test_a_previous_minor_client_pushes_from_memory_to_a_new_server():
    v0 = _model()
    with Server() as srv, Client(srv.address, protocol_minor=2, keep_base=True) as c:
        r = c.push(v0, verify=True)
        r2 = c.push(_step(v0, 0.01, seed=1))
        assert r.set_digest is None and r2.deltas == 0  # no update, no deltas: every tensor whole
        _holds(srv, _step(v0, 0.01, seed=1))


def test_a_new_client_pushes_to_a_previous_minor_server():
    v0 = _model()
    with Server(protocol_minor=2) as srv, Client(srv.address, keep_base=True) as c:
        assert not c.server_hello.has(P.Capability.DELTA)
        c.push(v0)
        r = c.push(_step(v0, 0.01, seed=1), verify=True)
        assert r.deltas == 0 and r.verified == len(v0)
        _holds(srv, _step(v0, 0.01, seed=1))


def test_update_commands_do_not_exist_in_minor_two():
    d = bytes(32)
    for msg in (Update(), Commit(), Delta(1, "w", "U8", (1,), 1, 0, d, d, 0), CommitReply(True, 0, 0, d)):
        with pytest.raises(LocalProtocolError, match="minor"):
            P.send(msg, minor=2)
    dec = P.Decoder(our_role="server", minor=2)
    dec.feed(P.send(Update()))
    with pytest.raises(RemoteProtocolError):
        dec.next_event()


def test_an_update_with_both_profilers_on():
    v0 = _model()
    with Server(profile=True) as srv, Client(srv.address, keep_base=True, profile=True) as c:
        c.push(v0)
        r = c.push(_step(v0, 0.01, seed=1), in_place=False)
        assert r.deltas == len(v0) and r.profile is not None
        r = c.push(_step(v0, 0.3, seed=2), in_place=True)
        _holds(srv, _step(v0, 0.3, seed=2))


def test_a_verified_in_place_update_counts_the_deltas_its_set_digest_proves():
    v0 = _model()
    with Server() as srv, Client(srv.address, keep_base=True) as c:
        c.push(v0)
        for in_place in (False, True):
            r = c.push(_step(v0, 0.01, seed=3 + in_place), verify=True, in_place=in_place)
            assert r.deltas == len(v0) and r.verified == len(v0), (in_place, r)


def test_a_delta_under_an_id_in_flight_or_a_same_that_changes_is_refused():
    v0 = np.arange(256, dtype=np.float32)
    d0 = blake3.blake3(v0.tobytes()).digest()
    with Server() as srv, Client(srv.address) as c:
        c.push({"w": v0})
        raw = Raw(srv.address)
        raw.hello()
        raw.send(Alloc(1, "other", "U8", (4,), 4))  # id 1 in flight
        raw.send(Delta(1, "w", "F32", v0.shape, v0.nbytes, DeltaEncoding.SAME, d0, d0, 0))
        raw.send(Delta(2, "w", "F32", v0.shape, v0.nbytes, DeltaEncoding.SAME, d0, bytes(32), 0))
        raw.send(WriteHeader(1, 0, 4), b"abcd")
        reply = _barrier(raw)
        assert len(reply.errors) == 2 and all("DELTA" in e for e in reply.errors)
        assert srv.tensors()["other"].tobytes() == b"abcd"  # the tensor in flight went on untouched
        assert srv.tensors()["w"].tobytes() == v0.tobytes()


def test_an_update_to_a_caching_server_fills_what_it_has(tmp_path):
    v0 = {f"big.{i}": _random("U8", (1 << 20,), i) for i in range(3)}
    with Server(cache_dir=tmp_path / "cache") as srv, Client(srv.address) as c:
        c.push(v0)
        c.free(list(v0))
        r = c.push(v0)  # no base kept: the cache has every tensor
        assert r.cached == 3 and r.bytes_sent == 0
        _holds(srv, v0)
        assert r.set_digest == set_digest(_digests(v0))


def test_a_pull_during_updates_holds_one_set(tmp_path):
    """Each version fills every tensor with one byte: a pulled file with two values mixed sets."""
    from safetensors.numpy import load_file

    names = [f"t{i}" for i in range(8)]
    n = 1 << 15
    with Server() as srv, Client(srv.address, keep_base=True) as writer:
        writer.push({name: np.full(n, 0, np.uint8) for name in names})
        stop = threading.Event()

        def updates() -> None:
            v = 0
            while not stop.is_set():
                v = (v + 1) % 250
                writer.push({name: np.full(n, v, np.uint8) for name in names})
                time.sleep(0.005)  # room for a pull between two switches, on a loaded machine too

        t = threading.Thread(target=updates, daemon=True)
        t.start()
        pulled = 0
        end = time.monotonic() + 2.0
        try:
            with Client(srv.address) as reader:
                while time.monotonic() < end:
                    try:
                        reader.pull(tmp_path / "p.safetensors")
                    except Exception as e:  # gave up after its attempts: updates came too fast
                        assert "replaced" in str(e)
                        continue
                    got = load_file(str(tmp_path / "p.safetensors"))
                    values = {int(a[0]) for a in got.values()} | {int(a[-1]) for a in got.values()}
                    assert len(values) == 1, values
                    pulled += 1
        finally:
            stop.set()
            t.join(10)
        assert pulled


def test_a_read_naming_an_old_generation_is_stale():
    with Server() as srv, Client(srv.address) as c:
        c.push({"x": np.zeros(4, np.uint8)})
        conn = c.connections[0]
        gen = srv.generation
        c.push({"x": np.ones(4, np.uint8)})  # an update: the generation moves on
        assert srv.generation == gen + 1
        conn.send(conn.frame(P.Read("x", 0, 4, 0, 0, gen)))
        with pytest.raises(Replaced, match="replaced"):
            conn.expect(P.ReadReply)
        conn.send(conn.frame(P.Read("x", 0, 4, 0, 0, gen + 1)))
        conn.expect(P.ReadReply)
        buf = bytearray(4)
        conn.recv_payload(memoryview(buf))
        assert bytes(buf) == bytes([1] * 4)


def test_a_kept_base_is_refreshed_by_the_scan_and_each_tensor_hashed_once():
    v0 = _model()
    v1 = _step(v0, 0.01, seed=1)
    v1["layer.3"] = _random("U8", (v1["layer.3"].nbytes,), 7).view(v1["layer.3"].dtype)  # noise: sent whole
    whole = sum(a.nbytes for a in v1.values())
    with Server() as srv, Client(srv.address, keep_base=True) as c:
        c.push(v0)
        r = c.push(v1)
        assert r.deltas == len(v1) - 1
        assert r.bytes_hashed == whole  # each tensor once: its scan, or the hash beside its send
        _holds(srv, v1)
        assert c.bases is not None
        for name, a in v1.items():
            kept = c.bases.get(name)
            assert kept is not None and kept.data.tobytes() == _bytes(a)
            assert kept.digest == blake3.blake3(_bytes(a)).digest()
        v2 = _step(v1, 0.01, seed=2)
        r = c.push(v2)  # against the refreshed copies
        assert r.deltas >= len(v2) - 1
        _holds(srv, v2)


def test_a_failed_update_forgets_the_kept_bases():
    v0 = _model()
    with Server() as srv, Client(srv.address, keep_base=True) as c:
        c.push(v0)
        srv.close()
        with pytest.raises(TransportError):
            c.push(_step(v0, 0.01, seed=1))
        assert c.bases is not None and c.bases.nbytes == 0


def test_an_in_place_switch_that_fails_on_any_error_takes_back_what_it_applied(monkeypatch):
    from weightlift.errors import WeightliftError
    from weightlift.remote.server.updates import switch

    real, calls = switch.codec.apply_hashed, []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("no memory for the chunk")  # not a DeltaError: any failure mid-switch
        return real(*args, **kwargs)

    v0 = _model()
    with Server() as srv, Client(srv.address, keep_base=True) as c:
        first = c.push(v0)
        monkeypatch.setattr(switch.codec, "apply_hashed", second_fails)
        with pytest.raises(WeightliftError, match=r"DELTA of 'layer\.1': MemoryError"):
            c.push(_step(v0, 0.01, seed=1), in_place=True)
        assert len(calls) == 2
        _holds(srv, v0)  # the first delta, applied in place, was taken back
        assert srv.set_digest(v0) == first.set_digest


def test_an_in_place_delta_that_does_not_decode_is_named_as_it_arrives():
    v0 = np.arange(1 << 12, dtype=np.float32)
    with Server() as srv, Client(srv.address) as c:
        c.push({"w": v0})
        d0 = blake3.blake3(v0.tobytes()).digest()
        payload = struct.pack("<II", 1 << 20, 1) + struct.pack("<I", 0)  # one chunk, no frame: fine
        payload = payload[:4] + struct.pack("<I", 3) + payload[8:]  # three chunks stated for one
        raw = Raw(srv.address)
        raw.hello()
        raw.send(Update(Update.FLAG_IN_PLACE))
        raw.send(Delta(1, "w", "F32", v0.shape, v0.nbytes, DeltaEncoding.XOR, d0, bytes(32), len(payload)), payload)
        errors = _barrier(raw).errors  # not kept for the switch
        assert len(errors) == 1 and "'w'" in errors[0] and "chunks" in errors[0]
        raw.send(Commit())
        commit = raw.recv()
        assert isinstance(commit, CommitReply) and commit.tensors == 0
        assert srv.tensors()["w"].tobytes() == v0.tobytes()
        raw.close()


def test_a_delta_applied_beside_an_in_place_switch_of_its_base_reads_one_version(monkeypatch):
    """One client's out-of-place DELTA reads its base while another client's in-place update of
    the same tensor switches in: the switch waits for the pass (it changes memory a READ would
    read), so the delta sees one version of its base and its result is proven."""
    v0 = {"layer.0": _model()["layer.0"]}
    v1, v2 = _step(v0, 0.01, seed=1), _step(v0, 0.01, seed=2)
    real, other = D.apply_hashed, {}

    def racing(encoding, payload, base, out, item, **kw):
        if out is not base and "thread" not in other:  # b's delta, read out of place
            a = Client(srv.address)

            def switch():
                try:
                    other["reply"] = a.push(v2, base=v0, in_place=True)
                except Exception as e:  # refused: b's version replaced the base it named
                    other["reply"] = e

            t = other["thread"] = threading.Thread(target=switch)
            t.start()
            t.join(2)  # a's switch runs now, unless it waits for this pass (the join gives up)
            other["client"] = a
        return real(encoding, payload, base, out, item, **kw)

    with Server() as srv, Client(srv.address, keep_base=True) as b:
        b.push(v0)
        monkeypatch.setattr(D, "apply_hashed", racing)
        r = b.push(v1)
        other["thread"].join(30)
        other["client"].close()
        assert r.deltas == 1 and r.set_digest == set_digest(_digests(v1))
        got = srv.tensors()["layer.0"].tobytes()
        assert got in (_bytes(v1["layer.0"]), _bytes(v2["layer.0"]))  # one client's version, whole


def test_a_delta_whose_base_is_switched_in_place_before_it_applies_goes_whole(monkeypatch):
    """Another client's in-place update of the base switches in after this DELTA found its base
    but before it reads it: the delta sees the base changed and the tensor is sent whole."""
    from weightlift.remote.server.store import Store

    v0 = {"layer.0": _model()["layer.0"]}
    v1, v2 = _step(v0, 0.01, seed=1), _step(v0, 0.01, seed=2)
    real, other = Store.reading, {}

    def switched_first(store, *memories):
        if "done" not in other:
            other["done"] = True
            with Client(srv.address) as a:  # the in-place switch of the same tensor, run to its end
                other["reply"] = a.push(v2, base=v0, in_place=True)
        return real(store, *memories)

    with Server() as srv, Client(srv.address, keep_base=True) as b:
        b.push(v0)
        monkeypatch.setattr(Store, "reading", switched_first)
        r = b.push(v1)
        assert other["reply"].deltas == 1  # a's update switched in while b's delta waited
        assert r.deltas == 0 and r.set_digest == set_digest(_digests(v1))  # refused, then sent whole
        _holds(srv, v1)


def test_the_scan_runs_on_the_cores_this_process_may_use_not_the_machines(monkeypatch):
    """A process pinned to one core of a large machine (``taskset``, a container's cpuset)
    scans its tensors on one thread: a thread per core of the machine would fight over that one."""
    import os

    from weightlift.remote.client import update

    workers: list[int] = []
    real = update.ThreadPoolExecutor

    def pool(n: int, **kw):
        workers.append(n)
        return real(n, **kw)

    monkeypatch.setattr(update, "ThreadPoolExecutor", pool)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    v0 = _model()
    with Server() as srv, Client(srv.address, keep_base=True) as c:
        c.push(v0)
        assert c.push(_step(v0, 0.01, seed=1)).deltas > 0
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(3)), raising=False)
        c.push(_step(v0, 0.02, seed=2))
    assert workers == [1, 1, 3]  # every update, the first (nothing to scan) too


@needs_cuda
def test_a_cuda_tensor_written_on_a_side_stream_is_pushed_as_written():
    """The caller queued the write on a side stream and pushed without synchronising: the push
    reads the tensor after what the caller's stream had queued, not before."""
    import torch

    t = torch.zeros(16 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with Server() as srv, Client(srv.address) as c, torch.cuda.stream(side):
        torch.cuda._sleep(400_000_000)  # the side stream is busy for a while ...
        t.fill_(3)  # ... before this write runs
        c.push({"w": t})
        assert (srv.tensors()["w"] == 3).all()
