"""Protected frames: on a connection with a token every frame carries a MAC, so a byte changed in
flight in either direction ends the connection and nothing of the changed tensor is published."""

from __future__ import annotations

import os

import numpy as np
import pytest

import weightlift.remote.protocol as P
from tests.remote.models import holds, write_u8
from tests.remote.relay import Relay
from weightlift.errors import AuthError, WeightliftError
from weightlift.remote.client.client import Client
from weightlift.remote.client.pull import read_tensors
from weightlift.remote.protocol import FrameMac, Hello, frame_keys
from weightlift.remote.server.server import Server

TOKEN = b"frame-mac-test-token-0123456789"


def _model(tmp_path) -> tuple[str, dict[str, bytes]]:
    rng = np.random.default_rng(2)
    tensors = {f"w.{i}": rng.integers(0, 256, 5000 * (i + 1), dtype=np.uint8).tobytes() for i in range(3)}
    tensors["big"] = rng.integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()  # sent with sendfile
    tensors["empty"] = b""
    return write_u8(tmp_path / "m.safetensors", tensors)


# ----- the MAC itself ----------------------------------------------------------------------------


def _hellos(**kw) -> tuple[Hello, Hello]:
    return Hello(1, 2, 0, nonce=bytes(range(32))), Hello(1, 2, P.Capability.AUTH, nonce=bytes(range(32, 64)), **kw)


def test_keys_differ_per_direction_and_bind_token_and_both_hellos():
    c, s = _hellos()
    c2s, s2c = frame_keys(TOKEN, c, s)
    assert c2s != s2c and len(c2s) == len(s2c) == 32
    assert frame_keys(TOKEN + b"x", c, s)[0] != c2s
    assert frame_keys(TOKEN, c, _hellos(max_memory=1)[1])[0] != c2s  # a changed HELLO field
    assert frame_keys(TOKEN, Hello(1, 2, 0, nonce=bytes(32)), s)[0] != c2s  # another nonce
    assert frame_keys(TOKEN, c, s) == (c2s, s2c)


def test_a_tag_covers_sequence_and_every_byte():
    key = frame_keys(TOKEN, *_hellos())[0]
    send, recv = FrameMac(key), FrameMac(key)
    frames = [b"first frame", b"second frame" + os.urandom(3 << 20), b""]
    tags = [send.seal([f]) for f in frames]
    assert len(set(tags)) == 3 and all(len(t) == P.MAC_SIZE for t in tags)
    for f, t in zip(frames, tags, strict=False):  # fed in pieces, as bytes arrive
        recv.begin()
        for i in range(0, len(f), 1 << 20):
            recv.update(f[i : i + (1 << 20)])
        recv.check(t)
    replay = FrameMac(key)
    replay.seal([frames[0]])
    replay.begin()
    replay.update(frames[0])  # the first frame again, as the second: its sequence number differs
    with pytest.raises(AuthError, match="MAC"):
        replay.check(tags[0])
    reflected = FrameMac(frame_keys(TOKEN, *_hellos())[1])  # the other direction's key
    reflected.begin()
    reflected.update(frames[0])
    with pytest.raises(AuthError):
        reflected.check(tags[0])
    changed = FrameMac(key)
    changed.begin()
    changed.update(b"first framE")
    with pytest.raises(AuthError):
        changed.check(tags[0])


# ----- over the wire -------------------------------------------------------------------------------


def test_a_token_connection_is_protected_and_moves_every_byte(tmp_path):
    path, tensors = _model(tmp_path)
    out = tmp_path / "out.safetensors"
    with Server(token=TOKEN, cache_dir=tmp_path / "c") as s, Client(s.address, token=TOKEN, streams=2) as c:
        assert c.server_hello.has(P.Capability.MAC)
        assert all(conn.protected for conn in c.connections)
        r = c.push(path, verify=True, hash_threshold=100_000)
        assert r.verified == len(tensors)
        assert c.push(path, hash_threshold=100_000).cached == 1  # HAVE and FILL_FROM_CACHE, protected too
        holds(s, tensors)
        c.pull(out, verify=True)
        assert c.free(["w.0"]) == 1 and len(c.list()) == len(tensors) - 1
    from weightlift import load

    got = load(out)
    assert {n: np.asarray(a).tobytes() for n, a in got.items()} == tensors


def test_without_a_token_frames_are_not_protected(tmp_path):
    with Server() as s, Client(s.address) as c:
        assert not c.connections[0].protected and not c.server_hello.has(P.Capability.MAC)


@pytest.mark.parametrize("where", ["w.1", "big"])
def test_a_byte_changed_on_the_way_in_fails_the_push_and_publishes_nothing_of_it(tmp_path, where):
    path, tensors = _model(tmp_path)
    target = tensors[where]
    with Server(token=TOKEN) as s:
        with Relay(s.address, tamper=("c2s", target[2000:2032], 9)) as relay:
            with Client(relay.address, token=TOKEN) as c, pytest.raises(AuthError, match="MAC"):
                c.push(path)
            assert relay.flipped.is_set()
        assert where not in s.tensors()
        for name, arr in s.tensors().items():  # what was published before the change is intact
            assert arr.tobytes() == tensors[name]
        assert s.stats()["errors"] >= 1


def test_a_changed_header_fails_too(tmp_path):
    path, tensors = _model(tmp_path)
    with Server(token=TOKEN) as s:
        with Relay(s.address, tamper=("c2s", b"w.2", 2)) as relay:  # the name in an ALLOC: w.2 -> w.\xcd
            with Client(relay.address, token=TOKEN) as c, pytest.raises(AuthError, match="MAC"):
                c.push(path)
            assert relay.flipped.is_set()
        assert not any(n.startswith("w.") and n not in tensors for n in s.tensors())


def test_a_byte_changed_on_the_way_out_fails_the_pull_and_writes_no_file(tmp_path):
    path, tensors = _model(tmp_path)
    out = tmp_path / "out.safetensors"
    with Server(token=TOKEN) as s:
        with Client(s.address, token=TOKEN) as c:
            c.push(path)
        with Relay(s.address, tamper=("s2c", tensors["w.2"][100:132], 1)) as relay:
            with Client(relay.address, token=TOKEN) as c, pytest.raises(AuthError, match="MAC"):
                c.pull(out)  # not even asked to verify: the MAC alone catches it
            assert relay.flipped.is_set()
        assert not out.exists()


def test_no_downgrade_below_the_protected_minor_with_a_token(tmp_path):
    with Server(token=TOKEN) as s:
        with pytest.raises(AuthError, match="cannot protect"):
            Client(s.address, token=TOKEN, protocol_minor=1)
    with Server(token=TOKEN, protocol_minor=1) as s:
        with pytest.raises(AuthError, match="cannot protect"):
            Client(s.address, token=TOKEN)
        # both ends told to speak the older minor: unprotected, as that minor always was
        with Client(s.address, token=TOKEN, protocol_minor=1) as c:
            assert not c.connections[0].protected
            assert c.list() == []


def test_a_server_error_after_auth_is_protected_too(tmp_path):
    with Server(token=TOKEN) as s, Client(s.address, token=TOKEN) as c:
        with pytest.raises(WeightliftError, match="no tensor"):
            read_tensors(c.connections[0], [P_entry("missing")], [0], None)
        assert c.list() == []  # the ERROR's tag checked, the connection still in step


def P_entry(name: str):  # noqa: N802 - a listing entry for a tensor that does not exist
    from weightlift.remote.protocol import ListEntry

    return ListEntry(name, "U8", (0,), 0)
