"""The tensor server: receives pushed tensors into host or device memory and serves them back.

Theory of operation: one thread accepts connections and one thread serves each. A connection's
protocol state (decoder, session, tensors in flight, errors since the last barrier, profiler) is
its own (:mod:`.connection`, :mod:`.receive`); the store of complete tensors and the memory
account are shared, and only :mod:`.store` changes them. A connection sees its server through a
:class:`~.context.Context`: settings, the store, the disk cache, nothing private.

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

``WEIGHTLIFT_LOAD_OPT=0`` (read when the Server is made) receives each WRITE into a fresh buffer
and copies it out, the naive way, for A/B measurements (:mod:`.legacy`).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import ssl
import threading
import time
import warnings
from typing import Any

from weightlift import env
from weightlift.errors import DeviceError, OptionError, StateError, TransportError
from weightlift.memory.pool import HostPool
from weightlift.memory.targets import Target, make_target
from weightlift.remote.protocol import PROTOCOL_MINOR, Error, ErrorCode, send
from weightlift.remote.server.cache import TensorCache
from weightlift.remote.server.connection import Connection
from weightlift.remote.server.context import Context
from weightlift.remote.server.frames import MIN_FRAME_RATE
from weightlift.remote.server.slots import Slot, Slots
from weightlift.remote.server.store import ENTRY_OVERHEAD, Store
from weightlift.remote.token import check_token
from weightlift.remote.transport import TCP, Backend, Listener, Stream, TlsBackend

__all__ = [
    "Server",
    "is_loopback",
    "default_max_memory",
    "ENTRY_OVERHEAD",
    "MAX_CONNECTIONS",
    "HANDSHAKE_TIMEOUT",
    "IDLE_TIMEOUT",
    "IO_TIMEOUT",
    "MIN_FRAME_RATE",
    "MAX_HANDSHAKES",
    "MAX_PER_ADDRESS",
]

MAX_CONNECTIONS = 64  # READY (authenticated) connections served at once; more are closed at accept
MAX_HANDSHAKES = 16  # connections still in HELLO/AUTH at once, apart from the READY ones
MAX_PER_ADDRESS = 32  # connections from one peer address at once, of both kinds
HANDSHAKE_TIMEOUT = 10.0  # seconds from accept for a connection to become READY (HELLO, AUTH)
IDLE_TIMEOUT = 300.0  # seconds a READY connection may wait between requests before it is closed
IO_TIMEOUT = 60.0  # seconds one receive inside a frame or payload, or one send, may wait
MEMORY_FRACTION = 0.9  # of physical RAM: a cpu server's max_memory when none is given

_log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (so no token is needed to bind it)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_max_memory(device: str = "cpu") -> int:
    """The memory cap a server uses when given none: 90 % of physical RAM for ``cpu``, the
    device's total memory for ``cuda[:N]``. OptionError where the amount cannot be found."""
    dev = str(device)
    if dev.startswith("cuda"):
        import torch

        try:
            return int(torch.cuda.get_device_properties(torch.device(dev)).total_memory)
        except (RuntimeError, AssertionError, ValueError) as e:
            raise DeviceError(f"cannot read the memory of device {dev!r}: {e}") from None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        raise OptionError("cannot tell how much memory this machine has: pass max_memory") from None
    return int(total * MEMORY_FRACTION)


