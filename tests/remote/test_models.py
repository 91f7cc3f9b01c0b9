"""Models as units on a server (protocol 1.5): a checkpoint's push is visible whole or not at all,
several models under names, their removal, and the server's stats over the wire."""

from __future__ import annotations

import numpy as np
import pytest

import weightlift.remote.protocol as P
from tests.remote.models import holds, write_u8
from tests.remote.rawclient import Raw, _barrier, _f32, _put
from tests.waiting import wait_for
from weightlift.errors import LocalProtocolError, StateError, WeightliftError
from weightlift.remote.client.client import Client
from weightlift.remote.client.connection import Busy
from weightlift.remote.client.push import Pusher
from weightlift.remote.server.server import Server


def _bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _model(tmp_path, name: str, count: int, size: int, seed: int = 0) -> tuple[str, dict[str, bytes]]:
    return write_u8(tmp_path / f"{name}.safetensors", {f"t.{i:03d}": _bytes(size, seed + i) for i in range(count)})


def test_a_push_refused_by_the_memory_limit_leaves_nothing_visible_and_no_memory_held(tmp_path):
    small, small_t = _model(tmp_path, "small", 4, 1000)
    big, _ = _model(tmp_path, "big", 90, 64 << 10, seed=100)
    with Server(max_memory=2 << 20) as s, Client(s.address) as c:
        c.push(small)
        held = s.stats()["memory_used"]
        with pytest.raises(WeightliftError, match="memory limit"):
            c.push(big)  # about 5.8 MiB into 2 MiB: most tensors would fit before the limit refuses
        holds(s, small_t)  # the earlier version is served whole, nothing of the refused push
        assert [t.name for t in c.list()] == sorted(small_t)
        wait_for(lambda: s.stats()["memory_used"] == held)  # what the refused push took went back
        stats = s.stats()
        assert stats["pushes_committed"] == 1 and stats["pushes_rolled_back"] == 1 and stats["pushes_refused"] == 1
        c.push(small)  # the connection is still in step with the server
        holds(s, small_t)


def test_a_push_over_several_streams_becomes_visible_at_once(tmp_path):
    path, tensors = _model(tmp_path, "m", 24, 3000)
    with Server() as s, Client(s.address, streams=3) as c:
        seen: list[int] = []
        real = Pusher._barrier

        def barrier(self, *, last=True):  # what another client sees at each stream's last barrier
            seen.append(len(s.tensors()))
            real(self, last=last)

        Pusher._barrier = barrier  # type: ignore[method-assign]
        try:
            r = c.push(path)
        finally:
            Pusher._barrier = real  # type: ignore[method-assign]
        assert r.tensors == len(tensors) and s.stats()["connections"] == 3
        assert seen == [0, 0, 0]  # nothing visible before the COMMIT, though every stream had sent its share
        holds(s, tensors)


def test_a_client_gone_mid_push_leaves_nothing_and_gives_its_memory_back(tmp_path):
    with Server() as s:
        raw = Raw.connected(s.address)
        raw.send(P.Update(0, 0))
        _put(raw, 0, "w", _f32(1000))
        assert _barrier(raw).tensors == 1  # complete on the server, held back by the open push
        with Client(s.address) as other:
            assert other.list() == [] and other.stats()["tensors_held"] == 0
            assert other.stats().model("").pushing
        assert s.stats()["memory_used"] > 0
        raw.close()
        wait_for(lambda: s.stats()["memory_used"] == 0)
        assert s.tensors() == {} and s.stats()["pushes_rolled_back"] == 1


def test_models_are_namespaces_of_their_own(tmp_path):
    a, a_t = _model(tmp_path, "a", 3, 100, seed=1)
    b, b_t = _model(tmp_path, "b", 5, 200, seed=2)
    plain, plain_t = write_u8(tmp_path / "plain.safetensors", {"t.000": b"default"})
    with Server() as s, Client(s.address) as c:
        c.push(a, model="llama-a")
        c.push(b, model="llama-b")
        c.push(plain)  # no model: the default one, as an old client pushes
        holds(s, plain_t)  # the server's own view of its default model is what it always was
        assert {n: t.tobytes() for n, t in s.tensors(model="llama-a").items()} == a_t
        assert [t.name for t in c.list(model="llama-b")] == sorted(b_t)
        assert [t.name for t in c.list()] == ["t.000"]
        out = tmp_path / "pulled.safetensors"
        c.pull(out, model="llama-a", verify=True)
        from safetensors.numpy import load_file

        assert {n: v.tobytes() for n, v in load_file(out).items()} == a_t
        assert c.free("t.001", model="llama-b") == 1 and len(c.list(model="llama-b")) == 4
        report = c.stats()
        assert [(m.name, m.tensors, m.nbytes) for m in report.models] == [
            ("", 1, 7),
            ("llama-a", 3, 300),
            ("llama-b", 4, 800),
        ]
        assert report.models_total == 3 and report["models"] == 3 and report["tensors_held"] == 8
        assert c.remove("llama-a") == 3
        assert c.list(model="llama-a") == [] and s.tensors(model="llama-a") == {}
        assert [m.name for m in c.stats().models] == ["", "llama-b"]
        assert c.remove("nothing-here") == 0
        assert s.stats()["removes"] == 2


