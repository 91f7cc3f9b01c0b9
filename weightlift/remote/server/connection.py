"""One client connection: the message loop, the handshake, and one handler per message type.

The connection takes one message at a time from its :class:`FrameReader` (which never
reads past a frame, so a WRITE's payload stays in the socket for the receive path to put where
it belongs), checks it against its :class:`~weightlift.remote.protocol.ServerSession`, and hands
it to the handler its type names in the connection's table. Tensors in flight belong to its
:class:`~.receive.Receiver`; READ, LIST, FREE and HAVE to its :class:`~.reads.Reads`; complete
tensors and the memory account to the store, which the connection only asks. A protocol or
authentication failure is answered with ERROR before the connection closes, so the client can
say why.

The receive path (direct, or the naive one of ``WEIGHTLIFT_LOAD_OPT=0``) is chosen here, once,
from the server's config.

On a protected connection (a token, minor 2: :mod:`weightlift.remote.protocol.mac`) every frame
read is fed to the incoming MAC as its bytes arrive, payload bytes as they land in their
destination, and its tag is checked before the frame is acted on; a WRITE's tag is checked
before its bytes count towards the tensor, so a tensor is published only with every WRITE of it
proven. A tag that fails ends the connection, and what it had in flight is dropped.

The frames are read off the stream under the limits that bound what a peer can hold. A
:class:`FrameReader` owns everything between the socket and a decoded message: the decoder
(never fed past the current frame, so a WRITE's payload stays in the socket until the receiver
says where it goes), the scratch buffer, the incoming frame MAC, the charge for a frame larger
than the scratch buffer, and the clocks:

* until the connection is READY every receive waits only for what is left of the handshake
  deadline;
* after it, the wait for the next request is bounded by the idle timeout, and every receive
  inside a frame or its payload by the I/O timeout;
* and a whole frame, payload included, must arrive within ``io_timeout + N / min_frame_rate``
  seconds of its first byte (N its size in bytes): a peer that sends one byte just inside each
  I/O timeout cannot hold a connection for longer than that.

A peer that trickles (two receives in a row inside one frame bringing fewer than
:data:`TRICKLE_BYTES`) is read after a short pause per receive, so that its bytes gather in the
socket and the server's cost per byte does not depend on how the peer fragments them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from weightlift.errors import AuthError, LocalProtocolError, RemoteProtocolError, TransportError, WeightliftError
from weightlift.profile import Profiler
from weightlift.remote import delta as codec
from weightlift.remote.protocol import (
    MAX_FRAME,
    MAX_HANDSHAKE_FRAME,
    MAX_MODELS,
    MAX_TENSOR_BYTES,
    NEED_DATA,
    PAYLOAD_COMMANDS,
    PROTOCOL_MAJOR,
    Alloc,
    Auth,
    Barrier,
    Bye,
    Capability,
    Commit,
    CommitReply,
    Decoder,
    Delta,
    Error,
    ErrorCode,
    Expect,
    FillFromCache,
    FrameMac,
    Free,
    FreeReply,
    Have,
    Hello,
    LayoutReply,
    LayoutRequest,
    ListRequest,
    Message,
    ModelStats,
    Read,
    Region,
    RelayEnd,
    Remove,
    ServerSession,
    SessionState,
    SketchRequest,
    Stats,
    StatsReply,
    Update,
    UseModel,
    WriteHeader,
    client_mac,
    frame_keys,
    mac_usable,
    new_nonce,
    planes_usable,
    regions_usable,
    send,
    server_mac,
    update_usable,
    verify_mac,
    verify_usable,
)
from weightlift.remote.protocol import Relay as RelayRequest
from weightlift.remote.protocol import Switch as SwitchRequest
from weightlift.remote.server.admission import Context, RequestError, Slot
from weightlift.remote.server.reads import Outbox, Reads
from weightlift.remote.server.receive import (
    Destinations,
    DirectPath,
    NaivePath,
    PayloadPath,
    Receiver,
    Regions,
    Staging,
    Wire,
)
from weightlift.remote.server.relay import Relays
from weightlift.remote.server.store import Charge, MemoryFull, Store
from weightlift.remote.server.updates.delta import Deltas
from weightlift.remote.server.updates.switch import Switch
from weightlift.remote.transport import Stream, receive_tag

__all__ = [
    "Connection",
    "LINGER_BYTES",
    "LINGER_SECONDS",
    "FrameReader",
    "FrameTooLarge",
    "SCRATCH_BYTES",
    "TRICKLE_BYTES",
    "TRICKLE_PAUSE",
    "FRAME_SLACK",
]

LINGER_BYTES = 64 * 1024 * 1024  # after an ERROR, how much of the peer's input to drain before closing
LINGER_SECONDS = 2.0  # ... and for how long at most, however the peer spaces its bytes

_log = logging.getLogger("weightlift.remote.server")
# the operator's log: one key=value line per event (a barrier, a commit, a refusal), never per frame
_events = logging.getLogger("weightlift.server.connection")


class Connection:
    """One client: reads messages and hands each to its handler."""

    def __init__(self, ctx: Context, stream: Stream, *, slot: Slot | None = None):
        config = ctx.config
        self.ctx = ctx
        self.slot = slot  # its place among the server's connections: moved to a READY one once READY
        self.store = ctx.store
        self.stream = stream
        self.minor = config.protocol_minor
        self.session = ServerSession(minor=self.minor, auth_required=config.token is not None)
        # Until READY: the server's own minor (the client's is not known yet) and tiny frames.
        self.frames = FrameReader(
            stream,
            self.store,
            minor=self.minor,
            max_tensor_bytes=self._max_tensor_bytes(),
            handshake_timeout=config.handshake_timeout,
            idle_timeout=config.idle_timeout,
            io_timeout=config.io_timeout,
            min_frame_rate=config.min_frame_rate,
        )
        self.out = Outbox(stream, self.minor)
        self.nonce = new_nonce()
        self.client_nonce = b""
        self.client_hello: Hello | None = None
        self.server_hello: Hello | None = None
        self.prof = Profiler(config.profile)
        self.staging = Staging(ctx)
        self.rx = self._receiver()
        self.reads = Reads(ctx, self.out, self.staging)
        self._done = False  # set by a handler when the connection is to end
        self.model = ""  # the model this connection's requests name (MODEL, minor 5)
        self.switch: Switch | None = None  # the open update (UPDATE to COMMIT), or the one it joined
        self.joined = False  # ... opened on another connection (the opener commits it)
        self.relays = Relays(ctx, self.rx, self.out.reply, self._event)  # RELAY to RELAY_END
        self.deltas = Deltas(
            self.store,
            self.rx,
            self.frames,
            lambda: self.switch,
            self.prof,
            enabled=self._deltas_usable(),
            planes=lambda: planes_usable(self.minor),
        )
        self.regions = Regions(ctx.assembly, self.store, self.frames.payload, self.frames.drain, self.frames.frame_end)
        rx = self.rx
        self._handlers: dict[type[Message], Callable[[Any], None]] = {
            Auth: self._auth,
            WriteHeader: rx.write,
            Alloc: lambda m: rx.guard(m.tensor_id, self._alloc, m),
            FillFromCache: lambda m: rx.guard(m.tensor_id, rx.fill, m),
            Have: self.reads.have,
            Barrier: self._barrier,
            Read: self.reads.read,
            ListRequest: self.reads.list,
            Free: self.reads.free,
            Bye: self._bye,
            Delta: lambda m: self.deltas.delta(self._named(m)),
            Update: self._update,
            Commit: self._commit,
            LayoutRequest: self._layout,
            Region: lambda m: self.regions.region(m, self.model),
            Expect: lambda m: self.regions.expect(m, self.model),
            SketchRequest: lambda m: self.out.reply(self.regions.sketch(m)),
            SwitchRequest: lambda m: self.out.reply(self.regions.switch(m)),
            UseModel: self._use,
            Stats: self._stats,
            Remove: self._remove,
            RelayRequest: self._relay,
            RelayEnd: self._relay_end,
        }

    def _receiver(self) -> Receiver:
        """The receiver, with the receive path the server's config asks for (chosen once)."""
        wire = Wire(self.frames.payload, self.staging, self.store, self.prof, lambda e: self.rx.cache_failed(e))
        path: PayloadPath = NaivePath(wire) if self.ctx.config.naive else DirectPath(wire)
        dests = Destinations(self.ctx, self.staging, fault_ahead=path.fault_ahead)
        return Receiver(
            self.ctx,
            self.staging,
            path=path,
            dests=dests,
            drain=self.frames.drain,
            prof=self.prof,
            frame_end=self.frames.frame_end,
        )

    def _max_tensor_bytes(self) -> int:
        return min(MAX_TENSOR_BYTES, self.ctx.config.max_memory)

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self._done:
                msg = self.frames.next()
                if msg is None:
                    return
                t0 = self.prof.clock()
                self.dispatch(msg)
                if not self._done:
                    self.prof.command(msg.COMMAND.name, t0, self.prof.clock())
                    self.prof.count(calls=1)
        except RemoteProtocolError as e:
            self._event(logging.WARNING, "protocol_error", reason=str(e))
            self._fatal(ErrorCode.PROTOCOL, str(e))
        except AuthError as e:
            self._event(logging.WARNING, "auth_failed", reason=str(e))
            self._fatal(ErrorCode.AUTH, str(e))
        except (FrameTooLarge, _Refused) as e:
            limit = "frame_size" if isinstance(e, FrameTooLarge) else "ready_connections"
            self._event(logging.WARNING, "refused", limit=limit, reason=str(e))
            self._fatal(ErrorCode.LIMIT, str(e))
        except TransportError as e:
            if "TLS" in str(e):  # a handshake that failed: a plaintext client, a certificate refused
                self._event(logging.WARNING, "tls_failed", reason=str(e))
            if self.frames.handshake_expired:
                what = "HELLO and AUTH" if self.ctx.config.token is not None else "HELLO"
                self._fatal(ErrorCode.PROTOCOL, f"no {what} within {self.ctx.config.handshake_timeout:g} s")
            # otherwise the client went away; what it had in flight is dropped below
        except WeightliftError as e:  # the server's own failure (a reply it could not encode, a device)
            _log.warning("weightlift server: connection %s: %s: %s", self.stream.peer, type(e).__name__, e)
            self._fatal(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
        except Exception as e:  # a bug: say so, end this connection only
            _log.exception("weightlift server: connection %s failed", self.stream.peer)
            self._fatal(ErrorCode.INTERNAL, f"internal server error: {type(e).__name__}")
        finally:
            self._close()

    def _close(self) -> None:
        self.relays.close()
        if self.switch is not None and not self.switch.closed:  # ended mid-update: nothing it held shows
            why = "server stopping" if self.ctx.stopping.is_set() else "connection closed"
            self._rolled_back(self.switch, why)
        self.switch = None
        self.regions.close()
        self.rx.close()
        self.frames.close()
        self.staging.close()
        if self.prof.enabled:
            self.ctx.reports.append(self.prof.report())
            sys.stderr.write(f"weightlift server: connection {self.stream.peer} closed\n{self.prof.format()}\n")

    def dispatch(self, msg: Message) -> None:
        """Handle one message (a HELLO before the session's check, which it starts)."""
        if isinstance(msg, Hello):
            self._hello(msg)
            return
        try:
            self.session.check(msg)
        except RemoteProtocolError:
            if self.session.state is SessionState.AWAIT_AUTH:
                raise AuthError(f"{msg.COMMAND.name} before AUTH: this server wants a token") from None
            raise
        self._handlers[type(msg)](msg)

    def _event(self, level: int, event: str, **fields: object) -> None:
        if _events.isEnabledFor(level):
            text = " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in fields.items())
            _events.log(level, "event=%s peer=%s %s", event, self.stream.peer, text)

    def _barrier(self, msg: Barrier) -> None:
        reply = self.rx.barrier(msg.flags)
        if self.model and reply.errors:  # a tensor is named as its client named it, not by its store key
            reply = dataclasses.replace(reply, errors=tuple(_shown(e) for e in reply.errors))
        if reply.errors and self.switch is not None and not self.switch.closed and not self.switch.refused:
            self.switch.refused = True  # a limit refused part of the push: it is not made visible
            self.store.count("pushes_refused")
        self.out.reply(reply)
        # a push ends with a barrier: what it published, and its first refusal (a memory limit...)
        level = logging.WARNING if reply.errors else logging.INFO
        first = {"error": reply.errors[0]} if reply.errors else {}
        self._event(level, "barrier", tensors=reply.tensors, bytes=reply.nbytes, errors=len(reply.errors), **first)

    def _layout(self, msg: LayoutRequest) -> None:
        slices = self.ctx.config.slices
        self.out.reply(slices.describe() if slices is not None else LayoutReply(0, 0))

    def _bye(self, msg: Bye) -> None:
        self._done = True

    # -- updates ---------------------------------------------------------------------------------

    def _deltas_usable(self) -> bool:
        """DELTAs apply to host memory, with the codec installed (the DELTA flag says so), of a
        server that holds whole tensors."""
        return self.ctx.pooled and codec.available() and self.ctx.config.slices is None

    def _update(self, msg: Update) -> None:
        if self.relays.open:
            raise RemoteProtocolError("UPDATE while a relay is open on this connection")
        if self.switch is not None and not self.switch.closed:
            raise RemoteProtocolError("UPDATE while an update is open on this connection")
        units = self.ctx.units
        if msg.flags & Update.FLAG_JOIN:
            switch = units.joinable(msg.push)
            if switch.model != self.model:
                raise RemoteProtocolError(f"UPDATE joins push {msg.push} into model {self.model!r}; it fills another")
            if switch.in_place_mode:  # its COMMIT holds readers off memory other connections may be filling
                raise RemoteProtocolError(f"UPDATE joins push {msg.push}, an in-place update: it takes no others")
            self.switch, self.joined = switch, True
        else:
            in_place = bool(msg.flags & Update.FLAG_IN_PLACE)
            switch = Switch(self.store, in_place=in_place, cache=self.ctx.cache, model=self.model)
            units.opened(switch, msg.push)
            self.switch, self.joined = switch, False
        self.rx.publish = switch.hold

    def _relay(self, msg: RelayRequest) -> None:
        """RELAY: forward what this connection proves, and hold it as one unit (an update that
        RELAY_END prepares and COMMIT switches in, here and down the chain)."""
        if self.switch is not None and not self.switch.closed:
            raise RemoteProtocolError("RELAY inside an update: a relayed push is an update of its own")
        self.relays.start(msg)
        if self.relays.open:
            switch = Switch(self.store, in_place=False, cache=self.ctx.cache, model=self.model)
            self.ctx.units.opened(switch)
            self.switch, self.joined = switch, False
            self.rx.publish = switch.hold

    def _relay_end(self, msg: RelayEnd) -> None:
        """RELAY_END: the unit prepared here (every tensor held, none in flight or refused) and,
        through the relay, at every hop downstream; the reply says so or names the hop that is not."""
        switch = self.switch
        why = ""
        if switch is None or switch.closed:
            why = "its update was dropped"
        elif self.rx.pending:
            why = f"{len(self.rx.pending)} tensors still in flight (BARRIER first)"
        elif switch.refused:
            why = "a limit refused part of the push"
        if why and switch is not None:  # no COMMIT follows: nothing of it shows here or downstream
            self.switch = None
            self.rx.publish = self.store.publish
            if not switch.closed:
                self._rolled_back(switch, why)
        self.relays.end(msg, refused=why)

    def _commit(self, msg: Commit) -> None:
        switch = self.switch
        if self.relays.open:
            raise RemoteProtocolError("COMMIT of a relayed push before its RELAY_END")
        if switch is None or switch.closed or self.joined:
            why = "of an update opened on another connection" if self.joined else "without an open update"
            raise RemoteProtocolError(f"COMMIT {why}")
        self.switch = None
        self.rx.publish = self.store.publish
        if self.rx.pending:  # a tensor still in flight would miss the switch: refuse the whole set
            why = f"update not switched: {len(self.rx.pending)} tensors still in flight (BARRIER first)"
            self._rolled_back(switch, why)
            self.relays.decide(False)
            self.out.reply(CommitReply(False, 0, self.store.generation, bytes(32), why))
            return
        if msg.flags & Commit.FLAG_ABORT:
            self._rolled_back(switch, "aborted by the client")
            self.relays.decide(False)
            self.out.reply(CommitReply(False, 0, self.store.generation, bytes(32), "update aborted"))
            return
        reply = switch.commit(root=not msg.flags & Commit.FLAG_NO_ROOT)
        self.ctx.units.ended(switch)
        # a relayed push: the decision goes down the chain once this hop has switched (or failed to)
        reply = self.relays.decide(reply.ok, reply) or reply
        self.out.reply(reply)
        if reply.ok:
            self.store.count("pushes_committed")
            self._event(logging.INFO, "push_committed", model=switch.model, tensors=reply.tensors)
        else:
            self.store.count("pushes_rolled_back")
            self._event(logging.WARNING, "push_rolled_back", model=switch.model, reason=reply.message)
        self._event(logging.INFO, "commit", ok=reply.ok, tensors=reply.tensors, generation=reply.generation)

    def _rolled_back(self, switch: Switch, why: str) -> None:
        """Drop an open update (the whole of it, whichever connections joined it), saying so."""
        held = switch.abort()
        self.ctx.units.ended(switch)
        self.store.count("pushes_rolled_back")
        self._event(
            logging.WARNING, "push_rolled_back", model=switch.model, tensors=held, refused=switch.refused, reason=why
        )

    # -- models and the operator's requests ------------------------------------------------------

    def _alloc(self, msg: Alloc) -> None:
        key = self.reads.key(msg.name)
        if key is None:  # the store keeps named models' tensors under such keys
            raise RequestError(f"tensor {msg.name!r}: a tensor name cannot begin with NUL")
        self.rx.alloc(dataclasses.replace(msg, name=key) if key != msg.name else msg)

    def _named(self, msg: Delta) -> Delta:
        """A DELTA with its name made the store's key in this connection's model."""
        key = self.reads.key(msg.name)
        if key is None:
            raise RemoteProtocolError(f"DELTA of {msg.name!r}: a tensor name cannot begin with NUL")
        return dataclasses.replace(msg, name=key) if key != msg.name else msg

    def _use(self, msg: UseModel) -> None:
        switch = self.switch
        if switch is not None and not switch.closed and msg.model != switch.model:  # one update, one model
            raise RemoteProtocolError(f"MODEL {msg.model!r} inside an update of model {switch.model!r}")
        self.model = self.reads.model = msg.model

    def _stats(self, msg: Stats) -> None:
        self.store.count("stats_requests")
        figures = tuple(self.ctx.stats().items())
        pushing = self.ctx.units.pushing()
        held = self.store.models()
        names = sorted(set(held) | pushing)
        models = tuple(ModelStats(m, *held.get(m, (0, 0)), pushing=m in pushing) for m in names[:MAX_MODELS])
        self.out.reply(StatsReply(figures, models, len(names)))
        self._event(logging.INFO, "stats", models=len(names))

    def _remove(self, msg: Remove) -> None:
        if msg.model in self.ctx.units.pushing():
            why = f"a push to model {msg.model!r} is in flight: nothing removed"
            self._event(logging.WARNING, "remove_refused", model=msg.model, reason=why)
            self.out.reply(Error(ErrorCode.BUSY, why))
            return
        if not msg.model and self.ctx.assembly is not None:  # REGIONs fill the default model
            building = self.ctx.assembly.remove()
            if building is not None:
                why = f"model '': {building}: nothing removed"
                self._event(logging.WARNING, "remove_refused", model=msg.model, reason=why)
                self.out.reply(Error(ErrorCode.BUSY, why))
                return
        freed = self.store.free(tuple(self.store.model_keys(msg.model)))
        self.store.count("removes")
        self.out.reply(FreeReply(freed))
        self._event(logging.INFO, "remove", model=msg.model, tensors=freed)

    def _fatal(self, code: ErrorCode, message: str) -> None:
        """Reply ERROR, then close without a reset, so the client can read why."""
        self.store.count("errors")
        try:
            self.stream.set_timeout(LINGER_SECONDS)  # a peer that reads nothing must not hold the send
            self.stream.send_parts(self.out.sealed(send(Error(code, message), minor=self.minor)))
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
                n = self.stream.recv_into(self.frames.scratch)
                if n == 0:
                    break
                drained += n
        except TransportError:
            pass

    def _renew_decoder(self) -> None:
        """A decoder for the negotiated minor, and, once READY, the full frame limit: a client
        that negotiated an older minor must not get past the decoder with a command its minor
        lacks (the server could not encode the reply)."""
        self.frames.renew(self.minor, ready=self.session.state is SessionState.READY)

    # -- handshake -----------------------------------------------------------------------------

    def _hello(self, msg: Hello) -> None:
        config = self.ctx.config
        if msg.major != PROTOCOL_MAJOR:
            self._fatal(
                ErrorCode.VERSION,
                f"client speaks protocol {msg.major}.{msg.minor}; this server speaks {PROTOCOL_MAJOR}.{config.protocol_minor}",
            )
            self._done = True
            return
        self.minor = self.out.minor = self.session.hello(msg)
        self.client_nonce = msg.nonce
        self.client_hello = msg
        if msg.max_frame:
            self.out.max_frame = min(msg.max_frame, MAX_FRAME)
        self._take_ready_slot()
        reply = Hello(
            PROTOCOL_MAJOR,
            config.protocol_minor,
            self._capabilities(),
            MAX_FRAME,
            self._max_tensor_bytes(),
            self.nonce,
            # the memory limit is nothing a peer that has not authenticated needs to know: 0 is
            # "not stated" (a client learns it from a BARRIER's errors when it matters)
            config.max_memory if config.token is None else 0,
        )
        self.server_hello = reply
        self.stream.send_parts([send(reply)])
        self._renew_decoder()

    def _capabilities(self) -> int:
        token = self.ctx.config.token
        flags = 0
        if self.ctx.cache is not None and self.session.cache_usable():
            flags |= Capability.CACHE
        if token is not None:
            flags |= Capability.AUTH
        if verify_usable(self.minor):
            flags |= Capability.VERIFY
        if mac_usable(self.minor, token):
            flags |= Capability.MAC  # informational: the minor and the token decide, not this bit
        if update_usable(self.minor) and self._deltas_usable():
            flags |= Capability.DELTA
        if regions_usable(self.minor) and self.ctx.config.slices is not None:
            flags |= Capability.SHARDED
        return flags

    def _take_ready_slot(self) -> None:
        """Once READY (before the reply that tells the client so), move to a READY slot."""
        if self.session.state is SessionState.READY and self.slot is not None:
            refused = self.slot.ready()
            if refused is not None:
                raise _Refused(refused)

    def _auth(self, msg: Auth) -> None:
        token = self.ctx.config.token
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
        self.out.reply(Auth(server_mac(token, self.client_nonce, self.nonce)))
        if s2c:
            self.out.mac = FrameMac(s2c)  # every frame after ours
        self._renew_decoder()


def _shown(text: str) -> str:
    """``text`` with each model key written as the names a client gave (tensor, model)."""
    return _KEY.sub(lambda m: f"'{m.group(2)}' (model '{m.group(1)}')", text)


_KEY = re.compile(r"'\\x00([^'\\]*)\\x00([^']*)'")  # a model_key as repr() writes it


class _Refused(Exception):
    """Every READY slot is taken: the connection cannot go on past its handshake."""


# -- the frames: reading one client's frames off its stream, under the limits ----------------------


SCRATCH_BYTES = 64 * 1024  # frame headers and drained payloads
TRICKLE_BYTES = 512  # two receives in a row inside one frame or payload bringing less than this ...
TRICKLE_PAUSE = 0.002  # ... and the next waits this long first, so that bytes gather in the socket
FRAME_SLACK = 1 / 8  # a frame buffer is charged its length and this much more (a bytearray over-allocates)


class FrameTooLarge(Exception):
    """A frame whose buffer would take the server past max_memory."""


class FrameReader:
    """One connection's incoming frames: :meth:`next` for messages, :meth:`payload` for the
    bytes of the current WRITE, :meth:`frame_end` to check a protected WRITE's tag.

    ``handshake_timeout`` starts the handshake clock now; :meth:`ready` stops it.
    ``io_timeout`` and ``idle_timeout`` None mean no limit; so does ``min_frame_rate`` None (no
    frame deadline; so, too, without an ``io_timeout``).
    """

    def __init__(
        self,
        stream: Stream,
        store: Store,
        *,
        minor: int,
        max_tensor_bytes: int,
        handshake_timeout: float,
        idle_timeout: float | None,
        io_timeout: float | None,
        min_frame_rate: int | None,
    ):
        self.stream = stream
        self._store = store
        self._max_tensor_bytes = max_tensor_bytes
        self._idle_timeout = idle_timeout
        self._io_timeout = io_timeout
        self._rate = min_frame_rate if io_timeout is not None else None
        self.dec = Decoder(
            our_role="server", minor=minor, max_frame=MAX_HANDSHAKE_FRAME, max_tensor_bytes=max_tensor_bytes
        )
        self.deadline: float | None = time.monotonic() + handshake_timeout  # None once READY
        self.mac: FrameMac | None = None  # set once the client's AUTH checks (protected connections)
        self.scratch = memoryview(bytearray(SCRATCH_BYTES))
        self._frame_charge: Charge | None = None  # a frame larger than scratch, while it is buffered
        self._timeout: float | None = -1.0  # the stream's timeout as last set (-1: not set yet)
        self._frame_start: float | None = None  # when the current frame's first byte came
        self._frame_bytes = 0  # the current frame's size as far as known, payload included
        self._minor = minor

    # -- clocks --------------------------------------------------------------------------------

    @property
    def handshake_expired(self) -> bool:
        """Whether the handshake deadline passed before the connection was READY."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    def set_timeout(self, seconds: float | None) -> None:
        """The stream's receive and send timeout, set only when it changes."""
        if seconds != self._timeout:
            self.stream.set_timeout(seconds)
            self._timeout = seconds

    def _inside_frame(self) -> float | None:
        """The timeout for one receive inside the current frame: the I/O timeout, or what is left
        of the frame's deadline where that is less; TransportError once the deadline passed."""
        io, rate, start = self._io_timeout, self._rate, self._frame_start
        if io is None or rate is None or start is None:
            return io
        left = start + io + self._frame_bytes / rate - time.monotonic()
        if left <= 0:
            why = f"a frame of {self._frame_bytes} bytes did not arrive within {io:g} s plus 1 s per {rate} bytes"
            _log.info("weightlift server: closing %s: %s", self.stream.peer, why)
            raise TransportError(why)
        return left if left < io else io

    def _before_receive(self) -> None:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TransportError("the peer did not send a whole message in time")
            self.stream.set_timeout(left)
            self._timeout = -1.0
        elif self.dec.at_boundary:
            self.set_timeout(self._idle_timeout)
        else:
            self.set_timeout(self._inside_frame())

    # -- frames --------------------------------------------------------------------------------

    def next(self) -> Message | None:
        """The next message; None if the peer closed cleanly between frames.

        Reads exactly what the decoder still wants, at most a scratch buffer at a time. A frame
        larger than the scratch buffer is charged to max_memory while the decoder buffers it.
        On a protected connection the frame's tag is checked before its body is decoded (that
        of a WRITE once its payload is in: :meth:`frame_end`).
        """
        dec, mac = self.dec, self.mac
        if mac is not None:
            mac.begin()
        if dec.at_boundary:
            self._frame_start = None
        small = 0  # receives in a row inside this frame that brought fewer than TRICKLE_BYTES
        checked = mac is None
        while True:
            if not checked:
                cmd = dec.complete_frame()
                if cmd is not None and cmd not in PAYLOAD_COMMANDS:
                    receive_tag(self.stream, mac)  # type: ignore[arg-type]  # before the body is decoded
                    checked = True
            ev = dec.next_event()
            if ev is not NEED_DATA:
                return self._decoded(ev, checked)  # type: ignore[arg-type]
            want = dec.bytes_wanted()
            self._frame_bytes = max(self._frame_bytes, dec.buffered + want)
            if want > len(self.scratch) and self._frame_charge is None:
                self._charge_frame(want + dec.buffered)
            self._before_receive()
            if small >= 2 and not dec.at_boundary:
                time.sleep(TRICKLE_PAUSE)  # a trickling peer: let its bytes gather
            n = self._receive(self.scratch[: min(want, len(self.scratch))])
            if n == 0:
                if dec.at_boundary:
                    return None
                raise TransportError("the peer closed the connection inside a frame")
            if self._frame_start is None:
                self._frame_start, self._frame_bytes = time.monotonic(), 0
            dec.feed(self.scratch[:n])
            if mac is not None:
                mac.update(self.scratch[:n])
            small = small + 1 if n < min(want, TRICKLE_BYTES) or small >= 2 else 0  # once trickling, for the rest

    def _decoded(self, msg: Message, checked: bool) -> Message:
        if not checked and not msg.length:  # type: ignore[attr-defined]  # an empty WRITE
            receive_tag(self.stream, self.mac)  # type: ignore[arg-type]
        if msg.HAS_PAYLOAD:
            self._frame_bytes += msg.length  # type: ignore[attr-defined]  # the payload is part of the frame
        if self._frame_charge is not None:
            self._frame_charge.release()
            self._frame_charge = None
            if self.dec.at_boundary:
                self._new_decoder(self._minor, ready=self.deadline is None)  # its buffer's memory goes with it
        if self.deadline is None:
            self.set_timeout(self._io_timeout)  # the payload and the reply
        return msg

    def _charge_frame(self, size: int) -> None:
        try:
            self._frame_charge = self._store.charge(size + int(size * FRAME_SLACK))
        except MemoryFull as e:
            raise FrameTooLarge(f"a frame of {size} bytes: {e}") from None

    def _receive(self, view: memoryview) -> int:
        try:
            return self.stream.recv_into(view)
        except TransportError as e:
            if self.deadline is None:
                what = "idle" if self.dec.at_boundary else "stalled inside a frame"
                _log.info("weightlift server: closing %s: %s (%s)", self.stream.peer, what, e)
            raise

    def _new_decoder(self, minor: int, *, ready: bool) -> None:
        self.dec = Decoder(
            our_role="server",
            minor=minor,
            max_frame=MAX_FRAME if ready else MAX_HANDSHAKE_FRAME,
            max_tensor_bytes=self._max_tensor_bytes,
        )

    def renew(self, minor: int, *, ready: bool) -> None:
        """A decoder for the negotiated ``minor``, and, once ``ready``, the full frame limit and
        no handshake deadline. Nothing is buffered when this runs: :meth:`next` never reads
        past a frame."""
        if not self.dec.at_boundary:
            raise LocalProtocolError("decoder replaced inside a frame")
        self._minor = minor
        self._new_decoder(minor, ready=ready)
        if ready:
            self.deadline = None
            self.set_timeout(self._io_timeout)

    # -- payloads ------------------------------------------------------------------------------

    def payload(self, view: memoryview) -> None:
        """Fill ``view`` with the next payload bytes of the current WRITE, straight from the
        socket, under the frame's deadline; trickled bytes are read after a short pause."""
        got = start = self.dec.payload_into(view)  # bytes the decoder held were MACed as they came
        small = 0
        while got < len(view):
            if self.deadline is None:
                self.set_timeout(self._inside_frame())
            if small >= 2:
                time.sleep(TRICKLE_PAUSE)
            n = self._receive(view[got:])
            if n == 0:
                raise TransportError("the peer closed the connection inside a payload")
            self.dec.payload_received(n)
            got += n
            small = small + 1 if n < TRICKLE_BYTES or small >= 2 else 0  # once trickling, for the rest of it
        if self.mac is not None and got > start:
            self.mac.update(view[start:got])  # as they land, while they are hot

    def drain(self, n: int) -> None:
        """Read and discard ``n`` payload bytes (a WRITE nobody will keep)."""
        while n:
            chunk = self.scratch[: min(n, len(self.scratch))]
            self.payload(chunk)
            n -= len(chunk)

    def frame_end(self) -> None:
        """A WRITE's payload is in: on a protected connection its tag is checked before any of
        its bytes count (AuthError ends the connection)."""
        if self.mac is not None and self.mac.open:
            receive_tag(self.stream, self.mac)

    def close(self) -> None:
        """The connection ends: a frame buffer's charge goes back."""
        if self._frame_charge is not None:
            self._frame_charge.release()
            self._frame_charge = None
