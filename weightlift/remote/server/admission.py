"""Admission: who may hold a connection, and what an admitted connection is given.

One thread accepts, one thread serves each connection.
An :class:`Acceptor` admits each accepted stream to a slot (:class:`Slots`) or refuses it at once
with a best-effort ERROR, starts the connection's thread, and keeps the streams and threads it
must end and wait for when the server closes. When the process runs out of descriptors it says
so in the log and uses one descriptor kept spare to tell the waiting client why.

:class:`Slots` decide who may hold a connection: slots for connections still in their handshake, slots for
authenticated (READY) ones, and a cap per peer address.

A peer without the token can only ever hold handshake slots, which are few and separate from the
READY slots, so it never takes the slot a client works in. When every handshake slot is taken, a
new connection evicts the oldest one still in its handshake (as sshd's MaxStartups drops
early): a legitimate client finishes its handshake in a round trip or two, a peer holding slots
open holds them for the whole handshake timeout, so it is that peer whose slots go. The cap per
address keeps one host from holding every slot of either kind; it counts a host, not an address
string: every loopback address (127.0.0.0/8, ::1) is this machine, and one IPv6 /64 is one site
(a host picks any address in its /64), so each of those counts as one address
(:func:`address_group`).

:class:`Context` is what a connection may know of its server: the settings, the store, the disk
cache, the reports. A connection is given this object instead of the :class:`~weightlift.remote.server.Server`
itself, so the seam between them is these fields and nothing private: the settings are one
frozen :class:`~weightlift.remote.server.config.ServerConfig`, tensors and memory change only
through the store, and the disk cache can only be switched off.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from weightlift.errors import CacheError, TransportError
from weightlift.memory.targets import Target, target_for
from weightlift.remote.protocol import Error, ErrorCode, send
from weightlift.remote.server.cache import TensorCache
from weightlift.remote.server.config import ServerConfig
from weightlift.remote.server.store import Assembly, MemoryFull, Store
from weightlift.remote.server.updates.switch import Units
from weightlift.remote.transport import Listener, Stream

__all__ = [
    "Acceptor",
    "Slots",
    "Slot",
    "address_group",
    "IPV6_GROUP_PREFIX",
    "Context",
    "RequestError",
    "PinBudget",
    "MAX_PINNED",
]

_log = logging.getLogger("weightlift.remote.server.server")
# one line per connection, key=value, for an operator's log shipper; never per frame or tensor
_conn_log = logging.getLogger("weightlift.server.connection")


def _spare_descriptor() -> int:
    try:
        return os.open(os.devnull, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return -1


class Acceptor:
    """Serves the connections ``listener`` accepts, under ``slots``, until :meth:`close`: each on
    its own thread, through ``serve(stream, slot)`` (the server runs a connection there)."""

    def __init__(self, ctx: Context, slots: Slots, serve: Callable[[Stream, Slot], None]):
        self._ctx = ctx
        self._serve = serve
        self.slots = slots
        self._lock = threading.Lock()  # guards the connections and their threads
        self._conns: set[Stream] = set()
        self._threads: set[threading.Thread] = set()
        self.closing = threading.Event()
        self._listener: Listener | None = None
        self._spare_fd = _spare_descriptor()  # given up to refuse a client when descriptors run out
        self._emfile_logged = -1e9

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def loop(self, listener: Listener) -> None:
        """Accept until :meth:`close`."""
        self._listener = listener
        while not self.closing.is_set():
            try:
                stream = self._listener.accept(timeout=0.2)
            except TransportError as e:
                if self.closing.is_set():
                    return
                if getattr(e.__context__, "errno", None) in (errno.EMFILE, errno.ENFILE):
                    self._out_of_descriptors(e)
                time.sleep(0.05)  # back off rather than spin
                continue
            if stream is None:
                continue
            slot = self.slots.admit(stream.peer.rpartition(":")[0], stream.shutdown)
            if isinstance(slot, str):
                self._refuse(stream, slot)
                continue
            with self._lock:
                if self.closing.is_set():
                    slot.release()
                    stream.close()
                    return
                self._conns.add(stream)
                self._ctx.store.count("connections")
                t = threading.Thread(
                    target=self._serve_one, args=(stream, slot), name=f"weightlift-conn {stream.peer}", daemon=True
                )
                self._threads.add(t)
                t.start()  # under the lock: close() never sees a thread it cannot join yet

    def _out_of_descriptors(self, e: TransportError) -> None:
        """The process has no descriptor left for a new connection: say so in the log, and use
        the one kept spare to accept the waiting client and tell it why, instead of leaving it
        hanging in the backlog."""
        now = time.monotonic()
        if now - self._emfile_logged > 10.0:
            self._emfile_logged = now
            _log.warning(
                "weightlift server: out of file descriptors (%s); refusing new connections "
                "until some close (raise the limit with `ulimit -n`)",
                e,
            )
        if self._spare_fd < 0 or self._listener is None:
            return
        os.close(self._spare_fd)
        self._spare_fd = -1
        try:
            stream = self._listener.accept(timeout=0)
            if stream is not None:
                self._refuse(stream, "the server is out of file descriptors; try again later")
        except TransportError:
            pass
        finally:
            self._spare_fd = _spare_descriptor()

    def _refuse(self, stream: Stream, why: str) -> None:
        """Close a connection over a limit at once, with a best-effort ERROR that cannot block."""
        _log.info("weightlift server: refused %s: %s", stream.peer, why)
        _conn_log.warning("event=refused peer=%s reason=%s", stream.peer, json.dumps(why))
        try:
            stream.set_timeout(0.0)
            stream.send_parts([send(Error(ErrorCode.LIMIT, why), minor=0)])
            stream.shutdown_write()
            stream.recv_into(memoryview(bytearray(256)))  # a HELLO already here: unread input would reset the reply
        except (TransportError, OSError):
            pass
        stream.close()

    def _serve_one(self, stream: Stream, slot: Slot) -> None:
        t0 = time.monotonic()
        _conn_log.info("event=connection_open peer=%s", stream.peer)
        try:
            self._serve(stream, slot)
        except Exception:  # a last resort: run() answers what it can; nothing may kill the server
            _log.exception("weightlift server: connection %s failed", stream.peer)
        finally:
            _conn_log.info("event=connection_close peer=%s seconds=%.3f", stream.peer, time.monotonic() - t0)
            stream.close()
            slot.release()
            with self._lock:
                self._conns.discard(stream)
                self._threads.discard(threading.current_thread())

    def close(self) -> None:
        """End every connection (their partial tensors are dropped) and wait for their threads."""
        self.closing.set()
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for s in conns:
            s.shutdown()
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=10)
        if self._spare_fd >= 0:
            os.close(self._spare_fd)
            self._spare_fd = -1


IPV6_GROUP_PREFIX = 64  # IPv6 peers in one network of this prefix length count as one address


def address_group(address: str) -> str:
    """What the cap per address counts ``address`` as: "loopback" for any loopback address
    (127.0.0.0/8, ::1, and their IPv4-mapped forms), the /64 network of an IPv6 address, else
    the address itself (IPv4, or a name that is no IP address)."""
    try:
        ip = ipaddress.ip_address(address.strip("[]").partition("%")[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((ip, IPV6_GROUP_PREFIX), strict=False))
    return str(ip)


class Slot:
    """One accepted connection's place: in the handshake until :meth:`ready`, then READY."""

    __slots__ = ("_slots", "address", "evict", "is_ready", "_live")

    def __init__(self, slots: Slots, address: str, evict: Callable[[], None]):
        self._slots = slots
        self.address = address  # the group it counts in (address_group)
        self.evict = evict  # ends the connection (its thread then releases the slot)
        self.is_ready = False
        self._live = True

    def ready(self) -> str | None:
        """Move to a READY slot; the reason it cannot (every READY slot is taken), or None."""
        return self._slots._ready(self)

    def release(self) -> None:
        """The connection ended; idempotent."""
        self._slots._release(self)


