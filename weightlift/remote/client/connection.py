"""One client connection: the handshake (a :class:`~weightlift.remote.protocol.ClientSession`),
framed sends, replies, and the server's ERROR turned into the matching weightlift error.

A server that closes on us after an ERROR has usually said why; a send or receive that fails
looks for that ERROR before reporting the transport's own failure, so the user reads the cause.
"""

from __future__ import annotations

from typing import Any

from weightlift.errors import (
    AuthError,
    NotFoundError,
    RemoteProtocolError,
    TransportError,
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
    Hello,
    Message,
    send,
)
from weightlift.remote.transport import Stream, receive_message, receive_payload

__all__ = ["Connection", "remote_error"]

ERRORS = {ErrorCode.AUTH: AuthError, ErrorCode.NOT_FOUND: NotFoundError}


def remote_error(msg: Error) -> WeightliftError:
    cls = ERRORS.get(msg.code, RemoteProtocolError)  # type: ignore[call-overload]
    return cls(f"server: {msg.message}")


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
        try:
            # every send, sendfile and receive from here on waits at most ``timeout`` seconds
            stream.set_io_timeout(timeout)
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
        self.verify = self.session.verify
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
            self.stream.set_timeout(min(2.0, self.timeout or 2.0))
            while True:
                msg = self._next()
                if isinstance(msg, Error):
                    return remote_error(msg)
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
            raise remote_error(msg)
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
