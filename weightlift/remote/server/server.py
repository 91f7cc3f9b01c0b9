"""The tensor server: receives pushed tensors into host or device memory and serves them back.

Theory of operation: one thread accepts connections and one thread serves each. A connection's
protocol state (decoder, session, tensors in flight, errors since the last barrier, profiler) is
its own; the store of complete tensors and the memory count are shared under one lock.

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
and copies it out, the naive way, for A/B measurements.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import sys
import threading
import time
import warnings
from bisect import bisect_left, bisect_right
from collections import deque
from typing import Any

import numpy as np

from weightlift import env
from weightlift.remote.server.cache import TensorCache, disk_unusable
from weightlift.errors import (
    AuthError,
    CacheError,
    DeviceError,
    LocalProtocolError,
    OptionError,
    RemoteProtocolError,
    StateError,
    TransportError,
    WeightliftError,
)
from weightlift.profile import Profiler
from weightlift.remote.protocol import (
    MAX_ERRORS,
    MAX_FRAME,
    MAX_HANDSHAKE_FRAME,
    MAX_MESSAGE,
    MAX_TENSOR_BYTES,
    MAX_TENSORS,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    Alloc,
    Auth,
    Barrier,
    BarrierReply,
    Bye,
    Capability,
    Decoder,
    Error,
    ErrorCode,
    FillFromCache,
    Free,
    FreeReply,
    Have,
    HaveReply,
    Hello,
    ListEntry,
    ListReply,
    ListRequest,
    Message,
    Read,
    ReadReply,
    ServerSession,
    SessionState,
    WriteHeader,
    client_mac,
    new_nonce,
    send,
    server_mac,
    verify_mac,
)
from weightlift.remote.digest import hash_buffer
from weightlift.memory.faulter import Faulter
from weightlift.memory.fresh import policy as fill_policy
from weightlift.memory.pool import POOL_MIN, HostPool, size_class
from weightlift.memory.targets import CudaTarget, Target, make_target, populate, view_as
from weightlift.remote.transport import TCP, Backend, Listener, Stream, receive_message, receive_payload

__all__ = ["Server", "is_loopback", "default_max_memory"]

STAGING_BYTES = 8 * 1024 * 1024  # one per connection, for targets that are not host memory
HASH_PIECE = 4 * 1024 * 1024  # received-then-hashed piece: still in the CPU cache when hashed
FAULT_PIECE = 4 * 1024 * 1024  # fresh destination memory is faulted in this much at a time by the helpers ...
FAULT_WINDOW = 64 * 1024 * 1024  # ... at most this far ahead of the bytes received (weightlift.memory.faulter)
SCRATCH_BYTES = 64 * 1024  # frame headers and drained payloads
LINGER_BYTES = 64 * 1024 * 1024  # after an ERROR, how much of the peer's input to drain before closing
LINGER_SECONDS = 2.0  # ... and for how long at most, however the peer spaces its bytes
MAX_CONNECTIONS = 64  # connections served at once; more are closed at accept
HANDSHAKE_TIMEOUT = 10.0  # seconds from accept for a connection to become READY (HELLO, AUTH)
MAX_RANGES = 4096  # disjoint byte ranges one pending tensor's WRITEs may leave
ENTRY_OVERHEAD = 256  # bytes charged per tensor on top of its data and name: a store entry costs memory too
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


def _entry_cost(name: str, nbytes: int) -> int:
    """What a tensor counts against max_memory: its bytes, its name, and a store entry's overhead."""
    return nbytes + len(name.encode("utf-8")) + ENTRY_OVERHEAD


class _Entry:
    """A complete tensor in the store. ``digest`` is set when its bytes were proven to hash to it
    (hashed as they arrived, or filled from a verified cache entry): the in-memory tier."""

    __slots__ = ("dtype", "shape", "nbytes", "tensor", "cost", "digest")

    def __init__(self, dtype: str, shape: tuple[int, ...], nbytes: int, tensor: Any, cost: int, digest: bytes | None):
        self.dtype, self.shape, self.nbytes, self.tensor, self.cost, self.digest = dtype, shape, nbytes, tensor, cost, digest


class _Pending:
    """A tensor being filled by one connection: its destination and which bytes have arrived.

    The arrived bytes are kept as sorted, disjoint, non-touching ranges ``[starts[i], ends[i])``;
    a WRITE merges in with two binary searches, so a tensor written in many pieces in any order
    costs O(log n) per WRITE plus the ranges it joins, never a rebuild of the list.
    """

    __slots__ = ("name", "dtype", "shape", "nbytes", "cost", "charged", "dest", "digest", "starts", "ends", "writer",
                 "hashed", "proven")

    def __init__(self, a: Alloc, dest: Any, cost: int, charged: bool = True):
        self.name, self.dtype, self.shape, self.nbytes = a.name, a.dtype, a.shape, a.nbytes
        self.cost = cost
        self.charged = charged  # cost counted against max_memory (deferred: at the first byte)
        self.dest = dest
        self.digest = a.digest
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.writer: Any = None
        self.hashed = 0
        self.proven = False  # the bytes in dest are known to hash to digest

    def _span(self, begin: int, end: int) -> tuple[int, int]:
        # Ranges i..j-1 overlap or touch [begin, end): those before i end before it begins,
        # those from j on start after it ends.
        i = bisect_left(self.ends, begin)
        return i, bisect_right(self.starts, end, lo=i)

    def can_add(self, begin: int, end: int) -> bool:
        """Whether adding [begin, end) keeps the ranges within MAX_RANGES."""
        if begin == end or len(self.starts) < MAX_RANGES:
            return True
        i, j = self._span(begin, end)
        return i < j

    def add(self, begin: int, end: int) -> None:
        if begin == end:
            return
        i, j = self._span(begin, end)
        if i < j:
            begin, end = min(begin, self.starts[i]), max(end, self.ends[j - 1])
        self.starts[i:j] = [begin]
        self.ends[i:j] = [end]

    def clear(self) -> None:
        self.starts, self.ends = [], []

    def fill(self) -> None:
        self.starts, self.ends = [0], [self.nbytes]

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.starts, self.ends))

    @property
    def complete(self) -> bool:
        return self.nbytes == 0 or (len(self.starts) == 1 and self.starts[0] == 0 and self.ends[0] == self.nbytes)