class Slots:
    def __init__(self, *, ready: int, handshakes: int, per_address: int):
        self.max_ready, self.max_handshakes, self.max_per_address = ready, handshakes, per_address
        self._lock = threading.Lock()
        self.n_ready = 0
        self.n_handshakes = 0
        self._per_address: dict[str, int] = {}
        self._handshaking: dict[Slot, None] = {}  # oldest first; evicted ones stay until their thread releases them
        self.evicted = 0

    def admit(self, address: str, evict: Callable[[], None]) -> Slot | str:
        """A handshake slot for a connection from ``address``, or why there is none; the oldest
        connection still in its handshake is evicted (``evict`` ends it) if that makes room."""
        victim: Slot | None = None
        group = address_group(address)
        with self._lock:
            if self.n_ready >= self.max_ready:
                return f"the server is serving its limit of {self.max_ready} connections"
            if self._per_address.get(group, 0) >= self.max_per_address:
                where = address if group == address else f"{address} (counted as {group})"
                return f"the server is serving its limit of {self.max_per_address} connections from {where}"
            if self.n_handshakes >= self.max_handshakes:
                victim = next(iter(self._handshaking), None)
                if victim is None:
                    return f"the server has {self.max_handshakes} connections in their handshake; try again"
                self._forget(victim)
                self.evicted += 1
            slot = Slot(self, group, evict)
            self.n_handshakes += 1
            self._per_address[group] = self._per_address.get(group, 0) + 1
            self._handshaking[slot] = None
        if victim is not None:
            victim.evict()
        return slot

    def _forget(self, slot: Slot) -> None:
        # the lock is held; the slot's counts go, whatever its connection still does
        slot._live = False
        self._handshaking.pop(slot, None)
        if slot.is_ready:
            self.n_ready -= 1
        else:
            self.n_handshakes -= 1
        left = self._per_address[slot.address] - 1
        if left:
            self._per_address[slot.address] = left
        else:
            del self._per_address[slot.address]

    def _ready(self, slot: Slot) -> str | None:
        with self._lock:
            if not slot._live:
                return "the connection was evicted during its handshake"
            if slot.is_ready:
                return None
            if self.n_ready >= self.max_ready:
                return f"the server is serving its limit of {self.max_ready} connections"
            self._handshaking.pop(slot, None)
            self.n_handshakes -= 1
            self.n_ready += 1
            slot.is_ready = True
        return None

    def _release(self, slot: Slot) -> None:
        with self._lock:
            if slot._live:
                self._forget(slot)


