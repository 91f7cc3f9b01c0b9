"""Byte streams between a client and a server: the only module that touches sockets.

Theory of operation: the protocol (``weightlift.remote.protocol``) knows nothing of I/O, and the
client and server know nothing of sockets; both talk to a :class:`Stream`:

* ``send_parts(parts)``: send several buffers as one, without joining them (scatter-gather
  ``sendmsg``): a frame header and a tensor's bytes leave together with no staging copy.
* ``sendfile(fd, offset, count)``: send a file range straight from the page cache.
* ``recv_into(buf)``: receive into the caller's memory (a tensor's own storage); 0 means EOF.
* ``set_timeout(seconds)``: bounds each receive; :func:`receive_message` uses it to hold a peer
  to a deadline (a server's handshake), so a peer that trickles bytes cannot hold a thread.
* ``shutdown_write()``: the peer reads EOF after our last bytes (a server closing on an error).
* ``shutdown()``: wake a thread blocked on the stream (a server closing its connections).
* ``close()``, and ``peer``, a printable name of the other end for messages.

:class:`TlsStream` is the same over TLS (Python's ``ssl``): the bytes are encrypted in user
space, so a send is a plain ``sendall`` of each buffer (no scatter-gather, no ``sendfile``: a
file range is read and sent in pieces) and a receive decrypts straight into the caller's
memory; :class:`TlsBackend` makes them from an ``ssl.SSLContext``. A server's TLS handshake runs
in the connection's own thread, at its first receive, under the handshake deadline.

Streams come from a :class:`Backend`: ``connect(address, timeout)`` for a client and
``listen(host, port)`` for a server, whose :class:`Listener` hands out accepted streams. The
client and the server take a backend (default :data:`TCP`) and never build a socket themselves,
so an RDMA or UCX backend would implement these calls and the protocol, client and server would
not change. Every OSError is mapped to TransportError here, so nothing above sees a socket
exception.
"""

from __future__ import annotations

import os
import socket
import ssl
import struct
import time
from collections.abc import Sequence
from typing import Protocol

from weightlift.errors import OptionError, TransportError, TransportTimeout
from weightlift.remote.protocol import MAC_SIZE, NEED_DATA, PAYLOAD_COMMANDS, Decoder, FrameMac, Message

__all__ = [
    "Buffer",
    "Stream",
    "Listener",
    "Backend",
    "TCP",
    "TcpBackend",
    "SocketStream",
    "SocketListener",
    "TlsStream",
    "TlsListener",
    "TlsBackend",
    "server_tls_context",
    "client_tls_context",
    "connect",
    "parse_address",
    "receive_message",
    "receive_payload",
    "receive_tag",
    "SOCKET_BUFFER",
]

Buffer = bytes | bytearray | memoryview

# Large kernel buffers let a fast link run without the sender stalling on every window; the
# kernel caps the request at its own limit (net.core.wmem_max / rmem_max) without complaint.
# Asked for only where the kernel does not size the buffers itself (see _autotuned).
SOCKET_BUFFER = 8 * 1024 * 1024
# Linux refuses more than IOV_MAX (1024) buffers in one sendmsg.
_MAX_IOV = 512
_SENDFILE_CHUNK = 1 << 30
_TLS_PIECE = 1 << 20


class Stream(Protocol):
    """What the client and server need from a connection (see the module's docstring)."""

    peer: str

    def send_parts(self, parts: Sequence[Buffer]) -> None: ...

    def sendfile(self, fd: int, offset: int, count: int) -> None: ...

    def recv_into(self, buf: memoryview) -> int: ...

    def set_timeout(self, seconds: float | None) -> None: ...

    def set_io_timeout(self, seconds: float | None) -> None: ...

    def send_within(self, seconds: float | None) -> None: ...

    def shutdown_write(self) -> None: ...

    def shutdown(self) -> None: ...

    def close(self) -> None: ...


