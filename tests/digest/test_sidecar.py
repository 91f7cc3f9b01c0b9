from __future__ import annotations

import json
import mmap
import os
import threading
import time
import warnings
from dataclasses import dataclass

import blake3
import ml_dtypes
import numpy as np
import pytest

from weightlift.digest.blake import HASH_THRESHOLD, NAIVE_HASH_THRESHOLD, DigestPool, byte_view, hash_buffer
from weightlift.digest.sidecar import SIDECAR_SUFFIX, Sidecar, hash_tensors
from weightlift.errors import NotFoundError, OptionError
from weightlift.profile import Profiler


def _data(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture(autouse=True)
def _private_home(tmp_path, monkeypatch):
    # Sidecars live in weightlift's cache folder; keep it inside the test.
    monkeypatch.setenv("WEIGHTLIFT_CACHE", str(tmp_path / "wl-cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


# -- hash_buffer --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 1023, 1025, 2 * 1024 * 1024 + 3])
def test_hash_buffer_equals_blake3_of_bytes(n):
    data = _data(n)
    expected = blake3.blake3(data).digest()
    assert hash_buffer(data) == expected
    assert hash_buffer(bytearray(data)) == expected
    assert hash_buffer(memoryview(data)) == expected
    assert hash_buffer(data, max_threads=1) == expected


def test_hash_buffer_typed_and_mmap(tmp_path):
    a = np.arange(10_000, dtype=np.float32).reshape(100, 100)
    assert hash_buffer(a) == blake3.blake3(a.tobytes()).digest()
    bf = np.arange(1000, dtype=np.float32).astype(ml_dtypes.bfloat16)
    assert hash_buffer(bf) == blake3.blake3(bf.tobytes()).digest()
    p = tmp_path / "f.bin"
    data = _data(50_000)
    p.write_bytes(data)
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)[1000:40_000]
        assert hash_buffer(view) == blake3.blake3(data[1000:40_000]).digest()
        view.release()


def test_byte_view_refuses_non_contiguous():
    a = np.arange(100, dtype=np.float32).reshape(10, 10)
    with pytest.raises(OptionError):
        hash_buffer(a[:, ::2])
    with pytest.raises(OptionError):
        hash_buffer(memoryview(b"abcdef")[::2])
    with pytest.raises(OptionError):
        hash_buffer(object())
    assert byte_view(a).nbytes == 400 and byte_view(a).format == "B"


# -- Sidecar -----------------------------------------------------------------------------------


def _checkpoint(tmp_path, data: bytes = b"") -> str:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    p = folder / "model.safetensors"
    p.write_bytes(data or _data(4096))
    return str(p)


D1 = bytes(range(32))
D2 = bytes(range(32, 64))


def _put_beside(path: str) -> str:
    """Move ``path``'s saved sidecar beside the file, where an older version wrote them (and where
    anyone who can write the folder can plant one); returns where it now is."""
    side = path + SIDECAR_SUFFIX
    os.replace(Sidecar(path, {}).fallback_path, side)
    return side


def _saved(path: str) -> Sidecar:
    """The sidecar of ``path`` with one digest (D1, of tensor "a"'s bytes 0 to 10), saved."""
    m = Sidecar.load(path)
    m.put("a", 0, 10, D1)
    m.save()
    return m


def test_manifest_round_trip(tmp_path):
    path = _checkpoint(tmp_path)
    m = Sidecar.load(path)
    assert len(m) == 0 and m.get("a", 0, 10) is None
    m.put("a", 0, 10, D1)
    m.put("b", 10, 20, D2)
    m.save()
    # in weightlift's cache folder, never in the model's
    assert os.listdir(os.path.dirname(path)) == ["model.safetensors"]
    assert m.fallback_path.startswith(str(tmp_path / "wl-cache" / "manifests"))
    doc = json.loads(open(m.fallback_path).read())
    assert doc["tensors"]["a"] == {"offset": 0, "length": 10, "blake3": D1.hex()}
    st = os.stat(path)
    assert (doc["file"]["size"], doc["file"]["mtime_ns"], doc["file"]["inode"]) == (
        st.st_size,
        st.st_mtime_ns,
        st.st_ino,
    )
    again = Sidecar.load(path)
    assert len(again) == 2
    assert again.get("a", 0, 10) == D1 and again.get("b", 10, 20) == D2
    # A digest counts only for exactly the bytes it was taken of.
    assert again.get("a", 0, 11) is None and again.get("a", 1, 10) is None and again.get("c", 0, 10) is None


def test_manifest_invalidated_by_mtime(tmp_path):
    path = _checkpoint(tmp_path)
    _saved(path)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert len(Sidecar.load(path)) == 0


def test_manifest_invalidated_by_size(tmp_path):
    path = _checkpoint(tmp_path)
    _saved(path)
    st = os.stat(path)
    with open(path, "ab") as f:
        f.write(b"x")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime, other size
    assert len(Sidecar.load(path)) == 0


def test_manifest_invalidated_by_rewrite(tmp_path):
    path = _checkpoint(tmp_path, _data(4096, seed=1))
    _saved(path)
    st = os.stat(path)
    # Same size and mtime, new bytes in a new inode: a download tool replacing the file.
    tmp = path + ".new"
    with open(tmp, "wb") as f:
        f.write(_data(4096, seed=2))
    keep = open(path, "rb")  # hold the old inode so the new file cannot reuse its number
    try:
        os.replace(tmp, path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(path).st_ino != st.st_ino
        assert len(Sidecar.load(path)) == 0
    finally:
        keep.close()


def test_manifest_invalidated_by_in_place_write_with_mtime_restored(tmp_path):
    # What rsync -t or touch -r leave: new bytes, old size and mtime, same inode.
    path = _checkpoint(tmp_path)
    _saved(path)
    st = os.stat(path)
    time.sleep(0.01)
    with open(path, "r+b") as f:
        f.write(b"changed!")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert len(Sidecar.load(path)) == 0


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{not json",
        b"[]",
        b'{"version": 1}',
        b"\xff\xfe\x00garbage",
        None,  # a well-formed document with a bad digest, filled in below
    ],
)
def test_manifest_ignores_corrupt_sidecar(tmp_path, content):
    path = _checkpoint(tmp_path)
    side = Sidecar(path, {}).fallback_path
    os.makedirs(os.path.dirname(side), mode=0o700, exist_ok=True)
    if content is None:
        _saved(path)
        doc = json.loads(open(side).read())
        doc["tensors"]["a"]["blake3"] = "zz" * 32
        content = json.dumps(doc).encode()
    with open(side, "wb") as f:
        f.write(content)
    m = Sidecar.load(path)
    assert len(m) == 0
    m.put("a", 0, 10, D2)
    m.save()  # overwrites the corrupt one
    assert Sidecar.load(path).get("a", 0, 10) == D2


def test_manifest_of_missing_file(tmp_path):
    with pytest.raises(NotFoundError):
        Sidecar.load(tmp_path / "absent.safetensors")


def _refuse_in(monkeypatch, folder: str) -> None:
    """Make creating files in ``folder`` fail as a read-only folder would (tests may run as root)."""
    real_open = os.open

    def guarded(path, flags, *args, **kwargs):
        if os.path.dirname(os.path.abspath(path)) == folder and flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", guarded)


def test_manifest_saved_in_the_cache_when_the_folder_is_read_only(tmp_path, monkeypatch):
    path = _checkpoint(tmp_path)
    _refuse_in(monkeypatch, os.path.dirname(path))
    m = Sidecar.load(path)
    m.put("a", 0, 10, D1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.save()
    assert not os.path.exists(path + SIDECAR_SUFFIX)
    assert m.fallback_path.startswith(str(tmp_path / "wl-cache" / "manifests"))
    assert os.path.exists(m.fallback_path)
    assert Sidecar.load(path).get("a", 0, 10) == D1
    assert [n for n in os.listdir(os.path.dirname(m.fallback_path)) if n.endswith(".tmp")] == []


def test_manifest_save_never_fails_the_caller(tmp_path, monkeypatch):
    path = _checkpoint(tmp_path)
    m = Sidecar.load(path)
    m.put("a", 0, 10, D1)
    _refuse_in(monkeypatch, os.path.dirname(path))
    _refuse_in(monkeypatch, os.path.dirname(m.fallback_path))
    with pytest.warns(UserWarning, match="cannot save"):
        m.save()
    monkeypatch.undo()
    assert len(Sidecar.load(path)) == 0


def test_manifest_not_saved_if_file_changed_since_load(tmp_path):
    path = _checkpoint(tmp_path)
    m = Sidecar.load(path)
    with open(path, "ab") as f:
        f.write(b"more")
    m.put("a", 0, 10, D1)
    with pytest.warns(UserWarning, match="changed"):
        m.save()
    assert not os.path.exists(path + SIDECAR_SUFFIX) and not os.path.exists(m.fallback_path)


# -- DigestPool and hash_tensors ----------------------------------------------------------------


def test_digest_pool_many_buffers():
    bufs = {f"t{i}": _data(1000 * i + i, seed=i) for i in range(40)}
    with DigestPool(threads=3) as pool:
        futs = {name: pool.submit(name, memoryview(b)) for name, b in bufs.items()}
        got = {name: f.result(timeout=60) for name, f in futs.items()}
    assert got == {name: blake3.blake3(b).digest() for name, b in bufs.items()}


def test_digest_pool_records_hash_phase():
    prof = Profiler(enabled=True, trace=True)
    pool = DigestPool(threads=2, profiler=prof)
    a = np.arange(1000, dtype=np.int64)
    assert pool.submit("w", a).result(timeout=60) == blake3.blake3(a.tobytes()).digest()
    pool.close()
    rep = prof.report()
    assert rep["background_s"]["hash"] > 0 and rep["phases_s"]["hash"] == 0  # in the background
    events = [e for e in prof.trace_events()["traceEvents"] if e.get("ph") == "X"]
    assert [(e["name"], e["cat"], e["args"]["bytes"]) for e in events] == [("hash w", "hash,background", 8000)], events
    off = DigestPool(threads=1, profiler=Profiler(enabled=False))
    assert off.submit("w", a).result(timeout=60) == blake3.blake3(a.tobytes()).digest()
    off.close()
    with pytest.raises(OptionError):
        DigestPool(threads=0)


@dataclass(frozen=True)
class _T:
    name: str
    file: str
    offset: int
    length: int


def test_hash_tensors_uses_and_fills_manifest(tmp_path):
    data = _data(20_000, seed=9)
    path = _checkpoint(tmp_path, data)
    tensors = [_T("small", path, 0, 100), _T("a", path, 100, 9000), _T("b", path, 9100, 10_900)]
    views: list[str] = []

    def view(t: _T) -> memoryview:
        views.append(t.name)
        return memoryview(data)[t.offset : t.offset + t.length]

    expected = {t.name: blake3.blake3(data[t.offset : t.offset + t.length]).digest() for t in tensors[1:]}
    with DigestPool(threads=2) as pool:
        futs = hash_tensors(tensors, view=view, pool=pool, threshold=1000)
        assert {n: f.result(timeout=60) for n, f in futs.items()} == expected
    assert sorted(views) == ["a", "b"]
    # The manifest was saved when the last digest arrived: the second pass hashes nothing.
    views.clear()
    futs = hash_tensors(tensors, view=view, threshold=1000)
    assert {n: f.result() for n, f in futs.items()} == expected
    assert views == []
    # Without a pool digests are computed inline.
    futs = hash_tensors(tensors, view=view, threshold=1000, manifests=False)
    assert {n: f.result() for n, f in futs.items()} == expected and sorted(views) == ["a", "b"]


def test_hash_threshold():
    assert HASH_THRESHOLD == 1024 * 1024  # mixture-of-experts experts are 1-8 MiB
    assert NAIVE_HASH_THRESHOLD == 10 * 1024 * 1024


def test_hash_tensors_default_view_reads_the_file(tmp_path):
    data = _data(30_000, seed=4)
    path = _checkpoint(tmp_path, data)
    tensors = [_T("x", path, 5000, 20_000)]
    futs = hash_tensors(tensors, threshold=1, manifests=False)
    assert futs["x"].result() == blake3.blake3(data[5000:25_000]).digest()


# -- who may have written a sidecar ------------------------------------------------------------

OTHER_UID = 65534  # nobody
_root_only = pytest.mark.skipif(
    os.name != "posix" or os.geteuid() != 0, reason="needs root to give a file to another user"
)


def _planted(tmp_path) -> tuple[str, dict[str, bytes]]:
    """A real checkpoint with a well-formed sidecar beside it that names other digests than the
    file's; returns the file and its real digests."""
    from weightlift.checkpoint import open_checkpoint

    from ..checkpoints import write

    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    ts = [(f"w{i}", "U8", (5000,), _data(5000, seed=20 + i)) for i in range(3)]
    path = str(write(folder / "model.safetensors", ts))
    m = Sidecar.load(path)
    for t in open_checkpoint(path).select():
        m.put(t.name, t.offset, t.length, D1)  # what a planter would name
    m.save()
    _put_beside(path)
    real = {name: blake3.blake3(raw).digest() for name, _, _, raw in ts}
    return path, real


def _published_digests(path: str) -> dict[str, bytes]:
    from weightlift.digest.published import make_manifest

    return {e.name: bytes.fromhex(e.blake3) for e in make_manifest(path).entries}


def _expected(path: str) -> dict[str, bytes]:
    from weightlift.checkpoint import open_checkpoint
    from weightlift.digest.published import expected_digests

    return expected_digests(open_checkpoint(path).select(), None)


def test_own_private_sidecar_is_trusted(tmp_path):
    path, _ = _planted(tmp_path)
    assert stat_mode(path + SIDECAR_SUFFIX) & 0o077 == 0  # written 0600
    assert len(Sidecar.load(path)) == 3
    assert set(_published_digests(path).values()) == {D1}  # the sidecar is believed (and here wrong)


@_root_only
def test_sidecar_of_another_user_is_ignored(tmp_path):
    path, real = _planted(tmp_path)
    side = path + SIDECAR_SUFFIX
    os.chown(side, OTHER_UID, OTHER_UID)
    os.chmod(side, 0o600)
    assert len(Sidecar.load(path)) == 0
    assert _published_digests(path) == real
    assert os.stat(side).st_uid == OTHER_UID  # the next save went to the cache, leaving it alone
    assert _expected(path) == real


@_root_only
def test_verified_load_ignores_a_planted_sidecar(tmp_path):
    import weightlift as wl

    path, real = _planted(tmp_path)
    os.chown(path + SIDECAR_SUFFIX, OTHER_UID, OTHER_UID)
    out = wl.load(path, verify=True)  # checked against the file's own digests, not the planted ones
    assert {n: blake3.blake3(v.tobytes()).digest() for n, v in out.items()} == real


def test_sidecar_writable_by_others_is_ignored(tmp_path):
    path, real = _planted(tmp_path)
    side = path + SIDECAR_SUFFIX
    os.chmod(side, 0o666)
    assert len(Sidecar.load(path)) == 0
    assert _published_digests(path) == real
    os.chmod(side, 0o620)
    assert _expected(path) == real


def test_sidecar_link_is_ignored_and_not_written_through(tmp_path):
    path, real = _planted(tmp_path)
    side = path + SIDECAR_SUFFIX
    elsewhere = tmp_path / "elsewhere.json"
    os.replace(side, elsewhere)
    before = elsewhere.read_bytes()
    os.symlink(elsewhere, side)
    assert len(Sidecar.load(path)) == 0
    assert _published_digests(path) == real
    assert elsewhere.read_bytes() == before  # the save wrote neither the link nor what it points at
    assert os.path.islink(side)


def test_sidecar_fifo_does_not_block(tmp_path):
    path, real = _planted(tmp_path)
    side = path + SIDECAR_SUFFIX
    os.unlink(side)
    os.mkfifo(side, 0o600)
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(len(Sidecar.load(path))), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # unblock the reader so the test process can end
        with open(side, "wb"):
            pass
        t.join(10)
        pytest.fail("reading a FIFO planted as the sidecar blocked")
    assert got == [0]


def stat_mode(p: str) -> int:
    import stat

    return stat.S_IMODE(os.stat(p).st_mode)


def _saved_in_fallback(tmp_path, monkeypatch) -> tuple[str, Sidecar, str]:
    """A checkpoint in a folder that refuses new files, its sidecar saved in the fallback folder:
    the checkpoint's path, the sidecar and the fallback folder."""
    path = _checkpoint(tmp_path)
    _refuse_in(monkeypatch, os.path.dirname(path))
    m = _saved(path)
    return path, m, os.path.dirname(m.fallback_path)


def test_fallback_folder_made_private(tmp_path, monkeypatch):
    path, m, folder = _saved_in_fallback(tmp_path, monkeypatch)
    assert stat_mode(folder) == 0o700 and stat_mode(m.fallback_path) & 0o077 == 0
    os.chmod(folder, 0o755)  # an older, wider folder of ours is narrowed
    m.put("a", 0, 10, D2)
    m.save()
    assert stat_mode(folder) == 0o700
    assert Sidecar.load(path).get("a", 0, 10) == D2


@_root_only
def test_fallback_folder_of_another_user_is_ignored(tmp_path, monkeypatch):
    path, m, folder = _saved_in_fallback(tmp_path, monkeypatch)
    os.chown(folder, OTHER_UID, OTHER_UID)
    assert len(Sidecar.load(path)) == 0  # not read from a folder another user controls
    with pytest.warns(UserWarning, match="cannot save"):
        m.put("a", 0, 10, D2)
        m.save()  # nor written to it
    os.chown(folder, 0, 0)
    assert Sidecar.load(path).get("a", 0, 10) == D1


def test_push_verify_against_a_caching_server_ignores_a_planted_sidecar(tmp_path):
    # Another user who can write the checkpoint's folder plants a sidecar naming the digests of
    # other bytes that a caching server holds: believed, the server would fill every tensor from
    # its cache with those bytes and the verified push would report them all verified.
    from weightlift.checkpoint import open_checkpoint
    from weightlift.remote.client.client import Client
    from weightlift.remote.server.server import Server

    from ..checkpoints import write

    def model(folder: str, seed: int) -> tuple[str, dict[str, bytes]]:
        (tmp_path / folder).mkdir()
        ts = {f"w{i}": _data(150_000, seed=seed + i) for i in range(3)}
        return str(write(tmp_path / folder / "m.safetensors", [(n, "U8", (len(b),), b) for n, b in ts.items()])), ts

    path, real = model("real", 40)
    decoy_path, decoy = model("decoy", 50)
    planted = Sidecar.load(path)
    for t in open_checkpoint(path).select():
        planted.put(t.name, t.offset, t.length, blake3.blake3(decoy[t.name]).digest())
    planted.save()
    os.chmod(_put_beside(path), 0o666)
    with Server(cache_dir=tmp_path / "cache") as s:
        with Client(s.address) as c:
            c.push(decoy_path, hash_threshold=100_000)  # the server's cache now holds the decoy's bytes
            r = c.push(path, verify=True, hash_threshold=100_000)
            assert r.verified == 3 and r.cached == 0
        got = s.tensors()
        assert {n: got[n].tobytes() for n in real} == real


@_root_only
def test_a_sidecar_of_root_is_trusted_by_another_user(tmp_path):
    # Root can change the checkpoint itself, so its sidecar adds nothing another user must fear;
    # the user's own sidecar is trusted the same way, and a third user's is not.
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="wl-sidecar-")
    try:
        os.chmod(folder, 0o755)
        path, _ = _planted(tmp_path)
        for p in (path, path + SIDECAR_SUFFIX):
            shutil.copy2(p, folder)
        path = os.path.join(folder, os.path.basename(path))
        m = Sidecar.load(path)  # the copy has another identity: record it afresh
        m.put("w0", 0, 10, D1)
        m.save()
        _put_beside(path)
        os.chmod(path + SIDECAR_SUFFIX, 0o644)

        def seen_by(uid: int) -> int:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child reports through the pipe
                try:
                    os.setgid(uid)
                    os.setuid(uid)
                    os.environ["XDG_CACHE_HOME"] = folder
                    os.write(w, bytes([len(Sidecar.load(path))]))
                finally:
                    os._exit(0)
            os.close(w)
            got = os.read(r, 1)
            os.close(r)
            os.waitpid(pid, 0)
            return got[0]

        assert seen_by(OTHER_UID) == 1  # root's, read by nobody
        os.chown(path + SIDECAR_SUFFIX, OTHER_UID - 1, OTHER_UID - 1)
        assert seen_by(OTHER_UID) == 0  # a third user's
        os.chown(path + SIDECAR_SUFFIX, OTHER_UID, OTHER_UID)
        assert seen_by(OTHER_UID) == 1  # its own
    finally:
        shutil.rmtree(folder)
