"""One client connection: the handshake (a :class:`~weightlift.remote.protocol.ClientSession`),
framed sends, replies, and the server's ERROR turned into the matching weightlift error.

A server that closes on us after an ERROR has usually said why; a send or receive that fails
looks for that ERROR before reporting the transport's own failure, so the user reads the cause.

On a protected connection (a token, minor 2: :mod:`weightlift.remote.protocol.mac`) every frame
made by :meth:`Connection.frame` carries its tag; a WRITE's tag covers its payload, so it is
taken by :meth:`Connection.payload_tag` once the payload is known, before the next frame is made.
Every frame received is checked before it is acted on.

``timeout`` is a deadline per reply, not per receive: a reply's frame must arrive whole within
``timeout`` seconds of asking for it, however the server spaces its bytes, and a payload within
``timeout`` plus its length at :data:`MIN_PAYLOAD_RATE`. Text a server sends (its ERROR, a
BARRIER reply's errors) reaches the user's errors escaped by :func:`printable`, so it cannot
move a terminal's cursor or fake a line of output.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar, cast

from weightlift.errors import (
    AuthError,
    LocalProtocolError,
    NotFoundError,
    RemoteProtocolError,
    StateError,
    TransportError,
    TransportTimeout,
    WeightliftError,
)
from weightlift.remote.protocol import (
    MAX_FRAME,
    Auth,
    Bye,
    ClientSession,
    Decoder,
    Error,
    ErrorCode,
    FrameMac,
    Hello,
    Message,
    UseModel,
    send,
)
from weightlift.remote.transport import Buffer, Stream, TlsStream, receive_message, receive_payload, receive_tag

__all__ = ["Connection", "Late", "Replaced", "Busy", "remote_error", "printable", "MIN_PAYLOAD_RATE", "MAX_TIMEOUT"]

#: Bytes per second below which a payload (a READ reply's bytes) runs out of time: a payload of
#: n bytes must arrive within the client's timeout plus n / MIN_PAYLOAD_RATE seconds.
MIN_PAYLOAD_RATE = 64 << 10
#: the longest timeout a client takes (a year; None waits for ever): sockets and clocks refuse
#: far longer ones with ValueError or OverflowError
MAX_TIMEOUT = 365 * 86400.0


M = TypeVar("M", bound=Message)


class Replaced(StateError):
    """The server answered a READ with STALE: the tensor listed was replaced before it was read."""


class Busy(StateError):
    """The server answered BUSY: a push to the model asked about is in flight (nothing changed).

    A :class:`StateError`, so a :class:`RuntimeError`: the server's state refuses the call now."""


ERRORS = {
    ErrorCode.AUTH: AuthError,
    ErrorCode.NOT_FOUND: NotFoundError,
    ErrorCode.STALE: Replaced,
    ErrorCode.BUSY: Busy,
}


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters (escape sequences, line breaks), lone
    surrogates and backslashes are shown escaped, as Python writes them in a string literal."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(_printable_char(c) for c in text)


def _printable_char(c: str) -> str:
    if c == "\\":
        return "\\\\"
    return c if c.isprintable() else repr(c)[1:-1]  # repr escapes what is not printable


def remote_error(msg: Error) -> WeightliftError:
    cls = ERRORS.get(msg.code, RemoteProtocolError)  # type: ignore[call-overload]
    return cls(f"server: {printable(msg.message)}")


class Late(TransportTimeout):
    """A reply (or its payload) did not arrive whole within its deadline."""


