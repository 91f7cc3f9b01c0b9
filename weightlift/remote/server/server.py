"""The tensor server: receives pushed tensors into host or device memory and serves them back.

Theory of operation: one thread accepts connections and one thread serves each. A connection's
protocol state (decoder, session, tensors in flight, errors since the last barrier, profiler) is
its own (:mod:`.connection`, :mod:`.receive`); the store of complete tensors and the memory
account are shared, and only :mod:`.store` changes them. A connection sees its server through a
:class:`~.admission.Context`: settings, the store, the disk cache, nothing private.

A WRITE is taken off the socket as a stream: the header through the decoder, then the payload
``recv_into`` straight into the destination tensor's memory when the target takes a plain
memcpy (host numpy / torch CPU), or into one staging buffer per connection (allocated once,
never zero-filled; a pinned slot of the CUDA target) that the target's fill step then uploads.
No buffer the size of a tensor is ever made for the transfer. With a cache folder, a tensor the
client named by digest is hashed into the cache as its bytes arrive, piece by piece while the
piece is still hot, and the digest check at the end doubles as proof that every byte arrived
intact.

A tensor becomes visible (``tensors()``, LIST, READ) only when all its bytes are in; the tensors
a connection had in flight when it ended are dropped. A malformed frame gets an ERROR reply and
the connection is closed; everything else that goes wrong with a request is collected and
reported at the next BARRIER, so a client never waits for a reply per tensor.

Every byte a peer sends is hostile until checked, and what a peer can make the server hold is
bounded: at most MAX_CONNECTIONS connections (more are refused at accept, no thread made); until
a connection is READY its frames are capped at MAX_HANDSHAKE_FRAME and it must get there within
the handshake timeout; nothing is allocated for a connection (CUDA staging included) before its
first ALLOC; destination memory is faulted in piece by piece as payload bytes arrive, not when
a WRITE header announces them; every stored or pending tensor is charged its bytes plus its
name and ENTRY_OVERHEAD against max_memory; errors kept per connection, the ranges a tensor's
WRITEs cover, and remembered failed ids are all capped. A failure inside a connection, however
unexpected, is answered with an ERROR and ends that connection only.

A frame, payload included, must arrive within ``io_timeout`` plus its size over
``min_frame_rate``; every loopback address counts as one peer address, and so does an IPv6 /64,
for ``max_per_address``. A CUDA connection's pinned staging and any connection's staging buffer
are charged to max_memory too.

``WEIGHTLIFT_LOAD_OPT=0`` (read when the Server is made, into its config) receives each WRITE into
a fresh buffer, charged while it lives, and copies it out, the naive way, for A/B measurements
(:class:`~.receive.NaivePath`); each connection picks its receive path once, from the config.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from weightlift.errors import StateError
from weightlift.memory.pool import HostPool
from weightlift.memory.targets import as_bytes, empty_device_cache
from weightlift.options import Array
from weightlift.remote.server.admission import Acceptor, Context, Slot, Slots
from weightlift.remote.server.cache import TensorCache
from weightlift.remote.server.cache.behind import sealed_since
from weightlift.remote.server.cache.hashing import set_digest, tensor_digest
from weightlift.remote.server.config import (
    HANDSHAKE_TIMEOUT,
    IDLE_TIMEOUT,
    IO_TIMEOUT,
    MAX_CONNECTIONS,
    MAX_HANDSHAKES,
    MAX_PER_ADDRESS,
    MIN_FRAME_RATE,
    ServerConfig,
    ServerOptions,
    configure,
    default_max_memory,
    is_loopback,
)
from weightlift.remote.server.connection import Connection
from weightlift.remote.server.stats import ServerStats
from weightlift.remote.server.store import ENTRY_OVERHEAD, Store, key_model, model_key
from weightlift.remote.transport import Listener, Stream

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "Server",
    "ServerConfig",
    "ServerOptions",
    "ServerStats",
    "is_loopback",
    "default_max_memory",
    "ENTRY_OVERHEAD",
    "MAX_CONNECTIONS",
    "MAX_HANDSHAKES",
    "MAX_PER_ADDRESS",
    "HANDSHAKE_TIMEOUT",
    "IDLE_TIMEOUT",
    "IO_TIMEOUT",
    "MIN_FRAME_RATE",
]


class Server:
    """A tensor server. ``start()`` serves on a background thread; ``serve_forever()`` in this one.

    The options after ``host`` and ``port`` are keyword-only, listed once in
    :class:`~weightlift.remote.server.config.ServerOptions` and checked into a
    :class:`~weightlift.remote.server.config.ServerConfig` (``self.config``).

    Binds 127.0.0.1 by default; any other address needs a ``token`` (clients must prove they hold it) or
    ``insecure=True``. ``max_memory`` caps the bytes allocated across all clients, each tensor counted as its
    bytes plus its name plus ENTRY_OVERHEAD; None (the default) means :func:`default_max_memory`: 90 % of
    physical RAM for ``cpu``, the device's total memory for ``cuda``. ``max_connections`` READY (authenticated)
    connections are served at once (more are closed at accept); connections still in their handshake take one of
    ``max_handshakes`` slots of their own, so peers without the token never lock authenticated clients out; one
    peer address holds at most ``max_per_address`` connections of both kinds. Each connection must finish HELLO
    (and AUTH) within ``handshake_timeout`` seconds or is closed. After that a connection that sends no request
    for ``idle_timeout`` seconds is closed, and so is one that stalls for ``io_timeout`` seconds inside a frame
    or payload, or while a reply is sent (None: no limit), and one whose frame of N bytes (payload included) has
    not arrived within ``io_timeout + N / min_frame_rate`` seconds of its first byte (``min_frame_rate`` in
    bytes per second, default :data:`MIN_FRAME_RATE`; None: no such deadline). For ``max_per_address`` the whole
    loopback range (127.0.0.0/8, ::1) is one address, and so is an IPv6 /64. An in-place commit waits for the READs
    sending what it changes at most ``io_timeout``, and at most :data:`~.config.GATE_TIMEOUT`, then is refused.
    ``cache_max_bytes`` caps the disk cache, counted in whole 4 KiB blocks per entry, the least recently used
    evicted first; "auto" (the default): half the space the cache's file system had free for it when the server
    started; None: no cap.
    ``tls``: a server ``ssl.SSLContext`` (:func:`~weightlift.remote.transport.server_tls_context`): every
    connection speaks TLS, its handshake bounded by ``handshake_timeout``. TLS gives confidentiality; clients
    are still authenticated by the token.
    ``peer_token`` and ``peer_tls`` (a client ``ssl.SSLContext``): what this server presents to the next
    server of a relayed push (:mod:`~weightlift.remote.server.relay`); ``peer_token`` defaults to ``token``
    (a fleet's servers share one). Neither ever crosses the wire: a client names the hops, never a secret.
    ``protocol_minor`` makes the server speak an older minor version (compatibility tests).
    ``profile`` None reads WEIGHTLIFT_LOADPROF; with it on, each connection's report is printed to stderr when
    the connection closes. ``reserve`` (host memory only) faults that many bytes in on a background thread from
    ``start()`` on, while the process does its other start-up work, so the first push lands in memory already
    backed; the reserve counts against ``max_memory`` and gives way to tensors that need the room.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **options: Unpack[ServerOptions]) -> None:
        config, host_target = configure(host, port, options)
        self.config = config
        self.host, self.port = config.host, config.port
        self.device, self.framework = config.device, config.framework
        self._slots = Slots(
            ready=config.max_connections, handshakes=config.max_handshakes, per_address=config.max_per_address
        )
        # touched host memory of released tensors, reused for new ones (a weight update)
        pool = HostPool() if host_target is not None and host_target.memcpy_ok else None
        remember, gate = config.cache_dir is not None, config.gate_timeout  # gate: a commit's wait for readers
        store = Store(max_memory=config.max_memory, pool=pool, remember_digests=remember, gate_timeout=gate)
        cache = (
            TensorCache(config.cache_dir, max_bytes=config.cache_max_bytes) if config.cache_dir is not None else None
        )
        self._ctx = Context(config, store, cache, host_target=host_target)
        self._store = store
        self._acceptor = Acceptor(self._ctx, self._slots, self._serve)
        self._ctx.stats = self.stats
        self._listener: Listener | None = None
        self._accept_thread: threading.Thread | None = None

    def _serve(self, stream: Stream, slot: Slot) -> None:
        """Serve one admitted connection on the calling thread until it ends."""
        Connection(self._ctx, stream, slot=slot).run()

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); OptionError before start()."""
        if self._listener is None:
            raise StateError("the server is not started")
        return self._listener.address

    def _bind(self) -> None:
        if self._acceptor.closing.is_set():
            raise StateError("the server is closed")
        if self._listener is None:
            self._listener = self.config.backend.listen(self.host, self.port)

    def bind(self) -> tuple[str, int]:
        """Bind without serving yet (to print the address first); returns the bound (host, port)."""
        self._bind()
        return self.address

    def start(self) -> tuple[str, int]:
        """Bind and serve on a background thread; returns the bound (host, port). Idempotent."""
        self._bind()
        self._start_reserve()
        if self._accept_thread is None:
            self._accept_thread = threading.Thread(target=self._accept, name="weightlift-accept", daemon=True)
            self._accept_thread.start()
        return self.address

    def _start_reserve(self) -> None:
        pool = self._store.pool
        if self.config.reserve and pool is not None:
            pool.reserve(self.config.reserve)  # once: later calls are no-ops

    @property
    def reserved(self) -> tuple[int, int]:
        """(bytes of the reserve faulted in so far, bytes reserved); (0, 0) without one."""
        pool = self._store.pool
        return pool.reserved if pool is not None else (0, 0)

    def _accept(self) -> None:
        assert self._listener is not None
        self._acceptor.loop(self._listener)

    def serve_forever(self) -> None:
        """Serve in the calling thread until close() (from another thread) or Ctrl-C, then close."""
        self._bind()
        self._start_reserve()
        try:
            if self._accept_thread is not None:  # already serving in the background: just wait
                while not self._acceptor.closing.wait(0.5):
                    pass
            else:
                self._accept()
        finally:
            self.close()

    def close(self) -> None:
        """Stop accepting, end every connection (their partial tensors and open pushes are
        dropped, never shown), and wait."""
        self._ctx.stopping.set()
        self._acceptor.closing.set()
        if self._listener is not None:
            self._listener.close()
        self._acceptor.close()
        if self._accept_thread is not None and self._accept_thread is not threading.current_thread():
            self._accept_thread.join(timeout=10)
        if self._ctx.cache is not None:
            self._ctx.cache.close()  # the entries still queued to be written behind are written
        if self._store.pool is not None:
            self._store.pool.close()  # idle memory goes back; tensors still held keep theirs

    stop = close

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the server holds -------------------------------------------------------------

    def tensors(self, *, writable: bool = False, model: str | None = None) -> dict[str, Array]:
        """The complete tensors of ``model`` (None: the default model, where a client that names
        none pushes) by name (numpy arrays or torch tensors); never a partial one, and nothing of
        a push still in flight.

        numpy arrays come as read-only views: what the server holds is its proof of what was
        pushed, and a digest-named push of the same bytes then finds them in memory without
        hashing them again. ``writable=True`` hands out the arrays themselves, for a process that
        changes its weights in place; those tensors (and torch tensors, which have no read-only
        form) are hashed again before a later push trusts them. The dictionary is taken at one
        instant: an update switched in (a client's push from memory) is in it whole or not at
        all; an in-place update changes the arrays handed out earlier at its switch."""
        return self._store.tensors(writable=writable, model=model or "")

    @contextmanager
    def reading(self, names: Iterable[str] | None = None) -> Iterator[dict[str, Array]]:
        """The tensors of ``names`` (None: all of the default model's) as :meth:`tensors` gives them,
        held off in-place updates until the block ends, so a caller copying them out gets one
        version of each. Keep it short: an in-place update waits for it (at most
        ``config.gate_timeout``, then it is refused). A block may take tensors again inside it, in
        the same thread, without waiting for that update."""
        with self._store.reading_entries(names) as entries:
            if names is None:  # named models' tensors are kept under NUL-marked keys: not these
                entries = {n: e for n, e in entries.items() if not key_model(n)[0]}
            yield self._store.handed_out(entries)

    def free(self, names: Iterable[str] | None = None) -> int:
        """Drop the named tensors (None: every one held), as a client's FREE does; returns how
        many were held. Their memory goes back to the pool (:meth:`trim` gives it to the system)
        once nobody references them; a disk cache keeps what it holds, so a later push of the
        same bytes is filled from it."""
        held = tuple(self._store.entries(None)) if names is None else tuple(names)
        return self._store.free(held)

    def cache_held(self, names: Iterable[str] | None = None) -> int:
        """Queue each named tensor (None: every one held) that the disk cache lacks to be written
        there behind (:meth:`TensorCache.flush` waits for it): those that arrived other than
        whole and named by digest (as changes to a base, or unnamed). Only host tensors with a
        proven digest; one handed out writable since is hashed again as it is written and kept
        only if it still matches. Returns how many were queued (0 without a cache)."""
        cache = self._ctx.cache
        if cache is None:
            return 0
        queued = 0
        # in-place changes held off meanwhile: no switch changes a tensor between its entry read
        # here and its job queued (a switch after drops the jobs of the memory it changes)
        with self._store.reading_entries(names) as entries:
            for name, e in entries.items():
                if e.digest is None or getattr(getattr(e.tensor, "device", None), "type", "cpu") != "cpu":
                    continue
                if cache.behind.pending(e.digest) or cache.has(e.digest, e.nbytes, wait=False):
                    continue
                sealed = sealed_since(self._store, name, e.tensor)
                if sealed is not None and cache.behind.submit(e.digest, e.tensor, as_bytes(e.tensor), sealed):
                    queued += 1
        return queued

    def set_digest(self, names: Iterable[str] | None = None, *, model: str | None = None) -> bytes:
        """The set digest (:func:`weightlift.digest.setdigest.set_digest`) over the named tensors
        of ``model`` (None: the default model; no names: every one it holds), from one instant's
        view of the store: what an update's COMMIT stated for its tensors. A tensor without a
        known digest is hashed; KeyError names one not held."""
        prefix = model_key(model or "", "")
        if names is None:  # the model's own tensors only: others' keys never mix in
            entries = {
                key_model(k)[1]: e for k, e in self._store.entries(None).items() if key_model(k)[0] == (model or "")
            }
        else:
            names = list(names)
            held = self._store.entries([prefix + n for n in names])
            entries = {n: held[prefix + n] for n in names if prefix + n in held}
            missing = [n for n in names if n not in entries]
            if missing:
                raise KeyError(f"the server holds no tensor {missing[0]!r}" + (f" in model {model!r}" if model else ""))
        return set_digest({n: e.digest or tensor_digest(e.tensor) for n, e in entries.items()})

    @property
    def generation(self) -> int:
        """The store's generation: 1 at start, one more at each update (a set switched in at once).
        LIST states it; a READ that names it is STALE once it has moved on (protocol minor 3)."""
        return self._store.generation

    @property
    def memory_used(self) -> int:
        """Bytes counted against max_memory now, complete and in flight: each tensor's bytes,
        name and ENTRY_OVERHEAD."""
        return self._store.used

    @property
    def max_memory(self) -> int:
        """The cap on memory_used (given, or :func:`default_max_memory`)."""
        return self._store.max_memory

    def stats(self) -> ServerStats:
        """What the server holds and has done (:class:`~.stats.ServerStats`): the counters since
        start, the tensors and memory held now, the pool, and the connections and their slots."""
        counters = self._store.stats()
        held, held_bytes = self._store.held()
        pool = self._store.pool
        faulted, reserved = pool.reserved if pool is not None else (0, 0)
        slots = self._slots
        open_connections = self._acceptor.open_connections
        return ServerStats(
            **counters,
            evicted=slots.evicted,
            tensors_held=held,
            bytes_held=held_bytes,
            memory_used=self._store.used,
            max_memory=self._store.max_memory,
            pool_idle_bytes=pool.idle_bytes if pool is not None else 0,
            reserve_faulted=faulted,
            reserve_bytes=reserved,
            open_connections=open_connections,
            handshakes=slots.n_handshakes,
            max_handshakes=slots.max_handshakes,
            ready=slots.n_ready,
            max_connections=slots.max_ready,
            max_per_address=slots.max_per_address,
            models=len(self._store.models()),
        )

    def trim(self, keep: int = 0) -> int:
        """Give idle pooled host memory back to the system until at most ``keep`` bytes stay
        idle, and on a CUDA device the blocks torch's caching allocator keeps of dropped tensors
        (held from other processes until then); returns the bytes given back."""
        pool = self._store.pool
        given = pool.trim(keep) if pool is not None else 0
        if self.config.placement.cuda:
            given += empty_device_cache(self.device)
        return given

    @property
    def cache(self) -> TensorCache | None:
        """The disk cache, or None (none configured, or switched off after a disk failure)."""
        return self._ctx.cache

    def profile_reports(self) -> list[dict[str, object]]:
        """The profiler reports of the most recent closed connections, oldest first (profiling on)."""
        return list(self._ctx.reports)
