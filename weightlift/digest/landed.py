"""Hashing what a load landed, as it lands.

A verified load (:class:`LandedHasher`) hashes what landed in the destination, not what was
read: the loader's workers call :meth:`LandedHasher.landed` with each chunk right after copying
it, while it is still in the cache. A chunk is cut at tensor boundaries into pieces; each tensor
has one incremental BLAKE3 hasher fed in byte order. A piece that arrives before the one ahead
of it (another worker still copying that chunk) is parked and hashed by whichever worker fills
the gap, so hashing follows the copy on the same threads without a second pass over memory.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from typing import Any

import blake3

from weightlift.digest.blake import byte_view
from weightlift.errors import IntegrityError
from weightlift.formats import TensorInfo

__all__ = ["LandedHasher"]


class _TensorHash:
    __slots__ = ("hasher", "pos", "parked", "busy")

    def __init__(self) -> None:
        self.hasher = blake3.blake3()
        self.pos = 0
        self.parked: dict[int, Any] = {}
        self.busy = False


class LandedHasher:
    """Hashes the bytes a load landed, per tensor, on the threads that landed them.

    ``expected`` maps tensor names to digests; :meth:`check` raises IntegrityError naming every
    tensor whose landed bytes differ (or that did not land completely) and ``against``, what
    the digests are (a published manifest, or the files as they are now).
    """

    def __init__(self, tensors: Sequence[TensorInfo], expected: dict[str, bytes], *, against: str = "their BLAKE3"):
        missing = [t.name for t in tensors if t.name not in expected]
        if missing:
            raise IntegrityError(f"no digest to verify {len(missing)} tensor(s) against: {', '.join(missing[:3])}")
        self.expected = expected
        self.against = against
        self._all = list(tensors)
        self._tensors: dict[str, list[TensorInfo]] = {}
        for t in sorted(tensors, key=lambda t: (t.file, t.offset)):
            if t.length:  # an empty tensor lands no bytes, and would break the order of ends
                self._tensors.setdefault(t.file, []).append(t)
        # tensors do not overlap, so their ends rise with their offsets
        self._ends = {f: [t.end for t in ts] for f, ts in self._tensors.items()}
        self._state = {t.name: _TensorHash() for t in tensors}
        self._lock = threading.Lock()

    def landed(self, file: str, offset: int, data: Any, *, stable: bool = True) -> None:
        """The bytes of ``file`` at [offset, offset + len(data)) have landed as ``data``.

        ``stable`` False means ``data`` is a staging buffer that is reused once this returns
        (a CUDA load's pinned slot): a piece that cannot be hashed now is copied before parking.
        """
        view = byte_view(data)
        end = offset + view.nbytes
        ts, ends = self._tensors.get(file), self._ends.get(file)
        if not ts or not ends:
            return
        i = bisect.bisect_right(ends, offset)  # the first tensor ending after offset
        while i < len(ts) and ts[i].offset < end:
            t = ts[i]
            a, b = max(offset, t.offset), min(end, t.end)
            if a < b:
                self._feed(self._state[t.name], a - t.offset, view[a - offset : b - offset], stable)
            i += 1

    def _feed(self, st: _TensorHash, pos: int, piece: Any, stable: bool) -> None:
        with self._lock:
            if st.busy or pos != st.pos:  # not next, or another thread is hashing this tensor
                st.parked[pos] = piece if stable else bytes(piece)
                return
            st.busy = True
        while True:  # whoever hashes the piece at st.pos also drains what was parked after it
            st.hasher.update(piece)
            with self._lock:
                st.pos += len(piece)
                nxt = st.parked.pop(st.pos, None)
                if nxt is None:
                    st.busy = False
                    return
            piece = nxt

    def check(self) -> None:
        """IntegrityError naming each tensor whose landed bytes differ from the expected digest."""
        differ = []
        for t in self._all:
            st = self._state[t.name]
            if st.pos != t.length or st.hasher.digest() != self.expected[t.name]:
                differ.append(t.name)
        if differ:
            shown = ", ".join(differ[:8]) + (f" and {len(differ) - 8} more" if len(differ) > 8 else "")
            raise IntegrityError(f"{len(differ)} tensor(s) landed with bytes that differ from {self.against}: {shown}")
