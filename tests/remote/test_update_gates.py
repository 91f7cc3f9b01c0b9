"""In-place updates against readers, over real sockets: a READ holds off only the commits that
change the tensor it sends, a commit its readers hold past the I/O timeout is refused with the
old version intact, overlapping commits take turns, and a reader of a set never sees a mix."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.remote.rawclient import Raw, _f32, _stalled_reader
from tests.remote.test_update import _mix_soak
from weightlift.errors import RemoteProtocolError
from weightlift.remote.client.client import Client
from weightlift.remote.protocol import Error, ErrorCode, ListReply, ListRequest, Read, ReadReply
from weightlift.remote.server.server import Server

JOIN = 30  # seconds a thread that must finish is given
BIG = 4 << 20  # F32 elements: 16 MiB, far more than a stalled reader's socket buffers take


def _changed(a: np.ndarray, seed: int) -> np.ndarray:
    """``a`` with one element changed: an in-place update sends it as a small delta."""
    new = a.copy()
    new[seed % a.size] += 1.0
    return new


def _read(address, name: str, nbytes: int, generation: int = 0):
    """One READ of a whole tensor on a fresh connection: its bytes, or the ERROR that came."""
    raw = Raw.connected(address)
    raw.sock.settimeout(JOIN)
    try:
        raw.send(Read(name, 0, nbytes, generation=generation))
        reply = raw.recv()
        if isinstance(reply, ReadReply):
            return raw.read_payload(nbytes)
        return reply
    finally:
        raw.close()


def _generation(address) -> int:
    raw = Raw.connected(address)
    try:
        raw.send(ListRequest())
        reply = raw.recv()
        assert isinstance(reply, ListReply)
        return reply.generation
    finally:
        raw.close()


class _Trickle:
    """A client inside a READ that takes the reply slowly (about 2 MB/s): the server's send keeps
    making progress (a sender waits for a third of its socket buffer, some MB, to drain, well
    inside the I/O timeout), so the READ holds its tensor for as long as this takes, some seconds
    for a 16 MiB tensor: past the I/O timeout."""

    def __init__(self, address, name: str, nbytes: int):
        self.raw = Raw(address)
        self.raw.hello()
        self.raw.send(Read(name, 0, nbytes))
        assert self.raw.sock.recv(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._take, daemon=True)
        self._thread.start()

    def _take(self) -> None:
        while not self._stop.wait(0.03):
            if not self.raw.sock.recv(65536):
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(JOIN)
        self.raw.close()


def _update(address, new, base, out: dict) -> threading.Thread:
    """An in-place update pushed in a thread; ``out`` gets its result or the error it raised."""

    def run() -> None:
        try:
            with Client(address) as c:
                out["result"] = c.push(new, base=base, in_place=True)
        except Exception as e:  # the test looks at it
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_an_in_place_commit_waits_for_the_reader_of_its_tensor_while_a_read_of_another_is_answered():
    v0 = {"a": _f32(BIG, seed=1), "b": _f32(1 << 16, seed=2)}
    v1 = {"a": _changed(v0["a"], 7)}
    with Server() as srv:
        with Client(srv.address) as c:
            c.push(v0)
        stalled = _stalled_reader(srv.address, "a", v0["a"].nbytes)
        out: dict = {}
        try:
            t = _update(srv.address, v1, {"a": v0["a"]}, out)
            t.join(1)
            assert t.is_alive(), "an in-place commit changed a tensor while a READ was sending it"
            assert _read(srv.address, "b", v0["b"].nbytes) == v0["b"].tobytes()  # while the commit waits
            assert srv.tensors()["a"].tobytes() == v0["a"].tobytes()
        finally:
            stalled.close()
        t.join(JOIN)
        assert not t.is_alive() and "error" not in out, out
        assert out["result"].deltas == 1
        assert _read(srv.address, "a", v0["a"].nbytes) == v1["a"].tobytes()


def test_an_in_place_commit_whose_reader_outlasts_the_io_timeout_is_refused_with_v_intact_and_the_gate_given_back():
    v0 = {"a": _f32(BIG, seed=3)}
    v1, v2 = {"a": _changed(v0["a"], 1)}, {"a": _changed(v0["a"], 2)}
    with Server(io_timeout=3.0) as srv:
        with Client(srv.address) as c:
            c.push(v0)
        generation = _generation(srv.address)
        slow = _Trickle(srv.address, "a", v0["a"].nbytes)
        try:
            with Client(srv.address) as c:
                with pytest.raises(RemoteProtocolError, match=r"not switched: .*a READ of 'a' was still sending"):
                    c.push(v1, base=v0, in_place=True)
            assert srv.tensors()["a"].tobytes() == v0["a"].tobytes()
            assert _generation(srv.address) == generation  # nothing switched
            # the commit's claim was given back: a new reader of v goes in beside the slow one
            assert _read(srv.address, "a", v0["a"].nbytes, generation) == v0["a"].tobytes()
        finally:
            slow.close()
        with Client(srv.address) as c:  # the reader gone, the next in-place update switches in
            assert c.push(v2, base=v0, in_place=True).deltas == 1
        assert srv.tensors()["a"].tobytes() == v2["a"].tobytes()


def test_without_an_io_timeout_a_commit_that_a_stalled_reader_holds_is_still_refused_after_the_gate_bound(
    monkeypatch,
):
    """``io_timeout=None`` puts no deadline on a READ's reply, so a reader that stops taking it
    holds its tensor for good. An in-place commit of that tensor still waits only GATE_TIMEOUT,
    then is refused with v intact and its claim given back: neither the pushing client nor the
    READs that its claim holds off wait forever."""
    from weightlift.remote.server import config

    monkeypatch.setattr(config, "GATE_TIMEOUT", 1.0)
    v0 = {"a": _f32(BIG, seed=4)}
    v1 = {"a": _changed(v0["a"], 5)}
    with Server(io_timeout=None) as srv:
        with Client(srv.address) as c:
            c.push(v0)
        stalled = _stalled_reader(srv.address, "a", v0["a"].nbytes)
        out: dict = {}
        try:
            t = _update(srv.address, v1, {"a": v0["a"]}, out)
            t.join(JOIN)
            assert not t.is_alive(), "an in-place commit waited for a stalled reader for good"
            assert isinstance(out.get("error"), RemoteProtocolError), out
            assert "a READ of 'a' was still sending its bytes after 1 s" in str(out["error"])
            assert srv.tensors()["a"].tobytes() == v0["a"].tobytes()
            assert _read(srv.address, "a", v0["a"].nbytes) == v0["a"].tobytes()  # the claim was given back
        finally:
            stalled.close()


def test_in_place_commits_of_overlapping_sets_take_turns_and_a_reader_of_the_set_never_sees_a_mix():
    """Two in-place updates, of {a, b} and {b, c}, both wait on a READ of b. A READ of d (in
    neither) is answered meanwhile. Once the reader goes, one switches in and the other, whose
    base of b is gone, is refused with nothing of it changed; neither hangs. A READ of c that
    names the generation listed before the switch is refused (STALE), not answered with a set
    that mixes generations."""
    n = 1 << 16
    v0 = {k: _f32(BIG if k == "b" else n, seed=s) for s, k in enumerate("abcd")}
    first = {"a": _changed(v0["a"], 1), "b": _changed(v0["b"], 1)}
    second = {"b": _changed(v0["b"], 2), "c": _changed(v0["c"], 2)}
    with Server() as srv:
        with Client(srv.address) as c:
            c.push(v0)
        generation = _generation(srv.address)
        stalled = _stalled_reader(srv.address, "b", v0["b"].nbytes)
        outs: list[dict] = [{}, {}]
        try:
            threads = [
                _update(srv.address, first, {k: v0[k] for k in first}, outs[0]),
                _update(srv.address, second, {k: v0[k] for k in second}, outs[1]),
            ]
            threads[0].join(1), threads[1].join(1)
            assert all(t.is_alive() for t in threads)
            assert _read(srv.address, "d", v0["d"].nbytes) == v0["d"].tobytes()
        finally:
            stalled.close()
        for t in threads:
            t.join(JOIN)
        assert not any(t.is_alive() for t in threads), "overlapping in-place commits deadlocked"
        ok = [i for i, o in enumerate(outs) if "result" in o]
        assert len(ok) == 1, outs
        won = (first, second)[ok[0]]
        lost = outs[1 - ok[0]]["error"]
        assert isinstance(lost, RemoteProtocolError) and "not switched" in str(lost)
        held = srv.tensors()
        for k in "abcd":
            assert held[k].tobytes() == (won[k] if k in won else v0[k]).tobytes(), k
        got = _read(srv.address, "c", n * 4, generation)
        assert isinstance(got, Error) and got.code == ErrorCode.STALE


def test_a_reader_of_a_set_naming_its_generation_never_sees_a_mix_while_in_place_updates_switch():
    """A soak: version v fills every tensor with the byte v and switches in place, each READ
    holding only its own tensor's gate. A reader that lists, then reads every tensor naming the
    generation it listed (as a pull does), either reads one version of all of them or is told
    STALE; never two versions in one set."""
    with _mix_soak() as soak:
        names, n, stop, seen = soak.names, soak.n, soak.stop, soak.seen

        def reader() -> None:
            raw = Raw.connected(soak.srv.address)
            raw.sock.settimeout(JOIN)
            while not stop.is_set():
                raw.send(ListRequest())
                generation = raw.recv().generation
                values = set()
                for name in names:
                    raw.send(Read(name, 0, n, generation=generation))
                    reply = raw.recv()
                    if isinstance(reply, Error):
                        assert reply.code == ErrorCode.STALE, reply
                        break
                    got = np.frombuffer(raw.read_payload(n), np.uint8)
                    values |= {int(got.min()), int(got.max())}
                else:
                    if len(values) != 1:
                        seen.append(f"one set read at generation {generation} held versions {sorted(values)}")
            raw.close()

        soak.run((reader, reader), in_place=True)


def test_a_process_reading_the_servers_tensors_holds_off_an_in_place_switch_until_it_is_done():
    """``Server.reading()`` (what a vLLM engine copies its update from): while the block runs an
    in-place update of those tensors waits, and the tensors read stay v's bytes throughout."""
    v0 = {"a": _f32(1 << 16, seed=5), "b": _f32(1 << 16, seed=6)}
    v1 = {"a": _changed(v0["a"], 3)}
    with Server() as srv:
        with Client(srv.address) as c:
            c.push(v0)
        out: dict = {}
        with srv.reading() as held:
            assert sorted(held) == ["a", "b"] and not held["a"].flags.writeable
            t = _update(srv.address, v1, {"a": v0["a"]}, out)
            t.join(1)
            assert t.is_alive(), "an in-place switch changed tensors a reader held"
            assert held["a"].tobytes() == v0["a"].tobytes()
        t.join(JOIN)
        assert not t.is_alive() and "error" not in out, out
        assert out["result"].deltas == 1
        assert srv.tensors()["a"].tobytes() == v1["a"].tobytes()
        with srv.reading(["b"]) as held:  # a named subset, and the gate free again after
            assert list(held) == ["b"] and held["b"].tobytes() == v0["b"].tobytes()


