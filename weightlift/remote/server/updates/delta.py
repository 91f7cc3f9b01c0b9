"""DELTA on one connection: a tensor rebuilt from a base the server holds and what changed.

A DELTA names its tensor, the base's digest and the digest of the result. The payload is read
off the socket into a buffer of its own (charged while it lives) and proven by the frame MAC
before anything uses it. Then:

* the base is the tensor this connection's open update holds under that name, else the store's
  entry; it must be host memory of the DELTA's dtype and shape that hashes to the base digest
  (an entry handed out writable is hashed again first). If not, the tensor is allocated as an
  ALLOC would, and its id goes into the next BARRIER_REPLY's need: the client sends it whole;
* in an in-place update the payload is kept until COMMIT (:mod:`.switch`);
* otherwise the result is written into fresh memory and hashed as it is written (the chunks
  applied on the codec's workers, one per core, and hashed in order on this connection's thread
  while they are in cache: :func:`weightlift.remote.delta.apply_hashed`), the
  base read under :meth:`Store.reading <weightlift.remote.server.store.Store.reading>` as a READ
  reads it, and completes like a tensor whose WRITEs all arrived: published, or held
  by the open update. A result that does not hash to the DELTA's digest fails the tensor; the
  base is untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from weightlift.dtypes import item_size
from weightlift.memory.targets import as_bytes
from weightlift.profile import Profiler
from weightlift.remote import delta as codec
from weightlift.remote.protocol import Alloc, Delta, DeltaEncoding
from weightlift.remote.server.cache.hashing import tensor_digest
from weightlift.remote.server.receive import Receiver
from weightlift.remote.server.store import Charge, Entry, MemoryFull, Store
from weightlift.remote.server.updates.switch import InPlace, Switch

__all__ = ["Deltas"]


class Payload(Protocol):
    """Where a DELTA's payload comes from: the connection's frame reader (a seam, so that the
    updates do not import the connection that dispatches to them)."""

    def payload(self, buf: memoryview, /) -> None: ...
    def drain(self, n: int, /) -> None: ...
    def frame_end(self) -> None: ...


class Deltas:
    """One connection's DELTA handler; ``switch()`` gives its open update, if any."""

    def __init__(
        self,
        store: Store,
        rx: Receiver,
        frames: Payload,
        switch: Callable[[], Switch | None],
        prof: Profiler,
        *,
        enabled: bool,
        planes: Callable[[], bool],
    ):
        self._store = store
        self._rx = rx
        self._frames = frames
        self._switch = switch
        self._prof = prof
        self._enabled = enabled  # host memory and the codec: else every DELTA is answered "need"
        self._planes = planes  # whether the minor negotiated knows PLANES (known once HELLO came)

    def delta(self, d: Delta) -> None:
        got = self._receive(d)
        if got is None:
            return
        payload, charge = got
        keep = False
        try:
            keep = self._use(d, payload, charge)
        finally:
            if not keep:
                charge.release()

    def _receive(self, d: Delta) -> tuple[np.ndarray, Charge] | None:
        """The payload, read and proven, with its charge; None (drained, the error kept) where
        it is longer than a whole tensor's encoding can be or does not fit in memory."""
        rx = self._rx
        why = None
        if d.length > codec.payload_bound(d.nbytes):
            why = f"DELTA of {d.name!r}: {d.length} payload bytes for a tensor of {d.nbytes}"
        else:
            try:
                charge = self._store.charge(d.length)
            except MemoryFull as e:
                why = f"DELTA of {d.name!r}: {e}"
        if why is not None:
            self._frames.drain(d.length)
            self._frames.frame_end()
            rx.outcomes.error(why)
            rx.outcomes.mark_failed(d.tensor_id)
            return None
        try:
            payload = np.empty(d.length, np.uint8)  # no memory for it after all: the charge goes back
            with self._prof.phase("wire", d.length, name=d.name):
                self._frames.payload(payload.data)
            self._frames.frame_end()  # proven before any of it is used
        except BaseException:
            charge.release()
            raise
        self._store.count("bytes_received", d.length)
        rx.outcomes.done_bytes += d.length
        return payload, charge

    def _base(self, d: Delta) -> Entry | None:
        switch = self._switch()
        e = switch.base(d.name) if switch is not None else self._store.get(d.name)
        if not self._enabled or e is None or (e.dtype, e.shape) != (d.dtype, d.shape) or item_size(d.dtype) == 0:
            return None
        if getattr(getattr(e.tensor, "device", None), "type", "cpu") != "cpu":
            return None  # device memory: no base to apply to on the host
        if e.exposed:  # handed out writable: a reader may have written into it since
            return e if tensor_digest(e.tensor) == d.base else None
        return e if e.digest == d.base else None

    def _still(self, d: Delta, base: Entry) -> bool:
        """Whether ``base`` is still what a DELTA of its name applies to: the same memory in the
        same version (an in-place switch publishes the memory it changed as a new version)."""
        switch = self._switch()
        now = switch.base(d.name) if switch is not None else self._store.get(d.name)
        return (
            now is not None and now.tensor is base.tensor and (now.version, now.digest) == (base.version, base.digest)
        )

    def _use(self, d: Delta, payload: np.ndarray, charge: Charge) -> bool:
        """Apply (or keep, in place) the delta; True when the payload's charge was taken over."""
        rx = self._rx
        base = self._base(d)
        switch = self._switch()
        if d.tensor_id in rx.pending or (d.encoding == DeltaEncoding.SAME and (payload.nbytes or d.digest != d.base)):
            why = f"DELTA of {d.name!r}: tensor id {d.tensor_id} is in flight, or a SAME delta that changes something"
            rx.outcomes.error(why)
            return False
        if d.encoding == DeltaEncoding.PLANES and not self._planes():
            # as a server of that minor would answer: an encoding it does not know
            rx.outcomes.error(f"DELTA of {d.name!r}: encoding PLANES needs protocol minor 4")
            rx.outcomes.mark_failed(d.tensor_id)
            return False
        try:  # refused as it arrives, not only at the switch that would apply it in place
            if base is not None:  # (without it the client is asked for the tensor whole)
                codec.check(d.encoding, payload.data, d.nbytes, item_size(d.dtype))
        except codec.DeltaError as e:
            rx.outcomes.error(f"DELTA of {d.name!r}: {e}")
            rx.outcomes.mark_failed(d.tensor_id)
            return False
        if base is not None and d.encoding == DeltaEncoding.SAME:
            # the tensor is its base, already there: it stays (and belongs to the open update)
            if switch is not None:
                switch.name(d.name)
            if d.verify:
                rx.outcomes.add_verified(d.tensor_id, d.base)
            rx.outcomes.done_tensors += 1
            return False
        # kept to change the store's memory at the switch; a base this update holds (sent whole
        # earlier in it) is applied now into new memory, as any second version in an update is
        if base is not None and switch is not None and switch.in_place_mode and self._store.get(d.name) is base:
            switch.in_place(InPlace(d.name, base, d.encoding, item_size(d.dtype), payload, charge, d.digest))
            return True
        rx.guard(d.tensor_id, rx.alloc, Alloc(d.tensor_id, d.name, d.dtype, d.shape, d.nbytes, d.digest, d.verify))
        p = rx.pending.get(d.tensor_id)
        if p is None:
            return False  # the allocation failed: its error is kept
        if base is None:
            rx.outcomes.need[d.tensor_id] = None  # not that base here: the client sends it whole
            return False
        try:
            rx.dests.ensure(p, fault=False)
            rx.dests.unfault(p)  # the delta writes every byte: no helper faults it in meanwhile
            out = as_bytes(p.dest)
            # what applying takes besides the payload (the decoded frames of the chunks out to the
            # workers at once), charged with it before anything is decoded
            charge.grow(codec.scratch_bound(d.encoding, payload.data, d.nbytes, item_size(d.dtype)))
            # read as a READ reads: another client's in-place switch of the base waits for the
            # pass, and one that came first is seen here (the base changed: sent whole instead)
            with self._store.reading(base.tensor), self._prof.phase("stage", d.nbytes, name="delta " + d.name):
                if not self._still(d, base):
                    rx.outcomes.need[d.tensor_id] = None
                    return False
                ok = (
                    codec.apply_hashed(d.encoding, payload.data, as_bytes(base.tensor), out, item_size(d.dtype))
                    == d.digest
                )
        except codec.DeltaError as e:
            rx.abandon(d.tensor_id, f"DELTA of {d.name!r}: {e}")
            return False
        except Exception as e:  # no memory for the result or for applying, after all
            rx.abandon(d.tensor_id, f"DELTA of {d.name!r}: {type(e).__name__}: {e}")
            return False
        if not ok:
            rx.abandon(d.tensor_id, f"DELTA of {d.name!r}: the result does not hash to the digest sent")
            return False
        p.fill()
        p.proven = True
        rx.complete(d.tensor_id, p)
        return False
