"""Reading one client's frames off its stream, under the limits that bound what a peer can hold.

A :class:`FrameReader` owns everything between the socket and a decoded message: the decoder
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

import logging
import time

from weightlift.errors import LocalProtocolError, TransportError
from weightlift.remote.protocol import (
    MAX_FRAME,
    MAX_HANDSHAKE_FRAME,
    NEED_DATA,
    PAYLOAD_COMMANDS,
    Decoder,
    FrameMac,
    Message,
)
from weightlift.remote.server.store import Charge, MemoryFull, Store
from weightlift.remote.transport import Stream, receive_tag

__all__ = [
    "FrameReader",
    "FrameTooLarge",
    "SCRATCH_BYTES",
    "TRICKLE_BYTES",
    "TRICKLE_PAUSE",
    "FRAME_SLACK",
    "MIN_FRAME_RATE",
]

SCRATCH_BYTES = 64 * 1024  # frame headers and drained payloads
TRICKLE_BYTES = 512  # two receives in a row inside one frame or payload bringing less than this ...
TRICKLE_PAUSE = 0.002  # ... and the next waits this long first, so that bytes gather in the socket
FRAME_SLACK = 1 / 8  # a frame buffer is charged its length and this much more (a bytearray over-allocates)
MIN_FRAME_RATE = 64 * 1024  # bytes per second: a frame of N bytes gets io_timeout + N / this to arrive

_log = logging.getLogger("weightlift.remote.server")


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
