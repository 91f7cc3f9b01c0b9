"""The server's store: its complete tensors and its memory account.

Invariants, and why this module is the only code that changes them:

* **Cost.** A tensor counts against ``max_memory`` as the memory it holds
  (:func:`weightlift.memory.pool.held_bytes`: a pooled tensor its whole 2 MiB size class, one of
  128 KiB to 2 MiB its pages) and what its bookkeeping really costs: :data:`ENTRY_OVERHEAD`, the name
  :data:`NAME_COPIES` times and :data:`DIM_OVERHEAD` per dimension (:func:`entry_cost`; the
  figures are measured by the tests, with a long name and many dimensions). Idle pooled memory
  counts too and is given back first when a charge would not fit.
* **Charges.** Memory is charged before a destination is made (:meth:`Store.charge`), as a
  :class:`Charge` that its holder releases once (:meth:`Charge.release`, idempotent) if the tensor
  never completes. :meth:`Store.publish` takes the charge over: from then on the entry holds it,
  and :meth:`Store.free` or a later version of the same name gives it back.
* **Visibility.** A tensor is visible (``tensors()``, READ, LIST) only once complete:
  :meth:`Store.publish` is the one place an entry appears, so a client that vanishes mid-tensor
  leaves nothing behind.
* **Release.** A replaced or freed entry's memory, and its charge, go back when the last
  reference to its array goes (``weakref.finalize``): memory a reader still holds (a READ reply
  the peer is slow to take, an in-process caller of ``tensors()``) is never reused and still
  counts against ``max_memory``, so stalled readers cannot pin old versions beyond the limit.
* **Switches.** :meth:`Store.switch` publishes a whole set at once under the one lock (an update:
  a reader sees every tensor of it as it was before or every one as it is after, never a mix)
  and counts the store's ``generation``. Memory changed in place (an in-place update) changes
  under :meth:`Store.exclusive` of exactly that memory, which waits for the READs sending its
  bytes (:meth:`Store.reading` of it) and holds new ones off until it is done; a READ of other
  memory goes on meanwhile (:mod:`weightlift.remote.server.updates.gates`). A commit that its readers
  hold past the store's ``gate_timeout`` is refused (:class:`GateTimeout`) with nothing changed.
  A switch counts the generation while it still holds the memory it changed, so a READ that
  names the generation it listed, checked once it holds its tensor's gate, is sent bytes of
  that generation or refused: a reader of a set sees v or v+1 of all of it, never a mix.
* **Proven digests.** An entry whose bytes were proven to hash to a digest answers HAVE and can
  fill a later ALLOC of that digest; :meth:`Store.distrust` forgets a digest whose bytes have
  changed since (a reader wrote into its tensor).

* **Models.** Each model is a namespace: a tensor ``name`` of model ``m`` is stored under
  :func:`model_key` (``"\\x00m\\x00name"``; the default model's under its own name), so the
  names of a model lie together in name order and every invariant above holds across models
  (one memory account, one generation). A tensor name never begins with NUL.

One lock guards all of it, held only for bookkeeping (never a sort, a comparison of names or a
hash); connections never touch the dictionaries themselves. The names in name order, which LIST
pages through, are kept apart (:class:`_Order`), under a lock of their own taken before the
store's, so that a page costs its own length and not the store's.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from weightlift.dtypes import byte_length, dtype_info
from weightlift.errors import WeightliftError
from weightlift.memory.pool import HostPool
from weightlift.memory.targets import as_bytes, view_as
from weightlift.remote.protocol import SketchEntry, SketchReply
from weightlift.remote.server.updates.gates import Gates, GateTimeout

if TYPE_CHECKING:
    from weightlift.remote.server.config import Slices

__all__ = [
    "ENTRY_OVERHEAD",
    "NAME_COPIES",
    "DIM_OVERHEAD",
    "Entry",
    "Charge",
    "GateTimeout",
    "MemoryFull",
    "Store",
    "Staged",
    "entry_cost",
    "Assembly",
    "RegionRefused",
    "model_key",
    "key_model",
]

# What one tensor's bookkeeping costs besides its data, measured (tests/remote/test_server_limits.py):
# the entry, the array object, its finalizer, the pending record and its message while in flight.
ENTRY_OVERHEAD = 2048  # bytes per tensor
NAME_COPIES = 3  # the name is held as str by the message, the pending record and the entry (and its key)
DIM_OVERHEAD = 96  # per dimension: a Python int in the shape tuple(s), the array's shape and strides


_MARK = "\x00"  # begins the key of every named model's tensor; no tensor name begins with it


def model_key(model: str, name: str) -> str:
    """Where the store keeps tensor ``name`` of ``model`` ("" the default model: the name itself)."""
    return f"{_MARK}{model}{_MARK}{name}" if model else name


def key_model(key: str) -> tuple[str, str]:
    """(model, name) of a store key: :func:`model_key` undone."""
    if not key.startswith(_MARK):
        return "", key
    model, _, name = key[1:].partition(_MARK)
    return model, name


def entry_cost(name: str, nbytes: int, ndim: int = 1) -> int:
    """What a tensor counts against max_memory: its bytes and its bookkeeping (name, dimensions, entry)."""
    return nbytes + NAME_COPIES * len(name.encode("utf-8", "surrogatepass")) + DIM_OVERHEAD * ndim + ENTRY_OVERHEAD


class MemoryFull(Exception):
    """A charge would exceed max_memory; the message says by how much (reported at the barrier)."""


class Entry:
    """A complete tensor in the store. ``digest`` is set when its bytes were proven to hash to it
    (hashed as they arrived, or filled from a verified cache entry): the in-memory tier.
    ``version`` names this version of the tensor (LIST states it; a READ may ask for it).
    ``exposed`` says whether anyone outside the server may have been able to write into it
    (handed out writable): only then must its bytes be hashed again before they prove anything."""

    __slots__ = ("dtype", "shape", "nbytes", "tensor", "cost", "digest", "version", "exposed", "_readonly")

    def __init__(
        self,
        dtype: str,
        shape: tuple[int, ...],
        nbytes: int,
        tensor: Any,
        cost: int,
        digest: bytes | None,
        version: int = 0,
    ):
        self.dtype, self.shape, self.nbytes, self.tensor, self.cost, self.digest = (
            dtype,
            shape,
            nbytes,
            tensor,
            cost,
            digest,
        )
        self.version = version
        self.exposed = False
        self._readonly: Any = None

    def readonly(self) -> Any:
        """The tensor as a read-only numpy view (the same object every time), or None where the
        tensor is not a numpy array (a torch tensor has no read-only form)."""
        if self._readonly is None and isinstance(self.tensor, np.ndarray):
            v = self.tensor.view()
            v.flags.writeable = False
            self._readonly = v
        return self._readonly


class Charge:
    """Bytes counted against max_memory for one tensor in flight; released at most once."""

    __slots__ = ("_store", "nbytes", "_live")

    def __init__(self, store: Store, nbytes: int):
        self._store = store
        self.nbytes = nbytes
        self._live = True

    @property
    def live(self) -> bool:
        return self._live

    def grow(self, nbytes: int, alloc: int = 0) -> None:
        """Charge ``nbytes`` more to this live charge; MemoryFull if they do not fit."""
        if not self._live:
            raise AssertionError("a released charge cannot grow")
        self._store.charge(nbytes, alloc)._hand_over()
        self.nbytes += nbytes

    def release(self) -> None:
        """Give the bytes back (the tensor will not complete); a no-op the second time."""
        if self._live:
            self._live = False
            self._store._uncharge(self.nbytes)

    def _hand_over(self) -> int:
        # the entry that publish() makes holds the bytes from now on
        if not self._live:
            raise AssertionError("a released charge cannot be published")
        self._live = False
        return self.nbytes


class Replaced(Exception):
    """An in-place change's memory is no longer what its name holds at the switch: another
    client's update replaced it meanwhile (nothing was published)."""