def test_a_process_reading_again_inside_its_reading_block_goes_in_while_an_update_waits_for_it():
    """A nested ``Server.reading()`` (a helper that takes the tensors it copies, called inside
    the caller's block) while an in-place update of them waits for the outer block: the inner
    block goes in at once, not after the update's bound (which would refuse the update), and the
    update switches in once the outer block ends."""
    v0 = {"a": _f32(1 << 16, seed=7), "b": _f32(1 << 16, seed=8)}
    v1 = {"a": _changed(v0["a"], 4)}
    with Server(io_timeout=5.0) as srv:
        with Client(srv.address) as c:
            c.push(v0)
        out: dict = {}
        with srv.reading() as held:
            t = _update(srv.address, v1, {"a": v0["a"]}, out)
            t.join(1)  # the update waits for this block
            with srv.reading(["a"]) as again, srv.reading(["b"]):
                assert again["a"].tobytes() == held["a"].tobytes() == v0["a"].tobytes()
            assert t.is_alive() and not out, out
        t.join(JOIN)
        assert not t.is_alive() and "error" not in out, out
        assert out["result"].deltas == 1
        assert srv.tensors()["a"].tobytes() == v1["a"].tobytes()


def _not_whole(held: dict, sets) -> str | None:
    """Why ``held`` is not every tensor of ``sets`` with one version of each set, or None."""
    if not {k for names in sets for k in names} <= set(held):
        return f"a block of every tensor was given only {sorted(held)}"
    for names in sets:
        values = {int(held[k].min()) for k in names} | {int(held[k].max()) for k in names}
        if len(values) != 1:
            return f"a block saw versions {sorted(values)} of one update's set"
    return None


