"""push(verify=True) and pull(verify=True): the server reports the digests of what it stored (or
states them with what it serves), and a byte changed on the wire or in a cache entry is caught
and named."""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import replace

import blake3
import numpy as np
import pytest

import weightlift.remote.protocol as P
from tests.checkpoints import write, write_sharded
from tests.remote.relay import Relay
from weightlift import open as wl_open
from weightlift.cli.main import main as cli
from weightlift.digest.published import Manifest, make_manifest
from weightlift.errors import IntegrityError, LocalProtocolError, OptionError, PushError, RemoteProtocolError
from weightlift.remote.client.client import Client
from weightlift.remote.client.servers import push_each
from weightlift.remote.protocol import NEED_DATA, Alloc, Barrier, BarrierReply, Decoder, Hello, WriteHeader, send
from weightlift.remote.server.server import Server

THRESHOLD = 100_000  # tensors at least this large are named by digest to a caching server


def _model(tmp_path, name: str = "m.safetensors") -> tuple[str, dict[str, bytes]]:
    rng = np.random.default_rng(1)
    tensors = {f"small.{i}": rng.integers(0, 256, 300 * (i + 1), dtype=np.uint8).tobytes() for i in range(4)}
    tensors["empty"] = b""
    tensors.update({f"large.{i}": rng.integers(0, 256, 150_000 + i, dtype=np.uint8).tobytes() for i in range(3)})
    path = write(tmp_path / name, [(n, "U8", (len(b),), b) for n, b in tensors.items()])
    return str(path), tensors


def _holds(server: Server, tensors: dict[str, bytes]) -> None:
    got = server.tensors()
    assert sorted(got) == sorted(tensors)
    for n, b in tensors.items():
        assert got[n].tobytes() == b, n


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("streams", [1, 2])
def test_verified_push_proves_every_tensor(tmp_path, cache, streams):
    path, tensors = _model(tmp_path)
    with Server(cache_dir=tmp_path / "c" if cache else None) as s:
        with Client(s.address, streams=streams) as c:
            assert c.server_hello.has(P.Capability.VERIFY)
            r = c.push(path, verify=True, hash_threshold=THRESHOLD)
            assert (r.tensors, r.verified) == (len(tensors), len(tensors))
            again = c.push(path, verify=True, hash_threshold=THRESHOLD)  # from the cache when there is one
            assert again.verified == len(tensors)
            assert again.cached == (3 if cache else 0)
        _holds(s, tensors)


def test_a_push_without_verify_verifies_nothing(tmp_path):
    path, tensors = _model(tmp_path)
    with Server() as s, Client(s.address) as c:
        assert c.push(path).verified == 0


def test_a_flipped_byte_on_the_wire_is_caught_only_with_verify(tmp_path):
    # An unauthenticated connection has nothing that protects its frames: a relay on the path
    # changes a byte of a tensor after a valid handshake. A plain push "succeeds" and the server
    # holds the wrong bytes; a verified push names the tensor.
    path, tensors = _model(tmp_path)
    target = tensors["small.2"]
    for verify in (False, True):
        with Server() as s, Relay(s.address, tamper=("c2s", target[40:72], 5)) as relay:
            with Client(relay.address) as c:
                if not verify:
                    c.push(path)
                else:
                    with pytest.raises(IntegrityError, match=r"1 of 8 tensors.*'small\.2'") as e:
                        c.push(path, verify=True)
                    assert "large" not in str(e.value)
                    # the connection is still in step after the failure, and nothing of the push shows
                    assert c.list() == [] and s.stats()["pushes_rolled_back"] == 1
            assert relay.flipped.is_set()
            if not verify:
                held = s.tensors()["small.2"].tobytes()
                assert held != target and held[:45] == target[:45] and held[46:] == target[46:]


def test_a_flipped_byte_in_a_large_tensor_is_caught_with_a_caching_server(tmp_path):
    # a tensor named by digest is proven by the server itself; the push fails either way
    path, tensors = _model(tmp_path)
    target = tensors["large.1"]
    with Server(cache_dir=tmp_path / "c") as s, Relay(s.address, tamper=("c2s", target[9000:9032], 3)) as relay:
        with Client(relay.address) as c, pytest.raises(RemoteProtocolError, match="large.1.*do not match"):
            c.push(path, verify=True, hash_threshold=THRESHOLD)
        assert relay.flipped.is_set()
        assert "large.1" not in s.tensors()