@dataclass
class Staged:
    """A tensor an update publishes at its switch: as :meth:`Store.publish` takes one. ``charge``
    None: the memory of the entry it replaces, changed in place (that entry's charge holds)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    tensor: Any
    charge: Charge | None
    digest: bytes | None


class _Rewritten:
    """Memory changed in place, and the digest of its last change: a proof older than that is void.

    Memory already stored can be published again unchanged (a tensor filled from the same name's
    memory) with the digest it was proven to hold when it was filled. Another client's in-place
    switch may have changed it since, before that publication (an update held it meanwhile):
    what the store knows of that memory now wins, the stored entry's digest or, for memory
    changed in place and freed since, the digest of its last change. Keyed by identity (arrays
    do not hash), forgotten with the memory; the store's lock is held."""

    def __init__(self) -> None:
        self._digests: dict[int, bytes | None] = {}

    def note(self, tensor: Any, digest: bytes | None) -> None:
        key = id(tensor)
        if key not in self._digests:
            try:
                weakref.finalize(tensor, self._digests.pop, key, None)
            except TypeError:  # memory without weak references (a device's) is never changed in place
                return
        self._digests[key] = digest

    def claim(self, digest: bytes | None, tensor: Any) -> bytes | None:
        """``digest`` (what the store knows of the memory, else the publisher's proof), or None
        where ``tensor`` was changed in place to other bytes since."""
        key = id(tensor)
        return None if key in self._digests and self._digests[key] != digest else digest


class _Order:
    """The store's names in name order, for LIST.

    The store notes each name it adds or drops in a set (no comparison under its lock); a page
    takes those in first (:meth:`Store.listing`), and so does a publish or free once they
    outnumber the names held. Names lie in sorted chunks of at most ``2 * _CHUNK``, found by
    bisecting the chunks' first names: taking a name in moves at most a chunk's pointers, and
    a page starts with two bisections. Many changes at once (a whole model pushed) are taken in
    by one sort instead. Only the holder of :attr:`lock` reads or changes it.
    """

    _CHUNK = 512

    def __init__(self) -> None:
        self.lock = threading.Lock()  # taken before the store's lock, never while holding it
        self._chunks: list[list[str]] = []
        self._firsts: list[str] = []  # each chunk's first name
        self.size = 0

    def rebuild(self, names: list[str]) -> None:
        names.sort()
        self._chunks = [names[i : i + self._CHUNK] for i in range(0, len(names), self._CHUNK)]
        self._firsts = [c[0] for c in self._chunks]
        self.size = len(names)

    def apply(self, changes: list[tuple[str, bool]]) -> None:
        """Take in each (name, whether the store holds it now)."""
        for name, present in changes:
            if present:
                self._put(name)
            else:
                self._drop(name)

    def _put(self, name: str) -> None:
        if not self._chunks:
            self._chunks, self._firsts, self.size = [[name]], [name], 1
            return
        i = max(0, bisect_right(self._firsts, name) - 1)
        c = self._chunks[i]
        j = bisect_left(c, name)
        if j < len(c) and c[j] == name:
            return
        c.insert(j, name)
        self.size += 1
        if j == 0:
            self._firsts[i] = name
        if len(c) > 2 * self._CHUNK:
            self._chunks.insert(i + 1, c[self._CHUNK :])
            self._firsts.insert(i + 1, c[self._CHUNK])
            del c[self._CHUNK :]

    def _drop(self, name: str) -> None:
        i = bisect_right(self._firsts, name) - 1
        if i < 0:
            return
        c = self._chunks[i]
        j = bisect_left(c, name)
        if j == len(c) or c[j] != name:
            return
        del c[j]
        self.size -= 1
        if not c:
            del self._chunks[i], self._firsts[i]
        elif j == 0:
            self._firsts[i] = c[0]

    def after(self, after: str, *, inclusive: bool = False) -> Iterator[str]:
        """The names that sort after ``after`` (``inclusive``: and ``after`` itself), in order
        (read while the lock is held)."""
        i = max(0, bisect_right(self._firsts, after) - 1)
        j = (bisect_left if inclusive else bisect_right)(self._chunks[i], after) if self._chunks else 0
        for c in self._chunks[i:]:
            yield from c[j:]
            j = 0


