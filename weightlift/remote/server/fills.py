"""Filling a pending tensor named by digest without its bytes crossing the wire.

From memory: a tensor the server already holds whose bytes were proven to hash to the digest
(the same name: the very same memory is published again; another name: one copy). From the disk
cache: the entry's bytes are read into the destination and checked against the digest as they
come. Either way the tensor's bytes are proven when it is filled.
"""

from __future__ import annotations

import numpy as np

from weightlift.digest.blake import hash_buffer
from weightlift.errors import CacheError
from weightlift.memory.targets import populate
from weightlift.profile import Profiler
from weightlift.remote.server.cache import TensorCache
from weightlift.remote.server.cache.read import PARALLEL_READ_MIN, Readers, reader_pool
from weightlift.remote.server.destinations import Destinations
from weightlift.remote.server.device import Device
from weightlift.remote.server.pending import Pending
from weightlift.remote.server.store import Store

__all__ = ["Fills"]


class Fills:
    """One connection's fills: ``from_memory`` and ``from_cache`` fill ``p`` and say whether they could."""

    def __init__(self, store: Store, device: Device, dests: Destinations, prof: Profiler):
        self._store = store
        self._device = device
        self._dests = dests
        self._prof = prof
        self._readers: Readers | None = None  # made at the first cache read large enough to share

    def close(self) -> None:
        """The connection ends: its reader threads go (no read is in progress)."""
        if self._readers is not None:
            self._readers.close()
            self._readers = None

    def from_memory(self, p: Pending, digest: bytes) -> bool:
        """Fill ``p`` from a tensor the server holds whose bytes were proven to hash to
        ``digest``. An entry handed out writable (see :meth:`Store.tensors`) is hashed again
        first: a reader may have written into it since. One nobody could write into still holds
        the bytes it was proven to hold."""
        store, prof = self._store, self._prof
        if not store.remembers_digests or not self._device.pooled:
            return False  # host memory only (and no device is touched to find out)
        target = self._device.target
        for name, e in store.candidates(p.name, digest):
            if e.digest != digest or e.nbytes != p.nbytes:
                continue
            src = np.frombuffer(target.host_view(e.tensor), dtype=np.uint8)
            sealed = not e.exposed  # nobody outside the server could have written into it
            if not sealed:
                with prof.phase("hash", p.nbytes, name="verify " + p.name):
                    ok = hash_buffer(src) == digest
                if not ok:  # written since it arrived: no longer proof of anything
                    store.distrust(name, e, digest)
                    continue
            if name == p.name and e.dtype == p.dtype and e.shape == p.shape:
                self._dests.charge(p)
                p.dest = e.tensor  # already there: publish the same memory again
            else:
                self._dests.ensure(p, fault=False)
                # read as a READ reads: an in-place switch of that memory waits for the copy, and
                # one that came after the entry was chosen made it another entry (other bytes)
                with store.reading(e.tensor), prof.phase("stage", p.nbytes, name="copy " + p.name):
                    if store.get(name) is not e:
                        continue
                    dst = np.frombuffer(target.host_view(p.dest), dtype=np.uint8)
                    dst[:] = src  # a user-space copy faults fresh pages itself as cheaply as anything
                if not sealed and hash_buffer(dst) != digest:  # the source changed under the copy: prove what landed
                    continue
            p.fill()
            p.proven = True
            store.count("memory_hits")
            store.count("bytes_from_memory", p.nbytes)
            return True
        return False

    def from_cache(self, p: Pending, digest: bytes, cache: TensorCache) -> bool:
        """Fill ``p`` (its destination made) from the cache entry of ``digest``; False when the
        entry was missing or corrupt (it is gone now: the client sends the bytes). The readers
        fault fresh memory in themselves."""
        # A destination made at ALLOC went to the faulter, whose helpers write into the pages
        # they fault: it leaves the faulter (running pieces waited for) before any byte lands,
        # or a helper could overwrite bytes already read and hashed.
        self._dests.unfault(p)
        target = self._device.target
        with self._prof.phase("read", p.nbytes, name=p.name):
            try:
                if target.memcpy_ok:
                    dest = target.host_view(p.dest)

                    def before(begin: int, end: int) -> None:
                        # fresh pages are faulted in by whichever reader fills them, just before
                        # its preadv (where the fill policy says that beats faulting inside it)
                        populate(dest[begin:end])

                    if self._readers is None and p.nbytes >= PARALLEL_READ_MIN:
                        self._readers = reader_pool()
                    cache.read_into(digest, dest, before=before if p.fresh else None, readers=self._readers)
                else:
                    cache.read_into_target(
                        digest,
                        p.nbytes,
                        lambda off, chunk: target.write(p.dest, off, chunk),
                        self._device.staging().data,
                    )
            except CacheError:
                return False
        self._store.count("cache_hits")
        self._store.count("bytes_from_cache", p.nbytes)
        p.fill()
        p.proven = True  # read_into verified the entry against this digest
        return True
