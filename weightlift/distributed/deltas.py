"""The delta of a reshard update: what changed in a sender's pieces since it last sent them. No I/O.

Theory of operation. An update walks the same plan as a full transfer (the pieces of
:mod:`.transfer`, at most a chunk each, in plan order). A sender that kept a copy of the shards
it last sent compares each piece's new bytes with that copy, element by element, and encodes
the piece as one of:

* ``SAME`` (0 bytes): nothing changed; the receiver's base already holds it;
* ``SPARSE`` (``4 + count * (4 + item)`` bytes): ``count:u32``, the changed elements' indexes in
  the piece (``u32`` each, increasing), then their new values: chosen where it is smaller
  than the piece;
* ``WHOLE`` (the piece's bytes): everything else.

The size is a function of the count of changed elements alone, so every size is known before
anything is encoded. Per (sender, receiver) pair the *stream* is the table of sizes (``u32``
per piece, in plan order), then the non-empty payloads; the pair's length is exchanged first,
so both ends cut the stream into the same messages of at most a chunk (gloo receives into a
buffer of the size sent), the sender encodes each piece as its message is filled and the
receiver applies each piece once its bytes are in: neither end holds more than a couple of
chunks of it. (The tensor server's zstd codecs learn a chunk's size only by compressing it, so
a sender would hold every compressed chunk until the lengths are exchanged: not used here.)

Every size and index in a stream is checked before it is used (:class:`IntegrityError`); what
the applied pieces add up to is proven afterwards by the reshard's sketch, as a full transfer is.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np

from weightlift.errors import IntegrityError

__all__ = ["SAME", "SPARSE", "WHOLE", "changed", "size_of", "kind_of", "encode", "apply", "Stream"]

SAME, SPARSE, WHOLE = 0, 1, 2
_U32 = struct.Struct("<I")
_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def changed(new: np.ndarray, old: np.ndarray, item: int) -> np.ndarray:
    """The indexes (uint32) of the elements of ``item`` bytes where ``new`` differs from ``old``."""
    w = _WORD[item]
    return np.flatnonzero(new.view(w) != old.view(w)).astype(np.uint32)


def size_of(nbytes: int, count: int, item: int) -> int:
    """The encoded size of a piece of ``nbytes`` with ``count`` changed elements."""
    if count == 0:
        return 0
    sparse = 4 + count * (4 + item)
    return sparse if sparse < nbytes else nbytes


def kind_of(size: int, nbytes: int, item: int) -> int:
    """SAME, SPARSE or WHOLE, from a size in a stream's table; IntegrityError if no piece can have it."""
    if size == 0:
        return SAME
    if size == nbytes:
        return WHOLE
    if size < nbytes and size > 4 and (size - 4) % (4 + item) == 0:
        return SPARSE
    raise IntegrityError(f"a delta piece of {nbytes} bytes cannot encode to {size} bytes")


def encode(new: np.ndarray, old: np.ndarray, item: int, size: int) -> np.ndarray:
    """The payload of a piece (``size`` from :func:`size_of` of the same bytes)."""
    if size == new.nbytes:
        return new
    idx = changed(new, old, item)
    if size_of(new.nbytes, len(idx), item) != size:
        raise IntegrityError("a sender's tensor changed while its update was being sent")
    out = np.empty(size, np.uint8)
    out[:4] = np.frombuffer(_U32.pack(len(idx)), np.uint8)
    out[4 : 4 + 4 * len(idx)] = idx.view(np.uint8)
    out[4 + 4 * len(idx) :] = new.view(_WORD[item])[idx].view(np.uint8)
    return out


def apply(piece: np.ndarray, payload: np.ndarray, item: int) -> None:
    """Apply a SPARSE payload to ``piece`` (its base bytes, written in place)."""
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
        self.next = 0  # the next piece to yield
        self.fed = 0
        if total < 4 * len(pieces):
            raise IntegrityError(f"{what}: a stream of {total} bytes cannot hold the table of {len(pieces)} pieces")

    def feed(self, data: np.ndarray) -> Iterator[tuple[int, int, np.ndarray]]:
        self.fed += data.nbytes
        if self.fed > self.total:
            raise IntegrityError(f"{self.what}: more than the {self.total} bytes stated")
        self.pending += data.tobytes()
        at = 0
        if self.sizes is None:
            table = 4 * len(self.pieces)
            if len(self.pending) < table:
                return
            sizes = np.frombuffer(bytes(self.pending[:table]), "<u4").astype(np.int64).tolist()
            for s, (n, item) in zip(sizes, self.pieces, strict=True):
                kind_of(s, n, item)  # every size checked before any is used
            if table + sum(sizes) != self.total:
                raise IntegrityError(f"{self.what}: the table's {sum(sizes)} bytes do not fill the stream")
            self.sizes, at = sizes, table
        while self.next < len(self.pieces):
            size = self.sizes[self.next]
            if len(self.pending) - at < size:
                break
            n, item = self.pieces[self.next]
            payload = np.frombuffer(bytes(self.pending[at : at + size]), np.uint8) if size else np.empty(0, np.uint8)
            yield self.next, kind_of(size, n, item), payload
            at += size
            self.next += 1
        del self.pending[:at]

    def finish(self) -> None:
        if self.fed != self.total or self.next != len(self.pieces):
            raise IntegrityError(f"{self.what}: the stream ended after {self.fed} of {self.total} bytes")
