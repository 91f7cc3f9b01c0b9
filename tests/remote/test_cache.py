from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
import threading
import time

import blake3
import numpy as np
import pytest

from weightlift.errors import CacheError, OptionError
from weightlift.remote.server.cache import (
    DEFAULT_MAX_FRACTION,
    DIGEST_SIZE,
    STALE_TEMP_SECONDS,
    CacheWriter,
    TensorCache,
    digest_hex,
    disk_unusable,
)
from weightlift.remote.server.cache.index import BLOCK, charge


def _data(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _digest(b: bytes) -> bytes:
    return blake3.blake3(b).digest()


def _files(root) -> list[str]:
    """Every file under the cache root, temporary or not, relative to it."""
    out = []
    for dirpath, _dirs, names in os.walk(root):
        out += [os.path.relpath(os.path.join(dirpath, n), root) for n in names]
    return sorted(out)


def _put(cache: TensorCache, data: bytes) -> bytes:
    d = _digest(data)
    with cache.writer(d, len(data)) as w:
        w.write(data)
        w.commit()
    return d


def test_digest_hex():
    d = bytes(range(32))
    assert DIGEST_SIZE == 32
    assert digest_hex(d) == d.hex()
    with pytest.raises(OptionError):
        digest_hex(b"short")


def test_round_trip_layout_and_exact_bytes(tmp_path):
    cache = TensorCache(tmp_path / "c")
    data = _data(100_003)
    d = _digest(data)
    assert not cache.has(d)
    _put(cache, data)
    hx = d.hex()
    assert _files(tmp_path / "c") == [os.path.join(hx[:2], hx)]
    assert cache.path_for(d) == str(tmp_path / "c" / hx[:2] / hx)
    assert cache.has(d) and cache.has(d, len(data))
    assert not cache.has(d, len(data) + 1)
    out = bytearray(len(data))
    cache.read_into(d, out)
    assert bytes(out) == data
    assert cache.total_bytes == charge(len(data)) == 25 * BLOCK  # whole blocks on disk


def test_read_into_numpy_destination(tmp_path):
    cache = TensorCache(tmp_path)
    src = np.arange(50_000, dtype=np.float32)
    d = _digest(src.tobytes())
    with cache.writer(d, src.nbytes) as w:
        w.write(src)  # a typed buffer, not bytes
        w.commit()
    dest = np.empty_like(src)
    cache.read_into(d, dest)
    np.testing.assert_array_equal(dest, src)


def test_read_into_calls_before_ahead_of_each_piece(tmp_path, monkeypatch):
    import weightlift.remote.server.cache as cache_mod

    monkeypatch.setattr(cache_mod, "READ_CHUNK", 1000)
    cache = TensorCache(tmp_path)
    data = _data(2500, seed=3)
    d = _digest(data)
    _put(cache, data)
    out = bytearray(len(data))
    seen: list[tuple[int, int, bytes]] = []
    cache.read_into(d, out, before=lambda b, e: seen.append((b, e, bytes(out[b:e]))))
    assert bytes(out) == data
    # each range announced before its bytes landed (still zero then), together all of them
    assert [(b, e) for b, e, _ in seen] == [(0, 1000), (1000, 2000), (2000, 2500)]
    assert all(chunk == bytes(e - b) for b, e, chunk in seen)


def test_chunked_writes_of_odd_sizes(tmp_path):
    cache = TensorCache(tmp_path)
    data = _data(3 * 1024 * 1024 + 17, seed=1)  # over 1 MiB: the parallel hasher path
    d = _digest(data)
    mv = memoryview(data)
    sizes = [1, 7, 4093, 65537, 300_000, 1 << 20]
    with cache.writer(d, len(data)) as w:
        off, i = 0, 0
        while off < len(data):
            n = sizes[i % len(sizes)]
            w.write(mv[off : off + n])
            off += n
            i += 1
        assert w.written == len(data)
        w.commit()
    out = bytearray(len(data))
    cache.read_into(d, out)
    assert bytes(out) == data


def test_empty_entry(tmp_path):
    cache = TensorCache(tmp_path)
    d = _put(cache, b"")
    assert cache.has(d, 0)
    cache.read_into(d, bytearray())


def test_commit_with_wrong_digest_leaves_nothing(tmp_path):
    cache = TensorCache(tmp_path)
    data = _data(5000)
    wrong = _digest(data + b"x")
    w = cache.writer(wrong, len(data))
    w.write(data)
    with pytest.raises(CacheError, match="digest"):
        w.commit()
    assert _files(tmp_path) == []
    assert not cache.has(wrong)


def test_commit_with_wrong_length_leaves_nothing(tmp_path):
    cache = TensorCache(tmp_path)
    data = _data(5000)
    d = _digest(data)
    w = cache.writer(d, len(data) + 1)
    w.write(data)
    with pytest.raises(CacheError, match="declared"):
        w.commit()
    assert _files(tmp_path) == []
    # Writing past the declared length is refused at once.
    w = cache.writer(d, 10)
    with pytest.raises(CacheError, match="more than"):
        w.write(data)
    assert _files(tmp_path) == []
    with pytest.raises(CacheError):
        w.write(b"x")


def test_abort_and_context_manager_leave_nothing(tmp_path):
    cache = TensorCache(tmp_path)
    data = _data(5000)
    d = _digest(data)
    w = cache.writer(d, len(data))
    w.write(data[:100])
    assert len(_files(tmp_path)) == 1  # the temporary file
    w.abort()
    w.abort()
    assert _files(tmp_path) == []
    with pytest.raises(RuntimeError):
        with cache.writer(d, len(data)) as w:
            w.write(data)
            raise RuntimeError("boom")
    assert _files(tmp_path) == []
    # Leaving the block without commit discards too.
    with cache.writer(d, len(data)) as w:
        w.write(data)
    assert _files(tmp_path) == [] and not cache.has(d)


def _stored(tmp_path) -> tuple[TensorCache, bytes, bytes]:
    cache = TensorCache(tmp_path)
    data = _data(200_000, seed=2)
    return cache, data, _put(cache, data)


def test_truncated_entry_is_dropped(tmp_path):
    cache, data, d = _stored(tmp_path)
    os.truncate(cache.path_for(d), len(data) - 1)
    with pytest.raises(CacheError, match="expected"):
        cache.read_into(d, bytearray(len(data)))
    assert not os.path.exists(cache.path_for(d))
    with pytest.raises(CacheError, match="missing"):
        cache.read_into(d, bytearray(len(data)))


def test_oversize_entry_is_dropped(tmp_path):
    cache, data, d = _stored(tmp_path)
    with open(cache.path_for(d), "ab") as f:
        f.write(b"\0")
    assert not cache.has(d, len(data))
    with pytest.raises(CacheError):
        cache.read_into(d, bytearray(len(data)))
    assert not os.path.exists(cache.path_for(d))


def test_corrupted_byte_is_dropped(tmp_path):
    cache, data, d = _stored(tmp_path)
    with open(cache.path_for(d), "r+b") as f:
        f.seek(123_457)
        b = f.read(1)
        f.seek(123_457)
        f.write(bytes([b[0] ^ 1]))
    assert cache.has(d, len(data))  # a stat cannot tell; the read must
    with pytest.raises(CacheError, match="does not match"):
        cache.read_into(d, bytearray(len(data)))
    assert not os.path.exists(cache.path_for(d))


def test_unreadable_entry_is_dropped(tmp_path):
    # Tests may run as root, where chmod 000 does not stop a read: a folder in the entry's
    # place cannot be read as a file by anyone.
    cache, data, d = _stored(tmp_path)
    path = cache.path_for(d)
    os.unlink(path)
    os.mkdir(path)
    (tmp_path / path / "junk").write_bytes(b"x")
    assert not cache.has(d)
    with pytest.raises(CacheError, match="unreadable|not a regular"):
        cache.read_into(d, bytearray(len(data)))
    assert not os.path.exists(path)


def test_read_error_mid_entry_is_dropped(tmp_path, monkeypatch):
    cache, data, d = _stored(tmp_path)

    class FailingFile:
        """A real file whose reads fail with EIO once the first bytes are in."""

        def __init__(self, path, mode, buffering=-1):
            self._f = open(path, mode, buffering=buffering)

        def fileno(self):
            return self._f.fileno()

        def readinto(self, b):
            if self._f.tell() > 0:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return self._f.readinto(memoryview(b)[:4096])

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    monkeypatch.setattr("weightlift.remote.server.cache.open", FailingFile, raising=False)
    with pytest.raises(CacheError, match="unreadable"):
        cache.read_into(d, bytearray(len(data)))
    monkeypatch.undo()
    assert not os.path.exists(cache.path_for(d))


def test_wrong_destination_size_drops_entry(tmp_path):
    cache, data, d = _stored(tmp_path)
    with pytest.raises(OptionError):
        cache.read_into(d, bytes(len(data)))  # read-only destination: an argument error
    assert cache.has(d)
    with pytest.raises(CacheError):
        cache.read_into(d, bytearray(len(data) - 1))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
def test_disk_error_on_write_raises_and_removes_temp(tmp_path, monkeypatch, code):
    cache = TensorCache(tmp_path)
    data = _data(10_000)
    d = _digest(data)
    w = cache.writer(d, len(data))
    w.write(data[:3000])
    real_write = os.write

    def half_then_fail(fd, buf):
        if fd == w._fd:
            n = real_write(fd, memoryview(buf)[:100])
            if n:
                raise OSError(code, os.strerror(code))
        return real_write(fd, buf)

    monkeypatch.setattr(os, "write", half_then_fail)
    with pytest.raises(CacheError, match=os.strerror(code)) as info:
        w.write(data[3000:])
    monkeypatch.undo()
    assert disk_unusable(info.value)
    assert _files(tmp_path) == []
    with pytest.raises(CacheError):
        w.commit()
    assert not cache.has(d)


def test_not_every_cache_error_is_a_disk_error(tmp_path):
    cache = TensorCache(tmp_path)
    w = cache.writer(_digest(b"a"), 1)
    w.write(b"b")
    with pytest.raises(CacheError) as info:
        w.commit()
    assert not disk_unusable(info.value)


def test_lru_eviction_under_max_bytes(tmp_path):
    cache = TensorCache(tmp_path, max_bytes=3 * BLOCK)
    a, b, c = (_data(1000, seed=s) for s in (10, 11, 12))  # one block each
    da, db, dc = (_put(cache, x) for x in (a, b, c))
    cache.read_into(da, bytearray(1000))  # a is now the most recent
    dd = _put(cache, _data(1000, seed=13))
    assert [cache.has(x) for x in (da, db, dc, dd)] == [True, False, True, True]
    assert cache.total_bytes == 3 * BLOCK
    de = _put(cache, _data(BLOCK + 1, seed=14))  # two blocks: two entries go
    assert [cache.has(x) for x in (da, dc, dd, de)] == [False, False, True, True]
    assert cache.total_bytes == 3 * BLOCK
    assert cache.stats()["evicted"] == 3
    with pytest.raises(CacheError, match="does not fit"):
        cache.writer(_digest(b"big"), 3 * BLOCK + 1)


def test_eviction_order_survives_a_restart(tmp_path):
    cache = TensorCache(tmp_path, max_bytes=3 * BLOCK)
    da, db, dc = (_put(cache, _data(1000, seed=s)) for s in (10, 11, 12))
    # Give the entries distinct, known ages, oldest first: a, b, c (a reopened cache goes by mtime).
    base = time.time_ns() - 3600 * 10**9
    for i, d in enumerate((da, db, dc)):
        os.utime(cache.path_for(d), ns=(base + i * 10**9, base + i * 10**9))
    cache = TensorCache(tmp_path, max_bytes=3 * BLOCK)
    cache.read_into(da, bytearray(1000))  # a is now the most recent
    dd = _put(cache, _data(1000, seed=13))
    assert [cache.has(x) for x in (da, db, dc, dd)] == [True, False, True, True]


def test_eviction_ignores_temp_files_and_reopen_counts_entries(tmp_path):
    cache = TensorCache(tmp_path, max_bytes=2 * BLOCK)
    d1 = _put(cache, _data(1000, seed=1))
    pending = cache.writer(_digest(_data(2000, seed=3)), 2000)
    pending.write(_data(2000, seed=3))
    d2 = _put(cache, _data(1000, seed=2))
    assert cache.has(d1) and cache.has(d2)  # the 2000 temporary bytes do not count
    pending.commit()
    assert TensorCache(tmp_path).total_bytes == cache.total_bytes <= 2 * BLOCK


def test_stale_temp_files_cleaned_on_open(tmp_path):
    cache, data, d = _stored(tmp_path)
    folder = os.path.dirname(cache.path_for(d))
    stale = os.path.join(folder, ".tmp-dead-1-aa")
    fresh = os.path.join(folder, ".tmp-live-2-bb")
    for p in (stale, fresh):
        with open(p, "wb") as f:
            f.write(b"partial")
    old = time.time() - STALE_TEMP_SECONDS - 60
    os.utime(stale, (old, old))
    cache2 = TensorCache(tmp_path)
    assert not os.path.exists(stale) and os.path.exists(fresh)
    assert cache2.total_bytes == charge(len(data))
    out = bytearray(len(data))
    cache2.read_into(d, out)
    assert bytes(out) == data


def test_read_via_staging_gives_same_bytes(tmp_path):
    cache = TensorCache(tmp_path)
    data = _data(1_000_003, seed=5)
    d = _put(cache, data)
    target = bytearray(len(data))
    calls = []

    def write(offset: int, chunk: memoryview) -> None:
        calls.append((offset, len(chunk)))
        target[offset : offset + len(chunk)] = chunk

    staging = bytearray(65536)
    cache.read_into_target(d, len(data), write, staging)
    assert bytes(target) == data
    assert calls[0] == (0, 65536) and calls[-1] == (len(data) - len(data) % 65536, len(data) % 65536)
    assert sum(n for _, n in calls) == len(data)


def test_staging_read_of_corrupt_entry_raises_and_drops(tmp_path):
    cache = TensorCache(tmp_path)
    data = _data(300_000, seed=6)
    d = _put(cache, data)
    with open(cache.path_for(d), "r+b") as f:
        f.seek(299_999)
        f.write(bytes([data[-1] ^ 0xFF]))
    got = []
    with pytest.raises(CacheError):
        cache.read_into_target(d, len(data), lambda off, c: got.append(len(c)), bytearray(100_000))
    assert sum(got) == len(data)  # everything was delivered; the caller must discard it
    assert not os.path.exists(cache.path_for(d))
    with pytest.raises(CacheError, match="missing"):
        cache.read_into_target(d, len(data), lambda off, c: None, bytearray(100_000))


def test_concurrent_writers_of_same_digest(tmp_path):
    cache = TensorCache(tmp_path)
    data = _data(2_000_000, seed=7)
    d = _digest(data)
    writers = [cache.writer(d, len(data)) for _ in range(2)]
    # Interleave the writes so both temporary files exist at once.
    mv = memoryview(data)
    for off in range(0, len(data), 250_000):
        for w in writers:
            w.write(mv[off : off + 250_000])
    errors: list[BaseException] = []

    def commit(w: CacheWriter) -> None:
        try:
            w.commit()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=commit, args=(w,)) for w in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    hx = d.hex()
    assert _files(tmp_path) == [os.path.join(hx[:2], hx)]
    out = bytearray(len(data))
    cache.read_into(d, out)
    assert bytes(out) == data


