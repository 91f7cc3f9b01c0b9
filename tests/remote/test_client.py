"""The push client against a real server on loopback: every dtype byte for byte, the cache path,
streams, the naive arm, pull/list/free, auth, and the remote CLI verbs."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest

from tests.checkpoints import write
from weightlift import cli
from weightlift.digest.blake import hash_buffer
from weightlift.digest.sidecar import SIDECAR_SUFFIX
from weightlift.dtypes import DTYPES, byte_length
from weightlift.errors import AuthError, NotFoundError, OptionError, RemoteProtocolError, StateError, TransportError
from weightlift.profile import Profiler
from weightlift.remote.client.client import Client, PushResult, RemoteTensor
from weightlift.remote.protocol import NEED_DATA, Alloc, Decoder, WriteHeader
from weightlift.remote.server.server import Server
from weightlift.remote.transport import TCP, Stream


def write_safetensors(path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> str:
    """A .safetensors file of raw tensors: name -> (dtype, shape, bytes)."""
    return str(write(path, [(n, d, s, b) for n, (d, s, b) in tensors.items()]))


def _rand(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def every_dtype() -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    out = {}
    for i, d in enumerate(DTYPES):
        shape = (3, 8) if d.bits % 8 == 0 else (8,)  # packed types: 8 values are whole bytes
        out[f"t.{d.name.lower()}"] = (d.name, shape, _rand(byte_length(d.name, shape), i))
    out["t.empty"] = ("F16", (0, 7), b"")
    out["t.scalar"] = ("I64", (), _rand(8, 99))
    return out


def model(tmp_path, *, large: int = 3, small: int = 4, size: int = 300_000) -> tuple[str, dict]:
    """Some tensors at or above a 200 kB hash threshold, some below."""
    t = {}
    for i in range(small):
        t[f"small.{i}"] = ("F32", (25, i + 1), _rand(100 * (i + 1), 100 + i))
    for i in range(large):
        t[f"large.{i}"] = ("BF16", (size // 2,), _rand(size, 200 + i))
    return write_safetensors(tmp_path / "model.safetensors", t), t


THRESHOLD = 200_000


def _host_bytes(arr) -> bytes:
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8).tobytes()


def assert_holds(server: Server, tensors: dict) -> None:
    got = server.tensors()
    assert sorted(got) == sorted(tensors)
    for name, (_dtype, _shape, data) in tensors.items():
        assert _host_bytes(got[name]) == data, name


def test_push_list_pull_every_dtype_byte_for_byte(tmp_path):
    tensors = every_dtype()
    path = write_safetensors(tmp_path / "all.safetensors", tensors)
    with Server() as s, Client(s.address) as c:
        result = c.push(path)
        assert isinstance(result, PushResult)
        total = sum(len(b) for _, _, b in tensors.values())
        assert (result.tensors, result.bytes, result.bytes_sent, result.cached) == (len(tensors), total, total, 0)
        assert result.bytes_hashed == 0 and result.profile is None
        assert_holds(s, tensors)
        for name, (dtype, shape, _data) in tensors.items():
            d = next(x for x in DTYPES if x.name == dtype)
            if d.bits % 8 == 0:
                assert s.tensors()[name].shape == shape
        listed = c.list()
        assert listed == sorted(RemoteTensor(n, d, sh, len(b)) for n, (d, sh, b) in tensors.items())
        out = tmp_path / "pulled.safetensors"
        assert c.pull(out) == listed
    import weightlift

    ck = weightlift.open(out)
    assert {t.name: (t.dtype, t.shape) for t in ck.tensors} == {n: (d, sh) for n, (d, sh, _) in tensors.items()}
    raw = out.read_bytes()
    for t in ck.tensors:
        assert raw[t.offset : t.end] == tensors[t.name][2], t.name
    from safetensors import safe_open

    with safe_open(str(out), framework="numpy") as f:  # the reference reader agrees
        assert sorted(f.keys()) == sorted(tensors)
        assert f.get_tensor("t.f32").tobytes() == tensors["t.f32"][2]
        assert f.get_tensor("t.i64").tobytes() == tensors["t.i64"][2]
    assert not list(tmp_path.glob("*.wl-tmp"))


def test_push_to_server_without_cache_hashes_nothing(tmp_path):
    path, tensors = model(tmp_path)
    with Server() as s, Client(s.address, profile=True) as c:
        r = c.push(path, hash_threshold=THRESHOLD)
        assert r.bytes_hashed == 0 and r.cached == 0
        assert r.profile is not None and r.profile["phases_s"]["hash"] == 0 and r.profile["background_s"]["hash"] == 0
        assert r.profile["tensors"] == len(tensors) and r.profile["bytes"] == r.bytes
        assert r.profile["commands"]["BARRIER"]["count"] == 1  # one round trip for the whole push
        assert_holds(s, tensors)
        again = c.push(path, hash_threshold=THRESHOLD)
        assert again.profile["tensors"] == len(tensors)  # this push's figures, not both pushes'
        assert again.profile["commands"]["BARRIER"]["count"] == 1
    assert not os.path.exists(path + SIDECAR_SUFFIX)


def test_second_push_to_a_caching_server_sends_no_large_payload_and_hashes_nothing(tmp_path):
    path, tensors = model(tmp_path)
    large = sum(len(b) for n, (_, _, b) in tensors.items() if n.startswith("large"))
    small = sum(len(b) for n, (_, _, b) in tensors.items() if n.startswith("small"))
    with Server(cache_dir=tmp_path / "cache") as s, Client(s.address) as c:
        first = c.push(path, hash_threshold=THRESHOLD)
        assert first.bytes_hashed == large and first.cached == 0 and first.bytes_sent == large + small
        assert not os.path.exists(path + SIDECAR_SUFFIX)  # digests saved in weightlift's cache, not beside the file
        c.free([n for n in tensors])
        assert s.tensors() == {}
        received = s.stats()["bytes_received"]
        second = c.push(path, hash_threshold=THRESHOLD)
        assert second.bytes_hashed == 0  # from the manifest
        assert second.cached == 3 and second.bytes_sent == small
        assert s.stats()["bytes_received"] - received == small  # the counter on the far side agrees
        assert s.stats()["cache_hits"] == 3
        assert_holds(s, tensors)


def test_a_corrupt_cache_entry_is_dropped_and_the_tensor_sent_again(tmp_path):
    path, tensors = model(tmp_path, large=2)
    with Server(cache_dir=tmp_path / "cache") as s, Client(s.address) as c:
        c.push(path, hash_threshold=THRESHOLD)
        assert s.cache is not None and s.cache.flush(10)  # the entries are written behind the push
        d = hash_buffer(tensors["large.1"][2])
        entry = tmp_path / "cache" / d.hex()[:2] / d.hex()
        data = bytearray(entry.read_bytes())
        data[12345] ^= 1
        entry.write_bytes(data)
        c.free(list(tensors))
        r = c.push(path, hash_threshold=THRESHOLD)
        assert r.cached == 1  # large.0 from the cache, large.1 sent again
        assert r.bytes_sent == len(tensors["large.1"][2]) + sum(
            len(b) for n, (_, _, b) in tensors.items() if n.startswith("small")
        )
        assert r.tensors == len(tensors) and r.bytes == sum(len(b) for _, _, b in tensors.values())
        assert_holds(s, tensors)
        assert s.cache.flush(10)
        assert entry.read_bytes() == tensors["large.1"][2]  # and the entry is good again


def test_streams_spread_tensors_and_give_the_same_bytes(tmp_path):
    path, tensors = model(tmp_path, large=5, small=6)
    with Server(cache_dir=tmp_path / "cache") as s, Client(s.address, streams=3) as c:
        r = c.push(path, hash_threshold=THRESHOLD)
        assert r.tensors == len(tensors) and r.bytes == sum(len(b) for _, _, b in tensors.values())
        assert s.stats()["connections"] == 3 and len(c.connections) == 3
        assert_holds(s, tensors)
        c.free(list(tensors))
        r = c.push(path, hash_threshold=THRESHOLD)
        assert r.cached == 5
        assert_holds(s, tensors)


class _Watched:
    """A client stream that shows ``watch`` every byte it is about to send."""

    def __init__(self, inner: Stream, watch: Callable[[list[bytes]], None]):
        self._inner, self._watch = inner, watch
        self.peer = inner.peer

    def send_parts(self, parts) -> None:
        self._watch([bytes(memoryview(p).cast("B")) for p in parts])
        self._inner.send_parts(parts)

    def sendfile(self, fd: int, offset: int, count: int) -> None:
        self._watch([os.pread(fd, count, offset)])
        self._inner.sendfile(fd, offset, count)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class Watching:
    """A backend (``Client(backend=...)``): TCP, with every client send shown to ``watch`` first."""

    def __init__(self, watch: Callable[[list[bytes]], None]):
        self.watch = watch

    def connect(self, address, *, timeout: float | None = 30.0) -> Stream:
        return _Watched(TCP.connect(address, timeout=timeout), self.watch)  # type: ignore[return-value]

    def listen(self, host: str, port: int, *, backlog: int = 64):
        return TCP.listen(host, port, backlog=backlog)


class FrameLog:
    """The ALLOCs and WRITEs a client sends, as (message type name, tensor id), in order."""

    def __init__(self) -> None:
        self.dec = Decoder(our_role="server")
        self.seen: list[tuple[str, int]] = []

    def __call__(self, parts: list[bytes]) -> None:
        for p in parts:
            self.dec.feed(p)
        while (ev := self.dec.next_event()) is not NEED_DATA:
            if isinstance(ev, (Alloc, WriteHeader)):
                self.seen.append((type(ev).__name__, ev.tensor_id))


def failing_after(limit: int) -> Watching:
    """A backend whose sends fail with OSError (a disk gone under the file) past ``limit`` bytes."""
    sent = [0]

    def watch(parts: list[bytes]) -> None:
        sent[0] += sum(len(p) for p in parts)
        if sent[0] > limit:
            raise OSError("disk went away")

    return Watching(watch)


def test_allocs_run_ahead_of_writes_within_the_window(tmp_path, monkeypatch):
    import weightlift.remote.client.push as push_mod

    t = {f"w.{i}": ("U8", (3 << 20,), _rand(3 << 20, i)) for i in range(6)}  # pooled: the server faults them ahead
    t["w.empty"] = ("F32", (0,), b"")
    path = write_safetensors(tmp_path / "m.safetensors", t)
    log = FrameLog()
    monkeypatch.setattr(push_mod, "ALLOC_AHEAD_BYTES", 7 << 20)  # two 3 MiB tensors ahead, not three
    with Server() as s, Client(s.address, backend=Watching(log)) as c:
        c.push(path)
        assert_holds(s, t)
    seen = log.seen
    allocs = [tid for kind, tid in seen if kind == "Alloc"]
    assert sorted(allocs) == sorted(set(allocs)) and len(allocs) == len(t)  # each tensor allocated once
    for i, (kind, tid) in enumerate(seen):
        if kind == "WriteHeader":
            ahead = [x for k, x in seen[:i] if k == "Alloc"]
            written = sum(1 for k, _ in seen[:i] if k == "WriteHeader")
            assert tid in ahead
            # every tensor in file order up to two beyond this one is allocated; no further
            assert len(ahead) - written - 1 <= 2
            if written < 4:
                assert len(ahead) - written - 1 == 2
    monkeypatch.setattr(push_mod, "ALLOC_AHEAD_BYTES", 0)
    log = FrameLog()
    with Server() as s, Client(s.address, backend=Watching(log)) as c:
        c.push(path)
        assert_holds(s, t)
    assert [k for k, _ in log.seen][:4] == ["Alloc", "WriteHeader", "Alloc", "WriteHeader"]  # off: none ahead


def test_a_push_that_fails_mid_stream_closes_the_client_one_refused_at_the_barrier_does_not(tmp_path):
    path, tensors = model(tmp_path, large=2, small=2)
    with Server() as s:
        c = Client(s.address, backend=failing_after(2000))  # the handshake and the small tensors go
        with pytest.raises(OSError, match="disk went away"):
            c.push(path)  # tensors were ALLOCated ahead and never written: the connection goes
        assert c.connections == ()
        with pytest.raises(StateError, match="closed"):
            c.list()
    path, tensors = model(tmp_path, large=2, small=0)
    with Server(max_memory=400_000) as s, Client(s.address) as c:
        with pytest.raises(RemoteProtocolError, match="memory limit"):
            c.push(path)
        assert c.list() == []  # still usable: the barrier settled it; nothing of the refused push shows


def test_a_naive_push_that_fails_mid_stream_closes_the_client_too(tmp_path, monkeypatch):
    path, _ = model(tmp_path, large=3, small=0)
    monkeypatch.setenv("WEIGHTLIFT_LOAD_OPT", "0")
    with Server() as s:
        c = Client(s.address, backend=failing_after(400_000))  # the second tensor: after the first one's BARRIER
        with pytest.raises(OSError, match="disk went away"):
            c.push(path, hash_threshold=THRESHOLD)
        with pytest.raises(StateError, match="closed"):
            c.list()


def test_allocs_ahead_go_on_past_a_large_tensor_already_allocated(tmp_path, monkeypatch):
    import weightlift.remote.client.push as push_mod

    sizes = [1 << 20, 1 << 20, 5 << 20, 1 << 20, 1 << 20, 1 << 20]
    t = {f"w.{i}": ("U8", (n,), _rand(n, i)) for i, n in enumerate(sizes)}
    path = write_safetensors(tmp_path / "m.safetensors", t)
    log = FrameLog()
    monkeypatch.setattr(push_mod, "ALLOC_AHEAD_BYTES", 7 << 20)
    with Server() as s, Client(s.address, backend=Watching(log)) as c:
        c.push(path)
        assert_holds(s, t)
    seen = log.seen
    # ALLOC 0, and 1, 2 (5 MiB), 3 ahead (7 MiB); when 1 is sent, 4 joins: 2 is counted once
    first_writes = [i for i, (k, _) in enumerate(seen) if k == "WriteHeader"]
    allocs_before = [sum(1 for k, _ in seen[:w] if k == "Alloc") for w in first_writes[:2]]
    assert allocs_before == [4, 5]


def test_naive_arm_gives_the_same_bytes(tmp_path, monkeypatch):
    path, tensors = model(tmp_path)
    monkeypatch.setenv("WEIGHTLIFT_LOAD_OPT", "0")
    with Server() as s, Client(s.address, profile=True) as c:
        r = c.push(path, hash_threshold=THRESHOLD)
        assert_holds(s, tensors)
    large = sum(len(b) for n, (_, _, b) in tensors.items() if n.startswith("large"))
    assert r.bytes_hashed == large  # hashed although the server has no cache
    assert r.profile["commands"]["BARRIER"]["count"] == len(tensors)  # a round trip per tensor
    assert r.profile["phase_bytes"]["stage"] == r.bytes  # and a staging copy of everything
    with Server(cache_dir=tmp_path / "cache") as s, Client(s.address) as c:
        c.push(path, hash_threshold=THRESHOLD)
        c.free(list(tensors))
        r = c.push(path, hash_threshold=THRESHOLD)
        assert r.cached == 3
        assert_holds(s, tensors)


def test_select_and_checkpoint_objects(tmp_path):
    import weightlift

    path, tensors = model(tmp_path)
    with Server() as s, Client(s.address) as c:
        r = c.push(weightlift.open(path), select="large.*")
        assert r.tensors == 3 and sorted(s.tensors()) == ["large.0", "large.1", "large.2"]
        with pytest.raises(NotFoundError):
            c.push(path, select="nothing*")


def test_free_and_list_empty(tmp_path):
    path, tensors = model(tmp_path)
    with Server() as s, Client(s.address) as c:
        assert c.list() == []
        c.push(path)
        assert c.free(["small.0", "small.1", "missing"]) == 2
        assert c.free("small.2") == 1
        assert [t.name for t in c.list()] == ["large.0", "large.1", "large.2", "small.3"]
        out = tmp_path / "few.safetensors"
        c.pull(out)
        import weightlift

        assert [t.name for t in weightlift.open(out).tensors] == ["large.0", "large.1", "large.2", "small.3"]


def test_pull_of_an_empty_server_writes_a_valid_file(tmp_path):
    with Server() as s, Client(s.address) as c:
        out = tmp_path / "empty.safetensors"
        assert c.pull(out) == []
    from safetensors.numpy import load_file

    assert load_file(str(out)) == {}


# -- the pulled file: written where nobody else chose, readable by nobody the user did not allow ----


def _pull(tmp_path, out, *, token: str | None = None, umask: int = 0o022) -> dict:
    path, tensors = model(tmp_path, large=1, small=1)
    old = os.umask(umask)
    try:
        with Server(token=token) as s, Client(s.address, token=token) as c:
            c.push(path)
            c.pull(out)
    finally:
        os.umask(old)
    return tensors


def _predictable_names(out) -> list[str]:
    """The temporary names a pull once used: the output's name, a process id, a suffix."""
    me = os.getpid()
    return [f"{out}.{pid}.wl-tmp" for pid in range(max(1, me - 100), me + 100)]


