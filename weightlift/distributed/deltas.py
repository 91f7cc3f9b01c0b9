"""The delta of a reshard update: what changed in a sender's pieces since it last sent them. No I/O.

Theory of operation. An update walks the same plan as a full transfer (the pieces of
:mod:`.transfer`, at most a chunk each, in plan order). A sender that kept a copy of the shards
it last sent compares each piece's new bytes with that copy, element by element, and encodes
the piece as one of:

* ``SAME`` (0 bytes): nothing changed; the receiver's base already holds it;
* ``SPARSE`` (``4 + count * (4 + item)`` bytes): ``count:u32``, the changed elements' indexes in
  the piece (``u32`` each, increasing), then their new values: a few changes;
* ``PLANES``: the tensor server's DELTA payload of that encoding
  (:mod:`weightlift.remote.delta`: the piece XOR its base, byte ``k`` of every element in plane
  ``k``, zstd-compressed): dense changes of elements of 2 bytes or more, where an optimizer
  step leaves signs and exponents mostly as they were;
* ``WHOLE`` (the piece's bytes): everything else.

A piece gets the smallest. Every size is known before the pair's messages are posted: SPARSE's
from a count of the changes, PLANES' by compressing the piece once to measure it and again to
send it (zstd at one level is deterministic; holding every compressed piece until the lengths
are exchanged would cost memory instead). Per (sender, receiver) pair the *stream* is the table
(``size:u32`` per piece, then ``kind:u8`` per piece, in plan order), then the non-empty
payloads; the pair's length is exchanged first, so both ends cut the stream into the same
messages of at most a chunk (gloo receives into a buffer of the size sent), the sender encodes
each piece as its message is filled and the receiver applies each piece once its bytes are in:
neither end holds more than a couple of chunks of it.

Every size and index in a stream is checked before it is used (:class:`IntegrityError`); what
the applied pieces add up to is proven afterwards by the reshard's sketch, as a full transfer is.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np

from weightlift.errors import IntegrityError, WeightliftError
from weightlift.remote import delta as packed

__all__ = ["SAME", "SPARSE", "WHOLE", "PLANES", "PACK_MIN", "changed", "measure", "check", "encode", "apply", "Stream"]

SAME, SPARSE, WHOLE = 0, 1, 2
PLANES = 3
#: Pieces smaller than this are never compressed (a zstd frame and its table cost more than they save).
PACK_MIN = 4096
_U32 = struct.Struct("<I")
_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def changed(new: np.ndarray, old: np.ndarray, item: int) -> np.ndarray:
    """The indexes (uint32) of the elements of ``item`` bytes where ``new`` differs from ``old``."""
    w = _WORD[item]
    return np.flatnonzero(new.view(w) != old.view(w)).astype(np.uint32)


def size_of(nbytes: int, count: int, item: int) -> int:
    """The size of a piece of ``nbytes`` with ``count`` changed elements, SPARSE or WHOLE."""
    if count == 0:
        return 0
    sparse = 4 + count * (4 + item)
    return sparse if sparse < nbytes else nbytes


def _planes(new: np.ndarray, old: np.ndarray, item: int, limit: int) -> list[bytes] | None:
    return packed.encode(PLANES, new, old, item, limit=limit)


def measure(new: np.ndarray, old: np.ndarray, item: int, *, pack: bool = False) -> tuple[int, int]:
    """(kind, size) of the smallest encoding of ``new`` against ``old``; ``pack``: PLANES may be
    tried (both ends have zstandard), where the changes are too many for SPARSE to be small."""
    count = len(changed(new, old, item))
    size = size_of(new.nbytes, count, item)
    if size == 0:
        return SAME, 0
    kind = SPARSE if size < new.nbytes else WHOLE
    if pack and item >= 2 and new.nbytes >= PACK_MIN and 4 * size > new.nbytes:
        parts = _planes(new, old, item, size - 1)
        if parts is not None:
            return PLANES, sum(len(p) for p in parts)
    return kind, size


def check(kind: int, size: int, nbytes: int, item: int) -> None:
    """IntegrityError where no piece of ``nbytes`` can encode to ``size`` bytes as ``kind``."""
    ok = {
        SAME: size == 0,
        WHOLE: size == nbytes,
        SPARSE: 4 < size < nbytes and (size - 4) % (4 + item) == 0,
        PLANES: 0 < size < nbytes and item >= 2,
    }.get(kind, False)
    if not ok:
        raise IntegrityError(f"a delta piece of {nbytes} bytes cannot encode to {size} bytes as kind {kind}")


def encode(new: np.ndarray, old: np.ndarray, item: int, kind: int, size: int) -> np.ndarray:
    """The payload of a piece (``kind`` and ``size`` from :func:`measure` of the same bytes)."""
    if kind == WHOLE:
        return new
    if kind == PLANES:
        parts = _planes(new, old, item, size)
        out = np.frombuffer(b"".join(parts), np.uint8) if parts is not None else None
        if out is None or out.nbytes != size:
            raise IntegrityError("a sender's tensor changed while its update was being sent")
        return out
    idx = changed(new, old, item)
    if size_of(new.nbytes, len(idx), item) != size:
        raise IntegrityError("a sender's tensor changed while its update was being sent")
    out = np.empty(size, np.uint8)
    out[:4] = np.frombuffer(_U32.pack(len(idx)), np.uint8)
    out[4 : 4 + 4 * len(idx)] = idx.view(np.uint8)
    out[4 + 4 * len(idx) :] = new.view(_WORD[item])[idx].view(np.uint8)
    return out


def apply(piece: np.ndarray, payload: np.ndarray, item: int, kind: int = SPARSE) -> None:
    """Apply a SPARSE or PLANES payload to ``piece`` (its base bytes, written in place)."""
    if kind == PLANES:
        try:
            packed.apply(PLANES, memoryview(payload.data), piece, piece, item)
        except WeightliftError as e:
            raise IntegrityError(f"a compressed delta piece does not apply: {e}") from None
        return
    (count,) = _U32.unpack(payload[:4].tobytes())
    if 4 + count * (4 + item) != payload.nbytes:
        raise IntegrityError(f"a sparse delta piece states {count} changes in {payload.nbytes} bytes")
    idx = payload[4 : 4 + 4 * count].view("<u4")
    n = piece.nbytes // item
    if count and (int(idx[-1]) >= n or (count > 1 and bool(np.any(idx[1:] <= idx[:-1])))):
        raise IntegrityError(f"a sparse delta piece names elements outside its {n} (or out of order)")
    piece.view(_WORD[item])[idx] = payload[4 + 4 * count :].view(_WORD[item])


class Stream:
    """One pair's stream as the receiver takes it in: fed its messages in order, it yields
    ``(piece, kind, payload)`` for every piece as soon as its bytes are in.

    ``pieces``: (bytes, element size) of each piece, in plan order; ``total``: the stream's
    length as the sender stated it."""

    def __init__(self, pieces: list[tuple[int, int]], total: int, what: str):
        self.pieces, self.total, self.what = pieces, total, what
        self.pending = bytearray()
        self.sizes: list[int] | None = None
        self.kinds: list[int] = []
        self.next = 0  # the next piece to yield
        self.fed = 0
        if total < 5 * len(pieces):
            raise IntegrityError(f"{what}: a stream of {total} bytes cannot hold the table of {len(pieces)} pieces")

    def feed(self, data: np.ndarray) -> Iterator[tuple[int, int, np.ndarray]]:
        self.fed += data.nbytes
        if self.fed > self.total:
            raise IntegrityError(f"{self.what}: more than the {self.total} bytes stated")
        self.pending += data.tobytes()
        at = 0
        if self.sizes is None:
            n = len(self.pieces)
            if len(self.pending) < 5 * n:
                return
            sizes = np.frombuffer(bytes(self.pending[: 4 * n]), "<u4").astype(np.int64).tolist()
            kinds = list(self.pending[4 * n : 5 * n])
            for size, kind, (nbytes, item) in zip(sizes, kinds, self.pieces, strict=True):
                check(kind, size, nbytes, item)  # every size checked before any is used
            if 5 * n + sum(sizes) != self.total:
                raise IntegrityError(f"{self.what}: the table's {sum(sizes)} bytes do not fill the stream")
            self.sizes, self.kinds, at = sizes, kinds, 5 * n
        while self.next < len(self.pieces):
            size = self.sizes[self.next]
            if len(self.pending) - at < size:
                break
            payload = np.frombuffer(bytes(self.pending[at : at + size]), np.uint8) if size else np.empty(0, np.uint8)
            yield self.next, self.kinds[self.next], payload
            at += size
            self.next += 1
        del self.pending[:at]

    def finish(self) -> None:
        if self.fed != self.total or self.next != len(self.pieces):
            raise IntegrityError(f"{self.what}: the stream ended after {self.fed} of {self.total} bytes")