class Server:
    """A tensor server. ``start()`` serves on a background thread; ``serve_forever()`` in this one.

    Binds 127.0.0.1 by default; any other address needs a ``token`` (clients must prove they hold
    it) or ``insecure=True``. ``max_memory`` caps the bytes allocated across all clients, each
    tensor counted as its bytes plus its name plus ENTRY_OVERHEAD; None (the default) means
    :func:`default_max_memory`: 90 % of physical RAM for ``cpu``, the device's total memory for
    ``cuda``. ``max_connections`` connections are served at once (more are closed at accept), and
    each must finish HELLO (and AUTH) within ``handshake_timeout`` seconds or is closed.
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
        token: str | bytes | None = None,
        insecure: bool = False,
        max_memory: int | None = None,
        reserve: int = 0,
        max_connections: int = MAX_CONNECTIONS,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        profile: bool | None = None,
        protocol_minor: int = PROTOCOL_MINOR,
        backend: Backend = TCP,
    ):
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise OptionError(f"port {port!r} is out of range")
        if max_memory is not None and max_memory < 0:
            raise OptionError(f"max_memory must be >= 0, got {max_memory}")
        if max_connections < 1:
            raise OptionError(f"max_connections must be >= 1, got {max_connections}")
        if not handshake_timeout > 0:
            raise OptionError(f"handshake_timeout must be > 0, got {handshake_timeout}")
        if not 0 <= protocol_minor <= PROTOCOL_MINOR:
            raise OptionError(f"protocol_minor must be between 0 and {PROTOCOL_MINOR}")
        self._backend = backend
        self._token = token.encode() if isinstance(token, str) else token
        if self._token is not None and not self._token:
            raise OptionError("token is empty")
        if not is_loopback(host):
            if self._token is None and not insecure:
                raise OptionError(f"binding {host} exposes the server beyond this machine: pass a token, or insecure=True")
            if self._token is None:
                warnings.warn(f"serving on {host} without a token: anyone who can reach it may write memory", RuntimeWarning, stacklevel=2)
        self.host, self.port = host, port
        self.device, self.framework = device, framework
        self._host_target = _check_device(device, framework)  # fails now on a missing device, not per client
        self._cache = TensorCache(cache_dir) if cache_dir is not None else None
        self._max_memory = default_max_memory(device) if max_memory is None else max_memory
        if not 0 <= reserve <= self._max_memory:
            raise OptionError(f"reserve must be between 0 and max_memory ({self._max_memory}), got {reserve}")
        self._max_connections = max_connections
        self._handshake_timeout = float(handshake_timeout)
        self._minor = protocol_minor
        self._opt = env.load_opt()
        self._profile = profile
        self._lock = threading.Lock()
        self._store: dict[str, _Entry] = {}
        self._held: dict[bytes, str] = {}  # digest -> name of a stored tensor proven to hold those bytes
        self._caching = cache_dir is not None  # digests of held tensors are remembered (the in-memory tier)
        # touched host memory of released tensors, reused for new ones (a weight update)
        self._pool = HostPool() if self._host_target is not None and self._host_target.memcpy_ok else None
        if reserve and self._pool is None:
            raise OptionError("reserve is for host memory: a cpu server without a dtype cast")
        self._reserve_bytes = reserve
        self._used = 0
        self._stats = {"connections": 0, "tensors": 0, "bytes_received": 0, "bytes_from_cache": 0, "cache_hits": 0,
                       "memory_hits": 0, "bytes_from_memory": 0, "errors": 0}
        self._reports: deque[dict[str, Any]] = deque(maxlen=64)
        self._listener: Listener | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[Stream] = set()
        self._threads: set[threading.Thread] = set()
        self._closing = threading.Event()

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
        if self._reserve_bytes and self._pool is not None:
            self._pool.reserve(self._reserve_bytes)  # once: later calls are no-ops

    @property
    def reserved(self) -> tuple[int, int]:
        """(bytes of the reserve faulted in so far, bytes reserved); (0, 0) without one."""
        return self._pool.reserved if self._pool is not None else (0, 0)

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
            except TransportError:
                if self._closing.is_set():
                    return
                time.sleep(0.05)  # e.g. EMFILE: back off rather than spin
                continue
            if stream is None:
                continue
            with self._lock:
                if self._closing.is_set():
                    stream.close()
                    return
                full = len(self._conns) >= self._max_connections
                if not full:
                    self._conns.add(stream)
                    self._stats["connections"] += 1
                    t = threading.Thread(target=self._serve_one, args=(stream,), name=f"weightlift-conn {stream.peer}", daemon=True)
                    self._threads.add(t)
            if full:
                self._refuse(stream)
                continue
            t.start()

    def _refuse(self, stream: Stream) -> None:
        """Close a connection over the limit at once, with a best-effort ERROR that cannot block."""
        try:
            stream.set_timeout(0.0)
            stream.send_parts([send(Error(ErrorCode.LIMIT, f"the server is serving its limit of {self._max_connections} connections"), minor=0)])
        except (TransportError, OSError):
            pass
        stream.close()

    def _serve_one(self, stream: Stream) -> None:
        try:
            _Connection(self, stream).run()
        except Exception:  # a last resort: run() answers what it can; nothing may kill the server
            _log.exception("weightlift server: connection %s failed", stream.peer)
        finally:
            stream.close()
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
        if self._pool is not None:
            self._pool.close()  # idle memory goes back; tensors still held keep theirs

    stop = close

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the server holds -------------------------------------------------------------

    def tensors(self) -> dict[str, Any]:
        """The complete tensors by name (numpy arrays or torch tensors); never a partial one."""
        with self._lock:
            return {name: entry.tensor for name, entry in self._store.items()}

    @property
    def memory_used(self) -> int:
        """Bytes counted against max_memory now, complete and in flight: each tensor's bytes,
        name and ENTRY_OVERHEAD."""
        return self._used

    @property
    def max_memory(self) -> int:
        """The cap on memory_used (given, or :func:`default_max_memory`)."""
        return self._max_memory

    def stats(self) -> dict[str, int]:
        """Counters since start: connections, tensors completed, payload bytes received over the
        wire, cache hits and bytes filled from the disk cache, memory hits and bytes filled from
        tensors the server already held (``memory_hits``, ``bytes_from_memory``), errors reported,
        and ``pooled``: tensors placed in reused memory instead of fresh."""
        with self._lock:
            out = dict(self._stats)
        out["pooled"] = self._pool.reused if self._pool is not None else 0
        return out

    def profile_reports(self) -> list[dict[str, Any]]:
        """The profiler reports of the most recent closed connections, oldest first (profiling on)."""
        with self._lock:
            return list(self._reports)

    # -- shared state, used by connections -------------------------------------------------

    def _reserve(self, nbytes: int, alloc: int = 0) -> None:
        """Charge ``nbytes`` against max_memory for a tensor of ``alloc`` bytes; idle pooled
        memory counts too and is given back first, except what that tensor will be placed in."""
        pool = self._pool
        if pool is not None:
            idle = pool.idle_bytes - pool.servable(alloc)
            over = self._used + nbytes + idle - self._max_memory
            if over > 0:
                pool.trim(pool.idle_bytes - over)
        with self._lock:
            if self._used + nbytes > self._max_memory:
                raise _RequestError(
                    f"{nbytes} bytes would exceed the server's memory limit ({self._used} of {self._max_memory} in use)"
                )
            self._used += nbytes

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    def _publish(self, p: _Pending, dest: Any) -> None:
        digest = p.digest if p.proven else None
        with self._lock:
            old = self._store.get(p.name)
            self._store[p.name] = _Entry(p.dtype, p.shape, p.nbytes, dest, p.cost, digest)
            if old is not None:
                self._used -= old.cost
                self._unhold(p.name, old)
            if digest is not None and self._caching:
                self._held[digest] = p.name
            self._stats["tensors"] += 1
        del old  # the last reference to a replaced tensor: its memory goes back to the pool now

    def _unhold(self, name: str, entry: _Entry) -> None:
        """Forget that ``entry`` (stored as ``name``) holds its digest; the lock is held."""
        if entry.digest is not None and self._held.get(entry.digest) == name:
            del self._held[entry.digest]

    def _take_host(self, nbytes: int) -> tuple[np.ndarray, bool]:
        assert self._pool is not None
        return self._pool.take_marked(nbytes)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def _disable_cache(self, exc: CacheError) -> None:
        if self._cache is not None:
            self._cache = None
            warnings.warn(f"tensor cache disabled: {exc}", RuntimeWarning, stacklevel=2)


class _RequestError(Exception):
    """A request failed; its message is reported at the next barrier."""


class _Connection:
    """One client: reads frames, dispatches them, and owns everything in flight."""

    def __init__(self, server: Server, stream: Stream):
        self.srv = server
        self.stream = stream
        self._target: Target | None = server._host_target  # a CUDA target is made at the first ALLOC
        self.minor = server._minor
        self.session = ServerSession(minor=server._minor, auth_required=server._token is not None)
        # Until READY: the server's own minor (the client's is not known yet) and tiny frames.
        self.dec = Decoder(our_role="server", minor=server._minor, max_frame=MAX_HANDSHAKE_FRAME, max_tensor_bytes=self._max_tensor_bytes())
        self.deadline: float | None = time.monotonic() + server._handshake_timeout
        self.nonce = new_nonce()
        self.client_nonce = b""
        self.client_max_frame = MAX_FRAME
        self.pending: dict[int, _Pending] = {}
        self.failed: dict[int, None] = {}  # ids whose ALLOC failed (oldest first): their WRITEs are drained quietly
        self.errors: list[str] = []
        self.dropped_errors = 0
        self.need: dict[int, None] = {}  # pending ids a FILL_FROM_CACHE could not fill, in order
        self.done_tensors = 0
        self.done_bytes = 0
        self.prof = Profiler(server._profile)
        self.scratch = memoryview(bytearray(SCRATCH_BYTES))
        self._staging: np.ndarray | None = None
        self._faulter: Faulter | None = None  # made at the first fresh destination

    def _max_tensor_bytes(self) -> int:
        return min(MAX_TENSOR_BYTES, self.srv._max_memory)

    @property
    def target(self) -> Target:
        if self._target is None:
            self._target = make_target(self.srv.device, self.srv.framework)
        return self._target

    @property
    def _pooled(self) -> bool:
        """Whether this connection's tensors land in the server's pooled host memory (checked
        without making a CUDA target)."""
        return self.srv._pool is not None and self._target is self.srv._host_target

    def staging(self) -> memoryview:
        if self._staging is None:
            self._staging = np.empty(STAGING_BYTES, dtype=np.uint8)  # reused, never zero-filled
        return memoryview(self._staging)

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while True:
                msg = receive_message(self.stream, self.dec, self.scratch, deadline=self.deadline)
                if msg is None:
                    return
                t0 = time.perf_counter_ns() if self.prof.enabled else 0
                if self._dispatch(msg):
                    return
                if self.prof.enabled:
                    self.prof.command(msg.COMMAND.name, t0, time.perf_counter_ns())
                    self.prof.count(calls=1)
        except RemoteProtocolError as e:
            self._fatal(ErrorCode.PROTOCOL, str(e))
        except AuthError as e:
            self._fatal(ErrorCode.AUTH, str(e))
        except TransportError:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                what = "HELLO and AUTH" if self.srv._token is not None else "HELLO"
                self._fatal(ErrorCode.PROTOCOL, f"no {what} within {self.srv._handshake_timeout:g} s")
            # otherwise the client went away; what it had in flight is dropped below
        except WeightliftError as e:  # the server's own failure (a reply it could not encode, a device)
            _log.warning("weightlift server: connection %s: %s: %s", self.stream.peer, type(e).__name__, e)
            self._fatal(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
        except Exception as e:  # a bug: say so, end this connection only
            _log.exception("weightlift server: connection %s failed", self.stream.peer)
            self._fatal(ErrorCode.INTERNAL, f"internal server error: {type(e).__name__}")
        finally:
            if self._faulter is not None:
                self._faulter.close()  # waits for the pieces in progress: nothing writes into freed memory
            self._drop_pending()
            if self.prof.enabled:
                self.srv._reports.append(self.prof.report())
                sys.stderr.write(f"weightlift server: connection {self.stream.peer} closed\n{self.prof.format()}\n")

    def _fatal(self, code: ErrorCode, message: str) -> None:
        """Reply ERROR, then close without a reset, so the client can read why."""
        self.srv._count("errors")
        try:
            self.stream.set_timeout(LINGER_SECONDS)  # a peer that reads nothing must not hold the send
            self.stream.send_parts([send(Error(code, message), minor=self.minor)])
            self.stream.shutdown_write()
            # Keep reading a while: closing with unread input would reset the connection and
            # could destroy the reply before the client reads it.
            end = time.monotonic() + LINGER_SECONDS
            drained = 0
            while drained < LINGER_BYTES:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self.stream.set_timeout(left)
                n = self.stream.recv_into(self.scratch)
                if n == 0:
                    break
                drained += n
        except TransportError:
            pass

    def _reply(self, msg: Message) -> None:
        self.stream.send_parts([send(msg, minor=self.minor, max_frame=self.client_max_frame)])

    def _renew_decoder(self) -> None:
        """A decoder for the negotiated minor, and, once READY, the full frame limit.

        A client that negotiated an older minor must not get past the decoder with a command its
        minor lacks (the server could not encode the reply). receive_message never reads past a
        frame, so nothing is buffered in the old decoder when this runs.
        """
        if not self.dec.at_boundary:
            raise LocalProtocolError("decoder replaced inside a frame")
        ready = self.session.state is SessionState.READY
        self.dec = Decoder(
            our_role="server",
            minor=self.minor,
            max_frame=MAX_FRAME if ready else MAX_HANDSHAKE_FRAME,
            max_tensor_bytes=self._max_tensor_bytes(),
        )
        if ready:
            self.deadline = None
            self.stream.set_timeout(None)

    def _dispatch(self, msg: Message) -> bool:
        """Handle one message; True when the connection should end."""
        if isinstance(msg, Hello):
            if msg.major != PROTOCOL_MAJOR:
                self._fatal(ErrorCode.VERSION, f"client speaks protocol {msg.major}.{msg.minor}; this server speaks {PROTOCOL_MAJOR}.{self.srv._minor}")
                return True
            self._hello(msg)
            return False
        try:
            self.session.check(msg)
        except RemoteProtocolError:
            if self.session.state is SessionState.AWAIT_AUTH:
                raise AuthError(f"{msg.COMMAND.name} before AUTH: this server wants a token") from None
            raise
        if isinstance(msg, Auth):
            self._auth(msg)
        elif isinstance(msg, WriteHeader):
            self._write(msg)
        elif isinstance(msg, Alloc):
            self._guard(msg.tensor_id, self._alloc, msg)
        elif isinstance(msg, FillFromCache):
            self._guard(msg.tensor_id, self._fill, msg)
        elif isinstance(msg, Have):
            cache, held = self.srv._cache, self.srv._held
            self._reply(HaveReply(tuple(d in held or (cache is not None and cache.has(d)) for d in msg.digests)))
        elif isinstance(msg, Barrier):
            self._barrier()
        elif isinstance(msg, Read):
            self._read(msg)
        elif isinstance(msg, ListRequest):
            self._list(msg)
        elif isinstance(msg, Free):
            self._reply(FreeReply(self._free(msg.names)))
        elif isinstance(msg, Bye):
            return True
        return False

    def _guard(self, tid: int, fn: Any, msg: Message) -> None:
        try:
            fn(msg)
        except _RequestError as e:
            self._error(str(e))
            self._mark_failed(tid)

    def _mark_failed(self, tid: int) -> None:
        self.failed.pop(tid, None)
        self.failed[tid] = None
        if len(self.failed) > MAX_TENSORS:  # forget the oldest: at worst one more "not allocated" error
            del self.failed[next(iter(self.failed))]

    def _error(self, text: str) -> None:
        """Keep an error for the next barrier; past MAX_ERRORS only count it."""
        self.srv._count("errors")
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(text[:MAX_MESSAGE])  # the wire cuts it there anyway
        else:
            self.dropped_errors += 1

    # -- handshake -----------------------------------------------------------------------------

    def _hello(self, msg: Hello) -> None:
        self.minor = self.session.hello(msg)
        self.client_nonce = msg.nonce
        if msg.max_frame:
            self.client_max_frame = min(msg.max_frame, MAX_FRAME)
        flags = 0
        if self.srv._cache is not None and self.session.cache_usable():
            flags |= Capability.CACHE
        if self.srv._token is not None:
            flags |= Capability.AUTH
        reply = Hello(
            PROTOCOL_MAJOR,
            self.srv._minor,
            flags,
            MAX_FRAME,
            self._max_tensor_bytes(),
            self.nonce,
            self.srv._max_memory,
        )
        self.stream.send_parts([send(reply)])
        self._renew_decoder()

    def _auth(self, msg: Auth) -> None:
        token = self.srv._token
        if token is None:
            raise RemoteProtocolError("AUTH sent to a server that wants none")
        verify_mac(client_mac(token, self.client_nonce, self.nonce), msg.mac, who="client")
        self.session.authenticated()
        self._reply(Auth(server_mac(token, self.client_nonce, self.nonce)))
        self._renew_decoder()

    # -- receiving tensors -----------------------------------------------------------------------

    def _alloc(self, a: Alloc) -> None:
        if a.tensor_id in self.pending:
            raise _RequestError(f"tensor id {a.tensor_id} ({a.name!r}) is already in flight")
        if len(self.pending) >= MAX_TENSORS:
            raise _RequestError(f"more than {MAX_TENSORS} tensors in flight on one connection")
        pooled = self._pooled and a.nbytes >= POOL_MIN
        cost = _entry_cost(a.name, size_class(a.nbytes) if pooled else a.nbytes)  # a pooled tensor holds whole huge pages
        try:
            self.srv._reserve(cost, a.nbytes if pooled else 0)
            charged = True
        except _RequestError:
            # A client allocates ahead of its writes: while an earlier tensor of this connection
            # is still arriving, its old version may be about to make the room (a weight update
            # near the limit). Charge this one at its first byte instead, and fail there.
            if not self.pending or not a.nbytes:
                raise
            charged = False
        p = _Pending(a, None, cost, charged)
        # A tensor named by digest may be filled from memory the server already holds: its
        # destination is made when the first byte needs a place, not here.
        if charged and (a.digest is None or a.nbytes == 0 or not self.srv._caching):
            try:
                self._ensure_dest(p)
            except _RequestError:
                self.srv._release(cost)
                raise
        self.failed.pop(a.tensor_id, None)
        self.pending[a.tensor_id] = p
        if p.complete:
            self._ensure_dest(p)
            self._complete(a.tensor_id, p)

    def _ensure_dest(self, p: _Pending, *, fault: bool = True) -> None:
        """Give ``p`` its destination: pooled or fresh host memory, or the target's own.

        Fresh host memory that the socket will fill directly goes to this connection's faulter
        at once, so that it is faulted in ahead of the bytes - across tensors, the next
        tensor's memory while this one's bytes arrive (a client sends ALLOCs ahead of WRITEs).
        """
        if p.dest is not None:
            return
        self._charge(p)
        fresh = False
        try:
            if self._pooled:
                raw, fresh = self.srv._take_host(p.nbytes)
                p.dest = view_as(raw, p.dtype, p.shape, self.srv.framework)
            else:
                p.dest = self.target.empty(p.dtype, p.shape)
        except Exception as e:  # ENOMEM from mmap, numpy on an absurd shape, torch out of memory, no device
            raise _RequestError(f"cannot allocate {p.name!r} ({p.dtype} {p.shape}, {p.nbytes} bytes): {type(e).__name__}: {e}") from None
        if fresh and fault and self.srv._opt and fill_policy().helpers > 0:
            if self._faulter is None:
                self._faulter = Faulter(threads=fill_policy().helpers, piece=FAULT_PIECE, window=FAULT_WINDOW)
            self._faulter.add(p, raw)

    def _charge(self, p: _Pending) -> None:
        """Count a tensor allocated while the server was full against max_memory now."""
        if not p.charged:
            self.srv._reserve(p.cost, p.nbytes if self._pooled and p.nbytes >= POOL_MIN else 0)
            p.charged = True

    def _release(self, p: _Pending) -> None:
        if p.charged:
            self.srv._release(p.cost)
            p.charged = False

    def _unfault(self, p: _Pending) -> None:
        """Stop faulting ``p``'s memory in (waiting for a piece in progress): before the memory
        is freed or filled by anything but :meth:`_receive_direct`."""
        if self._faulter is not None:
            self._faulter.cancel(p)

    def _abandon(self, tid: int, p: _Pending, why: str) -> None:
        """Give up on a pending tensor: free it, report why, and drain its later WRITEs quietly."""
        self._unfault(p)
        del self.pending[tid]
        self.need.pop(tid, None)
        if p.writer is not None:
            p.writer.abort()
            p.writer = None
        self._release(p)
        self._error(why)
        self._mark_failed(tid)

    def _write(self, h: WriteHeader) -> None:
        p = self.pending.get(h.tensor_id)
        if p is None or h.offset + h.length > p.nbytes:
            if p is not None:
                self._error(f"WRITE [{h.offset}, {h.offset + h.length}) runs past the {p.nbytes} bytes of {p.name!r}")
            elif h.tensor_id not in self.failed:  # a failed ALLOC was reported already
                self._error(f"WRITE to tensor id {h.tensor_id}, which is not allocated")
            self._drain(h.length)
            return
        if not p.can_add(h.offset, h.offset + h.length):
            self._abandon(h.tensor_id, p, f"tensor {p.name!r}: WRITEs leave more than {MAX_RANGES} separate byte ranges")
            self._drain(h.length)
            return
        try:
            self._ensure_dest(p)
        except _RequestError as e:
            self._abandon(h.tensor_id, p, str(e))
            self._drain(h.length)
            return
        cache = self.srv._cache
        if p.digest is not None and cache is not None and p.writer is None and h.offset == 0 and p.hashed == 0:
            if not cache.has(p.digest, p.nbytes):
                try:
                    p.writer = cache.writer(p.digest, p.nbytes)
                except CacheError as e:
                    self._cache_failed(e)
        if p.writer is not None and h.offset != p.hashed:  # out of order: cannot hash in one pass
            p.writer.abort()
            p.writer = None
        if not self.srv._opt:
            self._receive_naive(p, h)
        elif self.target.memcpy_ok:
            self._receive_direct(p, h)
        else:
            self._receive_staged(p, h)
        self.srv._count("bytes_received", h.length)
        self.done_bytes += h.length
        p.add(h.offset, h.offset + h.length)
        if p.complete:
            self._complete(h.tensor_id, p)

    def _hash(self, p: _Pending, chunk: memoryview) -> None:
        if p.writer is None:
            return
        t0 = time.perf_counter_ns() if self.prof.enabled else 0
        try:
            p.writer.write(chunk)
            p.hashed += len(chunk)
        except CacheError as e:
            p.writer = None
            self._cache_failed(e)
        if self.prof.enabled:
            self.prof.record("hash", t0, time.perf_counter_ns(), len(chunk), name=p.name)

    def _wire(self, view: memoryview, name: str) -> None:
        if self.prof.enabled:
            t0 = time.perf_counter_ns()
            receive_payload(self.stream, self.dec, view)
            self.prof.record("wire", t0, time.perf_counter_ns(), len(view), name=name)
        else:
            receive_payload(self.stream, self.dec, view)

    def _receive_direct(self, p: _Pending, h: WriteHeader) -> None:
        dest = self.target.host_view(p.dest)
        # Fresh memory is faulted in ahead of the socket by the faulter's helpers (see
        # _ensure_dest); a piece they have not reached is faulted here first or by recv_into
        # itself, whichever this machine's fill policy found faster (weightlift.memory.fresh).
        # Pieces end on FAULT_PIECE boundaries of the tensor, the faulter's pieces.
        step = HASH_PIECE if p.writer is not None else FAULT_PIECE
        pos, end = h.offset, h.offset + h.length
        while pos < end:
            stop = min(end, (pos // step + 1) * step)
            piece = dest[pos:stop]
            t0 = time.perf_counter_ns() if self.prof.enabled else 0
            if self._faulter is None or not self._faulter.ready(p, pos, stop):
                populate(piece)
            if self.prof.enabled:
                self.prof.record("stage", t0, time.perf_counter_ns(), 0, name="fault-in " + p.name)
            self._wire(piece, p.name)
            self._hash(p, piece)
            pos = stop

    def _receive_staged(self, p: _Pending, h: WriteHeader) -> None:
        target = self.target
        stage = self.staging()
        flat = None
        if isinstance(target, CudaTarget) and target.dtype is None:
            import torch

            flat = p.dest.reshape(-1).view(torch.uint8)
        pos = 0
        while pos < h.length:
            off = h.offset + pos
            if flat is not None:  # receive straight into the target's pinned slot, then upload async
                slot, buf = target.slot()
                n = min(len(buf), h.length - pos)
                chunk = memoryview(buf)[:n]
            else:
                n = min(len(stage), h.length - pos)
                chunk = stage[:n]
            self._wire(chunk, p.name)
            self._hash(p, chunk)
            t0 = time.perf_counter_ns() if self.prof.enabled else 0
            if flat is not None:
                target.upload(slot, flat[off : off + n], n)
            else:
                target.write(p.dest, off, chunk)
            if self.prof.enabled:
                self.prof.record("device", t0, time.perf_counter_ns(), n, name=p.name)
            pos += n

    def _receive_naive(self, p: _Pending, h: WriteHeader) -> None:
        t0 = time.perf_counter_ns() if self.prof.enabled else 0
        buf = bytearray(h.length)  # a fresh, zero-filled buffer per message, as the naive path did
        receive_payload(self.stream, self.dec, memoryview(buf))
        t1 = time.perf_counter_ns() if self.prof.enabled else 0
        self._hash(p, memoryview(buf))
        t2 = time.perf_counter_ns() if self.prof.enabled else 0
        self.target.write(p.dest, h.offset, buf)
        if self.prof.enabled:
            self.prof.record("wire", t0, t1, h.length, name=p.name)
            self.prof.record("stage", t2, time.perf_counter_ns(), h.length, name=p.name)

    def _drain(self, n: int) -> None:
        while n:
            chunk = self.scratch[: min(n, len(self.scratch))]
            receive_payload(self.stream, self.dec, chunk)
            n -= len(chunk)

    def _fill(self, f: FillFromCache) -> None:
        p = self.pending.get(f.tensor_id)
        if p is None:
            raise _RequestError(f"FILL_FROM_CACHE of tensor id {f.tensor_id}, which is not allocated")
        if p.digest is not None and p.digest != f.digest:
            raise _RequestError(f"FILL_FROM_CACHE of {p.name!r} names a digest other than its ALLOC's")
        try:
            if p.dest is None and self._fill_from_memory(p, f.digest):
                self._complete(f.tensor_id, p)
                return
            cache = self.srv._cache
            if cache is None:
                self.need[f.tensor_id] = None
                return
            self._ensure_dest(p)  # fresh memory: the helpers fault it in ahead of the reads below
        except _RequestError as e:  # no memory for it after all: nothing of it stays in flight
            self._abandon(f.tensor_id, p, str(e))
            return
        t0 = time.perf_counter_ns() if self.prof.enabled else 0
        try:
            if self.target.memcpy_ok:
                dest = self.target.host_view(p.dest)

                def before(begin: int, end: int) -> None:
                    # as for recv_into: fresh pages faulted inside readinto cost more
                    if self._faulter is None or not self._faulter.ready(p, begin, end):
                        populate(dest[begin:end])

                cache.read_into(f.digest, dest, before=before)
            else:
                cache.read_into_target(
                    f.digest, p.nbytes, lambda off, chunk: self.target.write(p.dest, off, chunk), self.staging()
                )
        except CacheError:
            # The entry was missing or corrupt and is gone now: ask the client for the bytes.
            p.clear()
            self.need[f.tensor_id] = None
            return
        if self.prof.enabled:
            self.prof.record("read", t0, time.perf_counter_ns(), p.nbytes, name=p.name)
        self.srv._count("cache_hits")
        self.srv._count("bytes_from_cache", p.nbytes)
        p.fill()
        p.proven = True  # read_into verified the entry against this digest
        if p.writer is not None:
            p.writer.abort()
            p.writer = None
        self._complete(f.tensor_id, p)

    def _fill_from_memory(self, p: _Pending, digest: bytes) -> bool:
        """Fill ``p`` from a tensor the server holds whose bytes were proven to hash to
        ``digest``: the same name (a second push of unchanged weights keeps the very same
        memory, no copy) or another name (one copy). The held bytes are hashed again first: a
        reader may have written into its tensor since, and an entry is never trusted unchecked."""
        srv = self.srv
        if not srv._caching or not self._pooled:
            return False  # host memory only (and no device is touched to find out)
        with srv._lock:
            mine = srv._store.get(p.name)
            other_name = srv._held.get(digest)
            other = srv._store.get(other_name) if other_name is not None else None
        seen = []
        for name, e in ((p.name, mine), (other_name, other)):
            if e is None or e.digest != digest or e.nbytes != p.nbytes or any(e is x for x in seen):
                continue
            seen.append(e)
            src = np.frombuffer(self.target.host_view(e.tensor), dtype=np.uint8)
            t0 = time.perf_counter_ns() if self.prof.enabled else 0
            ok = hash_buffer(src) == digest
            if self.prof.enabled:
                self.prof.record("hash", t0, time.perf_counter_ns(), p.nbytes, name="verify " + p.name)
            if not ok:  # written since it arrived: no longer proof of anything
                with srv._lock:
                    e.digest = None
                    if srv._held.get(digest) == name:
                        del srv._held[digest]
                continue
            if name == p.name and e.dtype == p.dtype and e.shape == p.shape:
                self._charge(p)
                p.dest = e.tensor  # already there: publish the same memory again
            else:
                self._ensure_dest(p, fault=False)
                t0 = time.perf_counter_ns() if self.prof.enabled else 0
                dst = np.frombuffer(self.target.host_view(p.dest), dtype=np.uint8)
                dst[:] = src  # a user-space copy faults fresh pages itself as cheaply as anything
                if self.prof.enabled:
                    self.prof.record("stage", t0, time.perf_counter_ns(), p.nbytes, name="copy " + p.name)
                if hash_buffer(dst) != digest:  # the source changed under the copy: prove what landed
                    continue
            p.fill()
            p.proven = True
            srv._count("memory_hits")
            srv._count("bytes_from_memory", p.nbytes)
            return True
        return False

    def _cache_failed(self, e: CacheError) -> None:
        if disk_unusable(e):
            self.srv._disable_cache(e)

    def _complete(self, tid: int, p: _Pending) -> None:
        self._unfault(p)
        del self.pending[tid]
        self.need.pop(tid, None)  # the bytes came after all: the client need not send them again
        if p.writer is not None:
            writer, p.writer = p.writer, None
            if p.hashed != p.nbytes:
                writer.abort()
            else:
                try:
                    writer.commit()
                    p.proven = True  # the bytes that arrived hash to the digest
                except CacheError as e:
                    if not isinstance(e.__cause__, OSError):
                        # The bytes that arrived are not the bytes the client hashed.
                        self._release(p)
                        self._error(f"tensor {p.name!r}: the bytes received do not match the digest the client sent")
                        return
                    self._cache_failed(e)
        dest = self.target.finish(p.dest)
        self.srv._publish(p, dest)
        self.done_tensors += 1
        if self.prof.enabled:
            self.prof.count(tensors=1, nbytes=p.nbytes)

    def _drop_pending(self) -> None:
        for p in self.pending.values():
            self._unfault(p)
            if p.writer is not None:
                p.writer.abort()
            self._release(p)
        self.pending.clear()

    def _barrier(self) -> None:
        errors = self.errors
        if self.dropped_errors:
            errors = errors[: MAX_ERRORS - 1] + [f"... and {self.dropped_errors + 1} more errors"]
        self._reply(BarrierReply(self.done_tensors, self.done_bytes, tuple(errors), tuple(self.need)))
        self.errors, self.need = [], {}
        self.dropped_errors = self.done_tensors = self.done_bytes = 0

    # -- serving tensors back ----------------------------------------------------------------------

    def _read(self, r: Read) -> None:
        with self.srv._lock:
            entry = self.srv._store.get(r.name)
        if entry is None:
            self._reply(Error(ErrorCode.NOT_FOUND, f"no tensor {r.name!r}"))
            return
        nbytes, dest = entry.nbytes, entry.tensor
        if r.offset + r.length > nbytes:
            self._reply(Error(ErrorCode.LIMIT, f"READ [{r.offset}, {r.offset + r.length}) runs past the {nbytes} bytes of {r.name!r}"))
            return
        head = send(ReadReply(r.length), minor=self.minor)
        if _is_host(dest):
            from weightlift.memory.targets import as_bytes

            self.stream.send_parts([head, memoryview(as_bytes(dest))[r.offset : r.offset + r.length]])
            return
        import torch

        flat = dest.reshape(-1).view(torch.uint8)
        self.stream.send_parts([head])
        stage = self.staging()
        for pos in range(r.offset, r.offset + r.length, len(stage)):
            n = min(len(stage), r.offset + r.length - pos)
            torch.from_numpy(self._staging[:n]).copy_(flat[pos : pos + n])  # type: ignore[index]
            self.stream.send_parts([stage[:n]])

    def _list(self, req: ListRequest) -> None:
        with self.srv._lock:
            items = sorted(((n, e) for n, e in self.srv._store.items() if n > req.after), key=lambda kv: kv[0])
        budget = self.client_max_frame - 64
        entries: list[ListEntry] = []
        for name, e in items:
            size = 15 + len(name.encode()) + 8 * len(e.shape)
            if len(entries) >= MAX_TENSORS or size > budget:
                break
            budget -= size
            entries.append(ListEntry(name, e.dtype, e.shape, e.nbytes))
        self._reply(ListReply(tuple(entries), more=len(entries) < len(items)))

    def _free(self, names: tuple[str, ...]) -> int:
        freed = 0
        with self.srv._lock:
            for n in names:
                entry = self.srv._store.pop(n, None)
                if entry is not None:
                    self.srv._used -= entry.cost
                    self.srv._unhold(n, entry)
                    freed += 1
        return freed


def _is_host(dest: Any) -> bool:
    if isinstance(dest, np.ndarray):
        return True
    return getattr(getattr(dest, "device", None), "type", "cpu") == "cpu"
