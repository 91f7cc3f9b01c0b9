"""The push client: sends a checkpoint's tensors to a tensor server, and lists and pulls them back.

Theory of operation: a push is a pipeline, not a conversation. For each tensor the client sends
ALLOC and WRITE headers and the payload in one scatter-gather send, straight from the file's
mapping (or with sendfile for large payloads): no staging copy, no zero-fill, and no reply to
wait for. One BARRIER at the end collects what the server completed and any errors.

Hashing happens only where it can pay: when the server's HELLO says it keeps a cache, and only
for tensors of at least ``hash_threshold`` bytes. Their digests come from the file's sidecar
manifest when it has them (so a second push of the same file hashes nothing) and are otherwise
computed on worker threads while the sender moves the small tensors. Each batch of large
tensors whose digests are ready is asked about in one HAVE; the server fills the ones it has
from its cache, and the rest are sent with their digest so the server can cache them. If a
cache entry turns out to be bad, the BARRIER reply lists the tensor and the client sends it.

``streams=N`` spreads the tensors over N connections, balanced by bytes, one thread each.
``WEIGHTLIFT_LOAD_OPT=0`` restores the naive client for A/B runs: every tensor of at least
10 MiB hashed inline whatever the server, header and payload copied into a fresh zero-filled
buffer, and a BARRIER round trip after every tensor.
"""

from __future__ import annotations

import builtins
import itertools
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from weightlift import env
from weightlift.checkpoint import Checkpoint, Select, open_checkpoint
from weightlift.disk.source import mapped
from weightlift.dtypes import CODES, byte_length
from weightlift.errors import (
    AuthError,
    FileError,
    NotFoundError,
    OptionError,
    RemoteProtocolError,
    StateError,
    TransportError,
    WeightliftError,
)
from weightlift.formats import TensorInfo
from weightlift.formats.safetensors import build_header
from weightlift.profile import Profiler
from weightlift.remote.digest import HASH_THRESHOLD, DigestPool, hash_buffer, hash_tensors
from weightlift.remote.protocol import (
    MAX_FRAME,
    MAX_TENSORS,
    PROTOCOL_MINOR,
    Alloc,
    Auth,
    Barrier,
    BarrierReply,
    Bye,
    ClientSession,
    Decoder,
    Error,
    ErrorCode,
    FillFromCache,
    Free,
    FreeReply,
    Have,
    HaveReply,
    Hello,
    ListReply,
    ListRequest,
    Message,
    Read,
    ReadReply,
    WriteHeader,
    send,
)
from weightlift.remote.transport import TCP, Backend, Stream, receive_message, receive_payload

__all__ = ["Client", "PushResult", "RemoteTensor"]

SENDFILE_MIN = 1 << 20  # below this a header and payload go out in one sendmsg
READ_WINDOW = 32  # READs in flight during a pull
HAVE_BATCH = 4096
# ALLOCs run this far ahead of the WRITEs (bytes, tensors): a server faults a tensor's fresh
# memory in as soon as it is allocated, so it can do the next tensors' while this one arrives.
# Half the server's fault-ahead window (weightlift.remote.server.FAULT_WINDOW): what is allocated
# ahead never takes all of it from the tensor being received.
ALLOC_AHEAD_BYTES = 32 << 20
ALLOC_AHEAD_TENSORS = 64


