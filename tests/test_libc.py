"""The C library's wrappers, on real mappings and files: each call does what the kernel says,
and each refusal is an ``OSError`` carrying the call's errno."""

from __future__ import annotations

import errno
import mmap
import os

import numpy as np
import pytest

from weightlift import libc
from weightlift.disk import residency

PAGE = mmap.PAGESIZE


def _address(m: mmap.mmap) -> int:
    return int(np.frombuffer(m, dtype=np.uint8).ctypes.data)


def test_madvise_populate_write_faults_a_real_mapping_in_and_keeps_its_bytes():
    m = mmap.mmap(-1, 8 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = _address(m)
    m[:PAGE] = b"\x07" * PAGE  # page 0 written, the rest never touched
    assert sum(b & 1 for b in libc.mincore(addr, 8 * PAGE)) == 1
    try:
        libc.madvise(addr, 8 * PAGE, libc.MADV_POPULATE_WRITE)
    except OSError as e:
        assert e.errno == errno.EINVAL  # a kernel before 5.14 knows no such advice
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14")
    assert libc.mincore(addr, 8 * PAGE) == b"\x01" * 8  # every page resident
    assert m[:PAGE] == b"\x07" * PAGE and m[PAGE:] == bytes(7 * PAGE)
    m.close()


def test_madvise_refusal_is_an_oserror_with_its_errno():
    m = mmap.mmap(-1, 2 * PAGE)
    with pytest.raises(OSError) as e:
        libc.madvise(_address(m) + 1, PAGE, mmap.MADV_DONTNEED)  # not page-aligned
    assert e.value.errno == errno.EINVAL and "madvise" in str(e.value)
    m.close()


def test_mincore_of_unmapped_memory_is_enomem():
    addr = libc.map_file(-1, 4 * PAGE, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    libc.unmap(addr, 4 * PAGE)
    with pytest.raises(OSError) as e:
        libc.mincore(addr, 4 * PAGE)
    assert e.value.errno == errno.ENOMEM


def test_map_file_maps_a_real_file_read_only(tmp_path):
    p = tmp_path / "f.bin"
    data = os.urandom(3 * PAGE + 5)
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    try:
        addr = libc.map_file(fd, len(data), mmap.PROT_READ, mmap.MAP_SHARED)
        try:
            import ctypes

            assert ctypes.string_at(addr, len(data)) == data
            assert libc.mincore(addr, len(data)) == b"\x01" * 4  # just written: in the page cache
        finally:
            libc.unmap(addr, len(data))
        with pytest.raises(OSError) as e:
            libc.map_file(fd, len(data), mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED)
        assert e.value.errno == errno.EACCES  # a shared writable mapping of a read-only fd
    finally:
        os.close(fd)


def test_posix_fadvise_dontneed_drops_a_real_file_from_the_page_cache(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(64 * PAGE))
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # a dirty page cannot be dropped
        libc.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        cold = residency.file_fraction(str(p))
        libc.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        os.pread(fd, 64 * PAGE, 0)
        assert residency.file_fraction(str(p)) == 1.0
        with pytest.raises(OSError) as e:
            libc.posix_fadvise(fd, 0, 0, 12345)  # no such advice
        assert e.value.errno == errno.EINVAL
    finally:
        os.close(fd)
    if cold != 0.0:
        pytest.skip(f"this file system kept {cold:.0%} of the file after DONTNEED")


def test_mincore_of_any_length_adds_no_ctypes_type():
    """ctypes keeps every array type it makes (one per length) for the life of the process: a
    probe of files of many sizes must not make one per size. Its vector is one byte per page
    touched, a length not a page multiple included, and none for no length."""
    import ctypes
    import gc

    def array_types() -> int:
        import warnings

        with warnings.catch_warnings():  # isinstance() on every live object wakes deprecated module attributes
            warnings.simplefilter("ignore")
            return sum(1 for o in gc.get_objects() if isinstance(o, type) and issubclass(o, ctypes.Array))

    m = mmap.mmap(-1, 40 * PAGE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # a huge page would make the untouched pages resident too
        m.madvise(mmap.MADV_NOHUGEPAGE)
    addr = _address(m)
    m[: 3 * PAGE] = b"\x01" * (3 * PAGE)
    libc.mincore(addr, PAGE)
    before = array_types()
    got = [libc.mincore(addr, n * PAGE - 7 * (n % 2)) for n in range(1, 40)]
    assert array_types() == before
    assert [len(v) for v in got] == list(range(1, 40))
    assert got[4][:3] == b"\x01" * 3 and all(b & 1 == 0 for b in got[-1][3:])
    assert libc.mincore(addr, 0) == b""
    m.close()


def _glibc() -> bool:
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):
        return False


def test_malloc_trim_gives_back_free_heap_memory_below_the_top_of_the_heap():
    """glibc frees the heap's top by itself; memory freed between blocks still held stays in
    the heap until malloc_trim returns it, and says so."""
    if not _glibc():
        assert libc.malloc_trim(0) is False  # nothing to ask: the allocator does it its own way
        return
    assert libc.available("malloc_trim")
    # 64 KiB blocks (under the mmap threshold: from the heap), each followed by a small block
    # kept alive, so that no freed block is merged into the heap's top, which free() trims itself
    blocks, keep = [], []
    for _ in range(256):
        blocks.append(bytearray(64 << 10))
        keep.append(bytearray(1024))
    del blocks
    assert libc.malloc_trim(0) is True
    del keep


def test_a_call_the_c_library_lacks_is_enosys_and_malloc_trim_false(monkeypatch):
    monkeypatch.setattr(libc, "_FUNCS", {})
    with pytest.raises(OSError) as e:
        libc.madvise(0, PAGE, mmap.MADV_DONTNEED)
    assert e.value.errno == errno.ENOSYS
    assert libc.malloc_trim() is False
    assert not libc.available("mincore")


def test_residency_loaded_by_path_uses_the_same_calls_without_the_package(tmp_path):
    """The benchmark's peer arms load residency.py by path: it must work there without
    importing weightlift."""
    import subprocess
    import sys

    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(16 * PAGE))
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('r', {residency.__file__!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"print(m.file_fraction({str(p)!r}), 'weightlift' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["1.0", "False"]
