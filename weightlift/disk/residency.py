"""How much of a file is in the page cache (``mincore``), and dropping a file from it.

This module imports nothing but the standard library and :mod:`weightlift.libc` (itself
standard library only), on purpose: the benchmark's arm bodies load it by path in child
processes that measure weightlift's peers, so that those never import the weightlift package,
and still ask the very probe and eviction that weightlift's own loads use
(:mod:`weightlift.disk.source` wraps both with its memo and its error mapping). Loaded so, it
loads the C library's module by path as well.

Both functions are strict: a failure is an ``OSError``, never a guess, so a benchmark that
cannot check residency says so instead of timing a "cold" run on a warm file.
"""

from __future__ import annotations

import mmap
import os

if __package__:
    from weightlift import libc
else:  # loaded by path (the benchmark's peer arms): the C library's module by path too
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "_wl_libc", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "libc.py")
    )
    assert _spec is not None and _spec.loader is not None
    libc = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(libc)

__all__ = ["PAGE", "mapping_fraction", "file_fraction", "drop"]

PAGE = mmap.PAGESIZE

_LOW_BIT = bytes(b & 1 for b in range(256))


def mapping_fraction(address: int, size: int) -> float:
    """Fraction of the pages of the mapping at ``address`` (``size`` bytes) in the page cache."""
    vec = libc.mincore(address, size)
    # bit 0 of each byte says whether that page is resident
    return sum(vec.translate(_LOW_BIT)) / len(vec)


def file_fraction(path: str) -> float:
    """Fraction of ``path``'s pages in the page cache, asked afresh (0.0 for an empty file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0.0
        try:
            addr = libc.map_file(fd, size, mmap.PROT_READ, mmap.MAP_SHARED)
        except OSError as e:
            raise OSError(e.errno, f"mmap of {path} failed: {e.strerror}") from None
        try:
            return mapping_fraction(addr, size)
        finally:
            libc.unmap(addr, size)
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
        libc.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
