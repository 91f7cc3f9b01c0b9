"""Tensor digests: BLAKE3 over any contiguous buffer without copying it, in the background.

:func:`hash_buffer` hashes an mmap slice or a numpy array in place; blake3's ``update`` releases
the GIL for large inputs, so hashing on a worker thread runs beside the thread that sends other
tensors. :class:`DigestPool` runs it on a few worker threads and hands back futures, so a sender
asks for a digest only when it reaches that tensor. The digests remembered across runs are in
:mod:`weightlift.digest.sidecar`.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import blake3

from weightlift.errors import OptionError
from weightlift.profile import Profiler

__all__ = [
    "DIGEST_SIZE",
    "HASH_THRESHOLD",
    "NAIVE_HASH_THRESHOLD",
    "PARALLEL_HASH_MIN",
    "digest_hex",
    "byte_view",
    "hash_buffer",
    "DigestPool",
]

#: Bytes in a BLAKE3 digest as used on the wire and as a cache key.
DIGEST_SIZE = 32
#: Tensors at or above this size are hashed when the server has a cache. Low enough for the
#: experts of a mixture-of-experts checkpoint (1-8 MiB each): the client asks about thousands of
#: digests in one HAVE, so a cached tensor costs an ALLOC and a FILL_FROM_CACHE frame (about a
#: hundred bytes) and no round trip of its own. Every server that keeps a cache (minor 1 on)
#: takes digests of any size, so no new capability is needed.
HASH_THRESHOLD = 1024 * 1024
#: The naive client's threshold (``WEIGHTLIFT_LOAD_OPT=0``), one round trip per tensor: kept as
#: it was for A/B runs.
NAIVE_HASH_THRESHOLD = 10 * 1024 * 1024
#: Inputs at least this large are hashed with blake3's multithreaded mode; fed in small pieces
#: its thread pool loses to one thread, so small inputs stay single-threaded (bench/RESULTS.md).
PARALLEL_HASH_MIN = 1024 * 1024


def digest_hex(d: bytes) -> str:
    """The lowercase hex of a 32-byte digest; OptionError for anything else."""
    if not isinstance(d, (bytes, bytearray, memoryview)) or len(d) != DIGEST_SIZE:
        raise OptionError(f"a digest is {DIGEST_SIZE} bytes, got {d!r:.80}")
    return bytes(d).hex()


def byte_view(buf: Any) -> memoryview:
    """A flat, byte-formatted view of ``buf`` without copying; OptionError if it is not contiguous.

    blake3 and ``os.write`` need format ``B`` and one dimension; numpy arrays of dtypes that the
    buffer protocol cannot describe (bfloat16, float8 from ml_dtypes) are viewed as uint8 first.
    """
    try:
        mv = memoryview(buf)
    except (TypeError, ValueError, BufferError):
        mv = _numpy_bytes(buf)
    if mv.format == "B" and mv.ndim == 1 and mv.c_contiguous:
        return mv
    if not mv.c_contiguous:
        raise OptionError("buffer is not contiguous; hash or cache a contiguous copy instead")
    if mv.ndim == 0:
        # cast() refuses zero-dimensional views; a reshape through numpy keeps it a view.
        mv = _numpy_bytes(buf)
        return mv
    return mv.cast("B")


def _numpy_bytes(buf: Any) -> memoryview:
    import numpy as np

    if not isinstance(buf, np.ndarray):
        raise OptionError(f"expected a buffer, got {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        raise OptionError("buffer is not contiguous; hash or cache a contiguous copy instead")
    return buf.reshape(-1).view(np.uint8).data


def hash_buffer(buf: Any, *, max_threads: int | None = None) -> bytes:
    """BLAKE3 digest of ``buf``'s bytes, in place, with the GIL released while hashing.

    ``max_threads`` None picks blake3's multithreaded mode for inputs of at least
    :data:`PARALLEL_HASH_MIN` bytes; pass 1 where other threads already keep the cores busy.
    """
    mv = byte_view(buf)
    if max_threads is None:
        max_threads = blake3.blake3.AUTO if mv.nbytes >= PARALLEL_HASH_MIN else 1
    hasher = blake3.blake3(max_threads=max_threads)
    hasher.update(mv)
    return hasher.digest()


# ---------------------------------------------------------------------------------------------
# Background hashing


_OFF = Profiler(enabled=False)


class DigestPool:
    """Hash buffers on ``threads`` worker threads while the caller does other work.

    Each worker hashes single-threaded: the pool's width is the hashing parallelism, so the caller
    decides how many cores hashing may take from sending.
    """

    def __init__(self, threads: int = 2, *, profiler: Profiler | None = None):
        if threads < 1:
            raise OptionError(f"threads must be at least 1, got {threads}")
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="weightlift-hash")
        self._profiler = profiler if profiler is not None else _OFF

    def submit(self, name: str, buffer: Any) -> Future[bytes]:
        """A future for the digest of ``buffer``; the buffer must stay alive and unchanged until it is done."""
        view = byte_view(buffer)  # fail fast in the caller's thread on a bad buffer
        return self._executor.submit(self._hash, name, view)

    def _hash(self, name: str, view: memoryview) -> bytes:
        with self._profiler.phase("hash", view.nbytes, name=name, background=True):
            return hash_buffer(view, max_threads=1)

    def close(self, *, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=not wait)

    def __enter__(self) -> DigestPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