def test_bad_digest_argument(tmp_path):
    cache = TensorCache(tmp_path)
    with pytest.raises(OptionError):
        cache.has(b"\0" * 31)
    with pytest.raises(OptionError):
        cache.writer(b"\0" * 33, 1)


def test_error_from_write_callback_keeps_entry(tmp_path):
    cache, data, d = _stored(tmp_path)

    def write(offset: int, chunk: memoryview) -> None:
        raise OSError(5, "device copy failed")

    with pytest.raises(OSError, match="device copy failed"):
        cache.read_into_target(d, len(data), write, bytearray(4096))
    assert cache.has(d, len(data))


# -- the folder is the server's own -------------------------------------------------------------

OTHER_UID = 65534  # nobody

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user (chown to uid 65534) needs root")


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@needs_root
def test_a_root_owned_by_another_user_is_refused(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, OTHER_UID, OTHER_UID)
    with pytest.raises(
        CacheError, match=rf"cache folder {root} is owned by uid {OTHER_UID}, not by this server's user"
    ):
        TensorCache(root)
    assert list(root.iterdir()) == []


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_root_others_can_write_is_refused(tmp_path, mode):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, mode)
    with pytest.raises(CacheError, match=rf"cache folder {root} is writable by .*chmod 700"):
        TensorCache(root)
    assert list(root.iterdir()) == [] and _mode(root) == mode