def test_an_old_client_sees_the_default_model_only(tmp_path):
    a, _ = _model(tmp_path, "a", 3, 100)
    plain, plain_t = write_u8(tmp_path / "plain.safetensors", {"x": b"old"})
    with Server() as s, Client(s.address) as c, Client(s.address, protocol_minor=4) as old:
        c.push(a, model="m")
        old.push(plain)
        assert [t.name for t in old.list()] == ["x"] and [t.name for t in c.list()] == ["x"]
        holds(s, plain_t)
        with pytest.raises(LocalProtocolError, match="protocol 1.4.*1.5"):
            old.stats()
        with pytest.raises(LocalProtocolError, match="no named models"):
            old.list(model="m")


def test_a_server_of_minor_four_answers_stats_and_rm_cleanly(tmp_path):
    with Server(protocol_minor=4) as s, Client(s.address) as c:
        with pytest.raises(LocalProtocolError, match="protocol 1.4, which has no stats"):
            c.stats()
        with pytest.raises(LocalProtocolError, match="protocol 1.4, which has no remove"):
            c.remove("m")
        c.push({"w": np.arange(4, dtype=np.float32)})  # and it still takes pushes as before
        assert [t.name for t in c.list()] == ["w"]


def test_removing_a_model_while_a_push_to_it_is_in_flight_is_refused(tmp_path):
    a, a_t = _model(tmp_path, "a", 3, 100)
    with Server() as s, Client(s.address) as c:
        c.push(a, model="m")
        raw = Raw.connected(s.address)
        raw.send(P.UseModel("m"))
        raw.send(P.Update(0, 0))
        _put(raw, 0, "new", _f32(10))
        assert _barrier(raw).tensors == 1
        with pytest.raises(Busy, match="push to model 'm' is in flight"):
            c.remove("m")
        assert isinstance(Busy("x"), StateError)
        assert {n: t.tobytes() for n, t in s.tensors(model="m").items()} == a_t  # nothing removed
        assert c.remove("other") == 0  # another model is not held up
        raw.send(P.Commit(P.Commit.FLAG_NO_ROOT))
        reply = raw.recv()
        assert reply.ok and reply.tensors == 1 and reply.root == bytes(32)
        assert sorted(s.tensors(model="m")) == ["new", *sorted(a_t)]
        assert c.remove("m") == 4
        raw.close()


def test_joining_a_push_that_is_not_open_is_a_protocol_error():
    with Server() as s:
        raw = Raw.connected(s.address)
        raw.send(P.Update(P.Update.FLAG_JOIN, 12345))
        reply = raw.recv()
        assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.PROTOCOL
        assert "12345" in reply.message


def test_stats_over_the_wire_are_the_servers_own_figures(tmp_path):
    path, tensors = _model(tmp_path, "m", 4, 500)
    with Server(max_memory=64 << 20) as s, Client(s.address) as c:
        c.push(path)
        report = c.stats()
        mine = s.stats()
        for key in ("tensors", "bytes_received", "tensors_held", "bytes_held", "max_memory", "pushes_committed"):
            assert report[key] == mine[key], key
        assert report["max_memory"] == 64 << 20 and report["stats_requests"] == 1
        assert set(mine) <= set(report.figures)
        assert report.as_dict()["models"] == [{"name": "", "tensors": 4, "bytes": 2000, "pushing": False}]


def test_stats_need_the_token_like_every_other_request():
    with Server(token="secret-token-of-some-length") as s:
        raw = Raw.connected(s.address)  # no AUTH
        raw.send(P.Stats())
        reply = raw.recv()
        assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.AUTH
        with Client(s.address, token="secret-token-of-some-length") as c:
            assert c.stats()["connections"] == 2


def test_a_tensor_name_the_models_reserve_is_refused(tmp_path):
    with Server() as s:
        raw = Raw.connected(s.address)
        _put(raw, 0, "\x00m\x00w", _f32(4))
        reply = _barrier(raw)
        assert reply.tensors == 0 and "NUL" in reply.errors[0]
        assert s.tensors() == {}


def test_the_wire_refuses_a_commit_without_an_update():
    with Server() as s:
        raw = Raw.connected(s.address)
        raw.send(P.Commit(P.Commit.FLAG_NO_ROOT))
        reply = raw.recv()
        assert isinstance(reply, P.Error) and "COMMIT without an open update" in reply.message


@pytest.mark.parametrize("why", ["model", "in_place"])
def test_a_join_into_another_model_or_an_in_place_update_is_refused(why):
    with Server() as s:
        opener = Raw.connected(s.address)
        opener.send(P.Update(P.Update.FLAG_IN_PLACE if why == "in_place" else 0, 77))
        assert _barrier(opener).errors == ()  # open on the server
        joiner = Raw.connected(s.address)
        if why == "model":
            joiner.send(P.UseModel("other"))
        joiner.send(P.Update(P.Update.FLAG_JOIN, 77))
        reply = joiner.recv()
        assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.PROTOCOL
        assert ("fills another" if why == "model" else "in-place") in reply.message
        opener.send(P.Commit())
        assert opener.recv().ok  # the opener's update is untouched