class Store:
    """The tensors a server holds, and what they cost; every change goes through these methods."""

    def __init__(
        self,
        *,
        max_memory: int,
        pool: HostPool | None,
        remember_digests: bool,
        gate_timeout: float | None = None,
    ):
        self.max_memory = max_memory
        self.pool = pool  # touched host memory of released tensors, reused for new ones
        self._remember = remember_digests  # digests of held tensors are remembered (the in-memory tier)
        # reentrant: a finalizer giving a charge back may run in any thread, also one holding it
        self._lock = threading.RLock()
        self._entries: dict[str, Entry] = {}
        self._order = _Order()  # the names in name order, for LIST
        self._renamed: set[str] = set()  # names added or dropped since _order took them in
        self._held: dict[bytes, str] = {}  # digest -> name of a stored tensor proven to hold those bytes
        self._used = 0
        self._versions = 0  # the last version number given to a published tensor
        self._generation = 1  # one more than the switches so far (a READ naming 0 asks for any)
        self._switched: dict[str, int] = {}  # model -> the generation its last switch made
        self._gates = Gates(gate_timeout)  # how long an in-place change waits for its readers
        self._unowned: dict[int, int] = {}  # id -> cost of held tensors that take no weak references
        self._rewritten = _Rewritten()
        self.on_free: Callable[[list[str]], None] | None = None  # told the names :meth:`free` dropped
        self._stats = {
            "connections": 0,
            "tensors": 0,
            "bytes_received": 0,
            "bytes_from_cache": 0,
            "cache_hits": 0,
            "memory_hits": 0,
            "bytes_from_memory": 0,
            "errors": 0,
            "pushes_committed": 0,
            "pushes_refused": 0,
            "pushes_rolled_back": 0,
            "stats_requests": 0,
            "removes": 0,
        }

    # -- the memory account ------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Bytes counted against max_memory: complete tensors and those in flight."""
        return self._used

    @property
    def remembers_digests(self) -> bool:
        return self._remember

    def charge(self, nbytes: int, alloc: int = 0) -> Charge:
        """Charge ``nbytes`` for a tensor of ``alloc`` bytes; MemoryFull if it does not fit.

        Idle pooled memory counts too and is given back first, except what that tensor will be
        placed in (``alloc`` says which size class it takes)."""
        pool = self.pool
        if pool is not None:
            idle = pool.idle_bytes - pool.servable(alloc)
            over = self._used + nbytes + idle - self.max_memory
            if over > 0:
                pool.trim(pool.idle_bytes - over)
        with self._lock:
            if self._used + nbytes > self.max_memory:
                raise MemoryFull(
                    f"{nbytes} bytes would exceed the server's memory limit ({self._used} of {self.max_memory} in use)"
                )
            self._used += nbytes
        return Charge(self, nbytes)

    def _uncharge(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    def take_host(self, nbytes: int) -> tuple[np.ndarray, bool]:
        """Host memory for a tensor of ``nbytes`` from the pool: (array, whether it is fresh)."""
        if self.pool is None:
            raise AssertionError("take_host on a store without a host pool")
        return self.pool.take_marked(nbytes)

    # -- entries -------------------------------------------------------------------------------

    def publish(
        self,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        nbytes: int,
        tensor: Any,
        charge: Charge,
        digest: bytes | None,
    ) -> None:
        """Make a complete tensor visible under ``name``, replacing any earlier version.

        The entry takes over ``charge``; a replaced version's cost is released and its memory
        goes back once nobody references it. ``digest``, when given, is proven: the entry can
        answer HAVE for it."""
        cost = charge._hand_over()
        with self._lock:
            old = self._publish(name, dtype, shape, nbytes, tensor, cost, digest, changed=False)
        del old  # the last reference to a replaced tensor: its memory goes back to the pool now
        self._tidy()

    def _publish(
        self,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        nbytes: int,
        tensor: Any,
        cost: int,
        digest: bytes | None,
        *,
        changed: bool,
    ) -> Entry | None:
        """Publish under the lock (held); returns the entry replaced. ``changed``: the same memory
        holds other bytes now (changed in place), so it is a new version all the same."""
        old = self._entries.get(name)
        if old is not None and old.tensor is tensor:
            # the same memory published again (unchanged weights, or changed in place): it is
            # charged once, by the finalizer its first publication set
            self._used -= cost
            cost = old.cost
        else:
            self._charge_until_gone(tensor, cost)
        same = old is not None and old.tensor is tensor and (old.dtype, old.shape) == (dtype, shape)
        if changed:
            self._rewritten.note(tensor, digest)
        elif digest is not None:
            digest = self._rewritten.claim(old.digest if old is not None and old.tensor is tensor else digest, tensor)
        if same and not changed:
            version = old.version  # type: ignore[union-attr]  # the same bytes as the same tensor: a listing still holds
        else:
            self._versions += 1
            version = self._versions
        entry = self._entries[name] = Entry(dtype, shape, nbytes, tensor, cost, digest, version)
        if old is not None and old.tensor is tensor:  # the same memory: what was handed out holds
            entry.exposed, entry._readonly = old.exposed, old._readonly
        if old is not None:
            self._unhold(name, old)
            if old.tensor is not tensor:
                self._drop(old)
        else:
            self._renamed.add(name)
        if digest is not None and self._remember:
            self._held[digest] = name
        self._stats["tensors"] += 1
        return old

    def switch(self, staged: list[Staged], names: list[str]) -> tuple[int, dict[str, bytes | None]]:
        """Publish every staged tensor at once; returns the new generation and the digest of every
        tensor in ``names`` as held right after the switch (None: not held, or no digest known)."""
        replaced = []
        with self._lock:
            for s in staged:  # memory changed in place must still be what its name holds
                now = self._entries.get(s.name) if s.charge is None else None
                if s.charge is None and (now is None or now.tensor is not s.tensor):
                    raise Replaced(f"{s.name!r} was replaced by another client during the update")
            costs = [s.charge._hand_over() if s.charge is not None else 0 for s in staged]
            for s, cost in zip(staged, costs, strict=True):
                changed = s.charge is None  # changed in place: the same memory, other bytes
                entry = (s.name, s.dtype, s.shape, s.nbytes, s.tensor, cost, s.digest)
                replaced.append(self._publish(*entry, changed=changed))
            self._generation += 1
            generation = self._generation
            for s in staged:
                self._switched[key_model(s.name)[0]] = generation
            digests = {}
            for n in names:
                e = self._entries.get(n)
                digests[n] = e.digest if e is not None else None
        del replaced  # replaced tensors' memory goes back once nobody holds it
        self._tidy()
        return generation, digests

    def generation_of(self, model: str) -> int:
        """What a reader of ``model`` compares: the generation of the last switch into it (1
        before any), so a switch into another model does not make its readers start over."""
        return self._switched.get(model, 1)

    @property
    def generation(self) -> int:
        """The store's generation: 1, and one more at each update switched in."""
        return self._generation

    def reading(self, *memories: Any) -> Any:
        """Hold off in-place changes of ``memories`` while their bytes are read (a READ sending
        them, a copy from them); a context manager. Waits while an in-place change claims any."""
        return self._gates.reading(*memories)

    def exclusive(self, memories: Mapping[str, Any]) -> Any:
        """Change ``memories`` (name -> the memory stored under it) in place, alone: their READs
        finish first, new ones wait; READs of other memory go on. A context manager; it raises
        GateTimeout, holding nothing, when that takes longer than ``gate_timeout``."""
        return self._gates.exclusive(memories)

    def reading_entries(self, names: Iterable[str] | None = None) -> Any:
        """A context manager giving the entries of ``names`` (None: all), their memory held off
        in-place changes until it ends (:meth:`Gates.reading_current
        <weightlift.remote.server.updates.gates.Gates.reading_current>`: what a switch meanwhile gives)."""
        names = None if names is None else list(names)
        return self._gates.reading_current(lambda: self.entries(names))

    def _charge_until_gone(self, tensor: Any, cost: int) -> None:
        # The charge goes back when the array does, not when the entry does: a reply in flight
        # or a caller may still hold it. The lock is held.
        try:
            weakref.finalize(tensor, self._uncharge, cost)
        except TypeError:  # an object without weak references: trust the entry's lifetime
            self._unowned[id(tensor)] = cost

    def _drop(self, entry: Entry) -> None:
        # the lock is held
        cost = self._unowned.pop(id(entry.tensor), None)
        if cost is not None:
            self._used -= cost

    def free(self, names: tuple[str, ...], *, holding: dict[str, Any] | None = None) -> int:
        """Drop the named tensors (``holding``: only those still holding that memory); how many."""
        gone: list[str] = []
        dropped = []  # released outside the lock's bookkeeping: their finalizers may run at once
        with self._lock:
            for n in names:
                if holding is not None and getattr(self._entries.get(n), "tensor", None) is not holding.get(n):
                    continue
                entry = self._entries.pop(n, None)
                if entry is not None:
                    self._renamed.add(n)
                    self._unhold(n, entry)
                    self._drop(entry)
                    dropped.append(entry)
                    gone.append(n)
        freed = len(dropped)
        del dropped
        self._tidy()
        if gone and self.on_free is not None:
            self.on_free(gone)
        return freed

    def _unhold(self, name: str, entry: Entry) -> None:
        # forget that entry (stored as name) holds its digest; the lock is held
        if entry.digest is not None and self._held.get(entry.digest) == name:
            del self._held[entry.digest]

    def get(self, name: str) -> Entry | None:
        with self._lock:
            return self._entries.get(name)

    def tensors(self, *, writable: bool = False, model: str = "") -> dict[str, Any]:
        """The complete tensors of ``model`` by name; never a partial one. numpy tensors come as
        read-only views unless ``writable``; a tensor handed out writable (a torch tensor always
        is) is marked exposed, and its digest is proven again before it is trusted."""
        with self._lock:
            if not model:
                return {n: _hand_out(e, writable) for n, e in self._entries.items() if not n.startswith(_MARK)}
            prefix = model_key(model, "")
            return {n[len(prefix) :]: _hand_out(e, writable) for n, e in self._entries.items() if n.startswith(prefix)}

    def model_keys(self, model: str) -> list[str]:
        """The keys of every tensor ``model`` holds."""
        with self._lock:
            if not model:
                return [n for n in self._entries if not n.startswith(_MARK)]
            prefix = model_key(model, "")
            return [n for n in self._entries if n.startswith(prefix)]

    def models(self) -> dict[str, tuple[int, int]]:
        """Each model held (the default one when it holds a tensor): (tensors, their data bytes)."""
        out: dict[str, list[int]] = {}
        with self._lock:
            for key, e in self._entries.items():
                m = key_model(key)[0] if key.startswith(_MARK) else ""
                tally = out.setdefault(m, [0, 0])
                tally[0] += 1
                tally[1] += e.nbytes
        return {m: (t[0], t[1]) for m, t in sorted(out.items())}

    def handed_out(self, entries: dict[str, Entry], *, writable: bool = False) -> dict[str, Any]:
        """``entries``' tensors as :meth:`tensors` gives them out."""
        with self._lock:
            return {name: _hand_out(entry, writable) for name, entry in entries.items()}

    def listing(self, after: str, limit: int, model: str = "") -> tuple[list[tuple[str, Entry]], bool]:
        """Up to ``limit`` entries of ``model`` whose names sort after ``after``, in name order
        (the names as the model knows them), and whether more follow them.

        The names come in order from :class:`_Order` (the names added or dropped since the last
        page taken in first), and the page's entries from the store by name: the store's lock
        is held for dictionary lookups only, never a comparison of names, so listing a large
        store never holds up another client's push or read, and a page costs its own length."""
        out: list[tuple[str, Entry]] = []
        prefix = model_key(model, "")
        if model:  # its names lie together, from its prefix on
            names_from, inclusive = prefix + after, not after
        else:  # named models' keys all sort before any name not beginning with NUL
            names_from, inclusive = (after, False) if after >= "\x01" else ("\x01", True)
        with self._order.lock:
            self._take_in()
            names = self._order.after(names_from, inclusive=inclusive)
            if model:
                names = itertools.takewhile(lambda n: n.startswith(prefix), names)
            while len(out) <= limit and (batch := list(itertools.islice(names, limit + 1 - len(out)))):
                with self._lock:  # a name dropped since it was taken in is passed over
                    found = [(n, self._entries.get(n)) for n in batch]
                out += [(n[len(prefix) :], e) for n, e in found if e is not None]
        return out[:limit], len(out) > limit

    def _take_in(self) -> None:
        """Bring :attr:`_order` up to the names held now (its lock held): the names changed
        since, or all of them where that is fewer comparisons."""
        with self._lock:
            renamed, self._renamed = self._renamed, set()
            whole = len(renamed) * 4 > self._order.size
            keys = list(self._entries) if whole else [n for n in renamed if n in self._entries]
        if whole:
            self._order.rebuild(keys)
        else:
            held = set(keys)
            self._order.apply([(n, n in held) for n in renamed])

    def _tidy(self) -> None:
        """Take in the changed names where they outnumber those held (no page was asked for
        since): what the set of them holds stays within the store's own size. Called without the
        store's lock."""
        if len(self._renamed) > max(4 * _Order._CHUNK, len(self._entries)):
            with self._order.lock:
                self._take_in()

    # -- proven digests --------------------------------------------------------------------------

    def holds(self, digest: bytes) -> bool:
        """Whether a stored tensor was proven to hold the bytes of ``digest``."""
        return digest in self._held

    def candidates(self, name: str, digest: bytes) -> list[tuple[str, Entry]]:
        """Entries that may hold ``digest``: the one stored as ``name``, then the one proven to."""
        with self._lock:
            mine = self._entries.get(name)
            other_name = self._held.get(digest)
            other = self._entries.get(other_name) if other_name is not None else None
        out = [(name, mine)] if mine is not None else []
        if other is not None and other_name is not None and other is not mine:
            out.append((other_name, other))
        return out

    def distrust(self, name: str, entry: Entry, digest: bytes) -> None:
        """``entry`` no longer hashes to ``digest`` (written since it arrived): forget it holds it."""
        with self._lock:
            entry.digest = None
            if self._held.get(digest) == name:
                del self._held[digest]

    def entries(self, names: Any = None) -> dict[str, Entry]:
        """The entries of ``names`` (None: every one), as they are at one instant."""
        with self._lock:
            if names is None:
                return dict(self._entries)
            return {n: self._entries[n] for n in names if n in self._entries}

    def held(self) -> tuple[int, int]:
        """(complete tensors held, their data bytes)."""
        with self._lock:
            return len(self._entries), sum(e.nbytes for e in self._entries.values())

    # -- counters ----------------------------------------------------------------------------------

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._stats)
        out["pooled"] = self.pool.reused if self.pool is not None else 0
        return out