def test_a_root_reached_through_a_link_is_checked_where_it_leads(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.chmod(real, 0o777)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(CacheError, match="writable by"):
        TensorCache(tmp_path / "link")
    os.chmod(real, 0o755)
    d = _put(TensorCache(tmp_path / "link"), b"through a link of my own")
    # an existing root keeps its mode (it may be any folder of the user's); what lies in it is private
    assert (real / d.hex()[:2] / d.hex()).is_file() and _mode(real) == 0o755
    assert _mode(real / d.hex()[:2]) == 0o700 and _mode(real / d.hex()[:2] / d.hex()) == 0o600


@needs_root
def test_a_root_reached_through_another_users_link_or_folder_is_refused(tmp_path):
    # /tmp-like: a sticky folder everyone may write; another user plants a link where the server's
    # cache folder will be, pointing at a folder of root's: the server must not follow it
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    (victim / "ab").write_bytes(b"precious")
    link = shared / "wlcache"
    link.symlink_to(victim)
    os.lchown(link, OTHER_UID, OTHER_UID)
    with pytest.raises(CacheError, match=f"goes through {link}, a symbolic link owned by uid {OTHER_UID}"):
        TensorCache(link)
    theirs = shared / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(CacheError, match=f"goes through {theirs}, a folder owned by uid {OTHER_UID}"):
        TensorCache(theirs / "cache")
    open_for_all = tmp_path / "open"
    open_for_all.mkdir()
    os.chmod(open_for_all, 0o777)  # writable by all and not sticky: anyone could swap what is below
    with pytest.raises(CacheError, match="writable by its group and others and not sticky"):
        TensorCache(open_for_all / "cache")
    assert (victim / "ab").read_bytes() == b"precious" and _mode(victim) == 0o700


def test_a_root_holding_other_data_loses_none_of_it(tmp_path):
    # --cache-dir pointed at a folder that holds more than a cache: names that look like fan-out
    # folders but are files, or folders of the user's, are neither removed nor narrowed away
    root = tmp_path / "models"
    root.mkdir(mode=0o755)
    (root / "ab").write_bytes(b"precious")
    (root / "cd").mkdir()
    (root / "cd" / "notes.txt").write_bytes(b"mine")
    data = _data(3000, seed=48)
    while _digest(data).hex()[:2] != "ab":  # an entry that would go where the file "ab" is
        data = data + b"x"
    cache = TensorCache(root)
    with pytest.raises(CacheError, match="ab under the cache folder is not a folder"):
        _put(cache, data)
    assert (root / "ab").read_bytes() == b"precious" and (root / "cd" / "notes.txt").read_bytes() == b"mine"
    assert _mode(root) == 0o755 and not cache.has(_digest(data), len(data))


@needs_root
def test_a_fan_out_folder_linked_elsewhere_is_never_written_through(tmp_path):
    data = _data(5000, seed=40)
    d = _digest(data)
    hx = d.hex()
    elsewhere = tmp_path / "elsewhere"  # another user's folder, open to anyone
    elsewhere.mkdir()
    os.chown(elsewhere, OTHER_UID, OTHER_UID)
    os.chmod(elsewhere, 0o777)
    root = tmp_path / "c"
    cache = TensorCache(root)
    (root / hx[:2]).symlink_to(elsewhere)  # planted while the cache is open
    os.lchown(root / hx[:2], OTHER_UID, OTHER_UID)
    assert not cache.has(d)
    _put(cache, data)
    assert list(elsewhere.iterdir()) == []
    assert not (root / hx[:2]).is_symlink() and _mode(root / hx[:2]) == 0o700
    out = bytearray(len(data))
    cache.read_into(d, out)
    assert bytes(out) == data


@needs_root
def test_links_found_at_open_are_removed_and_other_users_folders_left_unread(tmp_path):
    root = tmp_path / "c"
    root.mkdir(mode=0o755)  # as an older cache left it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.chown(elsewhere, OTHER_UID, OTHER_UID)
    data = [_data(3000, seed=s) for s in range(41, 43)]
    hx = [_digest(x).hex() for x in data]
    (root / hx[0][:2]).symlink_to(elsewhere)
    theirs = root / hx[1][:2]
    theirs.mkdir(mode=0o777)
    (theirs / "planted").write_bytes(b"x")
    os.chown(theirs, OTHER_UID, OTHER_UID)
    (root / hx[1][:2] / hx[1]).write_bytes(data[1])  # a planted entry of theirs, with the right bytes
    os.chown(root / hx[1][:2] / hx[1], OTHER_UID, OTHER_UID)
    cache = TensorCache(root)
    assert not os.path.lexists(root / hx[0][:2])  # the link went, not what it pointed to
    assert (theirs / "planted").exists() and not cache.has(_digest(data[1]), len(data[1]))
    _put(cache, data[0])
    with pytest.raises(CacheError, match="another user's folder"):
        _put(cache, data[1])  # nothing is written into their folder
    assert list(elsewhere.iterdir()) == []
    assert os.lstat(root / hx[0][:2]).st_uid == os.geteuid() and _mode(root / hx[0][:2]) == 0o700


def test_an_entry_that_is_a_link_is_not_followed(tmp_path):
    data = _data(4000, seed=44)
    d = _digest(data)
    cache = TensorCache(tmp_path / "c")
    target = tmp_path / "target"
    target.write_bytes(data)  # the right bytes, even: a link is refused for what it is
    os.makedirs(os.path.dirname(cache.path_for(d)), exist_ok=True)
    os.symlink(target, cache.path_for(d))
    before = os.stat(target)
    with pytest.raises(CacheError, match="unreadable"):
        cache.read_into(d, bytearray(len(data)))
    assert not os.path.lexists(cache.path_for(d)) and target.read_bytes() == data
    assert os.stat(target).st_mtime_ns == before.st_mtime_ns


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o277])
def test_folders_are_0700_and_entries_0600_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        root = tmp_path / "c"
        cache = TensorCache(root)
        d = _put(cache, _data(3000, seed=45))
        pending = cache.writer(_digest(b"pending"), 7)
        pending.write(b"pendin")
        temps = [p for p in (root / d.hex()[:2]).iterdir()] + list((root / _digest(b"pending").hex()[:2]).iterdir())
        modes = {_mode(root), _mode(root / d.hex()[:2]), _mode(cache.path_for(d)), *(_mode(p) for p in temps)}
        pending.abort()
    finally:
        os.umask(old)
    assert modes == {0o700, 0o600}
    assert _mode(root) == _mode(root / d.hex()[:2]) == 0o700 and _mode(cache.path_for(d)) == 0o600