class _Deadline:
    """``stream`` with every receive ending by ``until`` (a ``time.monotonic()`` instant): each
    waits only for the time left. The socket's own timeout (the client's ``timeout``, set once)
    already ends a receive in time while more than that is left, so only then is it narrowed."""

    def __init__(self, stream: Stream, until: float, io_timeout: float):
        self.stream, self.until, self.io_timeout = stream, until, io_timeout
        self.narrowed = False

    def recv_into(self, buf: memoryview) -> int:
        left = self.until - time.monotonic()
        if left < self.io_timeout:
            if left <= 0:
                raise self._late()
            self.stream.set_timeout(left)
            self.narrowed = True
        try:
            return self.stream.recv_into(buf)
        except TransportError:
            if self.narrowed and time.monotonic() >= self.until:
                raise self._late() from None
            raise

    def _late(self) -> Late:
        return Late(
            f"receiving from {self.stream.peer or 'the server'} timed out: the reply did not arrive whole in time"
        )

    def restore(self) -> None:
        """Back to blocking receives under the socket's own timeout (sendfile needs them)."""
        if self.narrowed:
            self.narrowed = False
            self.stream.set_timeout(None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class Connection:
    """One connection: handshake, framed sends, replies, and the error the server sent on closing."""

    def __init__(self, stream: Stream, *, token: bytes | None, minor: int, timeout: float | None = None):
        self.stream = stream
        self.timeout = timeout
        self.dec = Decoder(our_role="client", minor=minor)
        self.scratch = memoryview(bytearray(64 * 1024))
        self.next_id = 0
        self.session = ClientSession(minor=minor, token=token)
        self.minor = minor
        self.max_frame = MAX_FRAME
        self.mac_out: FrameMac | None = None  # set once READY on a protected connection
        self.mac_in: FrameMac | None = None
        self._payload_until = 0.0  # when the payload of the last reply is due (with a timeout)
        self.listed_generations: list[int] = []  # what each page of the last listing stated (minor 3)
        self.model = ""  # the model this connection's requests name (minor 5; "" the default)
        try:
            # every send, sendfile and receive from here on waits at most ``timeout`` seconds
            stream.set_io_timeout(timeout)
            self._handshake()
        except BaseException:
            self.stream.close()
            raise

    def _handshake(self) -> None:
        self.send(send(self.session.start()))
        try:
            hello = self.expect(Hello)
        except (TransportError, RemoteProtocolError) as e:
            if isinstance(self.stream, TlsStream):
                raise
            # a TLS server resets a plaintext HELLO or answers it with a TLS alert: say what to do
            # (a timeout stays one: a TimeoutError to the caller)
            kind = TransportTimeout if isinstance(e, TransportTimeout) else TransportError
            raise kind(
                f"{self.stream.peer} ended the handshake ({e}); if that server speaks TLS (serve --tls-cert), "
                "connect with TLS (--tls or --tls-ca; Client(tls=client_tls_context(...)))"
            ) from None
        auth = self.session.server_hello(hello)
        assert self.session.server is not None  # set by server_hello
        self.server: Hello = self.session.server
        self.minor = self.session.minor
        self.max_frame = self.session.max_frame
        self.cache = self.session.cache
        self.verify = self.session.verify
        if auth is not None:
            self.send(send(auth, minor=self.minor))
            self.session.server_auth(self.expect(Auth))
            macs = self.session.frame_macs()
            if macs is not None:
                self.mac_out, self.mac_in = macs

    def use(self, model: str) -> None:
        """Make the connection's later requests name ``model`` ("" the default model): a MODEL
        frame when it changes. LocalProtocolError naming the server's minor for a named model
        on a server that has none (protocol 1.4 or older)."""
        if model == self.model:
            return
        if not self.session.models:
            raise LocalProtocolError(
                f"model {model!r}: the server at {self.stream.peer} speaks protocol 1.{self.minor}, "
                "which has no named models (it needs 1.5: a newer weightlift serve)"
            )
        self.send(self.frame(UseModel(model)))
        self.model = model

    @property
    def protected(self) -> bool:
        """Whether every frame carries a MAC."""
        return self.mac_out is not None

    def frame(self, msg: Message) -> bytes:
        """The bytes of ``msg``, with its tag on a protected connection; a WRITE's tag comes from
        :meth:`payload_tag`, which must be called before the next frame is made."""
        raw = send(msg, minor=self.minor, max_frame=self.max_frame)
        mac = self.mac_out
        if mac is None:
            return raw
        if mac.open:
            raise LocalProtocolError("a frame was made before the tag of the previous WRITE's payload")
        mac.begin()
        mac.update(raw)
        if msg.HAS_PAYLOAD:
            if msg.length:  # type: ignore[attr-defined]
                return raw  # the tag follows the payload
        return raw + mac.tag()

    def payload_tag(self, payload: Buffer) -> bytes:
        """The tag of the WRITE just made, over its ``payload`` (b"" on an unprotected connection)."""
        mac = self.mac_out
        if mac is None:
            return b""
        mac.update(payload)
        return mac.tag()

    def send(self, *parts: Buffer) -> None:
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
        if isinstance(e, Late):
            return e  # the server is slow, not gone: waiting longer for an ERROR tells nothing
        try:
            while True:
                msg = self._next(min(2.0, self.timeout or 2.0))
                if isinstance(msg, Error):
                    return remote_error(msg)
                if msg is None:
                    return e
        except WeightliftError:
            return e

    def _next(self, seconds: float | None) -> Message | None:
        """The next message, whole within ``seconds`` (None: no bound)."""
        # on a protected connection every frame's tag is checked before it is decoded (a payload
        # frame's once its payload is in: recv_payload)
        if seconds is None:
            return receive_message(self.stream, self.dec, self.scratch, mac=self.mac_in)
        held = _Deadline(self.stream, time.monotonic() + seconds, self.timeout or seconds)
        try:
            return receive_message(cast(Stream, held), self.dec, self.scratch, mac=self.mac_in)
        finally:
            held.restore()

    def recv(self) -> Message:
        """The next message; a server ERROR is raised as the matching weightlift error."""
        try:
            msg = self._next(self.timeout)
        except TransportError as e:
            raise self._why_closed(e) from None
        if msg is None:
            raise TransportError(f"{self.stream.peer} closed the connection")
        if isinstance(msg, Error):
            raise remote_error(msg)
        if msg.HAS_PAYLOAD and self.timeout is not None:
            length: int = msg.length  # type: ignore[attr-defined]
            self._payload_until = time.monotonic() + self.timeout + length / MIN_PAYLOAD_RATE
        return msg

    def expect(self, cls: type[M]) -> M:
        """The next message, which must be a ``cls`` (RemoteProtocolError otherwise)."""
        msg = self.recv()
        if not isinstance(msg, cls):
            raise RemoteProtocolError(f"expected {cls.__name__}, server sent {msg.COMMAND.name}")
        return msg

    def recv_payload(self, view: memoryview) -> None:
        """The next payload bytes into ``view``; once the payload is complete its tag is checked."""
        held = None
        if self.timeout is not None:
            held = _Deadline(self.stream, self._payload_until, self.timeout)
        stream = self.stream if held is None else cast(Stream, held)
        try:
            receive_payload(stream, self.dec, view, mac=self.mac_in)
            if self.mac_in is not None and self.mac_in.open and self.dec.payload_remaining == 0:
                receive_tag(stream, self.mac_in)
        except TransportError as e:
            raise self._why_closed(e) from None
        finally:
            if held is not None:
                held.restore()

    def close(self) -> None:
        try:
            if self.mac_out is not None and self.mac_out.open:
                raise TransportError("a WRITE was left without its payload")  # say nothing more
            self.stream.send_parts([self.frame(Bye())])
        except (TransportError, AttributeError):
            pass
        self.stream.close()