def _hand_out(entry: Entry, writable: bool) -> Any:
    """An entry's tensor as the store gives it out: read-only where it can be, else marked
    exposed (its digest proven again before it is trusted). The store's lock is held."""
    ro = None if writable else entry.readonly()
    if ro is None:
        entry.exposed = True
        return entry.tensor
    return ro


# -- a sharded server's slices, assembled from REGIONs ------------------------------------------------

_MASK = (1 << 64) - 1
# Characters of names the open set (EXPECT) holds at most: the largest checkpoints' names come to a
# few MB, and without a bound a client repeating EXPECT would grow the server's memory without end.
MAX_SET_BYTES = 64 * 1024 * 1024
_BoxT = tuple[tuple[int, int], ...]


class RegionRefused(Exception):
    """A REGION that cannot be placed; the message names the tensor and why. Nothing was placed."""


class _Building:
    """A tensor whose slice is being covered: its declared dtype and unsharded shape, the local
    buffer, the boxes claimed so far and the bytes and sketch of those that landed."""

    __slots__ = (
        "dtype",
        "shape",
        "local",
        "nbytes",
        "raw",
        "elements",
        "charge",
        "segs",
        "boxes",
        "received",
        "sketch",
        "senders",
    )

    def __init__(self, dtype: str, shape: tuple[int, ...], local: tuple[int, ...], segs: Any, raw: Any, charge: Charge):
        item = dtype_info(dtype).bits // 8
        self.dtype, self.shape, self.local, self.segs, self.raw, self.charge = dtype, shape, local, segs, raw, charge
        self.nbytes = raw.nbytes
        self.elements = raw.view(f"<u{item}").reshape(local)  # the slice as unsigned elements of its width
        self.boxes: list[_BoxT] = []
        self.received = 0
        self.sketch = 0
        self.senders: set[int] = set()  # the open connections that claimed boxes of it (empty: abandoned)