def test_an_older_wider_cache_has_its_folders_and_entries_narrowed_at_open(tmp_path):
    root = tmp_path / "c"
    data = _data(3000, seed=46)
    hx = _digest(data).hex()
    (root / hx[:2]).mkdir(parents=True)
    (root / hx[:2] / hx).write_bytes(data)
    for p, m in ((root, 0o755), (root / hx[:2], 0o755), (root / hx[:2] / hx, 0o644)):
        os.chmod(p, m)
    cache = TensorCache(root)
    # the root keeps its mode (it may be any folder of the user's); what is in it is narrowed
    assert (_mode(root), _mode(root / hx[:2]), _mode(root / hx[:2] / hx)) == (0o755, 0o700, 0o600)
    assert cache.has(_digest(data), len(data)) and cache.total_bytes == BLOCK


# -- the size cap -------------------------------------------------------------------------------


def test_tiny_entries_are_counted_by_the_blocks_they_take(tmp_path):
    cache = TensorCache(tmp_path / "c", max_bytes=None)
    for i in range(300):
        _put(cache, i.to_bytes(8, "little"))  # 8 bytes, one block on disk
    assert cache.total_bytes == 300 * BLOCK
    assert TensorCache(tmp_path / "c").total_bytes == 300 * BLOCK  # and so counted again at open
    capped = TensorCache(tmp_path / "d", max_bytes=100 * BLOCK)
    for i in range(300):
        _put(capped, i.to_bytes(8, "little"))
    assert len(_files(tmp_path / "d")) == 100 and capped.total_bytes == 100 * BLOCK