def test_a_flipped_byte_in_a_cache_entry_never_reaches_the_server_memory(tmp_path):
    path, tensors = _model(tmp_path)
    cache = tmp_path / "c"
    with Server(cache_dir=cache) as s, Client(s.address) as c:
        c.push(path, verify=True, hash_threshold=THRESHOLD)
    digest = blake3.blake3(tensors["large.0"]).digest()
    entry = cache / digest.hex()[:2] / digest.hex()
    raw = bytearray(entry.read_bytes())
    raw[1234] ^= 1
    entry.write_bytes(bytes(raw))
    with Server(cache_dir=cache) as s, Client(s.address) as c:  # a restarted server, filling from disk
        r = c.push(path, verify=True, hash_threshold=THRESHOLD)
        # the cache's own check dropped the bad entry and the client sent the bytes again
        assert (r.verified, r.cached) == (len(tensors), 2)
        assert r.bytes_sent >= len(tensors["large.0"])
        _holds(s, tensors)
    assert not entry.exists() or entry.read_bytes() == tensors["large.0"]


def test_verify_against_a_minor_one_server_is_a_clear_error(tmp_path):
    path, tensors = _model(tmp_path)
    with Server(protocol_minor=1) as s, Client(s.address) as c:
        assert not c.server_hello.has(P.Capability.VERIFY)
        with pytest.raises(LocalProtocolError, match="protocol 1.1.*minor 2"):
            c.push(path, verify=True)
        with pytest.raises(LocalProtocolError, match="protocol 1.1.*minor 2"):
            c.pull(tmp_path / "out.safetensors", verify=True)
        c.push(path)  # nothing was sent: the connection still works
        _holds(s, tensors)


def test_verified_pull_writes_the_server_tensors(tmp_path):
    path, tensors = _model(tmp_path)
    out = tmp_path / "out.safetensors"
    with Server() as s, Client(s.address) as c:
        c.push(path)
        got = c.pull(out, verify=True)
    assert {e.name for e in got} == set(tensors)
    from weightlift import load

    loaded = load(out)
    for n, b in tensors.items():
        assert np.asarray(loaded[n]).tobytes() == b


def test_a_flipped_byte_on_the_way_back_fails_a_verified_pull_and_writes_no_file(tmp_path):
    path, tensors = _model(tmp_path)
    target = tensors["large.2"]
    out = tmp_path / "out.safetensors"
    with Server() as s:
        with Client(s.address) as c:
            c.push(path)
        with Relay(s.address, tamper=("s2c", target[5000:5032], 7)) as relay, Client(relay.address) as c:
            with pytest.raises(IntegrityError, match=r"'large\.2'") as e:
                c.pull(out, verify=True)
            assert "small" not in str(e.value) and relay.flipped.is_set()
            assert not out.exists() and not [f for f in os.listdir(tmp_path) if "wl-tmp" in f]
            assert len(c.list()) == len(tensors)  # still in step