def _overlaps(a: _BoxT, b: _BoxT) -> bool:
    return all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b, strict=True))


def _within(box: _BoxT, seg: Any) -> tuple[slice, ...]:
    """Where ``box`` (inside segment ``seg``: its box, split dimension, local start) lies in the slice."""
    sbox, dim, at = seg
    return tuple(
        slice(lo - s0 + (at if k == dim else 0), hi - s0 + (at if k == dim else 0))
        for k, ((lo, hi), (s0, _)) in enumerate(zip(box, sbox, strict=True))
    )


class Assembly:
    """The tensors of a sharded server (``Server(shard=...)``) as REGIONs cover their slices.

    Shared by every connection: boxes of one tensor may come from several senders. A box is
    claimed under the lock, after every check (it lies inside one segment of this server's slice,
    the tensor's dtype and shape are those of its earlier boxes, it overlaps no box claimed
    before), so two connections never write the same bytes, and a refused box changes nothing;
    its bytes land outside the lock. The tensor is complete once its received bytes reach the
    slice's size (the boxes being disjoint and inside the slice, it is then covered), and its
    entry, with the sketch of what landed, stays for SKETCH to report. A complete tensor is
    published at once, unless it belongs to the open set (EXPECT): those are held until the
    last of the set completes, then switched in together (:meth:`Store.switch`), so a reader sees
    all of the set's new versions or none. A held set (EXPECT HOLD, with an id) is not switched
    when complete but waits for :meth:`switch` of its id, or is dropped by it (ABORT): a
    coordinator switches the servers of one update together, or none of them.

    A build outlives a sender: another connection may send its missing boxes. Once every
    connection that claimed boxes of an incomplete tensor has closed (:meth:`leave`) it is
    abandoned, and a box it would refuse (one overlapping its claims, or of another dtype or
    shape) starts a fresh version instead: the abandoned one's charge is released and its claims
    forgotten, so a restarted sender is never locked out. Likewise the open set, once every
    connection that joined it (EXPECT) has closed: when a fresh version of one of its tensors
    begins (as above, or a box of a tensor it holds complete) the set is dropped, its held
    tensors released unpublished, and the names EXPECTed since by open connections form the new
    set. A tensor the store frees (FREE, REMOVE) is forgotten (:meth:`forget`). REMOVE of the
    default model is refused while a build or set has an open sender, and drops the abandoned
    ones (:meth:`remove`)."""

    def __init__(self, store: Store, slices: Slices, framework: str):
        self.store, self.slices, self.framework = store, slices, framework
        self._lock = threading.Lock()
        self._building: dict[str, _Building] = {}
        self._done: dict[str, SketchEntry] = {}
        self._geometry: dict[str, tuple[str, tuple[int, ...]]] = {}  # name -> dtype, unsharded shape
        self._set: set[str] = set()  # the open set's names (EXPECT), until it switches
        self._set_bytes = 0  # their characters, at most MAX_SET_BYTES
        self._held: dict[str, Staged] = {}  # complete tensors of the open set, held back
        self._joined: dict[int, set[str]] = {}  # open connection -> the names it EXPECTed into the set
        self._abandoned = False  # every connection that joined the open set has closed
        self._hold = False  # the open set waits for SWITCH once complete (EXPECT HOLD) ...
        self._set_id = 0  # ... naming this id
        self._switched = 0  # the id of the last held set switched in (a second SWITCH of it is refused)
        store.on_free = self.forget

    def leave(self, sender: int) -> None:
        """Connection ``sender`` closed: the builds and the set it alone kept alive are abandoned."""
        with self._lock:
            for b in self._building.values():
                b.senders.discard(sender)
            if self._joined.pop(sender, None) is not None and not self._joined and self._set:
                self._abandoned = True

    def _restart(self, name: str) -> None:
        """A fresh version of ``name`` begins: drop the abandoned set if it holds ``name`` (the
        lock held). The names EXPECTed since by open connections stay as the new set."""
        if self._abandoned and name in self._set:
            self._drop_set(set().union(*self._joined.values()))

    def _drop_set(self, keep: set[str]) -> None:
        # the lock is held: the open set's held tensors go unpublished; ``keep`` is the new set
        for st in self._held.values():
            if st.charge is not None:
                st.charge.release()
            e = self._done.get(st.name)
            if e is not None and not e.complete:
                del self._done[st.name]
        self._held.clear()
        self._set = keep
        self._set_bytes = sum(map(len, self._set))
        self._abandoned = False
        if not keep:
            self._hold, self._set_id = False, 0

    def _drop(self, name: str, b: _Building) -> None:
        # the lock is held; a box still landing in it (none: nobody that claimed one is open) counts nowhere
        del self._building[name]
        b.charge.release()

    def remove(self) -> str | None:
        """Before REMOVE of the default model: why not (a build or set with an open sender), else
        None, with every abandoned build and set dropped."""
        with self._lock:
            live = next((n for n, b in self._building.items() if b.senders), None)
            if live is not None:
                return f"tensor {live!r} is being assembled from REGIONs"
            if self._set and self._joined:
                return f"an EXPECT set of {len(self._set)} tensors is open"
            for n, b in list(self._building.items()):
                self._drop(n, b)
            self._drop_set(set())
            return None

    def forget(self, names: Iterable[str]) -> None:
        """The store freed ``names``: a complete one is no longer reported (SKETCH)."""
        with self._lock:
            for n in names:
                e = self._done.get(n)
                if e is not None and e.complete:
                    del self._done[n]
                    self._geometry.pop(n, None)

    def expect(self, names: tuple[str, ...], sender: int = 0, *, hold: bool = False, set_id: int = 0) -> None:
        """Add ``names`` (from connection ``sender``) to the open set (a new one if none is open);
        RegionRefused, nothing added, where the set would hold more than MAX_SET_BYTES of names,
        or where a set of another ``hold`` or ``set_id`` is open with a sender still connected (an
        abandoned one gives way). ``hold``: the complete set waits for :meth:`switch` of ``set_id``."""
        with self._lock:
            if self._set and (self._hold, self._set_id) != (hold, set_id):
                if not self._abandoned:
                    raise RegionRefused(
                        f"EXPECT of set {set_id}{' (held)' if hold else ''}: "
                        f"set {self._set_id}{' (held)' if self._hold else ''} is open"
                    )
                self._drop_set(set())
                self._joined.clear()
            if not self._set:
                self._hold, self._set_id = hold, set_id
            new = set(names) - self._set
            size = sum(map(len, new))
            if self._set_bytes + size > MAX_SET_BYTES:
                raise RegionRefused(
                    f"EXPECT of {len(names)} names: the open set would hold more than {MAX_SET_BYTES} characters of names"
                )
            self._set |= new
            self._set_bytes += size
            self._joined.setdefault(sender, set()).update(names)
            ready = self._ready()
        if ready:
            self._switch(ready)

    def _ready(self) -> list[Staged]:
        """The open set's tensors, taken out, once every one is complete (the lock held); a held
        set (EXPECT HOLD) waits for :meth:`switch`."""
        if self._hold or not self._set or not self._set <= self._held.keys():
            return []
        return self._take()

    def _take(self) -> list[Staged]:
        # the lock is held: the complete open set, taken out to be switched in
        staged = [self._held.pop(n) for n in sorted(self._set)]
        self._set, self._set_bytes, self._abandoned = set(), 0, False
        self._hold, self._set_id = False, 0
        self._joined.clear()
        return staged

    def _switch(self, staged: list[Staged]) -> int:
        generation = self.store.switch(staged, [])[0]
        with self._lock:
            for st in staged:
                e = self._done.get(st.name)
                if e is not None and not e.complete:
                    self._done[st.name] = SketchEntry(e.name, True, e.received, e.needed, e.sketch)
        return generation

    def set_state(self) -> tuple[int, int]:
        """The open set as SKETCH_REPLY states it: (SET_NONE, SET_OPEN or SET_HELD, its id)."""
        with self._lock:
            if not self._set:
                return SketchReply.SET_NONE, 0
            held = self._hold and self._set <= self._held.keys()
            return (SketchReply.SET_HELD if held else SketchReply.SET_OPEN), self._set_id

    def switch(self, set_id: int, *, abort: bool = False) -> tuple[int, int]:
        """Switch the held set ``set_id`` in at once: (its tensors, the store's generation after).
        ``abort``: drop it instead, its complete tensors released unpublished and its builds
        forgotten, so a box still to come starts afresh rather than showing alone: (its tensors,
        0). RegionRefused, nothing changed, where no held set of that id is open, or (switching)
        one of its tensors is incomplete or it was switched already."""
        with self._lock:
            if not (self._set and self._hold and self._set_id == set_id):
                if not abort and set_id == self._switched:
                    raise RegionRefused(f"SWITCH of set {set_id}: it was switched in already")
                now = f"set {self._set_id}{' (held)' if self._hold else ''} is open" if self._set else "no set is open"
                raise RegionRefused(f"{'ABORT' if abort else 'SWITCH'} of set {set_id}: no such held set ({now})")
            count = len(self._set)
            if abort:
                for n in self._set:
                    b = self._building.get(n)
                    if b is not None:
                        self._drop(n, b)
                self._drop_set(set())
                self._joined.clear()
                return count, 0
            missing = sorted(self._set - self._held.keys())
            if missing:
                raise RegionRefused(
                    f"SWITCH of set {set_id}: {len(missing)} of its {count} tensors incomplete, "
                    f"{', '.join(repr(n) for n in missing[:8])}"
                )
            self._switched = set_id
            staged = self._take()
        return count, self._switch(staged)

    def _begin(self, name: str, dtype: str, shape: tuple[int, ...]) -> _Building:
        bits = dtype_info(dtype).bits
        if bits % 8 or bits // 8 not in (1, 2, 4, 8):
            raise RegionRefused(f"tensor {name!r}: {dtype} elements cannot be placed as regions")
        try:
            segs = self.slices.segments(name, dtype, shape)
            local = self.slices.local_shape(name, dtype, shape)
        except WeightliftError as e:
            raise RegionRefused(f"tensor {name!r}: {e}") from None
        nbytes = byte_length(dtype, local)
        try:
            charge = self.store.charge(entry_cost(name, nbytes, len(local)), nbytes)
        except MemoryFull as e:
            raise RegionRefused(f"tensor {name!r}: {e}") from None
        raw = self.store.take_host(nbytes)[0] if self.store.pool is not None else np.empty(nbytes, np.uint8)
        return _Building(dtype, shape, local, segs, raw, charge)

    def claim(
        self, name: str, dtype: str, shape: tuple[int, ...], box: _BoxT, sender: int = 0
    ) -> tuple[_Building, Any]:
        """Check and claim ``box`` of ``name`` for connection ``sender``: (the tensor, the box's
        place in its slice as a view of unsigned elements). RegionRefused, with nothing claimed,
        where it cannot go."""
        with self._lock:
            b = self._building.get(name)
            if b is not None and not b.senders and self._refuses(b, dtype, shape, box):
                self._drop(name, b)  # abandoned: this box begins a fresh version
                self._restart(name)
                b = None
            if b is None:
                if name in self._held:
                    self._restart(name)  # a second version of a tensor the abandoned set holds
                b = self._begin(name, dtype, shape)
                self._building[name] = b
            elif (b.dtype, b.shape) != (dtype, shape):
                raise RegionRefused(
                    f"tensor {name!r}: a region of {dtype} {list(shape)}, but its slice is of {b.dtype} {list(b.shape)}"
                )
            try:
                dest = self._place(name, b, box)
            except RegionRefused:
                if not b.boxes and not b.senders:  # a refused first box leaves no build behind
                    self._drop(name, b)
                raise
            b.senders.add(sender)
            return b, dest

    def _place(self, name: str, b: _Building, box: _BoxT) -> Any:
        """Where ``box`` goes in ``b``'s slice, claimed (the lock held); RegionRefused where it cannot go."""
        empty = any(hi <= lo for lo, hi in box)
        if empty:
            if b.segs:
                raise RegionRefused(f"tensor {name!r}: an empty region, but this server's slice is not empty")
            dest = b.elements
        else:
            seg = next(
                (
                    sg
                    for sg in b.segs
                    if all(s0 <= lo and hi <= s1 for (lo, hi), (s0, s1) in zip(box, sg[0], strict=True))
                ),
                None,
            )
            if seg is None:
                raise RegionRefused(
                    f"tensor {name!r}: box {[list(x) for x in box]} is not inside this server's slice "
                    f"{[[list(x) for x in sg[0]] for sg in b.segs]} (rank {self.slices.rank})"
                )
            clash = next((o for o in b.boxes if _overlaps(o, box)), None)
            if clash is not None:
                raise RegionRefused(
                    f"tensor {name!r}: box {[list(x) for x in box]} overlaps box {[list(x) for x in clash]} received before"
                )
            dest = b.elements[_within(box, seg)]
            b.boxes.append(box)
        return dest

    @staticmethod
    def _refuses(b: _Building, dtype: str, shape: tuple[int, ...], box: _BoxT) -> bool:
        """Whether ``b`` refuses a box for what it already holds (its dtype, shape, claims)."""
        return (b.dtype, b.shape) != (dtype, shape) or any(_overlaps(o, box) for o in b.boxes)

    def release(self, name: str, b: _Building, box: _BoxT) -> None:
        """Give back a claimed box whose bytes never landed (the connection failed inside it)."""
        with self._lock:
            if box in b.boxes:
                b.boxes.remove(box)

    def landed(self, name: str, b: _Building, nbytes: int, sketch: int) -> bool:
        """A claimed box's bytes are in place; publishes the tensor when its slice is covered."""
        with self._lock:
            b.received += nbytes
            b.sketch = (b.sketch + sketch) & _MASK
            if b.received < b.nbytes or self._building.get(name) is not b:
                return False
            del self._building[name]
            self._geometry[name] = (b.dtype, b.shape)
            held = name in self._set
            self._done[name] = SketchEntry(name, not held, b.received, b.nbytes, b.sketch)
            tensor = view_as(b.raw, b.dtype, b.local, self.framework)
            ready: list[Staged] = []
            if held:
                old = self._held.pop(name, None)
                if old is not None and old.charge is not None:
                    old.charge.release()  # a newer version of it came before the set switched
                self._held[name] = Staged(name, b.dtype, b.local, b.nbytes, tensor, b.charge, None)
                ready = self._ready()
        if ready:
            self._switch(ready)
        elif not held:
            self.store.publish(name, b.dtype, b.local, b.nbytes, tensor, b.charge, None)
        return True

    def resketch(self, e: SketchEntry) -> SketchEntry:
        """``e`` with the sketch of its tensor as its memory holds it now (a complete one still held)."""
        with self._lock:
            geometry = self._geometry.get(e.name)
        entry = self.store.get(e.name)
        if (
            not e.complete
            or geometry is None
            or entry is None
            or entry.shape != self.slices.local_shape(e.name, *geometry)
        ):
            return e
        dtype, shape = geometry
        flat = (
            entry.tensor.reshape(-1).view(np.uint8) if isinstance(entry.tensor, np.ndarray) else as_bytes(entry.tensor)
        )
        local = flat.view(f"<u{dtype_info(dtype).bits // 8}").reshape(entry.shape)
        total = 0
        for seg in self.slices.segments(e.name, dtype, shape):
            total += self.slices.sketch(local[_within(seg[0], seg)], shape, seg[0], e.name)
        return SketchEntry(e.name, True, e.received, e.needed, total & _MASK)

    def status(self, names: tuple[str, ...]) -> list[SketchEntry]:
        """The entry of each of ``names`` the server has seen REGIONs of (none named: all of them)."""
        with self._lock:
            wanted = names or tuple(dict.fromkeys([*self._done, *self._building]))
            out = []
            for n in wanted:
                b = self._building.get(n)
                if b is not None:
                    out.append(SketchEntry(n, False, b.received, b.nbytes, b.sketch))
                elif n in self._done:
                    out.append(self._done[n])
            return out