def test_eviction_past_the_cap_does_not_walk_the_folder(tmp_path, monkeypatch):
    cache = TensorCache(tmp_path / "c", max_bytes=20 * BLOCK)
    first = [_put(cache, _data(BLOCK, seed=s)) for s in range(20)]  # a block each, by any count
    walks: list[str] = []
    for name in ("scandir", "listdir", "walk"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _real=real, _name=name, **k: walks.append(_name) or _real(*a, **k))
    later = [_put(cache, _data(BLOCK, seed=s)) for s in range(100, 160)]  # each commit evicts one
    monkeypatch.undo()
    assert walks == []
    assert cache.stats() == {
        "entries": 20,
        "bytes": 20 * BLOCK,
        "folder_scans": 1,  # the one walk when it opened
        "evicted": 60,
        "bytes_evicted": 60 * BLOCK,
    }
    assert not any(cache.has(d) for d in first) and all(cache.has(d) for d in later[-20:])
    assert len(_files(tmp_path / "c")) == 20


def test_the_default_cap_is_half_the_space_the_cache_could_use(tmp_path):
    cache = TensorCache(tmp_path / "c")
    _put(cache, _data(5000, seed=47))
    st = os.statvfs(tmp_path / "c")
    free = st.f_bavail * st.f_frsize
    reopened = TensorCache(tmp_path / "c")
    want = (2 * BLOCK + free) * DEFAULT_MAX_FRACTION
    assert reopened.max_bytes is not None and abs(reopened.max_bytes - want) <= 64 * BLOCK
    assert TensorCache(tmp_path / "e", max_bytes=None).max_bytes is None
    with pytest.raises(OptionError):
        TensorCache(tmp_path / "f", max_bytes=-1)


