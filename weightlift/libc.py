"""The C library's memory and page-cache calls that ``os`` and ``mmap`` do not offer on an address.

Python's ``mmap`` advises and maps only its own objects, and ``os`` has no ``mincore`` or
``malloc_trim``; weightlift needs them on addresses it holds (numpy buffers, mappings made for
the residency probe). One handle to the C library serves every module, each call typed, and
each failure an ``OSError`` carrying the call's ``errno``, never a return code to forget.

Where the C library lacks a call (``malloc_trim`` is glibc's own; musl and macOS have none),
the wrapper says so without guessing: :func:`malloc_trim` returns ``False`` (those allocators
give memory back their own way), the others raise ``OSError(ENOSYS)``, which callers that can do
without (an advice, a probe) catch like any refusal.

This module imports nothing but the standard library, on purpose: :mod:`weightlift.disk.residency`
is loaded by path in the benchmark's peer arms, and it loads this file the same way.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from typing import Any

__all__ = [
    "MADV_POPULATE_READ",
    "MADV_POPULATE_WRITE",
    "available",
    "madvise",
    "mincore",
    "map_file",
    "unmap",
    "posix_fadvise",
    "malloc_trim",
]

MADV_POPULATE_READ = 22  # Linux 5.14 and later; EINVAL before
MADV_POPULATE_WRITE = 23

_VOID, _SIZE, _INT, _LONG = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_long
# name: (restype, argtypes); a name the C library lacks is left out of the handle's table
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "madvise": (_INT, [_VOID, _SIZE, _INT]),
    "mincore": (_INT, [_VOID, _SIZE, _VOID]),
    "mmap": (_VOID, [_VOID, _SIZE, _INT, _INT, _INT, _LONG]),
    "munmap": (_INT, [_VOID, _SIZE]),
    "malloc_trim": (_INT, [_SIZE]),
}
_MAP_FAILED = ctypes.c_void_p(-1).value


def _load() -> dict[str, Any]:
    """The C library's functions named in the table, typed; empty where it cannot be loaded."""
    try:
        lib = ctypes.CDLL(None, use_errno=True)  # the process's own symbols: its C library
    except OSError:
        return {}
    out = {}
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = restype, argtypes
            out[name] = fn
    return out


_FUNCS = _load()


def available(name: str) -> bool:
    """Whether this C library has ``name`` (one of the calls wrapped here)."""
    return name in _FUNCS


def _call(name: str, *args: Any) -> Any:
    fn = _FUNCS.get(name)
    if fn is None:
        raise OSError(errno.ENOSYS, f"{name} is not in this C library")
    return fn(*args)


def _check(name: str, rc: int) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name} failed: {os.strerror(err)}")


def madvise(address: int, length: int, advice: int) -> None:
    """``madvise(address, length, advice)``; ``address`` page-aligned, as the kernel wants it."""
    _check("madvise", _call("madvise", address, length, advice))


def mincore(address: int, length: int) -> bytes:
    """One byte per page of ``[address, address + length)``: bit 0 set where it is resident."""
    pages = -(-length // mmap.PAGESIZE)
    # a bytearray, not a ctypes array: ctypes keeps every array type (one per length) for good
    vec = bytearray(max(pages, 1))
    _check("mincore", _call("mincore", address, length, ctypes.addressof(ctypes.c_char.from_buffer(vec))))
    return bytes(vec[:pages])


def map_file(fd: int, length: int, prot: int, flags: int, offset: int = 0) -> int:
    """``mmap`` of ``length`` bytes of ``fd``; returns the address. Unlike ``mmap.mmap`` the
    mapping has no Python object, so nothing holds it open past :func:`unmap`."""
    addr = _call("mmap", None, length, prot, flags, fd, offset)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap failed: {os.strerror(err)}")
    return int(addr)


def unmap(address: int, length: int) -> None:
    """``munmap`` a mapping made by :func:`map_file`."""
    _check("munmap", _call("munmap", address, length))


def posix_fadvise(fd: int, offset: int, length: int, advice: int) -> None:
    """``posix_fadvise`` (``length`` 0: to the end of the file); ``OSError(ENOSYS)`` where the
    system has none (macOS)."""
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is None:
        raise OSError(errno.ENOSYS, "posix_fadvise is not on this system")
    fadvise(fd, offset, length, advice)


def malloc_trim(pad: int = 0) -> bool:
    """Give the C heap's free memory back to the system, keeping ``pad`` bytes at the heap's top.

    True where glibc released memory; False where it found none to release, or where the C
    library is not glibc (its allocator returns memory its own way, and there is nothing to ask).
    """
    fn = _FUNCS.get("malloc_trim")
    return bool(fn(pad)) if fn is not None else False