#: Host memory all of a server's connections together may pin for their staging (a CUDA
#: connection pins two 64 MiB upload slots): 16 such connections at once. Pinned memory cannot be
#: paged out, and on a CUDA server max_memory counts the device, so this bounds the host's share.
MAX_PINNED = 16 * 128 * 1024 * 1024


class RequestError(Exception):
    """A request failed; its message is reported at the next barrier."""


class PinBudget:
    """The server-wide count of pinned host bytes, capped at ``limit``. Thread-safe."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Count ``n`` more pinned bytes; MemoryFull (from the store's tree) if they do not fit."""
        with self._lock:
            if self.used + n > self.limit:
                raise MemoryFull(
                    f"{n} bytes of pinned host staging would exceed the {self.limit}-byte cap on pinned "
                    f"host memory ({self.used} pinned by other connections)"
                )
            self.used += n

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


class Context:
    """``host_target`` is the target connections to host memory share; None: each connection
    makes its own with ``new_target`` (a CUDA target, at its first ALLOC). ``new_target``
    defaults to the config's device and framework."""

    def __init__(
        self,
        config: ServerConfig,
        store: Store,
        cache: TensorCache | None,
        *,
        host_target: Target | None,
        new_target: Callable[[], Target] | None = None,
    ):
        self.config = config
        self.store = store
        self.cache = cache
        self.host_target = host_target
        self.new_target = new_target or (lambda: target_for(config.placement))
        self.reports: deque[dict[str, Any]] = deque(maxlen=64)  # profiles of recently closed connections
        self.pins = PinBudget(MAX_PINNED)
        # a sharded server's tensors in assembly, shared by all connections (REGIONs of several senders)
        slices = config.slices
        self.assembly = Assembly(store, slices, config.framework) if slices is not None else None
        self.units = Units()  # the updates open on the server, for JOIN, REMOVE and STATS
        # the server's figures for a STATS request (set by the server once it has them all)
        self.stats: Callable[[], Mapping[str, int]] = store.stats
        self.stopping = threading.Event()  # set once the server is closing: its connections end
        self._lock = threading.Lock()

    @property
    def pooled(self) -> bool:
        """Whether tensors land in the store's pooled host memory (a host target with memcpy fills)."""
        return self.store.pool is not None

    def disable_cache(self, exc: CacheError) -> None:
        """Stop using the disk cache (the disk is full or failing); warns once."""
        with self._lock:
            was, self.cache = self.cache, None
        if was is not None:
            warnings.warn(f"tensor cache disabled: {exc}", RuntimeWarning, stacklevel=3)