def _as_other_user(attempt) -> int:
    """Run ``attempt()`` in a child process as uid/gid 65534; its exit code: 0 if it raised
    PermissionError (what the test wants), 1 if it succeeded, 2 on anything else."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery from here on, only _exit
        code = 2
        try:
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            attempt()
            code = 1
        except PermissionError:
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@needs_root
def test_another_user_can_neither_read_nor_list_the_cache():
    # The folders above the cache must let the other user through, or the test proves nothing:
    # pytest's own temporary folders are 0700.
    base = tempfile.mkdtemp(prefix="wl-cache-others-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        root = os.path.join(base, "c")
        cache = TensorCache(root)
        secret = _data(6000, seed=48)
        d = _put(cache, secret)
        assert _as_other_user(lambda: open(cache.path_for(d), "rb").read()) == 0
        assert _as_other_user(lambda: os.listdir(root)) == 0
        assert _as_other_user(lambda: os.listdir(os.path.dirname(cache.path_for(d)))) == 0
    finally:
        shutil.rmtree(base)


def _one_entry(root, seed: int):
    """A cache at ``root`` holding one entry of 5000 bytes: the cache, the bytes, their digest and
    the entry's path."""
    cache = TensorCache(root)
    data = _data(5000, seed=seed)
    d = _digest(data)
    _put(cache, data)
    return cache, data, d, cache.path_for(d)