class Listener(Protocol):
    """A bound, listening endpoint that hands out accepted streams."""

    address: tuple[str, int]

    def accept(self, timeout: float | None = None) -> Stream | None: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """Where streams come from: the one object a client and a server take to reach the network."""

    def connect(self, address: str | tuple[str, int], *, timeout: float | None = 30.0) -> Stream: ...

    def listen(self, host: str, port: int, *, backlog: int = 64) -> Listener: ...


def _autotuned() -> bool:
    """Whether the kernel sizes TCP buffers itself (Linux): a buffer set by hand switches that
    off for the socket and pins it at the size asked for, capped at net.core.[rw]mem_max, which
    was measured to slow even loopback transfers (raw TCP, not only the protocol)."""
    return os.path.exists("/proc/sys/net/ipv4/tcp_rmem")


def _tune(sock: socket.socket) -> None:
    sizes = (
        [] if _autotuned() else [(socket.SOL_SOCKET, o, SOCKET_BUFFER) for o in (socket.SO_SNDBUF, socket.SO_RCVBUF)]
    )
    for level, opt, value in (*sizes, (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)):
        try:
            sock.setsockopt(level, opt, value)
        except OSError:
            pass  # not TCP, or not allowed here: a tuning, never a requirement


class SocketStream:
    """A connected, blocking socket."""

    def __init__(self, sock: socket.socket, *, peer: str = ""):
        self._sock = sock
        self.peer = peer
        self.closed = False
        self._send_by: float | None = None
        sock.settimeout(None)  # sendfile and partial sendmsg need a blocking socket
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            _tune(sock)

    def _error(self, e: OSError, what: str) -> TransportError:
        if isinstance(e, (BlockingIOError, TimeoutError)):  # a kernel or socket timeout ran out
            return TransportTimeout(f"{what} {self.peer or 'peer'} timed out")
        return TransportError(f"{what} {self.peer or 'peer'} failed: {e.strerror or e}")

    def send_parts(self, parts: Sequence[Buffer]) -> None:
        """Send every buffer, in order, as one byte stream; no buffer is copied or joined."""
        views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
        i = 0
        try:
            while i < len(views):
                sent = self._sock.sendmsg(views[i : i + _MAX_IOV])
                if self._send_by is not None and time.monotonic() > self._send_by:
                    raise TransportTimeout(
                        f"sending to {self.peer or 'peer'} timed out: the peer took the bytes too slowly"
                    )
                # A partial send stops anywhere: drop what went, slice the buffer it stopped in.
                while sent and i < len(views):
                    n = len(views[i])
                    if sent >= n:
                        sent -= n
                        i += 1
                    else:
                        views[i] = views[i][sent:]
                        sent = 0
        except TransportError:  # ours (an OSError too): already says what failed
            raise
        except OSError as e:
            raise self._error(e, "sending to") from None

    def sendfile(self, fd: int, offset: int, count: int) -> None:
        """Send ``count`` bytes of the file ``fd`` from ``offset`` (kernel to kernel where possible)."""
        if not hasattr(os, "sendfile"):
            self._sendfile_by_reads(fd, offset, count)
            return
        end = offset + count
        try:
            while offset < end:
                n = os.sendfile(self._sock.fileno(), fd, offset, min(end - offset, _SENDFILE_CHUNK))
                if n == 0:
                    raise TransportError(f"file ended {end - offset} bytes before the range sent to {self.peer}")
                offset += n
        except TransportError:
            raise
        except OSError as e:
            raise self._error(e, "sending a file to") from None

    def _sendfile_by_reads(self, fd: int, offset: int, count: int) -> None:
        buf = bytearray(min(count, 4 << 20))
        view = memoryview(buf)
        while count:
            try:
                n = os.preadv(fd, [view[: min(count, len(buf))]], offset)
            except OSError as e:
                raise TransportError(f"reading the file to send to {self.peer} failed: {e.strerror or e}") from None
            if n == 0:
                raise TransportError(f"file ended {count} bytes before the range sent to {self.peer}")
            self.send_parts([view[:n]])
            offset += n
            count -= n

    def recv_into(self, buf: memoryview) -> int:
        """Receive up to len(buf) bytes into ``buf``; 0 means the peer closed."""
        try:
            return self._sock.recv_into(buf)
        except OSError as e:
            raise self._error(e, "receiving from") from None

    def recv_exactly(self, buf: memoryview) -> None:
        """Fill all of ``buf``; TransportError if the peer closes first."""
        got = 0
        while got < len(buf):
            n = self.recv_into(buf[got:])
            if n == 0:
                raise TransportError(f"{self.peer or 'peer'} closed the connection {len(buf) - got} bytes early")
            got += n

    def shutdown(self) -> None:
        """Wake any thread blocked on this stream (it sees EOF or an error); idempotent."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def shutdown_write(self) -> None:
        """Tell the peer we are done sending (it reads EOF after our last bytes); idempotent."""
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def set_timeout(self, seconds: float | None) -> None:
        """A receive timeout (for draining an error reply); None restores blocking mode."""
        self._sock.settimeout(seconds)

    def send_within(self, seconds: float | None) -> None:
        """Bound the sends that follow, all together, to ``seconds`` from now (None: no bound), so a
        peer that takes a reply a byte at a time, each just inside the I/O timeout, cannot hold a
        connection; a send past it fails as TransportError."""
        self._send_by = None if seconds is None else time.monotonic() + seconds

    def set_io_timeout(self, seconds: float | None) -> None:
        """Bound every blocking send, sendfile and receive to ``seconds`` (None: no bound).

        Kernel timeouts (SO_SNDTIMEO, SO_RCVTIMEO) keep the socket in blocking mode, which
        sendfile and partial sendmsg need; a call that waits longer fails as TransportError.
        """
        usec = 0 if not seconds else max(1, int(seconds * 1e6))
        tv = struct.pack("@ll", usec // 1_000_000, usec % 1_000_000)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        except OSError as e:
            raise self._error(e, "setting a timeout on the connection to") from None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self._sock.close()
            except OSError:
                pass

    def __enter__(self) -> SocketStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def receive_message(
    stream: Stream,
    decoder: Decoder,
    scratch: memoryview,
    *,
    deadline: float | None = None,
    mac: FrameMac | None = None,
) -> Message | None:
    """The next message from ``stream``; None if the peer closed cleanly between frames.

    Reads exactly what the decoder still wants, so a payload that follows a header stays in the
    socket for :func:`receive_payload` to put where it belongs. TransportError if the peer closes
    inside a frame, or if ``deadline`` (a ``time.monotonic()`` instant) passes first: every
    receive waits only for the time left, however the peer spaces its bytes. With a deadline the
    stream is left with a timeout; the caller restores blocking mode when it no longer wants one.
    ``mac`` (a protected connection) is begun here and fed every byte the decoder is fed; the
    tag of a frame without payload is checked before its body is decoded, that of a WRITE or
    READ_REPLY is the caller's to check once the payload is in (:func:`receive_tag`).
    """
    checked = mac is None
    if mac is not None:
        mac.begin()
    while True:
        if not checked:
            cmd = decoder.complete_frame()
            if cmd is not None and cmd not in PAYLOAD_COMMANDS:
                receive_tag(stream, mac)  # type: ignore[arg-type]
                checked = True
        ev = decoder.next_event()
        if ev is not NEED_DATA:
            if not checked and not ev.length:  # type: ignore[union-attr]  # a payload frame, empty
                receive_tag(stream, mac)  # type: ignore[arg-type]
            return ev  # type: ignore[return-value]
        want = decoder.bytes_wanted()
        buf = scratch if want <= len(scratch) else memoryview(bytearray(want))
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError("the peer did not send a whole message in time")
            stream.set_timeout(left)
        n = stream.recv_into(buf[:want])
        if n == 0:
            if decoder.at_boundary:
                return None
            raise TransportError("the peer closed the connection inside a frame")
        decoder.feed(buf[:n])
        if mac is not None:
            mac.update(buf[:n])


def receive_tag(stream: Stream, mac: FrameMac) -> None:
    """Read the tag that follows a protected frame and check it (AuthError if it fails)."""
    tag = memoryview(bytearray(MAC_SIZE))
    got = 0
    while got < MAC_SIZE:
        n = stream.recv_into(tag[got:])
        if n == 0:
            raise TransportError("the peer closed the connection before a frame's MAC")
        got += n
    mac.check(bytes(tag))


def receive_payload(stream: Stream, decoder: Decoder, view: memoryview, *, mac: FrameMac | None = None) -> None:
    """Fill ``view`` with the next payload bytes of the current frame, straight from the socket;
    ``mac`` is fed the bytes received here (those the decoder held it was fed with them)."""
    got = start = decoder.payload_into(view)
    while got < len(view):
        n = stream.recv_into(view[got:])
        if n == 0:
            raise TransportError("the peer closed the connection inside a payload")
        decoder.payload_received(n)
        got += n
    if mac is not None and got > start:
        mac.update(view[start:got])  # while the bytes are hot


def parse_address(address: str | tuple[str, int]) -> tuple[str, int]:
    """``"host:port"``, ``"[v6]:port"`` or ``(host, port)`` -> (host, port); OptionError if malformed."""
    if isinstance(address, tuple):
        if len(address) != 2:
            raise OptionError(f"address {address!r} is not (host, port)")
        host, port = address
    else:
        host, sep, port_s = str(address).rpartition(":")
        if not sep or not host:
            raise OptionError(f"address {address!r} is not HOST:PORT")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        try:
            port = int(port_s)
        except ValueError:
            raise OptionError(f"port {port_s!r} in {address!r} is not a number") from None
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise OptionError(f"port {port!r} is out of range")
    return str(host), port


def connect(address: str | tuple[str, int], *, timeout: float | None = 30.0) -> SocketStream:
    """Connect to a server; TransportError if it cannot be reached."""
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise TransportError(f"cannot connect to {host}:{port}: {e.strerror or e}") from None
    return SocketStream(sock, peer=f"{host}:{port}")


class SocketListener:
    """A listening TCP socket."""

    def __init__(self, host: str, port: int, *, backlog: int = 64):
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, _, _, _, addr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:
            raise TransportError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(backlog)
        except OSError as e:
            sock.close()
            raise TransportError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        self._sock = sock
        self.address: tuple[str, int] = sock.getsockname()[:2]

    def accept(self, timeout: float | None = None) -> SocketStream | None:
        """The next connection, or None if none came within ``timeout`` seconds."""
        try:
            self._sock.settimeout(timeout)
            sock, addr = self._sock.accept()
        except TimeoutError:
            return None
        except OSError as e:
            raise TransportError(f"accept on {self.address[0]}:{self.address[1]} failed: {e.strerror or e}") from None
        return SocketStream(sock, peer=f"{addr[0]}:{addr[1]}")

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


class TcpBackend:
    """TCP sockets (:class:`SocketStream`, :class:`SocketListener`): the default backend."""

    def connect(self, address: str | tuple[str, int], *, timeout: float | None = 30.0) -> SocketStream:
        return connect(address, timeout=timeout)

    def listen(self, host: str, port: int, *, backlog: int = 64) -> SocketListener:
        return SocketListener(host, port, backlog=backlog)


TCP: Backend = TcpBackend()


# ---------------------------------------------------------------------------------------------
# TLS

_TLS_JOIN = 64 * 1024  # buffers smaller than this are joined, so a frame goes out as one record


class TlsStream(SocketStream):
    """A TLS connection (see the module's docstring): the zero-copy sends do not apply."""

    def __init__(self, sock: ssl.SSLSocket, *, peer: str = ""):
        super().__init__(sock, peer=peer)
        self._tls: ssl.SSLSocket = sock
        self._handshaken = False

    def _handshake(self) -> None:
        if not self._handshaken:
            try:
                self._tls.do_handshake()
            except OSError as e:
                raise self._error(e, "TLS handshake with") from None
            self._handshaken = True

    def send_parts(self, parts: Sequence[Buffer]) -> None:
        self._handshake()
        pending: list[memoryview] = []
        size = 0
        try:
            for v in (memoryview(p).cast("B") for p in parts):
                if len(v) < _TLS_JOIN:
                    pending.append(v)
                    size += len(v)
                    continue
                if pending:
                    self._tls.sendall(b"".join(pending))
                    pending, size = [], 0
                for at in range(0, len(v), _TLS_PIECE):  # pieces, so a deadline is checked between them
                    self._tls.sendall(v[at : at + _TLS_PIECE])
                    if self._send_by is not None and time.monotonic() > self._send_by:
                        raise TransportTimeout(
                            f"sending to {self.peer or 'peer'} timed out: the peer took the bytes too slowly"
                        )
            if pending:
                self._tls.sendall(b"".join(pending))
        except TransportError:
            raise
        except OSError as e:
            raise self._error(e, "sending to") from None

    def sendfile(self, fd: int, offset: int, count: int) -> None:
        self._sendfile_by_reads(fd, offset, count)  # the kernel cannot encrypt: read, then send

    def recv_into(self, buf: memoryview) -> int:
        self._handshake()
        return super().recv_into(buf)


class TlsListener(SocketListener):
    """A listening TCP socket whose connections speak TLS (handshake at their first receive)."""

    def __init__(self, context: ssl.SSLContext, host: str, port: int, *, backlog: int = 64):
        super().__init__(host, port, backlog=backlog)
        self._context = context

    def accept(self, timeout: float | None = None) -> SocketStream | None:
        plain = super().accept(timeout)
        if plain is None:
            return None
        sock = plain._sock
        try:
            tls = self._context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        except OSError as e:
            sock.close()
            raise TransportError(f"TLS on a connection from {plain.peer} failed: {e.strerror or e}") from None
        return TlsStream(tls, peer=plain.peer)


class TlsBackend:
    """TCP with TLS: ``context`` is a server context (for ``listen``) or a client one (``connect``)."""

    def __init__(self, context: ssl.SSLContext):
        self.context = context

    def connect(self, address: str | tuple[str, int], *, timeout: float | None = 30.0) -> TlsStream:
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise TransportError(f"cannot connect to {host}:{port}: {e.strerror or e}") from None
        try:
            tls = self.context.wrap_socket(sock, server_hostname=host)  # handshake within ``timeout``
        except OSError as e:
            sock.close()
            raise TransportError(f"TLS handshake with {host}:{port} failed: {e.strerror or e}") from None
        stream = TlsStream(tls, peer=f"{host}:{port}")
        stream._handshaken = True
        return stream

    def listen(self, host: str, port: int, *, backlog: int = 64) -> TlsListener:
        return TlsListener(self.context, host, port, backlog=backlog)


def server_tls_context(cert: str | os.PathLike[str], key: str | os.PathLike[str]) -> ssl.SSLContext:
    """A server's TLS context from a certificate (chain) and its private key, PEM files."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(os.fspath(cert), os.fspath(key))
    except (OSError, ssl.SSLError) as e:
        raise OptionError(f"cannot load the TLS certificate {os.fspath(cert)} and key: {e}") from None
    return ctx


def client_tls_context(ca: str | os.PathLike[str] | None = None) -> ssl.SSLContext:
    """A client's TLS context: the server's certificate is checked against ``ca`` (a PEM file),
    or the system's trusted roots, and must name the host connected to."""
    try:
        return ssl.create_default_context(cafile=os.fspath(ca) if ca is not None else None)
    except (OSError, ssl.SSLError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise OptionError(f"cannot load the TLS CA file {ca!r}: {e}") from None