def _assert_pulled(out, tensors: dict) -> None:
    import weightlift

    st = os.lstat(out)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()
    assert sorted(t.name for t in weightlift.open(out).tensors) == sorted(tensors)


def test_pull_follows_no_link_sprayed_over_predictable_names(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"the puller's own file")
    out = folder / "pulled.safetensors"
    links = _predictable_names(out)
    for name in links:
        os.symlink(victim, name)
    tensors = _pull(tmp_path, out)
    assert victim.read_bytes() == b"the puller's own file"
    _assert_pulled(out, tensors)
    assert all(os.path.islink(n) for n in links)  # untouched, and nothing of ours left beside them
    assert sorted(os.listdir(folder)) == sorted([out.name] + [os.path.basename(n) for n in links])


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="needs root to make files another user owns")
def test_pull_output_is_ours_where_another_user_created_the_names(tmp_path):
    out = tmp_path / "pulled.safetensors"
    for name in _predictable_names(out):
        with open(name, "wb"):
            pass
        os.chown(name, 65534, 65534)
    _assert_pulled(out, _pull(tmp_path, out))


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_a_pulled_file_is_no_wider_than_the_umask(tmp_path, umask, mode):
    out = tmp_path / "pulled.safetensors"
    _pull(tmp_path, out, umask=umask)
    assert stat.S_IMODE(os.stat(out).st_mode) == mode