def test_server_reading_in_place_writers_of_disjoint_sets_and_fills_together_never_deadlock_or_mix(tmp_path):
    """A soak of everything that takes gates at once: two clients switch disjoint sets in place
    (version v: every byte v), a process copies every tensor out in ``Server.reading()`` blocks,
    and a third client pushes copies of the tensors that the server fills from their memory.
    Nothing hangs; each block sees one version of each writer's set (an update is switched in
    whole) and gets in while the writers go on; each copy holds bytes some version had."""
    import time

    n = 1 << 16
    sets = (["a0", "a1", "a2"], ["b0", "b1", "b2"])

    def version(names: list[str], v: int) -> dict[str, np.ndarray]:
        return {name: np.full(n, v, np.uint8) for name in names}

    with Server(cache_dir=tmp_path / "cache") as srv:
        with Client(srv.address) as c:
            c.push({**version(sets[0], 0), **version(sets[1], 0)})
        stop = threading.Event()
        problems: list[str] = []
        blocks = {"in": 0}

        def writer(names: list[str]) -> None:
            with Client(srv.address, keep_base=True) as w:
                w.push(version(names, 0))
                v = 0
                while not stop.is_set():
                    v = v % 250 + 1
                    try:
                        w.push(version(names, v), in_place=True)
                    except RemoteProtocolError as e:  # refused as a whole is allowed; a hang is not
                        if "not switched" not in str(e):
                            problems.append(f"writer: {e}")

        def engine() -> None:
            while not stop.is_set():
                with srv.reading() as held:
                    blocks["in"] += 1
                    why = _not_whole(held, sets)
                    if why is not None:
                        problems.append(why)

        def filler() -> None:
            with Client(srv.address) as f:
                while not stop.is_set():
                    with srv.reading(["a0"]) as now:  # one version: a plain copy could straddle a switch
                        got = now["a0"].copy()  # bytes the server holds: sent, it fills from memory
                    f.push({"copy": got}, hash_threshold=0)
                    held = srv.tensors()["copy"]
                    if held.min() != held.max():
                        problems.append("a copy filled from memory holds bytes of two versions")

        threads = [threading.Thread(target=writer, args=(s,), daemon=True) for s in sets]
        threads += [threading.Thread(target=fn, daemon=True) for fn in (engine, filler)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        stop.set()
        for t in threads:
            t.join(JOIN)
        assert not any(t.is_alive() for t in threads), "a gate deadlocked"
        assert not problems, problems[:3]
        assert blocks["in"] > 0
        assert srv.stats().memory_hits > 0  # some copy was filled from another name's memory