@dataclass(frozen=True)
class PushResult:
    """What a push did. ``bytes``: tensor bytes now on the server; ``bytes_sent``: payload that
    crossed the wire; ``bytes_hashed``: bytes hashed by this push; ``cached``: tensors the server
    filled from its cache; ``profile``: the profiler report when profiling was on."""

    tensors: int
    bytes: int
    bytes_sent: int
    bytes_hashed: int
    cached: int
    seconds: float
    profile: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class RemoteTensor(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


_ERRORS = {ErrorCode.AUTH: AuthError, ErrorCode.NOT_FOUND: NotFoundError}


def _remote_error(msg: Error) -> WeightliftError:
    cls = _ERRORS.get(msg.code, RemoteProtocolError)  # type: ignore[call-overload]
    return cls(f"server: {msg.message}")


class _Conn:
    """One connection: handshake, framed sends, replies, and the error the server sent on closing."""

    def __init__(self, stream: Stream, *, token: bytes | None, minor: int):
        self.stream = stream
        self.dec = Decoder(our_role="client", minor=minor)
        self.scratch = memoryview(bytearray(64 * 1024))
        self.next_id = 0
        self.session = ClientSession(minor=minor, token=token)
        self.minor = minor
        self.max_frame = MAX_FRAME
        try:
            self._handshake()
        except BaseException:
            self.stream.close()
            raise

    def _handshake(self) -> None:
        self.send(send(self.session.start()))
        auth = self.session.server_hello(self.expect(Hello))
        assert self.session.server is not None  # set by server_hello
        self.server: Hello = self.session.server
        self.minor = self.session.minor
        self.max_frame = self.session.max_frame
        self.cache = self.session.cache
        if auth is not None:
            self.send(send(auth, minor=self.minor))
            self.session.server_auth(self.expect(Auth))

    def frame(self, msg: Message) -> bytes:
        return send(msg, minor=self.minor, max_frame=self.max_frame)

    def send(self, *parts: Any) -> None:
        try:
            self.stream.send_parts(parts)
        except TransportError as e:
            raise self._why_closed(e) from None

    def sendfile(self, fd: int, offset: int, count: int) -> None:
        try:
            self.stream.sendfile(fd, offset, count)
        except TransportError as e:
            raise self._why_closed(e) from None

    def _why_closed(self, e: TransportError) -> WeightliftError:
        """The server's ERROR, if it sent one before closing on us; else the transport error."""
        try:
            self.stream.set_timeout(2.0)
            while True:
                msg = self._next()
                if isinstance(msg, Error):
                    return _remote_error(msg)
                if msg is None:
                    return e
        except WeightliftError:
            return e

    def _next(self) -> Message | None:
        return receive_message(self.stream, self.dec, self.scratch)

    def recv(self) -> Message:
        """The next message; a server ERROR is raised as the matching weightlift error."""
        try:
            msg = self._next()
        except TransportError as e:
            raise self._why_closed(e) from None
        if msg is None:
            raise TransportError(f"{self.stream.peer} closed the connection")
        if isinstance(msg, Error):
            raise _remote_error(msg)
        return msg

    def expect(self, cls: type) -> Any:
        msg = self.recv()
        if not isinstance(msg, cls):
            raise RemoteProtocolError(f"expected {cls.__name__}, server sent {msg.COMMAND.name}")
        return msg

    def recv_payload(self, view: memoryview) -> None:
        try:
            receive_payload(self.stream, self.dec, view)
        except TransportError as e:
            raise self._why_closed(e) from None

    def close(self) -> None:
        try:
            self.stream.send_parts([send(Bye(), minor=self.minor)])
        except (TransportError, AttributeError):
            pass
        self.stream.close()


class _Plan(NamedTuple):
    info: TensorInfo
    dtype: str
    shape: tuple[int, ...]


def _wire_form(t: TensorInfo) -> _Plan:
    """The dtype and shape a tensor travels as: its own, or raw bytes for types the wire lacks."""
    if t.dtype in CODES:
        try:
            if byte_length(t.dtype, t.shape) == t.length:
                return _Plan(t, t.dtype, t.shape)
        except WeightliftError:
            pass
    return _Plan(t, "U8", (t.length,))  # GGUF quantized blocks: pushed as their raw bytes


class _Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tensors = self.bytes = self.sent = self.hashed = self.cached = 0

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)