def _spare_descriptor() -> int:
    try:
        return os.open(os.devnull, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return -1


def _check_device(device: str, framework: str) -> Target | None:
    """Fail now on a device the server cannot use, without allocating anything on it.

    Returns the host target all connections share (it holds no state), or None for a CUDA
    device: each connection makes its own CUDA target, with its pinned slots, at its first ALLOC.
    """
    dev = str(device)
    if not dev.startswith("cuda"):
        return make_target(dev, framework)  # cpu; anything else is an OptionError
    if framework != "torch":
        raise OptionError(f"device {dev!r} needs framework='torch'")
    import torch

    try:
        index = torch.device(dev).index
    except RuntimeError:
        raise OptionError(f"unknown device {dev!r}: expected 'cpu' or 'cuda[:N]'") from None
    if not torch.cuda.is_available():
        raise DeviceError(f"device {dev!r} asked for, but torch sees no CUDA device")
    if index is not None and index >= torch.cuda.device_count():
        raise DeviceError(f"device {dev!r} asked for, but torch sees {torch.cuda.device_count()} CUDA devices")
    return None


class Server:
    """A tensor server. ``start()`` serves on a background thread; ``serve_forever()`` in this one.

    Binds 127.0.0.1 by default; any other address needs a ``token`` (clients must prove they hold
    it) or ``insecure=True``. ``max_memory`` caps the bytes allocated across all clients, each
    tensor counted as its bytes plus its name plus ENTRY_OVERHEAD; None (the default) means
    :func:`default_max_memory`: 90 % of physical RAM for ``cpu``, the device's total memory for
    ``cuda``. ``max_connections`` READY (authenticated) connections are served at once (more are closed
    at accept); connections still in their handshake take one of ``max_handshakes`` slots of
    their own, so peers without the token never lock authenticated clients out; one peer
    address holds at most ``max_per_address`` connections of both kinds. Each connection must
    finish HELLO (and AUTH) within ``handshake_timeout`` seconds or is closed. After
    that a connection that sends no request for ``idle_timeout`` seconds is closed, and so is one
    that stalls for ``io_timeout`` seconds inside a frame or payload, or while a reply is sent
    (None: no limit).
    ``cache_max_bytes`` caps the disk cache's entries, the least recently used evicted first.
    ``tls``: a server ``ssl.SSLContext`` (:func:`~weightlift.remote.transport.server_tls_context`):
    every connection speaks TLS, its handshake bounded by ``handshake_timeout``. TLS gives
    confidentiality; clients are still authenticated by the token.
    ``protocol_minor`` makes the server speak an older minor version (compatibility tests).
    ``profile`` None reads WEIGHTLIFT_LOADPROF; with it on, each connection's report is printed
    to stderr when the connection closes. ``reserve`` (host memory only) faults that many bytes
    in on a background thread from ``start()`` on, while the process does its other start-up
    work, so the first push lands in memory already backed; the reserve counts against
    ``max_memory`` and gives way to tensors that need the room.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        device: str = "cpu",
        framework: str = "numpy",
        cache_dir: str | os.PathLike[str] | None = None,
        cache_max_bytes: int | None = None,
        token: str | bytes | None = None,
        insecure: bool = False,
        max_memory: int | None = None,
        reserve: int = 0,
        max_connections: int = MAX_CONNECTIONS,
        max_handshakes: int = MAX_HANDSHAKES,
        max_per_address: int = MAX_PER_ADDRESS,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        idle_timeout: float | None = IDLE_TIMEOUT,
        io_timeout: float | None = IO_TIMEOUT,
        min_frame_rate: int | None = MIN_FRAME_RATE,
        profile: bool | None = None,
        protocol_minor: int = PROTOCOL_MINOR,
        backend: Backend = TCP,
        tls: ssl.SSLContext | None = None,
    ):
        if tls is not None:
            if backend is not TCP:
                raise OptionError("pass tls= or backend=, not both")
            backend = TlsBackend(tls)
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise OptionError(f"port {port!r} is out of range")
        if max_memory is not None and max_memory < 0:
            raise OptionError(f"max_memory must be >= 0, got {max_memory}")
        for what, n in (
            ("max_connections", max_connections),
            ("max_handshakes", max_handshakes),
            ("max_per_address", max_per_address),
        ):
            if n < 1:
                raise OptionError(f"{what} must be >= 1, got {n}")
        if not handshake_timeout > 0:
            raise OptionError(f"handshake_timeout must be > 0, got {handshake_timeout}")
        for what, t in (("idle_timeout", idle_timeout), ("io_timeout", io_timeout)):
            if t is not None and not t > 0:
                raise OptionError(f"{what} must be > 0 or None, got {t}")
        if min_frame_rate is not None and not min_frame_rate > 0:
            raise OptionError(f"min_frame_rate must be > 0 or None, got {min_frame_rate}")
        if not 0 <= protocol_minor <= PROTOCOL_MINOR:
            raise OptionError(f"protocol_minor must be between 0 and {PROTOCOL_MINOR}")
        self._backend = backend
        self._token = token.encode() if isinstance(token, str) else token
        if self._token is not None:
            check_token(self._token)
        if not is_loopback(host):
            if self._token is None and not insecure:
                raise OptionError(
                    f"binding {host} exposes the server beyond this machine: pass a token, or insecure=True"
                )
            if self._token is None:
                warnings.warn(
                    f"serving on {host} without a token: anyone who can reach it may write memory",
                    RuntimeWarning,
                    stacklevel=2,
                )
        self.host, self.port = host, port
        self.device, self.framework = device, framework
        host_target = _check_device(device, framework)  # fails now on a missing device, not per client
        max_memory = default_max_memory(device) if max_memory is None else max_memory
        if not 0 <= reserve <= max_memory:
            raise OptionError(f"reserve must be between 0 and max_memory ({max_memory}), got {reserve}")
        self._max_connections = max_connections
        self._slots = Slots(ready=max_connections, handshakes=max_handshakes, per_address=max_per_address)
        # touched host memory of released tensors, reused for new ones (a weight update)
        pool = HostPool() if host_target is not None and host_target.memcpy_ok else None
        if reserve and pool is None:
            raise OptionError("reserve is for host memory: a cpu server without a dtype cast")
        self._reserve_bytes = reserve
        store = Store(max_memory=max_memory, pool=pool, remember_digests=cache_dir is not None)
        self._ctx = Context(
            device=device,
            framework=framework,
            host_target=host_target,
            token=self._token,
            minor=protocol_minor,
            handshake_timeout=float(handshake_timeout),
            idle_timeout=None if idle_timeout is None else float(idle_timeout),
            io_timeout=None if io_timeout is None else float(io_timeout),
            min_frame_rate=min_frame_rate,
            opt=env.load_opt(),
            profile=profile,
            store=store,
            cache=TensorCache(cache_dir, max_bytes=cache_max_bytes) if cache_dir is not None else None,
        )
        self._store = store
        self._lock = threading.Lock()  # guards the connections and their threads
        self._listener: Listener | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[Stream] = set()
        self._threads: set[threading.Thread] = set()
        self._closing = threading.Event()
        self._spare_fd = _spare_descriptor()  # given up to refuse a client when descriptors run out
        self._emfile_logged = -1e9

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); OptionError before start()."""
        if self._listener is None:
            raise StateError("the server is not started")
        return self._listener.address

    def _bind(self) -> None:
        if self._closing.is_set():
            raise StateError("the server is closed")
        if self._listener is None:
            self._listener = self._backend.listen(self.host, self.port)

    def bind(self) -> tuple[str, int]:
        """Bind without serving yet (to print the address first); returns the bound (host, port)."""
        self._bind()
        return self.address

    def start(self) -> tuple[str, int]:
        """Bind and serve on a background thread; returns the bound (host, port). Idempotent."""
        self._bind()
        self._start_reserve()
        if self._accept_thread is None:
            self._accept_thread = threading.Thread(target=self._accept_loop, name="weightlift-accept", daemon=True)
            self._accept_thread.start()
        return self.address

    def _start_reserve(self) -> None:
        pool = self._store.pool
        if self._reserve_bytes and pool is not None:
            pool.reserve(self._reserve_bytes)  # once: later calls are no-ops

    @property
    def reserved(self) -> tuple[int, int]:
        """(bytes of the reserve faulted in so far, bytes reserved); (0, 0) without one."""
        pool = self._store.pool
        return pool.reserved if pool is not None else (0, 0)

    def serve_forever(self) -> None:
        """Serve in the calling thread until close() (from another thread) or Ctrl-C, then close."""
        self._bind()
        self._start_reserve()
        try:
            if self._accept_thread is not None:  # already serving in the background: just wait
                while not self._closing.wait(0.5):
                    pass
            else:
                self._accept_loop()
        finally:
            self.close()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closing.is_set():
            try:
                stream = self._listener.accept(timeout=0.2)
            except TransportError as e:
                if self._closing.is_set():
                    return
                if getattr(e.__context__, "errno", None) in (errno.EMFILE, errno.ENFILE):
                    self._out_of_descriptors(e)
                time.sleep(0.05)  # back off rather than spin
                continue
            if stream is None:
                continue
            slot = self._slots.admit(stream.peer.rpartition(":")[0], stream.shutdown)
            if isinstance(slot, str):
                self._refuse(stream, slot)
                continue
            with self._lock:
                if self._closing.is_set():
                    slot.release()
                    stream.close()
                    return
                self._conns.add(stream)
                self._store.count("connections")
                t = threading.Thread(
                    target=self._serve_one, args=(stream, slot), name=f"weightlift-conn {stream.peer}", daemon=True
                )
                self._threads.add(t)
            t.start()

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
        try:
            stream.set_timeout(0.0)
            stream.send_parts([send(Error(ErrorCode.LIMIT, why), minor=0)])
            stream.shutdown_write()
            stream.recv_into(memoryview(bytearray(256)))  # a HELLO already here: unread input would reset the reply
        except (TransportError, OSError):
            pass
        stream.close()

    def _serve_one(self, stream: Stream, slot: Slot) -> None:
        try:
            Connection(self._ctx, stream, slot=slot).run()
        except Exception:  # a last resort: run() answers what it can; nothing may kill the server
            _log.exception("weightlift server: connection %s failed", stream.peer)
        finally:
            stream.close()
            slot.release()
            with self._lock:
                self._conns.discard(stream)
                self._threads.discard(threading.current_thread())

    def close(self) -> None:
        """Stop accepting, end every connection (their partial tensors are dropped), and wait."""
        self._closing.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for s in conns:
            s.shutdown()
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=10)
        if self._accept_thread is not None and self._accept_thread is not threading.current_thread():
            self._accept_thread.join(timeout=10)
        if self._spare_fd >= 0:
            os.close(self._spare_fd)
            self._spare_fd = -1
        if self._store.pool is not None:
            self._store.pool.close()  # idle memory goes back; tensors still held keep theirs

    stop = close

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the server holds -------------------------------------------------------------

    def tensors(self, *, writable: bool = False) -> dict[str, Any]:
        """The complete tensors by name (numpy arrays or torch tensors); never a partial one.

        numpy arrays come as read-only views: what the server holds is its proof of what was
        pushed, and a digest-named push of the same bytes then finds them in memory without
        hashing them again. ``writable=True`` hands out the arrays themselves, for a process that
        changes its weights in place; those tensors (and torch tensors, which have no read-only
        form) are hashed again before a later push trusts them."""
        return self._store.tensors(writable=writable)

    @property
    def memory_used(self) -> int:
        """Bytes counted against max_memory now, complete and in flight: each tensor's bytes,
        name and ENTRY_OVERHEAD."""
        return self._store.used

    @property
    def max_memory(self) -> int:
        """The cap on memory_used (given, or :func:`default_max_memory`)."""
        return self._store.max_memory

    def stats(self) -> dict[str, int]:
        """Counters since start: connections, tensors completed, payload bytes received over the
        wire, cache hits and bytes filled from the disk cache, memory hits and bytes filled from
        tensors the server already held (``memory_hits``, ``bytes_from_memory``), errors reported,
        and ``pooled``: tensors placed in reused memory instead of fresh."""
        return self._store.stats()

    def profile_reports(self) -> list[dict[str, Any]]:
        """The profiler reports of the most recent closed connections, oldest first (profiling on)."""
        return list(self._ctx.reports)