def test_a_read_moves_an_entrys_mtime_only_past_the_grain(tmp_path):
    # The mtime carries the order across a restart; a hit on an entry used within the grain
    # leaves the inode alone, one on an older entry makes it the most recent.
    from weightlift.remote.server.cache import TOUCH_GRAIN_NS

    cache, data, d, path = _one_entry(tmp_path, seed=21)
    recent = time.time_ns() - TOUCH_GRAIN_NS // 2
    os.utime(path, ns=(recent, recent))
    cache.read_into(d, bytearray(len(data)))
    assert os.stat(path).st_mtime_ns == recent
    old = time.time_ns() - 2 * TOUCH_GRAIN_NS
    os.utime(path, ns=(old, old))
    before = time.time_ns()
    cache.read_into(d, bytearray(len(data)))
    assert os.stat(path).st_mtime_ns >= before


def test_a_read_brings_an_entrys_mtime_from_the_future_back_to_now(tmp_path):
    # An mtime ahead of the clock (a clock set back, a cache copied from another machine) would
    # rank the entry newer than any after a restart for as long as it is ahead: a read sets it.
    cache, data, d, path = _one_entry(tmp_path, seed=22)
    ahead = time.time_ns() + 24 * 3600 * 10**9
    os.utime(path, ns=(ahead, ahead))
    cache.read_into(d, bytearray(len(data)))
    assert os.stat(path).st_mtime_ns <= time.time_ns()
