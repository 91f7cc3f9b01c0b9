"""How much of a file is in the page cache (``mincore``), and dropping a file from it.

This module imports nothing but the standard library, on purpose: the benchmark's arm bodies
load it by path in child processes that measure weightlift's peers, so that those never import
the weightlift package, and still ask the very probe and eviction that weightlift's own loads
use (:mod:`weightlift.disk.source` wraps both with its memo and its error mapping).

Both functions are strict: a failure is an ``OSError``, never a guess, so a benchmark that
cannot check residency says so instead of timing a "cold" run on a warm file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

__all__ = ["PAGE", "mapping_fraction", "file_fraction", "drop"]

PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value
_LOW_BIT = bytes(b & 1 for b in range(256))


def mapping_fraction(address: int, size: int) -> float:
    """Fraction of the pages of the mapping at ``address`` (``size`` bytes) in the page cache."""
    pages = (size + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    # bit 0 of each byte says whether that page is resident
    return sum(memoryview(vec).cast("B").tobytes().translate(_LOW_BIT)) / pages


def file_fraction(path: str) -> float:
    """Fraction of ``path``'s pages in the page cache, asked afresh (0.0 for an empty file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0.0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            return mapping_fraction(addr, size)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop(path: str, offset: int = 0, length: int = 0, *, write_back: bool = True) -> None:
    """Drop ``[offset, offset + length)`` of ``path`` (``length`` 0: to the end) from the page cache.

    With ``write_back`` dirty pages are written first: the kernel cannot drop a page that has not
    reached the disk (a just-written checkpoint), and DONTNEED alone would skip it silently.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        if write_back:
            os.fdatasync(fd)
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