def test_a_file_pulled_from_a_token_server_is_the_users_alone(tmp_path):
    out = tmp_path / "pulled.safetensors"
    _pull(tmp_path, out, token="sesame-sesame-sesame", umask=0o022)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600


def test_token(tmp_path):
    path, tensors = model(tmp_path, large=1, small=1)
    with Server(token="sesame-sesame-sesame") as s:
        with pytest.raises(AuthError, match="wants a token"):
            Client(s.address)
        with pytest.raises(AuthError):
            Client(s.address, token="wrong")
        with Client(s.address, token=b"sesame-sesame-sesame") as c:
            c.push(path)
        assert_holds(s, tensors)
    with Server() as s:  # a server that does not ask for the token has not proven it knows it
        with pytest.raises(AuthError, match="did not ask"):
            Client(s.address, token="unused")


def test_server_errors_surface_at_the_end_of_a_push(tmp_path):
    path, tensors = model(tmp_path, large=2, small=0)
    # a client of minor 4 pushes tensors visible as they land (a newer one pushes a unit: test_models)
    with Server(max_memory=400_000) as s, Client(s.address, protocol_minor=4) as c:
        with pytest.raises(RemoteProtocolError, match="memory limit"):
            c.push(path)
        assert list(s.tensors()) == ["large.0"]
        # each stored tensor is charged its name and a per-entry overhead besides the pages its
        # bytes take
        import mmap

        from weightlift.remote.server.store import entry_cost

        pages = -(-300_000 // mmap.PAGESIZE) * mmap.PAGESIZE
        assert s.memory_used == entry_cost("large.0", pages, 1)


def test_connection_refused_is_a_transport_error():
    s = Server()
    s.start()
    addr = s.address
    s.close()
    with pytest.raises(TransportError):
        Client(addr, timeout=5)
    with pytest.raises(OptionError):
        Client("nohost")
    with pytest.raises(OptionError):
        Client(addr, streams=0)


def test_clients_keywords_are_written_once():
    """ClientKw types what ClientOptions defines (the same names, in order); Client's signature
    shows each with its default; a keyword that is neither is refused as Python refuses it."""
    import dataclasses
    import inspect
    import ssl

    from weightlift.remote.client.client import ClientKw, ClientOptions

    fields = [f for f in dataclasses.fields(ClientOptions) if f.init]
    assert list(ClientKw.__annotations__) == [f.name for f in fields] and not ClientKw.__required_keys__
    params = inspect.signature(Client).parameters
    assert list(params) == ["address"] + [f.name for f in fields]
    assert {n: p.default for n, p in params.items() if n != "address"} == {f.name: f.default for f in fields}
    for name in ("tokn", "secret", "transport"):  # derived fields are not keywords
        with pytest.raises(TypeError, match=rf"^Client.__init__\(\) got an unexpected keyword argument '{name}'$"):
            Client("127.0.0.1:1", **{name: None})  # type: ignore[arg-type]
    for bad, match in (
        ({"streams": 0}, "streams must be"),
        ({"timeout": float("nan")}, "timeout must be"),
        ({"protocol_minor": 99}, "protocol_minor must be"),
        ({"tls": ssl.create_default_context(), "backend": object()}, "tls= or backend="),
    ):
        with pytest.raises(OptionError, match=match):
            ClientOptions(**bad)  # type: ignore[arg-type]
    o = ClientOptions(token=" a token\n")
    assert o.secret == b"a token" and "a token" not in repr(o) and o.transport is TCP


def test_pushs_keywords_are_written_once(tmp_path):
    """PushKw and MemoryPushKw type what PushOptions defines, ``to`` being push's own; push's
    signature shows each with its default; a keyword that is neither is refused as Python does."""
    import dataclasses
    import inspect

    from weightlift.remote.client.client import MemoryPushKw, PushKw, PushOptions

    fields = [f for f in dataclasses.fields(PushOptions) if f.init]
    assert set(MemoryPushKw.__annotations__) == {f.name for f in fields} - {"to"}
    assert set(PushKw.__annotations__) == set(MemoryPushKw.__annotations__) - {"base", "in_place"}
    params = inspect.signature(Client.push).parameters
    assert list(params) == ["self", "source"] + [f.name for f in fields]
    assert {n: params[n].default for n in list(params)[2:]} == {f.name: f.default for f in fields}
    path, _ = model(tmp_path)
    with Server() as s, Client(s.address) as c:
        with pytest.raises(TypeError, match=r"^Client.push\(\) got an unexpected keyword argument 'selct'$"):
            c.push(path, selct="*")  # type: ignore[call-overload]
        with pytest.raises(OptionError, match=r"push\(base=..., in_place=...\) apply to tensors pushed from memory"):
            c.push(path, in_place=True)
        assert c.push(path).tensors == len(c.list())  # the client is still usable


def test_client_profile_and_trace(tmp_path):
    path, tensors = model(tmp_path)
    prof = Profiler(enabled=True, trace=True)
    with Server(cache_dir=tmp_path / "cache") as s, Client(s.address, profile=prof) as c:
        r = c.push(path, hash_threshold=THRESHOLD)
    assert r.profile["background_s"]["hash"] > 0  # hashing ran on the pool, beside the sends
    assert r.profile["phase_bytes"]["wire"] == r.bytes_sent
    prof.write_trace(tmp_path / "t.json")
    names = {e["name"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]}
    assert "wire large.0" in names and "hash large.0" in names


def test_gguf_quantized_tensors_travel_as_raw_bytes(tmp_path):
    pytest.importorskip("gguf")
    import weightlift
    from tests import gguf_files

    path = tmp_path / "m.gguf"
    gguf_files.write_sample(path)
    ck = weightlift.open(path)
    raw = path.read_bytes()
    with Server() as s, Client(s.address) as c:
        c.push(ck)
        got = s.tensors()
        listed = {t.name: t for t in c.list()}
    for t in ck.tensors:
        assert _host_bytes(got[t.name]) == raw[t.offset : t.end], t.name
        if t.quantized:
            assert listed[t.name].dtype == "U8" and listed[t.name].shape == (t.length,)


def test_a_split_gguf_model_is_pushed_whole(tmp_path):
    pytest.importorskip("gguf")
    import weightlift
    from tests import gguf_files

    files = gguf_files.write_split_sample(tmp_path / "m.gguf", max_tensors=5)
    ck = weightlift.open(files[0])
    assert len(ck.files) == len(files) > 1
    with Server() as s, Client(s.address) as c:
        c.push(str(files[0]))
        got = s.tensors()
    assert sorted(got) == sorted(gguf_files.SAMPLE_NAMES)
    for t in ck.tensors:
        with open(t.file, "rb") as f:
            f.seek(t.offset)
            assert _host_bytes(got[t.name]) == f.read(t.length), t.name


# -- the CLI verbs -------------------------------------------------------------------------------


def test_cli_push_ls_pull(tmp_path, capsys):
    path, tensors = model(tmp_path)
    token = tmp_path / "token"
    token.write_text("sesame-sesame-sesame\n")
    token.chmod(0o600)
    with Server(token="sesame-sesame-sesame", cache_dir=tmp_path / "cache") as s:
        host, port = s.address
        to = f"{host}:{port}"
        assert cli.main(["push", path, "--to", to, "--token-file", str(token), "--json", "--select", "small.*"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["tensors"] == 4 and out["bytes_hashed"] == 0 and out["profile"]["tensors"] == 4
        assert out["profile"]["phases_s"]["hash"] == 0
        assert (
            cli.main(
                [
                    "push",
                    path,
                    "--to",
                    to,
                    "--token-file",
                    str(token),
                    "--streams",
                    "2",
                    "--profile",
                    "--trace",
                    str(tmp_path / "trace.json"),
                ]
            )
            == 0
        )
        text = capsys.readouterr().out
        assert "pushed 7 tensors" in text and "load profile" in text
        assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
        assert cli.main(["ls", "--from", to, "--token-file", str(token), "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert [e["name"] for e in listed] == sorted(tensors)
        assert cli.main(["ls", "--from", to, "--token-file", str(token)]) == 0
        assert "7 tensors" in capsys.readouterr().out
        out_file = tmp_path / "pulled.safetensors"
        assert cli.main(["pull", "--from", to, "--token-file", str(token), "-o", str(out_file)]) == 0
        import weightlift

        assert sorted(t.name for t in weightlift.open(out_file).tensors) == sorted(tensors)
        capsys.readouterr()
        assert cli.main(["ls", "--from", to]) == 2  # no token: one line, status 2
        assert "wants a token" in capsys.readouterr().err
        assert cli.main(["push", path, "--to", to, "--token-file", str(tmp_path / "missing")]) == 2
        assert cli.main(["push", path, "--to", "nonsense", "--token-file", str(token)]) == 2
        assert cli.main(["push", path, "--to", to, "--streams", "0"]) == 2


def test_cli_serve_in_a_subprocess(tmp_path):
    path, tensors = model(tmp_path, large=1, small=2)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weightlift.cli",
            "serve",
            "--port",
            "0",
            "--max-memory",
            "1M",
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("weightlift: serving on 127.0.0.1:"), line + proc.stderr.read()
        addr = line.split()[3]
        with Client(addr) as c:
            assert c.server_hello.max_memory == 1 << 20
            c.push(path)
            assert len(c.list()) == 3
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_cli_serve_refuses_a_public_address_without_token(capsys):
    assert cli.main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "token" in capsys.readouterr().err
    assert cli.main(["serve", "--port", "0", "--max-memory", "lots"]) == 2


def _recorder() -> tuple[list[tuple[int, int]], Callable[[int, int], None]]:
    calls: list[tuple[int, int]] = []
    return calls, lambda done, total: calls.append((done, total))


@pytest.mark.parametrize("streams", [1, 3])
def test_push_and_pull_report_progress_through_their_callback(tmp_path, streams):
    path, tensors = model(tmp_path, large=3, small=4)
    total = sum(len(b) for _, _, b in tensors.values())
    with Server(cache_dir=tmp_path / "cache") as s, Client(s.address, streams=streams) as c:
        for cached in (0, 3):  # sent, then the large ones filled from the server's cache
            calls, progress = _recorder()
            r = c.push(path, hash_threshold=THRESHOLD, progress=progress)
            assert r.cached == cached
            assert len(calls) == len(tensors)  # once per tensor, sent or filled
            assert all(t == total for _, t in calls) and calls[-1] == (total, total)
            assert [d for d, _ in calls] == sorted(d for d, _ in calls)
            c.free(list(tensors))
        c.push(path)
        calls, progress = _recorder()
        c.pull(tmp_path / "out.safetensors", verify=True, progress=progress)
        assert len(calls) == len(tensors) and calls[-1] == (total, total)
        assert [d for d, _ in calls] == sorted(d for d, _ in calls)
        calls, progress = _recorder()
        c.push({"m.0": np.arange(1000, dtype=np.float32)}, progress=progress)  # from memory too
        assert calls == [(4000, 4000)]
        with pytest.raises(OptionError, match="progress"):
            c.push(path, to=[s.address], progress=progress)