def test_a_push_into_another_model_does_not_make_a_reader_start_over(tmp_path):
    a, _ = _model(tmp_path, "a", 2, 100, seed=1)
    b, _ = _model(tmp_path, "b", 2, 100, seed=2)
    with Server() as s, Client(s.address) as c:
        c.push(a, model="a")
        raw = Raw.connected(s.address)
        raw.send(P.UseModel("a"))
        raw.send(P.ListRequest())
        listed = raw.recv()
        c.push(b, model="b")  # a switch into model b moves the server's generation
        assert s.generation > listed.generation
        e = listed.entries[0]
        raw.send(P.Read(e.name, 0, e.nbytes, 0, e.version, listed.generation))
        reply = raw.recv()
        assert isinstance(reply, P.ReadReply), reply  # served: model a did not change
        raw.read_payload(e.nbytes)
        c.push(a, model="a")  # a switch into model a: the listing is stale now
        raw.send(P.Read(e.name, 0, e.nbytes, 0, 0, listed.generation))
        reply = raw.recv()
        assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.STALE


def test_an_error_names_a_tensor_as_its_client_did():
    with Server() as s:
        raw = Raw.connected(s.address)
        raw.send(P.UseModel("m"))
        raw.send(P.Alloc(0, "w", "F32", (4,), 16))
        raw.send(P.WriteHeader(0, 0, 32), bytes(32))
        (error,) = _barrier(raw).errors
        assert "'w' (model 'm')" in error and "\\x00" not in error, error


def test_reading_everything_gives_the_default_model_only(tmp_path):
    # what the vLLM engine copies into the model (reading() with no names): a named model pushed
    # to the same server must not come along under the store's NUL-marked keys
    a, _ = _model(tmp_path, "a", 2, 100)
    plain, plain_t = write_u8(tmp_path / "plain.safetensors", {"w": b"default"})
    with Server() as s, Client(s.address) as c:
        c.push(a, model="other")
        c.push(plain)
        with s.reading() as held:
            assert {n: t.tobytes() for n, t in held.items()} == plain_t
        with s.reading(["w"]) as held:
            assert list(held) == ["w"]


def test_tensors_from_memory_pushed_into_a_named_model(tmp_path):
    # a push from memory is an update whose COMMIT_REPLY states the set digest of the tensors it
    # switched in: the server took it over its store keys ("\x00m\x00w"), the client over the
    # names it pushed, so every such push into a named model failed as an IntegrityError
    v1, v2 = np.arange(8, dtype=np.float32), np.arange(8, dtype=np.float32) * 3
    with Server() as s, Client(s.address, keep_base=True) as c:
        c.push({"w": v1}, model="m")
        c.push({"w": v2}, model="m")  # the second as a delta against the first
        assert s.tensors(model="m")["w"].tobytes() == v2.tobytes() and s.tensors() == {}
        c.push({"w": v1})  # the default model's, a tensor of its own
        assert s.tensors()["w"].tobytes() == v1.tobytes()
        assert s.tensors(model="m")["w"].tobytes() == v2.tobytes()


def test_an_update_fills_the_one_model_it_was_opened_in(tmp_path):
    # a MODEL inside an open update sent its later tensors into another model under the first
    # one's update: a REMOVE of that other model was not refused as busy, and the COMMIT then
    # published into it; the server refuses it, as it refuses a JOIN from another model
    with Server() as s:
        raw = Raw.connected(s.address)
        raw.send(P.UseModel("a"))
        raw.send(P.Update(0, 0))
        raw.send(P.UseModel("a"))  # the same model: nothing changes
        raw.send(P.UseModel("b"))
        reply = raw.recv()
        assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.PROTOCOL
        assert "MODEL 'b' inside an update of model 'a'" in reply.message
        raw.close()
        wait_for(lambda: s.stats()["pushes_rolled_back"] == 1)


def test_the_set_digest_of_a_model_takes_only_its_tensors(tmp_path):
    # set_digest() with no names mixed every model's internal keys into the default model's digest
    a, a_t = _model(tmp_path, "a", 3, 100)
    b, b_t = _model(tmp_path, "b", 2, 100, seed=50)
    with Server() as s, Client(s.address) as c:
        c.push(a, model="m")
        c.push(b)
        assert s.set_digest() == s.set_digest(sorted(b_t))
        assert s.set_digest(model="m") == s.set_digest(sorted(a_t), model="m") != s.set_digest()
        with pytest.raises(KeyError, match="no tensor 't.002' in model 'x'"):
            s.set_digest(["t.002"], model="x")
        with pytest.raises(KeyError, match="no tensor 't.002'"):
            s.set_digest(["t.002"])  # the default model holds two
