"""A tensor named by digest is published only with its bytes proven, whatever the cache holds; a
client's mistakes never cost a valid entry; one connection holds a bounded number of files open."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import weightlift.remote.protocol as P
from tests.remote.rawclient import Raw, _barrier, _cache_push, _cached, _entry, _f32
from weightlift.digest.blake import hash_buffer
from weightlift.errors import CacheError
from weightlift.remote.protocol import Alloc, BarrierReply, WriteHeader
from weightlift.remote.server.cache import TensorCache
from weightlift.remote.server.cache.index import charge
from weightlift.remote.server.receive import MAX_OPEN_FILES
from weightlift.remote.server.server import Server


def test_a_fill_of_the_wrong_size_keeps_the_valid_entry(tmp_path):
    a = _f32(50_000, 1)
    d = hash_buffer(a)
    with _cached(tmp_path / "c", a, d) as (s, raw):
        entry = _entry(tmp_path / "c", d)
        raw.send(Alloc(1, "bigger", "F32", (2 * a.size,), 2 * a.nbytes, d))
        raw.send(P.FillFromCache(1, d))
        assert _barrier(raw) == BarrierReply(0, 0, (), (1,))  # not filled: send the bytes
        assert entry.read_bytes() == a.tobytes()  # and the entry is still there
        raw.close()


def test_wrong_bytes_under_a_cached_digest_are_refused(tmp_path):
    a = _f32(50_000, 2)
    d = hash_buffer(a)
    with _cached(tmp_path / "c", a, d) as (s, raw):
        _cache_push(raw, _f32(50_000, 3), 1, "liar", d)  # the digest is cached: the bytes are still checked
        reply = _barrier(raw)
        assert reply.tensors == 0 and "do not match the digest" in reply.errors[0]
        assert "liar" not in s.tensors()
        raw.close()


def test_out_of_order_writes_under_a_digest_are_proven_at_the_end(tmp_path):
    a = _f32(50_000, 4)
    bad = a.copy()
    bad[7] += 1
    with Server(cache_dir=tmp_path / "c") as s:
        raw = Raw.connected(s.address)
        for tid, name, arr in ((0, "good", a), (1, "bad", bad)):
            raw.send(Alloc(tid, name, "F32", a.shape, a.nbytes, hash_buffer(a)))
            half = a.nbytes // 2
            raw.send(WriteHeader(tid, half, a.nbytes - half), arr.tobytes()[half:])
            raw.send(WriteHeader(tid, 0, half), arr.tobytes()[:half])
        reply = _barrier(raw)
        assert reply.tensors == 1 and "'bad'" in reply.errors[0] and "do not match" in reply.errors[0]
        assert np.array_equal(s.tensors()["good"], a) and "bad" not in s.tensors()
        raw.close()


def test_one_connection_holds_a_bounded_number_of_cache_files(tmp_path):
    arrs = [_f32(1000, 10 + i) for i in range(40)]
    with Server(cache_dir=tmp_path / "c") as s:
        raw = Raw.connected(s.address)
        half = arrs[0].nbytes // 2
        for i, a in enumerate(arrs):  # every tensor begun, none finished
            raw.send(Alloc(i, f"t{i}", "F32", a.shape, a.nbytes, hash_buffer(a)))
            raw.send(WriteHeader(i, 0, half), a.tobytes()[:half])
        raw.send(P.ListRequest())
        raw.recv()  # every WRITE above was handled
        temps = [f for f in (tmp_path / "c").rglob(".tmp-*")]
        assert len(temps) <= MAX_OPEN_FILES
        for i, a in enumerate(arrs):
            raw.send(WriteHeader(i, half, a.nbytes - half), a.tobytes()[half:])
        assert _barrier(raw).tensors == len(arrs)
        assert all(np.array_equal(s.tensors()[f"t{i}"], a) for i, a in enumerate(arrs))
        raw.send(P.Have(tuple(hash_buffer(a) for a in arrs)))
        assert raw.recv() == P.HaveReply((True,) * len(arrs))  # every one proven, cached or not
        raw.close()


def test_the_disk_cache_is_capped_least_recently_used_first(tmp_path):
    arrs = [_f32(25_000, 20 + i) for i in range(4)]  # 100 kB each: 25 blocks on disk
    with Server(cache_dir=tmp_path / "c", cache_max_bytes=250_000) as s:
        raw = Raw.connected(s.address)
        for i, a in enumerate(arrs):
            _cache_push(raw, a, i, f"t{i}", hash_buffer(a))
            assert _barrier(raw).tensors == 1
        held = sum(f.stat().st_blocks * 512 for f in (tmp_path / "c").rglob("*") if f.is_file())
        assert held <= 250_000
        raw.close()
    cache = TensorCache(tmp_path / "c", max_bytes=None)  # what the server left on disk
    assert cache.has(hash_buffer(arrs[-1])) and not cache.has(hash_buffer(arrs[0]))
    assert cache.total_bytes == 2 * charge(arrs[0].nbytes)


@pytest.mark.skipif(os.geteuid() != 0, reason="a folder of another user's (uid 65534) needs root to make")
def test_a_server_refuses_a_cache_folder_another_user_owns(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(CacheError, match="is owned by uid 65534"):
        Server(cache_dir=theirs)
    assert list(theirs.iterdir()) == []


def test_serve_refuses_a_cache_folder_others_can_write(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    done = subprocess.run(
        [sys.executable, "-m", "weightlift", "serve", "--port", "0", "--cache-dir", str(shared)],
        capture_output=True,
        text=True,
        timeout=30,  # a server that accepted the folder would serve until killed
    )
    assert done.returncode == 2, done
    assert f"weightlift: error: cache folder {shared} is writable by its group and others (mode 1777)" in done.stderr
    assert "chmod 700" in done.stderr and list(shared.iterdir()) == []
