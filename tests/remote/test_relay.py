"""Relayed pushes on loopback: one selection pushed to a chain of servers, each byte out of the
client once, every tensor proven against the origin's digest at every hop, tokens and TLS on
every hop, and a hop that fails named."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

from tests.checkpoints import write
from tests.remote.test_tls import _self_signed
from weightlift.errors import LocalProtocolError, OptionError, PushError, RemoteProtocolError
from weightlift.remote import protocol as P
from weightlift.remote.client import client as client_module
from weightlift.remote.client.client import Client
from weightlift.remote.server import relay as relay_module
from weightlift.remote.server.server import Server
from weightlift.remote.transport import client_tls_context, server_tls_context

TOKEN = b"relay-test-token-0123456789abcdef"


def _model(tmp_path) -> tuple[str, dict[str, bytes]]:
    rng = np.random.default_rng(35)
    tensors = {f"w.{i}": rng.integers(0, 256, 9000 * (i + 1), dtype=np.uint8).tobytes() for i in range(5)}
    tensors["big"] = rng.integers(0, 256, (2 << 20) + 3, dtype=np.uint8).tobytes()  # the sendfile path
    tensors["empty"] = b""
    path = write(tmp_path / "m.safetensors", [(n, "U8", (len(b),), b) for n, b in tensors.items()])
    return str(path), tensors


def _key(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


def _holds(server: Server, tensors: dict[str, bytes]) -> None:
    got = server.tensors()
    assert {n: got[n].tobytes() for n in got} == tensors


@contextlib.contextmanager
def _fleet(n: int, **options):
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(Server(**options)) for _ in range(n)]  # started
        yield servers, [_key(s.address) for s in servers]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_chain_delivers_every_byte_to_every_server_sending_it_once(tmp_path, n):
    path, tensors = _model(tmp_path)
    model = sum(len(b) for b in tensors.values())
    with _fleet(n, token=TOKEN) as (servers, addrs):
        with Client(addrs[0], token=TOKEN) as c:
            results = c.push(path, to=addrs[1:])
        assert list(results) == addrs
        for s in servers:
            _holds(s, tensors)
            assert s.stats()["bytes_received"] == model  # each server got each byte once
        assert sum(r.bytes_sent for r in results.values()) == model  # the client's egress: the model once
        assert all(r.tensors == len(tensors) and r.bytes == model for r in results.values())


def test_caching_servers_fill_a_second_relayed_push_from_what_they_hold(tmp_path):
    path, tensors = _model(tmp_path)
    model = sum(len(b) for b in tensors.values())
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(Server(cache_dir=tmp_path / f"cache{i}")) for i in range(3)]
        addrs = [_key(s.address) for s in servers]
        with Client(addrs[0]) as c:
            first = c.push(path, to=addrs[1:])
            again = c.push(path, to=addrs[1:])
        assert first[addrs[0]].bytes_sent == model
        assert again[addrs[0]].bytes_sent == 0 and again[addrs[0]].cached == len(tensors) - 1  # all but the empty
        for s in servers:
            _holds(s, tensors)
            assert s.stats()["bytes_received"] == model  # the second push moved no payload on any hop


def test_a_client_of_several_streams_relays_over_the_one_its_relay_was_asked_on(tmp_path):
    path, tensors = _model(tmp_path)
    with _fleet(3, token=TOKEN) as (servers, addrs):
        with Client(addrs[0], token=TOKEN, streams=3) as c:
            c.push(path, to=addrs[1:], relay="chain")
            assert len(c.connections) == 1
            c.push(path)  # a plain push still spreads over its streams
            assert len(c.connections) == 3
        for s in servers:
            _holds(s, tensors)


def test_direct_pushes_each_server_from_the_client(tmp_path):
    path, tensors = _model(tmp_path)
    model = sum(len(b) for b in tensors.values())
    with _fleet(3) as (servers, addrs):
        with Client(addrs[0]) as c:
            results = c.push(path, to=addrs[1:], relay="direct")
        for s in servers:
            _holds(s, tensors)
        assert sum(r.bytes_sent for r in results.values()) == 3 * model


def test_tensors_from_memory_are_relayed(tmp_path):
    rng = np.random.default_rng(7)
    tensors = {"a": rng.standard_normal((64, 33)).astype(np.float32), "b": np.arange(1000, dtype=np.int64)}
    with _fleet(3, token=TOKEN) as (servers, addrs):
        with Client(addrs[0], token=TOKEN) as c:
            results = c.push(tensors, to=addrs[1:])
        assert sum(r.bytes_sent for r in results.values()) == sum(a.nbytes for a in tensors.values())
        for s in servers:
            got = s.tensors()
            assert sorted(got) == ["a", "b"]
            for k, a in tensors.items():
                assert got[k].dtype == a.dtype and got[k].shape == a.shape and got[k].tobytes() == a.tobytes()


def test_every_hop_speaks_tls_with_its_peer_context(tmp_path):
    path, tensors = _model(tmp_path)
    cert, key = _self_signed(tmp_path)
    tls = {"tls": server_tls_context(cert, key), "peer_tls": client_tls_context(cert)}
    with _fleet(3, token=TOKEN, **tls) as (servers, addrs):
        with Client(addrs[0], token=TOKEN, tls=client_tls_context(cert)) as c:
            c.push(path, to=addrs[1:], relay="chain")
        for s in servers:
            _holds(s, tensors)


def test_a_hop_without_the_fleets_token_is_named_and_the_hops_before_it_hold_everything(tmp_path):
    path, tensors = _model(tmp_path)
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(Server(token=TOKEN))
        second = stack.enter_context(Server(token=TOKEN))
        other = stack.enter_context(Server(token=b"another-token-0123456789abcdef"))
        addrs = [_key(s.address) for s in (first, second, other)]
        with Client(addrs[0], token=TOKEN) as c, pytest.raises(PushError) as e:
            c.push(path, to=addrs[1:], relay="chain")
        assert set(e.value.results) == set(addrs[:2])
        assert set(e.value.errors) == {addrs[2]}
        assert "AuthError" in str(e.value.errors[addrs[2]])
        _holds(first, tensors)
        _holds(second, tensors)
        assert other.tensors() == {}


def test_a_peer_token_lets_a_relay_reach_servers_of_another_token(tmp_path):
    path, tensors = _model(tmp_path)
    theirs = b"another-token-0123456789abcdef"
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(Server(token=TOKEN, peer_token=theirs))
        second = stack.enter_context(Server(token=theirs))
        with Client(first.address, token=TOKEN) as c:
            c.push(path, to=[_key(second.address)], relay="chain")
        _holds(second, tensors)


def test_a_relay_that_changes_a_byte_is_caught_and_routed_around(tmp_path, monkeypatch):
    """The second server forwards one tensor with a byte flipped: the third refuses it (it does
    not hash to the origin's digest) before it is visible, and gets the push from the client
    instead; the second server relays nothing more."""
    path, tensors = _model(tmp_path)
    model = sum(len(b) for b in tensors.values())
    forward = relay_module.Relay.forward
    flipped: list[str] = []

    def flipping(self, name, dtype, shape, data, digest):
        if not self.rest and not flipped:  # the relay of the second server, on the last link
            data = bytearray(data)
            data[5] ^= 0x40
            flipped.append(name)
        forward(self, name, dtype, shape, data, digest)

    monkeypatch.setattr(relay_module.Relay, "forward", flipping)
    with _fleet(3, token=TOKEN) as (servers, addrs):
        with Client(addrs[0], token=TOKEN) as c:
            results = c.push(path, to=addrs[1:])
        assert flipped  # the relay did change a tensor's bytes
        for s in servers:
            _holds(s, tensors)
        # the third server's tensors came again from the client (no cache: all of them)
        assert results[addrs[2]].bytes_sent == model and results[addrs[0]].bytes_sent == model


def test_routed_around_a_corrupting_relay_a_caching_hop_gets_only_what_it_lacks(tmp_path, monkeypatch):
    path, tensors = _model(tmp_path)
    forward = relay_module.Relay.forward
    flipped: list[str] = []

    def flipping(self, name, dtype, shape, data, digest):
        if not self.rest and name == "big":  # the last tensor with bytes, on the last link
            data = bytearray(data)
            data[-1] ^= 1
            flipped.append(name)
        forward(self, name, dtype, shape, data, digest)

    monkeypatch.setattr(relay_module.Relay, "forward", flipping)
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(Server(cache_dir=tmp_path / f"cache{i}")) for i in range(3)]
        addrs = [_key(s.address) for s in servers]
        with Client(addrs[0]) as c:
            results = c.push(path, to=addrs[1:])
        for s in servers:
            _holds(s, tensors)
        # the third server refused the changed tensor, kept the rest, and filled them again from memory
        assert results[addrs[2]].bytes_sent == len(tensors[flipped[0]])


def test_a_relay_killed_mid_push_is_dropped_and_its_child_served_by_the_client(tmp_path, monkeypatch):
    """The second server dies once the first has sent it a batch: the client is told which, the
    third server gets every tensor, and neither the first nor the third shows any before the
    COMMIT."""
    path, tensors = _model(tmp_path)
    push = relay_module.Relay._push
    on = threading.local()  # the relay's thread: which relay it runs

    def marking(self, conn):
        on.first = bool(self.rest)  # the first server's relay, to the second
        push(self, conn)

    with _fleet(3, token=TOKEN) as (servers, addrs):
        killed = []
        shown: list[str] = []

        class Killing(relay_module.Pusher):
            def send(self, plans):
                super().send(plans)
                if getattr(on, "first", False) and plans and not killed:
                    killed.append(len(plans))
                    servers[1].close()
                    # the first server has proven what it forwarded, the third taken some: neither shows any
                    shown.extend(n for i in (0, 2) for n in servers[i].tensors())

        monkeypatch.setattr(relay_module.Relay, "_push", marking)
        monkeypatch.setattr(relay_module, "Pusher", Killing)
        with Client(addrs[0], token=TOKEN) as c, pytest.raises(PushError) as e:
            c.push(path, to=addrs[1:])
        assert killed and shown == []
        assert set(e.value.errors) == {addrs[1]}
        assert set(e.value.results) == {addrs[0], addrs[2]}
        _holds(servers[0], tensors)
        _holds(servers[2], tensors)


def test_a_stalled_relay_is_routed_around_by_its_parent(tmp_path, monkeypatch):
    """The second server stops forwarding: the first gives up on it after RELAY_TIMEOUT and
    serves the third itself; the client then pushes to the second alone, whose receiving works."""
    path, tensors = _model(tmp_path)
    model = sum(len(b) for b in tensors.values())
    monkeypatch.setattr(relay_module, "RELAY_TIMEOUT", 1.0)
    push = relay_module.Relay._push
    release = threading.Event()

    stalled: list[str] = []

    def stalling(self, conn):
        if self.next == addrs[2] and not stalled:  # the first relay to the third: the second server's
            stalled.append(self.next)
            release.wait(30)
        push(self, conn)

    monkeypatch.setattr(relay_module.Relay, "_push", stalling)
    with _fleet(3, token=TOKEN) as (servers, addrs):
        try:
            with Client(addrs[0], token=TOKEN, timeout=5.0) as c:
                results = c.push(path, to=addrs[1:])
        finally:
            release.set()
        for s in servers:
            _holds(s, tensors)
        assert results[addrs[2]].bytes_sent == 0  # served by the first server, not the client
        assert results[addrs[1]].bytes_sent == model  # served by the client, alone


def test_a_relaying_server_refuses_a_tensor_without_the_origins_digest():
    """After RELAY every ALLOC must name its digest: a tensor a hop could not prove is neither
    published nor forwarded."""
    with _fleet(2) as (servers, addrs), Client(addrs[0]) as c:
        conn = c.connections[0]
        conn.send(conn.frame(P.Relay((addrs[1],))))
        assert conn.expect(P.RelayReply).ok
        # a plain ALLOC (no digest) as a client without a cache would send it; a push of a 1.5
        # client would open an update first, which a relaying connection refuses on its own
        conn.send(conn.frame(P.Alloc(1, "w", "F32", (4,), 16)))
        conn.send(conn.frame(P.Barrier()))
        reply = conn.expect(P.BarrierReply)
        assert any("names every tensor's digest" in e for e in reply.errors), reply
        conn.send(conn.frame(P.RelayEnd()))
        end = conn.expect(P.RelayReply)  # part of the push was refused: the unit is dropped on every hop
        assert not end.ok and end.failed == "" and "not held here" in end.message, end
        assert set(servers[0].tensors()) == set() and set(servers[1].tensors()) == set()


def test_a_relay_and_an_update_do_not_mix_on_one_connection():
    with _fleet(2) as (_, addrs):
        with Client(addrs[0]) as c:
            conn = c.connections[0]
            conn.send(conn.frame(P.Update()))
            conn.send(conn.frame(P.Relay((addrs[1],))))
            with pytest.raises(RemoteProtocolError, match="inside an update"):
                conn.expect(P.RelayReply)
        with Client(addrs[0]) as c:
            conn = c.connections[0]
            conn.send(conn.frame(P.Relay((addrs[1],))))
            assert conn.expect(P.RelayReply).ok
            conn.send(conn.frame(P.Update()))
            conn.send(conn.frame(P.Barrier()))
            with pytest.raises(RemoteProtocolError, match="a relay is open"):
                conn.expect(P.BarrierReply)


def test_chain_needs_servers_that_relay_and_auto_falls_back_to_direct(tmp_path):
    path, tensors = _model(tmp_path)
    with _fleet(2, protocol_minor=P.PREVIOUS_MINOR) as (servers, addrs):
        with Client(addrs[0]) as c:
            with pytest.raises(OptionError, match="relays need 1.7"):
                c.push(path, to=addrs[1:], relay="chain")
            results = c.push(path, to=addrs[1:])  # auto
        for s in servers:
            _holds(s, tensors)
        assert all(r.bytes_sent for r in results.values())  # each pushed from the client


def test_relay_options_are_checked_before_any_connection(tmp_path):
    path, _ = _model(tmp_path)
    with _fleet(1) as (_, addrs), Client(addrs[0]) as c:
        with pytest.raises(OptionError, match="relay="):
            c.push(path, to=["127.0.0.1:1"], relay="tree")
        with pytest.raises(OptionError, match="list of addresses"):
            c.push(path, to={"127.0.0.1:1": None}, relay="chain")
        with pytest.raises(OptionError, match="relay="):
            c.push({"a": np.zeros(3)}, to=["127.0.0.1:1"], relay="direct")


def test_an_unreachable_hop_is_named(tmp_path):
    path, tensors = _model(tmp_path)
    with _fleet(2) as (servers, addrs):
        with Server() as gone:
            dead = _key(gone.start())
        with Client(addrs[0]) as c, pytest.raises(PushError) as e:
            c.push(path, to=[addrs[1], dead])
        assert set(e.value.errors) == {dead} and "cannot connect" in str(e.value.errors[dead])
        for s in servers:
            _holds(s, tensors)


def test_relay_messages_need_minor_seven_and_name_a_hop():
    with pytest.raises(LocalProtocolError, match="minor 7"):
        P.send(P.Relay(("a:1",)), minor=6)
    with pytest.raises(LocalProtocolError, match="between 1 and"):
        P.send(P.Relay(()))
    dec = P.Decoder(our_role="server")
    dec.feed(bytes.fromhex("19000000" + "02000000" + "0000"))  # a RELAY of no hops
    with pytest.raises(RemoteProtocolError, match="no hop"):
        dec.next_event()
    assert [P.relay_usable(m) for m in (4, 6, 7)] == [False, False, True]


# -- a relayed push is one unit on every hop ------------------------------------------------------


def _old(tensors: dict[str, bytes]) -> dict[str, np.ndarray]:
    """An earlier version of ``tensors``: the same names, other bytes and sizes."""
    return {n: np.full(7 + i, i + 1, dtype=np.uint8) for i, n in enumerate(tensors)}


def _seen(address: str, tmp_path, tag: str) -> dict[str, bytes]:
    """What a reader on another connection sees on ``address``: its LIST, and the bytes it pulls."""
    from safetensors.numpy import load_file

    with Client(address, token=TOKEN) as reader:
        listed = {t.name: t.nbytes for t in reader.list()}
        out = tmp_path / f"seen-{tag}.safetensors"
        reader.pull(out, verify=True)
    pulled = {n: a.tobytes() for n, a in load_file(str(out)).items()}
    assert listed == {n: len(b) for n, b in pulled.items()}
    return pulled


def _stall_last_link(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """The relay to the last hop waits once it has pushed every tensor there (before that hop's
    set is prepared): (stalled, release)."""
    push = relay_module.Relay._push
    stalled, release = threading.Event(), threading.Event()

    def stalling(self, conn):
        push(self, conn)
        if not self.rest and not stalled.is_set():
            stalled.set()
            release.wait(30)

    monkeypatch.setattr(relay_module.Relay, "_push", stalling)
    return stalled, release


def _stall_commit(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """The client waits once RELAY_END said every hop holds its whole set, before its COMMIT:
    (stalled, release)."""
    stalled, release = threading.Event(), threading.Event()

    def commit(flags: int = 0) -> P.Commit:
        if flags == P.Commit.FLAG_NO_ROOT and not stalled.is_set():
            stalled.set()
            release.wait(30)
        return P.Commit(flags)

    commit.FLAG_ABORT, commit.FLAG_NO_ROOT = P.Commit.FLAG_ABORT, P.Commit.FLAG_NO_ROOT  # type: ignore[attr-defined]
    monkeypatch.setattr(client_module, "Commit", commit)
    return stalled, release


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("kind", ["file", "memory"])
@pytest.mark.parametrize("stall", [_stall_last_link, _stall_commit], ids=["last-link", "prepared"])
def test_no_hop_shows_a_tensor_of_a_relayed_push_until_every_hop_holds_all_of_it(tmp_path, monkeypatch, n, kind, stall):
    """Stalled with every tensor on every hop (the last hop's set not yet prepared), or with every
    hop prepared and the client's COMMIT not yet sent: a reader on each hop sees the old version."""
    path, tensors = _model(tmp_path)
    old = {k: a.tobytes() for k, a in _old(tensors).items()}
    source = path if kind == "file" else {k: np.frombuffer(b, dtype=np.uint8) for k, b in tensors.items()}
    with _fleet(n, token=TOKEN) as (servers, addrs):
        with Client(addrs[0], token=TOKEN) as c:
            c.push(_old(tensors), to=addrs[1:])
        stalled, release = stall(monkeypatch)
        outcome: list[object] = []

        def pushing():
            try:
                with Client(addrs[0], token=TOKEN) as c:
                    outcome.append(c.push(source, to=addrs[1:]))
            except BaseException as e:  # noqa: BLE001 - asserted below
                outcome.append(e)

        t = threading.Thread(target=pushing)
        t.start()
        try:
            assert stalled.wait(30)  # every hop has every tensor of the new version, none prepared yet
            for i, a in enumerate(addrs):
                assert _seen(a, tmp_path, f"during{i}") == old, f"hop {i} shows part of the push in flight"
        finally:
            release.set()
            t.join(60)
        assert isinstance(outcome[0], dict) and list(outcome[0]) == addrs, outcome
        with Server(token=TOKEN) as plain, Client(_key(plain.address), token=TOKEN) as c:
            c.push(source)
            used = plain.stats()["memory_used"]  # what the new version alone takes
        for i, (s, a) in enumerate(zip(servers, addrs, strict=True)):
            _holds(s, tensors)
            assert _seen(a, tmp_path, f"after{i}") == tensors
            assert s.stats()["memory_used"] == used  # the old version freed, nothing held left over


def test_a_client_gone_mid_relay_leaves_every_hop_on_its_old_version(tmp_path, monkeypatch):
    """The client goes away with every tensor held on every hop: no hop switches, each gives back
    what it held."""
    path, tensors = _model(tmp_path)
    old = {k: a.tobytes() for k, a in _old(tensors).items()}
    with _fleet(3, token=TOKEN) as (servers, addrs):
        with Client(addrs[0], token=TOKEN) as c:
            c.push(_old(tensors), to=addrs[1:])
        used = [s.stats()["memory_used"] for s in servers]
        stalled, release = _stall_last_link(monkeypatch)
        gone: list[BaseException] = []
        c = Client(addrs[0], token=TOKEN)

        def pushing():
            try:
                c.push(path, to=addrs[1:])
            except BaseException as e:  # noqa: BLE001 - asserted below
                gone.append(e)

        t = threading.Thread(target=pushing)
        t.start()
        try:
            assert stalled.wait(30)
            c.connections[0].stream.shutdown()  # the client's connection drops while every hop holds the set
        finally:
            release.set()
            t.join(60)
            c.close()
        assert gone and isinstance(gone[0], PushError)
        for s, a, u in zip(servers, addrs, used, strict=True):
            _until(lambda s=s, u=u: s.stats()["memory_used"] == u and s.stats()["pushes_rolled_back"] >= 1)
            assert _seen(a, tmp_path, a.replace(":", "-")) == old


def _until(ok, seconds: float = 30.0) -> None:
    """Wait for ``ok()`` (a connection's teardown runs on the server's thread, after the client sees it)."""
    import time

    end = time.monotonic() + seconds
    while not ok():
        assert time.monotonic() < end, "not reached"
        time.sleep(0.02)


def test_past_a_corrupting_relay_no_hop_shows_a_partial_set(tmp_path, monkeypatch):
    """The second server flips a byte of the last tensor it forwards: the hops before the third
    switch the whole set in; the third, which refused it, shows none of what it had taken before
    it (its old version), until the client's own push to it switches in whole."""
    path, tensors = _model(tmp_path)
    old = {k: a.tobytes() for k, a in _old(tensors).items()}
    forward = relay_module.Relay.forward

    def flipping(self, name, dtype, shape, data, digest):
        if not self.rest and name == "big":  # the last tensor with bytes, on the last link
            data = bytearray(data)
            data[-1] ^= 1
        forward(self, name, dtype, shape, data, digest)

    relay_rest = Client._relay_rest
    before: dict[str, dict[str, bytes]] = {}

    def seeing(self, source, o, prepared, hops):
        if not before and hops == []:  # the client's own push to the third server, after the relay failed
            before.update({a: _seen(a, tmp_path, a.replace(":", "-")) for a in addrs})
        return relay_rest(self, source, o, prepared, hops)

    with _fleet(3, token=TOKEN) as (servers, addrs):
        with Client(addrs[0], token=TOKEN) as c:
            c.push(_old(tensors), to=addrs[1:])
        monkeypatch.setattr(relay_module.Relay, "forward", flipping)
        monkeypatch.setattr(Client, "_relay_rest", seeing)
        with Client(addrs[0], token=TOKEN) as c:
            results = c.push(path, to=addrs[1:])
        assert before == {addrs[0]: tensors, addrs[1]: tensors, addrs[2]: old}
        assert results[addrs[2]].bytes_sent == sum(len(b) for b in tensors.values())
        for s in servers:
            _holds(s, tensors)


def test_a_relayed_push_refused_at_a_barrier_is_dropped_on_every_hop(tmp_path):
    """The first server refuses a tensor over its memory limit: the client drops the unit (no
    hop shows any of the push, none keeps what it held) and its connection stays usable."""
    path, tensors = _model(tmp_path)
    old = {k: a.tobytes() for k, a in _old(tensors).items()}
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(Server(token=TOKEN, max_memory=3 << 20))]
        servers += [stack.enter_context(Server(token=TOKEN)) for _ in range(2)]
        addrs = [_key(s.address) for s in servers]
        with Client(addrs[0], token=TOKEN) as c:
            c.push(_old(tensors), to=addrs[1:])
            used = [s.stats()["memory_used"] for s in servers]
            with pytest.raises(PushError):
                c.push(path, to=addrs[1:])
            assert {t.name: t.nbytes for t in c.list()} == {n: len(b) for n, b in old.items()}
            for s, a, u in zip(servers, addrs, used, strict=True):  # with the client's connection still open
                _until(lambda s=s, u=u: s.stats()["memory_used"] == u, seconds=10)
                assert _seen(a, tmp_path, a.replace(":", "-")) == old


def test_a_hop_dead_between_its_prepare_and_the_commit_switches_nothing_after_it(tmp_path, monkeypatch):
    """Every hop holds its set, then the third of four dies before the COMMIT reaches it: the
    first two switch in, the fourth (whose parent died) drops its set, and the client, told which
    hop did not switch, names it dead and pushes the fourth again itself (a unit of its own)."""
    path, tensors = _model(tmp_path)
    with _fleet(4, token=TOKEN) as (servers, addrs):
        with Client(addrs[0], token=TOKEN) as c:
            c.push(_old(tensors), to=addrs[1:])
        stalled, release = _stall_commit(monkeypatch)
        relay_rest = Client._relay_rest
        before: dict[str, dict[str, bytes]] = {}

        def seeing(self, source, o, prepared, hops):
            if stalled.is_set() and not before:  # the client's own push after the COMMIT went wrong
                before.update({a: _seen(a, tmp_path, a.replace(":", "-")) for a in (addrs[0], addrs[1], addrs[3])})
            return relay_rest(self, source, o, prepared, hops)

        monkeypatch.setattr(Client, "_relay_rest", seeing)
        outcome: list[BaseException] = []

        def pushing():
            try:
                with Client(addrs[0], token=TOKEN) as c:
                    c.push(path, to=addrs[1:])
            except BaseException as e:  # noqa: BLE001 - asserted below
                outcome.append(e)

        t = threading.Thread(target=pushing)
        t.start()
        try:
            assert stalled.wait(30)  # RELAY_END said every hop holds its whole set
            servers[2].close()
        finally:
            release.set()
            t.join(60)
        old = {k: a.tobytes() for k, a in _old(tensors).items()}
        assert before == {addrs[0]: tensors, addrs[1]: tensors, addrs[3]: old}
        assert outcome and isinstance(outcome[0], PushError), outcome
        assert set(outcome[0].errors) == {addrs[2]}
        assert set(outcome[0].results) == {addrs[0], addrs[1], addrs[3]}
        for i in (0, 1, 3):
            _holds(servers[i], tensors)
