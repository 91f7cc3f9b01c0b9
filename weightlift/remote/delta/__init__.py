"""The payload of a DELTA: a tensor encoded against a base of the same dtype and shape, and back.

Both ends of a connection use this package (the client encodes: :mod:`.encode`; the server
applies: :mod:`.applying`; both share :mod:`.chunks`); it does no I/O. A tensor is cut into chunks of ``chunk_bytes`` (a whole number of elements); each chunk is
encoded on its own (zstandard and numpy release the GIL) and an unchanged chunk costs four bytes. The payload::

    head   := chunk_bytes:u32  nchunks:u32           nchunks = ceil(nbytes / chunk_bytes)
                                                     chunk_bytes >= min(MIN_CHUNK_BYTES, nbytes)
    table  := clen:u32 * nchunks                     0: the chunk is its base's bytes
    chunks := one zstd frame per chunk whose clen is not 0, in order

and what a chunk's frame holds, by the DELTA's encoding:

* ``XOR``: the chunk's new bytes XOR its base's (exactly the chunk's length): dense changes, where
  the sign and exponent of most values stay put and compress well;
* ``PLANES`` (elements of two bytes or more): XOR's bytes regrouped into planes, byte ``k`` of
  every element of the chunk in plane ``k`` (``k`` from 0, the byte's place in memory), the
  planes one after another in one frame (exactly the chunk's length): the bytes that hold
  signs and exponents, which rarely change, lie together and compress far better than
  interleaved with the mantissas' (smaller and faster to compress than ``XOR``);
* ``SPARSE``: ``count:u32``, ``gap:u32 * count`` (the changed elements' indices within the
  chunk as differences: the first from 0, the others from the one before, never 0), then the
  ``count`` new elements: a few changed values, applied in time proportional to them rather
  than to the tensor.

Which one a tensor gets is decided by :func:`choose` from a sample of its elements: SPARSE
where at most :data:`SPARSE_MAX` of them changed, XOR (PLANES where the receiver applies it and
elements have two bytes or more) where the sample compresses to at most
:data:`DENSE_RATIO_MAX` of its size, else none (the tensor is sent whole, and the attempt cost
only the sample). Sub-byte dtypes (packed 4-bit and smaller) always travel whole.

The passes. A sender calls :func:`scan`: one pass over the new bytes and the base, a
:data:`~.chunks.BLOCK_BYTES` block at a time, that hashes the new bytes (the digest the DELTA names),
finds the changes (compared as 64-bit words, only the words that differ looked at element by
element) and, for a base the sender keeps, writes them into it, all while the block is in cache.
The scan runs on the calling thread (a digest is one sequential pass): a sender scans several
tensors on several threads, ahead of its sends. A receiver calls :func:`apply_hashed`: base
and changes, into fresh memory or in place, a chunk per core, and the hash of the result on the
calling thread, chunk after chunk as each is applied. :func:`encode` and
:func:`apply` do the same without the hash, a chunk per core.

Every length in a payload is checked before anything is sized from it (:class:`DeltaError`).

The sizes the passes read at call time live in the module that reads them, where a test or a
benchmark sets them: ``chunks.CHUNK_BYTES``, ``chunks.BLOCK_BYTES``, ``chunks.LEVEL`` and
``applying.APPLY_AHEAD``.
"""

from __future__ import annotations

from weightlift.remote.delta import applying, chunks
from weightlift.remote.delta.applying import Undo, apply, apply_hashed, check, scratch_bound
from weightlift.remote.delta.chunks import (
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    PLANES,
    SAME,
    SPARSE,
    XOR,
    DeltaError,
    available,
    chunk_size,
    copy,
    payload_bound,
)
from weightlift.remote.delta.encode import COMPRESS_AHEAD, DENSE_RATIO_MAX, SPARSE_MAX, choose, encode, scan

__all__ = [
    "applying",
    "chunks",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "SPARSE_MAX",
    "DENSE_RATIO_MAX",
    "COMPRESS_AHEAD",
    "SAME",
    "SPARSE",
    "XOR",
    "PLANES",
    "DeltaError",
    "Undo",
    "available",
    "chunk_size",
    "choose",
    "encode",
    "scan",
    "apply",
    "apply_hashed",
    "check",
    "payload_bound",
    "scratch_bound",
    "copy",
]