def test_cli_push_and_pull_verify(tmp_path, capsys):
    path, tensors = _model(tmp_path)
    with Server() as s:
        addr = f"{s.address[0]}:{s.address[1]}"
        assert cli(["push", path, "--to", addr, "--verify"]) == 0
        out = capsys.readouterr().out  # no published manifest: nothing is called verified
        assert f"{len(tensors)} checked on the server against the files as they are now" in out
        assert "verified" not in out
        assert cli(["pull", "--from", addr, "-o", str(tmp_path / "o.safetensors"), "--verify"]) == 0
        assert "every tensor equal to what the server holds" in capsys.readouterr().out
        assert cli(["manifest", path]) == 0
        capsys.readouterr()
        assert cli(["push", path, "--to", addr, "--verify"]) == 0
        assert f"{len(tensors)} verified on the server against the published manifest {path}.manifest.json" in (
            capsys.readouterr().out
        )
        with Relay(s.address, tamper=("c2s", tensors["small.3"][100:132], 0)) as relay:
            raddr = f"{relay.address[0]}:{relay.address[1]}"
            assert cli(["push", path, "--to", raddr, "--verify"]) == 1
            assert "'small.3'" in capsys.readouterr().err


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("cache", [False, True])
def test_a_byte_flipped_on_disk_after_publishing_fails_a_verified_push(tmp_path, capsys, cache):
    """The file's own digests follow the file; only the published manifest beside it can tell."""
    path, tensors = _model(tmp_path)
    assert cli(["manifest", path]) == 0
    with Server(cache_dir=tmp_path / "c" if cache else None) as s, Client(s.address) as c:
        assert c.push(path, verify=True, hash_threshold=THRESHOLD).manifest == path + ".manifest.json"
        _flip(path, wl_open(path)["large.1"].offset + 1234)
        with pytest.raises(IntegrityError, match=r"as published in .*m\.safetensors\.manifest\.json: 'large\.1'"):
            c.push(path, verify=True, hash_threshold=THRESHOLD)
        capsys.readouterr()
        addr = f"{s.address[0]}:{s.address[1]}"
        assert cli(["push", path, "--to", addr, "--verify"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "'large.1'" in err and "manifest.json" in err


# ----- push(manifest=...): the published digests the server must report ------------------------


def _lying(m: Manifest, name: str) -> Manifest:
    """``m`` with another digest for ``name``: a well-formed manifest that lies about one tensor."""
    return Manifest(tuple(replace(e, blake3="00" * 32) if e.name == name else e for e in m.entries))


@pytest.mark.parametrize("layout", ["file", "folder"])
@pytest.mark.parametrize("given", ["path", "object"])
def test_a_push_with_a_matching_manifest_is_verified_without_hashing_on_the_client(tmp_path, layout, given):
    path, tensors = _model(tmp_path)
    if layout == "folder":
        items = [(n, "U8", (len(b),), b) for n, b in tensors.items()]
        path = str(write_sharded(tmp_path / "sharded", items, 3))
    m = make_manifest(path)
    out = tmp_path / "published.manifest.json"
    out.write_text(m.to_json())
    with Server() as s, Client(s.address) as c:
        r = c.push(path, verify=True, manifest=str(out) if given == "path" else m)
        assert (r.tensors, r.verified, r.bytes_hashed) == (len(tensors), len(tensors), 0)
        _holds(s, tensors)


def test_a_push_whose_manifest_lies_about_a_tensor_is_refused_naming_it(tmp_path):
    path, tensors = _model(tmp_path)
    with Server() as s, Client(s.address) as c:
        with pytest.raises(IntegrityError, match=r"1 of 8 tensors.*'small\.1' \(server [0-9a-f]+, published 0000") as e:
            c.push(path, verify=True, manifest=_lying(make_manifest(path), "small.1"))
        assert "large" not in str(e.value) and "small.0" not in str(e.value)
        assert c.push(path, verify=True, manifest=make_manifest(path)).verified == len(tensors)  # still in step


def test_a_push_whose_manifest_lacks_a_tensor_is_refused_before_any_byte_is_sent(tmp_path):
    path, tensors = _model(tmp_path)
    m = make_manifest(path)
    short = Manifest(tuple(e for e in m.entries if e.name != "large.2"))
    with Server() as s, Server() as other, Client(s.address) as c:
        with pytest.raises(IntegrityError, match=r"1 tensor\(s\) not in the manifest.*large\.2"):
            c.push(path, verify=True, manifest=short)
        with pytest.raises(IntegrityError, match=r"large\.2"):  # to several servers: checked before any starts
            c.push(path, verify=True, manifest=short, to=[other.address])
        for server in (s, other):
            assert server.tensors() == {} and server.stats()["bytes_received"] == 0
        # a selection the manifest covers goes
        assert c.push(path, select="small.*", verify=True, manifest=short).verified == 4


def test_a_push_to_several_servers_checks_each_against_the_manifest(tmp_path):
    path, tensors = _model(tmp_path)
    with Server() as s, Server() as other, Client(s.address) as c:
        got = c.push(path, verify=True, manifest=make_manifest(path), to={other.address: "large.*"}, select="small.*")
        assert sorted(r.verified for r in got.values()) == [3, 4]
        with pytest.raises(PushError) as e:
            c.push(
                path,
                verify=True,
                manifest=_lying(make_manifest(path), "large.0"),
                to={other.address: "large.*"},
                select="small.*",
            )
        assert list(e.value.errors) == [f"{other.address[0]}:{other.address[1]}"]
        assert "'large.0'" in str(e.value.errors[f"{other.address[0]}:{other.address[1]}"])


def test_push_manifest_options_that_do_not_go_together(tmp_path):
    path, _ = _model(tmp_path)
    m = make_manifest(path)
    with Server() as s, Client(s.address) as c:
        with pytest.raises(OptionError, match="verify=True"):
            c.push(path, manifest=m)
        with pytest.raises(OptionError, match="takes a checkpoint"):
            c.push({"w": np.zeros(4, np.uint8)}, verify=True, manifest=m)
        with pytest.raises(OptionError, match="verify=True"):
            push_each(path, {s.address: None}, connect=lambda a: Client(a), manifest=m)
        assert s.stats()["bytes_received"] == 0


@pytest.mark.parametrize("holds", ["memory", "disk"])
def test_a_manifest_never_picks_the_bytes_a_caching_server_fills_a_tensor_with(tmp_path, holds):
    """A caching server fills a tensor asked about by digest from bytes it already holds. The
    digest asked about is the file's own, so a manifest giving ``large.0`` the digest of other
    bytes of its length (which the server holds) cannot land those in its place: the server
    gets the file's bytes and the push is refused naming the tensor, as on a server without them."""
    path, tensors = _model(tmp_path)
    n = len(tensors["large.0"])
    decoy = bytes(range(256)) * (n // 256) + bytes(n % 256)
    other = str(write(tmp_path / "other.safetensors", [("other", "U8", (n,), decoy)]))
    m = make_manifest(path)
    lie = Manifest(
        tuple(replace(e, blake3=blake3.blake3(decoy).hexdigest()) if e.name == "large.0" else e for e in m.entries)
    )
    cache = tmp_path / "c"
    with Server(cache_dir=cache) as s, Client(s.address) as c:
        c.push(other, hash_threshold=1000)
        assert s.stats()["bytes_received"] == n
    # minor 4: tensors visible as they land, so the one filled can be looked at after the refusal
    with Server(cache_dir=cache) as s, Client(s.address, protocol_minor=4) as c:
        if holds == "memory":
            c.push(other, hash_threshold=1000)
            assert s.stats()["bytes_received"] == 0  # from the disk cache: held in memory now too
        with pytest.raises(IntegrityError, match=r"1 of 8 tensors.*'large\.0' \(server [0-9a-f]+, published"):
            c.push(path, verify=True, manifest=lie, hash_threshold=1000)
        assert s.tensors()["large.0"].tobytes() == tensors["large.0"]  # the file's bytes, never the decoy


def test_cli_push_with_a_manifest(tmp_path, capsys):
    path, tensors = _model(tmp_path)
    good, bad = tmp_path / "good.manifest.json", tmp_path / "bad.manifest.json"
    good.write_text(make_manifest(path).to_json())
    bad.write_text(_lying(make_manifest(path), "small.3").to_json())
    with Server() as s:
        addr = f"{s.address[0]}:{s.address[1]}"
        assert cli(["push", path, "--to", addr, "--manifest", str(good)]) == 0  # --manifest implies --verify
        assert f"{len(tensors)} verified on the server" in capsys.readouterr().out
        assert cli(["push", path, "--to", addr, "--manifest", str(bad)]) == 1
        assert "'small.3'" in capsys.readouterr().err


# ----- the server side, frame by frame ---------------------------------------------------------


class _Raw:
    def __init__(self, address):
        self.sock = socket.create_connection(address, timeout=10)
        self.dec = Decoder(our_role="client")
        self.sock.sendall(send(Hello(1, P.PROTOCOL_MINOR, nonce=P.new_nonce())))
        self.hello = self.recv()

    def send(self, msg, payload: bytes = b"") -> None:
        self.sock.sendall(send(msg) + payload)

    def recv(self):
        while (ev := self.dec.next_event()) is NEED_DATA:
            self.dec.feed(self.sock.recv(65536))
        return ev


def test_server_reports_digests_only_for_verify_allocs_and_only_when_asked():
    a, b = b"abc" * 1000, os.urandom(5000)
    with Server() as s:
        raw = _Raw(s.address)
        raw.send(Alloc(1, "a", "U8", (len(a),), len(a), None, True))
        # out of order: hashed once complete, from memory
        raw.send(WriteHeader(1, 1000, len(a) - 1000), a[1000:])
        raw.send(WriteHeader(1, 0, 1000), a[:1000])
        raw.send(Alloc(2, "b", "U8", (len(b),), len(b)))
        raw.send(WriteHeader(2, 0, len(b)), b)
        raw.send(Alloc(3, "z", "U8", (0,), 0, None, True))
        raw.send(Barrier(Barrier.FLAG_DIGESTS))
        reply = raw.recv()
        assert reply == BarrierReply(
            3, len(a) + len(b), digests=((1, blake3.blake3(a).digest()), (3, blake3.blake3(b"").digest()))
        )
        raw.send(Alloc(4, "a2", "U8", (len(a),), len(a), None, True))
        raw.send(WriteHeader(4, 0, len(a)), a)
        raw.send(Barrier())  # not asked: the digests are dropped with the barrier
        assert raw.recv().digests == ()
        raw.send(Barrier(Barrier.FLAG_DIGESTS))
        assert raw.recv().digests == ()


def test_server_remembers_at_most_max_digests_between_barriers(monkeypatch):
    import weightlift.remote.server.receive as receive

    monkeypatch.setattr(receive, "MAX_DIGESTS", 3)
    with Server() as s:
        raw = _Raw(s.address)
        for i in range(5):
            raw.send(Alloc(i, f"t{i}", "U8", (1,), 1, None, True))
            raw.send(WriteHeader(i, 0, 1), bytes([i]))
        raw.send(Barrier(Barrier.FLAG_DIGESTS))
        reply = raw.recv()
        assert [i for i, _ in reply.digests] == [0, 1, 2]
        assert len(reply.errors) == 1 and "2 verified tensors" in reply.errors[0]
        assert struct.calcsize("<I32s") * P.MAX_DIGESTS < P.MIN_FRAME // 2
