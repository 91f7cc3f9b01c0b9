"""An update on one connection: tensors held back from UPDATE to COMMIT, then switched in at once.

Theory of operation. UPDATE opens a :class:`Switch`; from then on the connection's receiver hands
each tensor that completes to :meth:`Switch.hold` instead of publishing it, so readers keep the
version they had (the double-buffered way: the new bytes live in memory of their own). A DELTA
in an in-place update is kept encoded (:meth:`Switch.in_place`): its payload is small, and the
tensor it changes stays as it was. COMMIT then, under :meth:`Store.exclusive
<weightlift.remote.server.store.Store.exclusive>` (no READ sends bytes of that memory meanwhile), applies the
in-place deltas into their bases' memory (each a chunk per core, hashed as it is applied; what
an undo keeps is charged before it is taken), proves every result against the digest its DELTA
named, and publishes everything held with one :meth:`Store.switch
<weightlift.remote.server.store.Store.switch>`. Whatever fails undoes every in-place change and
switches nothing: readers see the old set or the new one, never a mix. A connection that ends
with its update open (a client killed mid-update) drops what it held; nothing visible changed.

The reply states the set digest (:func:`weightlift.digest.setdigest.set_digest`) over every
tensor the update named, as held right after the switch, for the client to compare with its own
(or zeros where the COMMIT asked for none: a checkpoint pushed as one unit, whose tensors are
then never hashed for it).

One update may span several connections (a push over ``streams``, protocol minor 5): the one
that opens it registers it by its push id in :class:`Units`, the others JOIN it, and every
tensor any of them completes is held by the one :class:`Switch` (its lock makes that safe). The
opener's COMMIT switches it all in; whichever connection ends first with the update still open
aborts all of it, and a tensor completing later on a connection that joined it is refused.
:class:`Units` also says which models have an update open, so that a model being pushed is not
removed under it.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np

from weightlift.errors import RemoteProtocolError
from weightlift.memory.targets import as_bytes
from weightlift.remote import delta as codec
from weightlift.remote.protocol import CommitReply
from weightlift.remote.server.cache import TensorCache
from weightlift.remote.server.cache.hashing import set_digest, tensor_digest
from weightlift.remote.server.store import Charge, Entry, Replaced, Staged, Store, key_model

__all__ = ["Switch", "InPlace", "Units"]


@dataclass
class InPlace:
    """A DELTA of an in-place update, kept encoded until COMMIT applies it into ``base``."""

    name: str
    base: Entry
    encoding: int
    item: int
    payload: np.ndarray
    charge: Charge  # the payload's memory, until the commit
    digest: bytes


class Switch:
    """An open update (``in_place``: its DELTAs change their bases' own memory) into ``model``,
    of one connection or of every connection that joined it."""

    def __init__(self, store: Store, *, in_place: bool, cache: TensorCache | None = None, model: str = ""):
        self._store = store
        self._cache = cache
        self.in_place_mode = in_place
        self.model = model
        self.closed = False  # committed or aborted: it holds nothing and takes nothing more
        self.refused = False  # a limit refused part of it (a BARRIER reported errors)
        self._lock = threading.RLock()  # the connections that joined it hold tensors from their own threads
        self._held: dict[str, Staged] = {}
        self._deltas: dict[str, InPlace] = {}
        self._names: dict[str, None] = {}  # every tensor the update named, in order

    @property
    def tensors(self) -> int:
        """Tensors held so far."""
        return len(self._held) + len(self._deltas)

    def hold(
        self,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        nbytes: int,
        tensor: Any,
        charge: Charge,
        digest: bytes | None,
    ) -> None:
        """Take a complete tensor (as :meth:`Store.publish` would) to publish at the switch;
        RemoteProtocolError (the charge given back) once the update is committed or aborted."""
        with self._lock:
            if self.closed:
                charge.release()
                raise RemoteProtocolError(f"{name!r} completed after the update it belongs to had ended")
            self._drop(name)
            self._held[name] = Staged(name, dtype, shape, nbytes, tensor, charge, digest)
            self._names[name] = None

    def in_place(self, d: InPlace) -> None:
        with self._lock:
            if self.closed:
                d.charge.release()
                raise RemoteProtocolError(f"{d.name!r} arrived after the update it belongs to had ended")
            self._drop(d.name)
            self._deltas[d.name] = d
            self._names[d.name] = None

    def name(self, name: str) -> None:
        """``name`` belongs to the update unchanged (a DELTA that said its tensor is its base)."""
        with self._lock:
            self._names[name] = None

    def base(self, name: str) -> Entry | None:
        """The tensor a DELTA of ``name`` applies to: one this update holds, else the store's."""
        held = self._held.get(name)
        if held is not None:
            return Entry(held.dtype, held.shape, held.nbytes, held.tensor, 0, held.digest)
        return self._store.get(name)

    def _drop(self, name: str) -> None:
        held = self._held.pop(name, None)
        if held is not None and held.charge is not None:
            held.charge.release()
        d = self._deltas.pop(name, None)
        if d is not None:
            d.charge.release()

    def abort(self) -> int:
        """Drop everything held: nothing visible changes. Returns how many tensors it held."""
        with self._lock:
            self.closed = True
            held = len(self._held) + len(self._deltas)
            for name in list(self._held) + list(self._deltas):
                self._drop(name)
            self._names.clear()
            return held

    def commit(self, *, root: bool = True) -> CommitReply:
        """Apply, prove and switch in everything at once; or nothing, saying why. ``root``
        False: the reply's root is zeros, and tensors sent without a digest are not hashed."""
        with self._lock:
            if self.closed:
                return CommitReply(False, 0, self._store.generation, bytes(32), "update not switched: it was dropped")
            try:
                return self._commit(root)
            finally:
                self.closed = True

    def _commit(self, root: bool) -> CommitReply:
        store = self._store
        held = list(self._held.values())
        for s in held:
            if s.digest is None and root:  # sent without one: hashed here, before anyone can see it
                s.digest = tensor_digest(s.tensor)
        # only memory changed in place is held off its readers (a commit they hold past the bound is refused)
        with ExitStack() as gate:
            kept = store.charge(0)  # what the undo keeps, charged before each part is taken
            undo = codec.Undo(reserve=kept.grow)
            try:
                gate.enter_context(store.exclusive({n: d.base.tensor for n, d in self._deltas.items()}))
                staged = self._apply(undo)
                # refused, nothing published, where another client replaced a base since _apply
                generation, digests = store.switch(staged + held, list(self._names))
            except Exception as e:  # a bad delta, or no memory for a chunk: every base applied goes back
                self._undo(undo, kept)
                why = e if isinstance(e, (codec.DeltaError, _Failed, Replaced)) else f"{type(e).__name__}: {e}"
                return CommitReply(False, 0, store.generation, bytes(32), f"update not switched: {why}")
            except BaseException:
                self._undo(undo, kept)
                raise
        kept.release()
        for d in self._deltas.values():
            d.charge.release()
        self._held, self._deltas, self._names = {}, {}, {}
        missing = [n for n, dg in digests.items() if dg is None]
        if not root:
            return CommitReply(True, len(staged) + len(held), generation, bytes(32))
        if missing:
            return CommitReply(
                True, len(staged) + len(held), generation, bytes(32), f"no digest for {key_model(missing[0])[1]!r}"
            )
        # over the names as the client pushed them, not the store's keys of a named model's tensors
        named = {key_model(n)[1]: dg for n, dg in digests.items()}
        return CommitReply(True, len(staged) + len(held), generation, set_digest(named))  # type: ignore[arg-type]

    def _undo(self, undo: codec.Undo, kept: Charge) -> None:
        """Every in-place change taken back, and what the update held given back: also where the
        undo fails (the connection that calls this no longer has the update to drop). Where it
        fails, every tensor the update changes in place is dropped: its bytes may be neither v nor v+1."""
        try:
            undo.run()
        except BaseException:
            torn = {n: d.base.tensor for n, d in self._deltas.items()}
            self._store.free(tuple(torn), holding=torn)
            raise
        finally:
            kept.release()
            self.abort()

    def _apply(self, undo: codec.Undo) -> list[Staged]:
        """The in-place deltas applied (each proven), as entries to publish."""
        out = []
        for d in self._deltas.values():
            now = self._store.get(d.name)
            if now is None or now.tensor is not d.base.tensor:
                raise _Failed(f"{d.name!r} was replaced by another client during the update")
            if self._cache is not None:  # no entry may be written from this memory as it changes
                self._cache.behind.drop(d.base.tensor, wait=True)
            raw = as_bytes(d.base.tensor)
            # what applying takes (the chunks' decoded frames) is charged while it applies; what
            # the undo keeps, as it is taken, until the switch is done
            scratch = self._store.charge(codec.scratch_bound(d.encoding, d.payload.data, raw.nbytes, d.item))
            try:
                got = codec.apply_hashed(d.encoding, d.payload.data, raw, raw, d.item, undo=undo)
            except codec.DeltaError as e:
                raise _Failed(f"DELTA of {d.name!r}: {e}") from None
            except Exception as e:  # no memory for a chunk, say
                raise _Failed(f"DELTA of {d.name!r}: {type(e).__name__}: {e}") from e
            finally:
                scratch.release()
            if got != d.digest:
                raise _Failed(f"{d.name!r}: the delta applied does not give the digest the client sent")
            b = d.base
            out.append(Staged(d.name, b.dtype, b.shape, b.nbytes, b.tensor, None, d.digest))
        return out


class Units:
    """The updates open on a server: those shared by push id (for a JOIN), and the models they
    fill (a REMOVE of one is refused meanwhile). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_push: dict[int, Switch] = {}
        self._open: dict[int, Switch] = {}  # id(switch) -> every open update, shared or not

    def opened(self, switch: Switch, push: int = 0) -> None:
        """``switch`` is open; a non-zero ``push`` lets other connections join it. RemoteProtocolError
        where another open update has that push id."""
        with self._lock:
            if push:
                other = self._by_push.get(push)
                if other is not None and not other.closed:
                    raise RemoteProtocolError(f"UPDATE opens push {push}, which is open already")
                self._by_push[push] = switch
            self._open[id(switch)] = switch

    def joinable(self, push: int) -> Switch:
        """The open update of ``push``; RemoteProtocolError where there is none."""
        with self._lock:
            switch = self._by_push.get(push) if push else None
        if switch is None or switch.closed:
            raise RemoteProtocolError(f"UPDATE joins push {push}, which is not open")
        return switch

    def ended(self, switch: Switch) -> None:
        """``switch`` was committed or aborted: forget it."""
        with self._lock:
            self._open.pop(id(switch), None)
            for push, s in list(self._by_push.items()):
                if s is switch:
                    del self._by_push[push]

    def pushing(self) -> set[str]:
        """The models an open update fills."""
        with self._lock:
            return {s.model for s in self._open.values() if not s.closed}


class _Failed(Exception):
    """An in-place delta that cannot be switched in: the whole update is not."""