class Client:
    """A connection (or ``streams`` connections) to a tensor server.

    ``address`` is ``"host:port"`` or ``(host, port)``. ``token`` (str or bytes) answers a server
    that wants AUTH. ``profile``: None reads WEIGHTLIFT_LOADPROF, a bool forces it, or pass a
    :class:`~weightlift.profile.Profiler`. ``protocol_minor`` speaks an older minor version.
    """

    def __init__(
        self,
        address: str | tuple[str, int],
        *,
        token: str | bytes | None = None,
        streams: int = 1,
        profile: Profiler | bool | None = None,
        timeout: float | None = 30.0,
        protocol_minor: int = PROTOCOL_MINOR,
        backend: Backend = TCP,
    ):
        if not isinstance(streams, int) or streams < 1:
            raise OptionError(f"streams must be a positive integer, got {streams!r}")
        if not 0 <= protocol_minor <= PROTOCOL_MINOR:
            raise OptionError(f"protocol_minor must be between 0 and {PROTOCOL_MINOR}")
        self.address = address
        self._token = token.encode() if isinstance(token, str) else token
        self.streams = streams
        self._minor = protocol_minor
        self._timeout = timeout
        self._backend = backend
        self._opt = env.load_opt()
        self.profiler = profile if isinstance(profile, Profiler) else Profiler(profile)
        # A profiler of our own reports one push at a time; one passed in accumulates as its owner wishes.
        self._own_profiler = not isinstance(profile, Profiler)
        self._conns: list[_Conn] = [self._connect()]

    def _connect(self) -> _Conn:
        return _Conn(self._backend.connect(self.address, timeout=self._timeout), token=self._token, minor=self._minor)

    @property
    def server_hello(self) -> Hello:
        """The server's HELLO: its version, capability flags and limits."""
        return self._conn().server

    def _conn(self) -> _Conn:
        if not self._conns:
            raise StateError("the client is closed")
        return self._conns[0]

    def close(self) -> None:
        """Say BYE and close every connection."""
        conns, self._conns = self._conns, []
        for c in conns:
            c.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- push ----------------------------------------------------------------------------------

    def push(
        self,
        source: str | os.PathLike[str] | Checkpoint,
        *,
        select: Select = None,
        hash_threshold: int = HASH_THRESHOLD,
    ) -> PushResult:
        """Send the selected tensors of a checkpoint to the server; returns when all have landed."""
        ck = source if isinstance(source, Checkpoint) else open_checkpoint(source)
        plans = [_wire_form(t) for t in ck.select(select)]
        self._conn()
        while len(self._conns) < self.streams:
            self._conns.append(self._connect())
        conns = self._conns[: self.streams]
        prof = self.profiler
        if self._own_profiler:
            prof.reset()
        tally = _Tally()
        t0 = time.perf_counter()
        hashing = _Hashing(plans, threshold=hash_threshold, prof=prof, enabled=self._opt and conns[0].cache)
        ok = False
        pushers = [_Pusher(c, self._opt, prof, tally, hashing, hash_threshold) for c in conns]
        try:
            groups = _balance(plans, len(conns))
            if len(conns) == 1:
                pushers[0].run(groups[0])
            else:
                self._push_parallel(pushers, groups)
            ok = True
        except BaseException:
            # Unless every connection ended at a BARRIER reply (the server's errors), one may be
            # mid-message or hold tensors allocated ahead and never written: it is unusable.
            if not all(p.settled for p in pushers):
                self.close()
            raise
        finally:
            hashing.close(ok=ok)
        seconds = time.perf_counter() - t0
        return PushResult(
            tally.tensors,
            tally.bytes,
            tally.sent,
            tally.hashed + hashing.hashed_bytes,
            tally.cached,
            seconds,
            prof.report() if prof.enabled else None,
        )

    def _push_parallel(self, pushers: list[_Pusher], groups: list[list[_Plan]]) -> None:
        errors: list[BaseException] = []

        def run(pusher: _Pusher, group: list[_Plan]) -> None:
            try:
                pusher.run(group)
            except BaseException as e:  # re-raised in the caller's thread
                errors.append(e)

        threads = [
            threading.Thread(target=run, args=(p, g), name=f"weightlift-push {i}", daemon=True)
            for i, (p, g) in enumerate(zip(pushers, groups))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    # -- list / pull / free --------------------------------------------------------------------------

    def list(self) -> list[RemoteTensor]:
        """Every complete tensor the server holds, in name order."""
        conn = self._conn()
        out: list[RemoteTensor] = []
        after = ""
        while True:
            conn.send(conn.frame(ListRequest(after)))
            page = conn.expect(ListReply)
            out.extend(RemoteTensor(e.name, e.dtype, e.shape, e.nbytes) for e in page.entries)
            if not page.more or not page.entries:
                return out
            after = page.entries[-1].name

    def free(self, names: Sequence[str]) -> int:
        """Drop the named tensors on the server; returns how many existed."""
        conn = self._conn()
        freed = 0
        batch: list[str] = []
        size = 0
        for n in [names] if isinstance(names, str) else names:
            cost = len(n.encode()) + 2
            if batch and (len(batch) >= MAX_TENSORS or size + cost > conn.max_frame - 64):
                freed += self._free_batch(conn, batch)
                batch, size = [], 0
            batch.append(n)
            size += cost
        return freed + (self._free_batch(conn, batch) if batch else 0)

    @staticmethod
    def _free_batch(conn: _Conn, names: builtins.list[str]) -> int:
        conn.send(conn.frame(Free(tuple(names))))
        return conn.expect(FreeReply).freed

    def pull(self, path: str | os.PathLike[str]) -> builtins.list[RemoteTensor]:
        """Write every tensor the server holds to ``path`` as a .safetensors file; returns them."""
        entries = self.list()
        conn = self._conn()
        header, offsets = build_header([(e.name, e.dtype, e.shape, e.nbytes) for e in entries])
        total = len(header) + sum(e.nbytes for e in entries)
        path = os.fspath(path)
        tmp = f"{path}.{os.getpid()}.wl-tmp"
        try:
            with open(tmp, "w+b") as f:
                f.truncate(total)
                f.write(header)
                f.flush()
                mm = mmap.mmap(f.fileno(), total) if total > len(header) else None
                try:
                    self._read_all(conn, entries, [len(header) + o for o in offsets], mm)
                    if mm is not None:
                        mm.flush()
                finally:
                    if mm is not None:
                        mm.close()
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            raise FileError(f"cannot write: {e.strerror or e}", file=str(path), errno=e.errno) from None
        except BaseException:
            _unlink(tmp)
            self.close()  # replies may still be in flight: the connection is unusable
            raise
        return entries

    def _read_all(
        self, conn: _Conn, entries: builtins.list[RemoteTensor], starts: builtins.list[int], mm: mmap.mmap | None
    ) -> None:
        view = memoryview(mm) if mm is not None else memoryview(b"")
        try:
            sent = 0
            for i, e in enumerate(entries):
                while sent < len(entries) and sent < i + READ_WINDOW:
                    conn.send(conn.frame(Read(entries[sent].name, 0, entries[sent].nbytes)))
                    sent += 1
                reply = conn.expect(ReadReply)
                if reply.length != e.nbytes:
                    raise RemoteProtocolError(f"READ of {e.name!r} returned {reply.length} bytes, not {e.nbytes}")
                conn.recv_payload(view[starts[i] : starts[i] + e.nbytes])
        finally:
            view.release()


class _Hashing:
    """Digests of the large tensors of one push: from the files' manifests, else hashed on a pool.

    Counts the bytes it actually hashes: :func:`hash_tensors` asks for a tensor's bytes only
    when the manifest lacks its digest.
    """

    def __init__(self, plans: list[_Plan], *, threshold: int, prof: Profiler, enabled: bool):
        self.futures: dict[str, Future[bytes]] = {}
        self.hashed_bytes = 0
        self._pool: DigestPool | None = None
        chosen = [p.info for p in plans if p.info.length >= max(threshold, 1)] if enabled else []
        if chosen:
            self._pool = DigestPool(max(1, min(4, (os.cpu_count() or 2) // 2)), profiler=prof)
            self.futures = hash_tensors(chosen, view=self._view, pool=self._pool, threshold=0)

    def _view(self, t: TensorInfo) -> memoryview:
        self.hashed_bytes += t.length
        return mapped(t.file).view(t.offset, t.length)

    def close(self, *, ok: bool) -> None:
        """After a push: wait for the workers (they save the manifests), or cancel on failure."""
        if self._pool is not None:
            self._pool.close(wait=ok)


def _balance(plans: list[_Plan], n: int) -> list[list[_Plan]]:
    """Split into ``n`` groups of about equal bytes; each group keeps file order."""
    if n == 1:
        return [plans]
    groups: list[list[_Plan]] = [[] for _ in range(n)]
    load = [0] * n
    for p in sorted(plans, key=lambda p: -p.info.length):
        i = load.index(min(load))
        groups[i].append(p)
        load[i] += p.info.length
    for g in groups:
        g.sort(key=lambda p: (p.info.file, p.info.offset))
    return groups


class _Pusher:
    """Pushes one group of tensors over one connection."""

    def __init__(self, conn: _Conn, opt: bool, prof: Profiler, tally: _Tally, hashing: _Hashing, threshold: int):
        self.conn, self.opt, self.prof, self.tally, self.hashing = conn, opt, prof, tally, hashing
        self.threshold = threshold
        self.sent: dict[int, _Plan] = {}
        self.ahead: dict[int, int] = {}  # tensors ALLOCated ahead of their WRITE: id(plan) -> tensor id
        self.ahead_bytes = 0
        self.settled = True  # False while frames are out that no BARRIER reply has answered

    def run(self, plans: list[_Plan]) -> None:
        self.settled = not plans
        if not self.opt:
            for p in plans:
                self._naive(p)
            return
        futures = self.hashing.futures
        small = deque(p for p in plans if p.info.name not in futures)
        large = deque(p for p in plans if p.info.name in futures)
        while small or large:
            ready: list[_Plan] = []
            while large and futures[large[0].info.name].done() and len(ready) < HAVE_BATCH:
                ready.append(large.popleft())
            if ready:
                self._large(ready)
            elif small:
                self._send(small.popleft(), None, upcoming=small)
            else:
                futures[large[0].info.name].result()  # nothing else to send: wait for this hash
        self._barrier()

    def _large(self, plans: list[_Plan]) -> None:
        digests = [self.hashing.futures[p.info.name].result() for p in plans]
        have = self._have(digests)
        for p, d, h in zip(plans, digests, have):
            if h:
                self._fill(p, d)
            else:
                self._send(p, d)

    def _fill(self, p: _Plan, digest: bytes) -> None:
        """ALLOC and FILL_FROM_CACHE: the server takes the bytes from its own cache."""
        tid = self._alloc(p, digest)
        self._command(FillFromCache(tid, digest))
        if self.prof.enabled:
            self.prof.count(tensors=1)
        self.tally.add(tensors=1, bytes=p.info.length, cached=1)

    def _have(self, digests: list[bytes]) -> tuple[bool, ...]:
        t0 = time.perf_counter_ns() if self.prof.enabled else 0
        self.conn.send(self.conn.frame(Have(tuple(digests))))
        reply = self.conn.expect(HaveReply)
        if self.prof.enabled:
            self.prof.command("HAVE", t0, time.perf_counter_ns())
        if len(reply.have) != len(digests):
            raise RemoteProtocolError(f"HAVE asked about {len(digests)} digests; the reply has {len(reply.have)}")
        return reply.have

    def _new_id(self, p: _Plan) -> int:
        tid = self.conn.next_id
        self.conn.next_id = (tid + 1) & 0xFFFFFFFF
        self.sent[tid] = p
        return tid

    def _alloc_ahead(self, upcoming: deque[_Plan]) -> bytes:
        """ALLOC frames for the next tensors without a digest, up to the ALLOC_AHEAD limits."""
        frames = []
        for q in itertools.islice(upcoming, ALLOC_AHEAD_TENSORS):
            if id(q) in self.ahead:
                continue  # counted in ahead_bytes already
            if self.ahead_bytes + q.info.length > ALLOC_AHEAD_BYTES:
                break
            if q.info.length:
                tid = self._new_id(q)
                frames.append(self._alloc_frame(tid, q, None))
                self.ahead[id(q)] = tid
                self.ahead_bytes += q.info.length
        return b"".join(frames)

    def _alloc_frame(self, tid: int, p: _Plan, digest: bytes | None) -> bytes:
        return self.conn.frame(Alloc(tid, p.info.name, p.dtype, p.shape, p.info.length, digest))

    def _alloc(self, p: _Plan, digest: bytes | None) -> int:
        tid = self._new_id(p)
        self._command(Alloc(tid, p.info.name, p.dtype, p.shape, p.info.length, digest))
        return tid

    def _command(self, msg: Message) -> None:
        self.conn.send(self.conn.frame(msg))
        if self.prof.enabled:
            self.prof.count(calls=1)

    def _send(
        self, p: _Plan, digest: bytes | None, tid: int | None = None, upcoming: deque[_Plan] | None = None
    ) -> None:
        """ALLOC (unless resending or ALLOCated ahead) and WRITE with the payload, in one send
        where possible; with ``upcoming``, the ALLOCs of the next tensors go out ahead, first."""
        t = p.info
        head = b""
        if tid is None and id(p) in self.ahead:
            tid = self.ahead.pop(id(p))
            self.ahead_bytes -= t.length
        if tid is None:
            tid = self._new_id(p)
            head = self._alloc_frame(tid, p, digest)
        if upcoming:
            head += self._alloc_ahead(upcoming)
        if t.length == 0:  # complete at ALLOC: a WRITE would name a tensor no longer in flight
            self.conn.send(head)
            if self.prof.enabled:
                self.prof.count(tensors=1, calls=1)
            self.tally.add(tensors=1)
            return
        head += self.conn.frame(WriteHeader(tid, 0, t.length))
        t0 = time.perf_counter_ns() if self.prof.enabled else 0
        m = mapped(t.file)
        if t.length >= SENDFILE_MIN:
            self.conn.send(head)
            self.conn.sendfile(m.fileno(), t.offset, t.length)
        else:
            self.conn.send(head, m.view(t.offset, t.length))
        if self.prof.enabled:
            self.prof.record("wire", t0, time.perf_counter_ns(), t.length, name=t.name)
            self.prof.count(tensors=1, calls=2, nbytes=t.length)
        self.tally.add(tensors=1, bytes=t.length, sent=t.length)

    def _barrier(self) -> None:
        for _ in range(3):
            t0 = time.perf_counter_ns() if self.prof.enabled else 0
            self.conn.send(self.conn.frame(Barrier()))
            reply: BarrierReply = self.conn.expect(BarrierReply)
            if self.prof.enabled:
                self.prof.command("BARRIER", t0, time.perf_counter_ns())
            if reply.errors:
                self.settled = not reply.need  # in step with the server, nothing left allocated
                raise RemoteProtocolError("server: " + "; ".join(reply.errors))
            if not reply.need:
                self.settled = True
                return
            for tid in reply.need:  # a cache entry failed its check on the server: send the bytes
                p = self.sent.get(tid)
                if p is None:
                    raise RemoteProtocolError(f"server asks again for tensor id {tid}, which this client never sent")
                self.tally.add(tensors=-1, bytes=-p.info.length, cached=-1)
                self._send(p, None, tid)
        raise RemoteProtocolError("server keeps asking for tensors again")

    def _naive(self, p: _Plan) -> None:
        """The unoptimised path (WEIGHTLIFT_LOAD_OPT=0), kept for A/B runs."""
        self.settled = False
        t = p.info
        view = mapped(t.file).view(t.offset, t.length)
        digest = None
        if t.length >= max(self.threshold, 1):
            t0 = time.perf_counter_ns() if self.prof.enabled else 0
            digest = hash_buffer(view, max_threads=1)
            if self.prof.enabled:
                self.prof.record("hash", t0, time.perf_counter_ns(), t.length, name=t.name)
            self.tally.add(hashed=t.length)
        if digest is not None and self.conn.cache and self._have([digest])[0]:
            self._fill(p, digest)
        else:
            tid = self._new_id(p)
            head = self._alloc_frame(tid, p, digest if self.conn.cache else None)
            if t.length:
                head += self.conn.frame(WriteHeader(tid, 0, t.length))
            t0 = time.perf_counter_ns() if self.prof.enabled else 0
            buf = bytearray(len(head) + t.length)  # zero-filled, then copied into: the staging cost
            buf[: len(head)] = head
            buf[len(head) :] = view
            t1 = time.perf_counter_ns() if self.prof.enabled else 0
            self.conn.send(buf)
            if self.prof.enabled:
                self.prof.record("stage", t0, t1, t.length, name=t.name)
                self.prof.record("wire", t1, time.perf_counter_ns(), t.length, name=t.name)
                self.prof.count(tensors=1, calls=2, nbytes=t.length)
            self.tally.add(tensors=1, bytes=t.length, sent=t.length)
        self._barrier()  # one round trip per tensor


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
