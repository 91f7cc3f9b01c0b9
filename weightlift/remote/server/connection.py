"""One client connection: the frame loop, the handshake, BARRIER, and READ, LIST and FREE.

The connection reads one frame at a time (never past it, so a WRITE's payload stays in the
socket for the receiver to put where it belongs), checks each message against its
:class:`~weightlift.remote.protocol.ServerSession`, and dispatches it. Tensors in flight belong
to its :class:`~weightlift.remote.server.receive.Receiver`; complete tensors and the memory
account belong to the store, which the connection only asks. A protocol or authentication
failure is answered with ERROR before the connection closes, so the client can say why.

On a protected connection (a token, minor 2: :mod:`weightlift.remote.protocol.mac`) every frame
read is fed to the incoming MAC as its bytes arrive, payload bytes as they land in their
destination, and its tag is checked before the frame is acted on; a WRITE's tag is checked
before its bytes count towards the tensor, so a tensor is published only with every WRITE of it
proven. A tag that fails ends the connection, and what it had in flight is dropped.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import blake3
import numpy as np

from weightlift.digest.blake import hash_buffer
from weightlift.errors import AuthError, RemoteProtocolError, TransportError, WeightliftError
from weightlift.memory.targets import Target, as_bytes, make_target
from weightlift.profile import Profiler
from weightlift.remote.protocol import (
    MAX_FRAME,
    MAX_TENSOR_BYTES,
    MAX_TENSORS,
    PROTOCOL_MAJOR,
    Alloc,
    Auth,
    Barrier,
    Bye,
    Capability,
    Error,
    ErrorCode,
    FillFromCache,
    FrameMac,
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
    frame_keys,
    mac_usable,
    new_nonce,
    send,
    server_mac,
    verify_mac,
    verify_usable,
)
from weightlift.remote.server.context import Context
from weightlift.remote.server.frames import FrameReader, FrameTooLarge
from weightlift.remote.server.receive import STAGING_BYTES, Receiver
from weightlift.remote.server.slots import Slot
from weightlift.remote.transport import Stream

__all__ = ["Connection", "LINGER_BYTES", "LINGER_SECONDS"]

LINGER_BYTES = 64 * 1024 * 1024  # after an ERROR, how much of the peer's input to drain before closing
LINGER_SECONDS = 2.0  # ... and for how long at most, however the peer spaces its bytes

_log = logging.getLogger("weightlift.remote.server")


class Connection:
    """One client: reads frames, dispatches them; its receiver owns everything in flight."""

    def __init__(self, ctx: Context, stream: Stream, *, slot: Slot | None = None):
        self.ctx = ctx
        self.slot = slot  # its place among the server's connections: moved to a READY one once READY
        self.store = ctx.store
        self.stream = stream
        self._target: Target | None = ctx.host_target  # a CUDA target is made at the first ALLOC
        self.minor = ctx.minor
        self.session = ServerSession(minor=ctx.minor, auth_required=ctx.token is not None)
        # Until READY: the server's own minor (the client's is not known yet) and tiny frames.
        self.frames = FrameReader(
            stream,
            self.store,
            minor=ctx.minor,
            max_tensor_bytes=self._max_tensor_bytes(),
            handshake_timeout=ctx.handshake_timeout,
            idle_timeout=ctx.idle_timeout,
            io_timeout=ctx.io_timeout,
            min_frame_rate=ctx.min_frame_rate,
        )
        self.nonce = new_nonce()
        self.client_nonce = b""
        self.client_hello: Hello | None = None
        self.server_hello: Hello | None = None
        self.mac_out: FrameMac | None = None  # set once our AUTH went out
        self.client_max_frame = MAX_FRAME
        self.prof = Profiler(ctx.profile)
        self.scratch = self.frames.scratch
        self._staging: np.ndarray | None = None
        self.rx = Receiver(
            ctx,
            payload=self.frames.payload,
            scratch=self.scratch,
            target=lambda: self.target,
            pooled=lambda: self.pooled,
            staging=self.staging,
            prof=self.prof,
            frame_end=self.frames.frame_end,
        )

    def _max_tensor_bytes(self) -> int:
        return min(MAX_TENSOR_BYTES, self.ctx.max_memory)

    @property
    def target(self) -> Target:
        if self._target is None:
            self._target = make_target(self.ctx.device, self.ctx.framework)
        return self._target

    @property
    def pooled(self) -> bool:
        """Whether this connection's tensors land in the server's pooled host memory (checked
        without making a CUDA target)."""
        return self.ctx.pooled and self._target is self.ctx.host_target

    def staging(self) -> memoryview:
        if self._staging is None:
            self._staging = np.empty(STAGING_BYTES, dtype=np.uint8)  # reused, never zero-filled
        return self._staging.data

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while True:
                msg = self.frames.next()
                if msg is None:
                    return
                t0 = time.perf_counter_ns() if self.prof.enabled else 0
                if self.dispatch(msg):
                    return
                if self.prof.enabled:
                    self.prof.command(msg.COMMAND.name, t0, time.perf_counter_ns())
                    self.prof.count(calls=1)
        except RemoteProtocolError as e:
            self._fatal(ErrorCode.PROTOCOL, str(e))
        except AuthError as e:
            self._fatal(ErrorCode.AUTH, str(e))
        except (FrameTooLarge, _Refused) as e:
            self._fatal(ErrorCode.LIMIT, str(e))
        except TransportError:
            if self.frames.handshake_expired:
                what = "HELLO and AUTH" if self.ctx.token is not None else "HELLO"
                self._fatal(ErrorCode.PROTOCOL, f"no {what} within {self.ctx.handshake_timeout:g} s")
            # otherwise the client went away; what it had in flight is dropped below
        except WeightliftError as e:  # the server's own failure (a reply it could not encode, a device)
            _log.warning("weightlift server: connection %s: %s: %s", self.stream.peer, type(e).__name__, e)
            self._fatal(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
        except Exception as e:  # a bug: say so, end this connection only
            _log.exception("weightlift server: connection %s failed", self.stream.peer)
            self._fatal(ErrorCode.INTERNAL, f"internal server error: {type(e).__name__}")
        finally:
            self.rx.close()
            self.frames.close()
            if self.prof.enabled:
                self.ctx.reports.append(self.prof.report())
                sys.stderr.write(f"weightlift server: connection {self.stream.peer} closed\n{self.prof.format()}\n")

    def _fatal(self, code: ErrorCode, message: str) -> None:
        """Reply ERROR, then close without a reset, so the client can read why."""
        self.store.count("errors")
        try:
            self.stream.set_timeout(LINGER_SECONDS)  # a peer that reads nothing must not hold the send
            self.stream.send_parts(self._sealed(send(Error(code, message), minor=self.minor)))
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

    def _sealed(self, *parts: Any) -> list[Any]:
        """``parts`` (one frame and its payload), with the tag after them on a protected connection."""
        if self.mac_out is None:
            return list(parts)
        return [*parts, self.mac_out.seal(parts)]

    def _reply(self, msg: Message) -> None:
        self.stream.send_parts(self._sealed(send(msg, minor=self.minor, max_frame=self.client_max_frame)))

    def _renew_decoder(self) -> None:
        """A decoder for the negotiated minor, and, once READY, the full frame limit.

        A client that negotiated an older minor must not get past the decoder with a command its
        minor lacks (the server could not encode the reply).
        """
        self.frames.renew(self.minor, ready=self.session.state is SessionState.READY)

    def dispatch(self, msg: Message) -> bool:
        """Handle one message; True when the connection should end."""
        if isinstance(msg, Hello):
            if msg.major != PROTOCOL_MAJOR:
                self._fatal(
                    ErrorCode.VERSION,
                    f"client speaks protocol {msg.major}.{msg.minor}; this server speaks {PROTOCOL_MAJOR}.{self.ctx.minor}",
                )
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
            self.rx.write(msg)
        elif isinstance(msg, Alloc):
            self.rx.guard(msg.tensor_id, self.rx.alloc, msg)
        elif isinstance(msg, FillFromCache):
            self.rx.guard(msg.tensor_id, self.rx.fill, msg)
        elif isinstance(msg, Have):
            cache = self.ctx.cache
            self._reply(
                HaveReply(tuple(self.store.holds(d) or (cache is not None and cache.has(d)) for d in msg.digests))
            )
        elif isinstance(msg, Barrier):
            self._reply(self.rx.barrier(msg.flags))
        elif isinstance(msg, Read):
            self._read(msg)
        elif isinstance(msg, ListRequest):
            self._list(msg)
        elif isinstance(msg, Free):
            self._reply(FreeReply(self.store.free(msg.names)))
        elif isinstance(msg, Bye):
            return True
        return False

    # -- handshake -----------------------------------------------------------------------------

    def _hello(self, msg: Hello) -> None:
        self.minor = self.session.hello(msg)
        self.client_nonce = msg.nonce
        self.client_hello = msg
        if msg.max_frame:
            self.client_max_frame = min(msg.max_frame, MAX_FRAME)
        flags = 0
        if self.ctx.cache is not None and self.session.cache_usable():
            flags |= Capability.CACHE
        if self.ctx.token is not None:
            flags |= Capability.AUTH
        if verify_usable(self.minor):
            flags |= Capability.VERIFY
        if mac_usable(self.minor, self.ctx.token):
            flags |= Capability.MAC  # informational: the minor and the token decide, not this bit
        self._take_ready_slot()
        reply = Hello(
            PROTOCOL_MAJOR,
            self.ctx.minor,
            flags,
            MAX_FRAME,
            self._max_tensor_bytes(),
            self.nonce,
            # the memory limit is nothing a peer that has not authenticated needs to know: 0 is
            # "not stated" (a client learns it from a BARRIER's errors when it matters)
            self.ctx.max_memory if self.ctx.token is None else 0,
        )
        self.server_hello = reply
        self.stream.send_parts([send(reply)])
        self._renew_decoder()

    def _take_ready_slot(self) -> None:
        """Once READY (before the reply that tells the client so), move to a READY slot."""
        if self.session.state is SessionState.READY and self.slot is not None:
            refused = self.slot.ready()
            if refused is not None:
                raise _Refused(refused)

    def _auth(self, msg: Auth) -> None:
        token = self.ctx.token
        if token is None:
            raise RemoteProtocolError("AUTH sent to a server that wants none")
        verify_mac(client_mac(token, self.client_nonce, self.nonce), msg.mac, who="client")
        self.session.authenticated()
        self._take_ready_slot()
        c2s = s2c = b""
        if mac_usable(self.minor, token):
            assert self.client_hello is not None and self.server_hello is not None  # set at HELLO
            c2s, s2c = frame_keys(token, self.client_hello, self.server_hello)
            self.frames.mac = FrameMac(c2s)  # every frame after the client's AUTH
        self._reply(Auth(server_mac(token, self.client_nonce, self.nonce)))
        if s2c:
            self.mac_out = FrameMac(s2c)  # every frame after ours
        self._renew_decoder()

    # -- serving tensors back ----------------------------------------------------------------------

    def _read(self, r: Read) -> None:
        entry = self.store.get(r.name)
        if entry is None:
            self._reply(Error(ErrorCode.NOT_FOUND, f"no tensor {r.name!r}"))
            return
        if r.version and r.version != entry.version:
            # the listing the reader works from is out of date: another version's bytes under
            # the listed dtype and shape would be a silent wrong tensor
            self._reply(Error(ErrorCode.STALE, f"{r.name!r} was replaced since it was listed"))
            return
        nbytes, dest = entry.nbytes, entry.tensor
        if r.offset + r.length > nbytes:
            self._reply(
                Error(
                    ErrorCode.LIMIT,
                    f"READ [{r.offset}, {r.offset + r.length}) runs past the {nbytes} bytes of {r.name!r}",
                )
            )
            return
        # The digest is stated before the bytes, so it is taken first: of the tensor as it is now,
        # which is what the reply carries (a stored digest could predate a writer in process).
        want_digest = bool(r.flags & Read.FLAG_DIGEST) and verify_usable(self.minor)
        if _is_host(dest):
            view = as_bytes(dest).data[r.offset : r.offset + r.length]
            digest = hash_buffer(view) if want_digest else None
            self.stream.send_parts(self._sealed(send(ReadReply(r.length, digest), minor=self.minor), view))
            return
        import torch

        flat = dest.reshape(-1).view(torch.uint8)
        stage = self.staging()
        staging = self._staging
        assert staging is not None
        digest = None
        if want_digest:
            hasher = blake3.blake3()
            for pos in range(r.offset, r.offset + r.length, len(stage)):
                n = min(len(stage), r.offset + r.length - pos)
                torch.from_numpy(staging[:n]).copy_(flat[pos : pos + n])
                hasher.update(stage[:n])
            digest = hasher.digest()
        head = send(ReadReply(r.length, digest), minor=self.minor)
        mac = self.mac_out
        if mac is not None:
            mac.begin()
            mac.update(head)
        self.stream.send_parts([head])
        for pos in range(r.offset, r.offset + r.length, len(stage)):
            n = min(len(stage), r.offset + r.length - pos)
            torch.from_numpy(staging[:n]).copy_(flat[pos : pos + n])
            if mac is not None:
                mac.update(stage[:n])
            self.stream.send_parts([stage[:n]])
        if mac is not None:
            self.stream.send_parts([mac.tag()])

    def _list(self, req: ListRequest) -> None:
        items, more = self.store.listing(req.after, MAX_TENSORS)
        budget = self.client_max_frame - 64
        entries: list[ListEntry] = []
        for name, e in items:
            size = 23 + len(name.encode()) + 8 * len(e.shape)
            if size > budget:
                break
            budget -= size
            entries.append(ListEntry(name, e.dtype, e.shape, e.nbytes, e.version))
        self._reply(ListReply(tuple(entries), more=more or len(entries) < len(items)))


class _Refused(Exception):
    """Every READY slot is taken: the connection cannot go on past its handshake."""


def _is_host(dest: Any) -> bool:
    if isinstance(dest, np.ndarray):
        return True
    return getattr(getattr(dest, "device", None), "type", "cpu") == "cpu"
