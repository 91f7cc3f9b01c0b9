"""File access: one mapping per file, the residency probe, eviction and the warmer."""

from __future__ import annotations

import os

import pytest

from weightlift.disk import source
from weightlift.errors import NotFoundError, WeightliftError


@pytest.fixture()
def blob(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(8 * 2**20 + 123))
    return p


def test_one_mapping_per_file(blob):
    a, b = source.mapped(blob), source.mapped(str(blob))
    assert a is b
    assert bytes(a.view(10, 5)) == blob.read_bytes()[10:15]
    blob.write_bytes(b"changed")
    c = source.mapped(blob)
    assert c is not a and bytes(c.buffer) == b"changed"


def test_missing_file(tmp_path):
    with pytest.raises(NotFoundError):
        source.mapped(tmp_path / "nope")


def test_empty_file(tmp_path):
    p = tmp_path / "e"
    p.write_bytes(b"")
    assert bytes(source.mapped(p).buffer) == b""
    assert source.resident_fraction(p) == 1.0


def test_residency_probe_memoized_and_eviction(blob):
    with open(blob, "rb") as f:
        f.read()
    assert source.resident_fraction(blob, refresh=True) > 0.9
    source.evict(blob)
    frac = source.resident_fraction(blob, refresh=True)
    if frac > 0.5:
        pytest.skip(f"this filesystem keeps pages after DONTNEED ({frac:.0%} resident)")
    # memoized: a second call without refresh does not walk the file again
    with open(blob, "rb") as f:
        f.read()
    assert source.resident_fraction(blob) == frac
    assert source.resident_fraction(blob, refresh=True) > 0.9


def test_page_eviction_override(monkeypatch):
    monkeypatch.delenv("WEIGHTLIFT_PAGE_EVICTION", raising=False)
    assert source.page_eviction_override() is None
    monkeypatch.setenv("WEIGHTLIFT_PAGE_EVICTION", "1")
    assert source.page_eviction_override() is True
    monkeypatch.setenv("WEIGHTLIFT_PAGE_EVICTION", "0")
    assert source.page_eviction_override() is False


def test_warmer_reads_every_chunk_and_stops(blob):
    m = source.mapped(blob)
    seen = []
    w = source.Warmer(m.fileno(), [(0, m.size)], chunk=2**20, on_chunk=lambda o, n, a, b: seen.append((o, n)))
    with w:
        import time

        deadline = time.time() + 10
        while w.bytes_read < m.size and time.time() < deadline:
            w.advance(0)
            time.sleep(0.01)
    assert w.bytes_read == m.size
    assert sorted(seen) == [(o, min(2**20, m.size - o)) for o in range(0, m.size, 2**20)]


def test_warmer_skips_behind_cursor(blob):
    m = source.mapped(blob)
    w = source.Warmer(m.fileno(), [(0, m.size)], chunk=2**20, max_readers=1, lead=2**20)
    w.advance(m.size)  # the copy is already past everything
    w.start()
    w.stop()
    assert w.bytes_read == 0


def test_replaced_file_gets_a_new_mapping_and_the_old_fd_closes(tmp_path):
    import gc

    p = tmp_path / "r.bin"
    p.write_bytes(b"a" * 100)
    fds_before = len(os.listdir("/proc/self/fd"))
    for i in range(20):
        (tmp_path / "new").write_bytes(bytes([i]) * (100 + i))
        os.replace(tmp_path / "new", p)
        m = source.mapped(p)
        assert bytes(m.view(0, 1)) == bytes([i]) and m.size == 100 + i
    del m
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 2


@pytest.mark.parametrize("splice", [True, False])
@pytest.mark.parametrize("readers", [1, 3])
def test_prefetch_reads_every_range_once_in_contiguous_shares(blob, readers, splice, monkeypatch):
    if not splice:  # a filesystem or kernel that refuses sendfile: preadv into a buffer instead
        import errno

        def refuse(*a):
            raise OSError(errno.EINVAL, "Invalid argument")

        monkeypatch.setattr(source.os, "sendfile", refuse)
    m = source.mapped(blob)
    ranges = [(0, 3 * 2**20 + 5), (4 * 2**20, 2**20), (6 * 2**20, m.size - 6 * 2**20)]
    seen = []
    source.evict(blob)
    cold = source.resident_fraction(blob, refresh=True) < 0.5
    got = source.prefetch(m, ranges, readers=readers, chunk=2**20, on_chunk=lambda o, n, a, b: seen.append((o, n)))
    want = [(o + i, min(2**20, n - i)) for o, n in ranges for i in range(0, n, 2**20)]
    assert got == sum(n for _, n in ranges)
    assert sorted(seen) == sorted(want)
    if cold:  # the bytes are in the page cache now (the gap between ranges may or may not be)
        assert source.resident_fraction(blob, refresh=True) > (m.size - 2 * 2**20) / m.size


def test_prefetch_of_bytes_past_the_end_names_the_file(blob):
    m = source.mapped(blob)
    with pytest.raises(WeightliftError, match=r"f\.bin: file ended at byte"):
        source.prefetch(m, [(m.size - 10, 4096)], readers=2, chunk=2**20)
