"""Protected frames: on a connection that proved a token, a MAC after every frame.

Theory of operation. AUTH proves that both ends hold the token, but on its own it protects only
the handshake: a relay on the path could change any later frame. So from protocol minor 2 on,
once a direction has sent its AUTH, every frame in that direction is followed by a tag::

    frame   := prefix body [payload] tag
    tag     := BLAKE3-keyed(key[direction], seq:u64 || prefix || body || payload)     32 bytes

``seq`` counts that direction's protected frames from 0, so a frame cannot be dropped, replayed
or reordered; each direction has its own key, so a frame cannot be reflected back to its sender.
Both keys are derived from the token, both nonces and both HELLOs as each side sent and read
them (:func:`frame_keys`): a relay that changed a HELLO field (a flag, a limit, the minor)
makes the first protected frame fail, and because the keys differ per connection a recorded
conversation proves nothing on a new one.

A receiver feeds the bytes of a frame to :meth:`FrameMac.update` as they arrive (payload bytes
as they land in their destination, no second pass) and calls :meth:`FrameMac.check` with the
tag that follows; a tensor is published only after the tag of its last WRITE checks. A frame
that fails is an :class:`~weightlift.errors.AuthError`, and the connection ends.

What the MAC does not give: confidentiality (the bytes travel in the clear; use TLS for that),
or protection of a connection without a token.
"""

from __future__ import annotations

import hmac
import struct
from typing import Any

import blake3

from weightlift.errors import AuthError
from weightlift.remote.protocol.messages import HELLO_LAYOUT, MAC_SIZE, Hello

__all__ = ["FrameMac", "frame_keys", "MAC_SIZE"]

_SEQ = struct.Struct("<Q")
_CONTEXT = "weightlift 1.2 frame mac {}"
# Payload updates at least this large hash on blake3's threads (the header is held until then).
_PARALLEL = 1 << 20
_HEAD_HOLD = 64 * 1024


def _hello_fields(h: Hello) -> bytes:
    return HELLO_LAYOUT.pack(h.major, h.minor, h.flags, h.max_frame, h.max_tensor_bytes, h.nonce, h.max_memory)


def frame_keys(token: bytes, client_hello: Hello, server_hello: Hello) -> tuple[bytes, bytes]:
    """(client-to-server key, server-to-client key) for one connection."""
    material = (
        _SEQ.pack(len(token)) + bytes(token) + _hello_fields(client_hello) + _hello_fields(server_hello)
    )  # the nonces are in the HELLOs
    return (
        blake3.blake3(material, derive_key_context=_CONTEXT.format("client to server")).digest(),
        blake3.blake3(material, derive_key_context=_CONTEXT.format("server to client")).digest(),
    )


class FrameMac:
    """The tags of one direction of one connection: ``begin`` a frame, ``update`` with its bytes
    in order, then ``tag`` (sender) or ``check`` (receiver). ``seal(parts)`` does all three."""

    __slots__ = ("_key", "seq", "_head", "_hasher")

    def __init__(self, key: bytes):
        self._key = bytes(key)
        self.seq = 0
        self._head: bytearray | None = None
        self._hasher: Any = None

    @property
    def open(self) -> bool:
        """Whether a frame was begun and its tag not yet taken."""
        return self._head is not None or self._hasher is not None

    def begin(self) -> None:
        self._head = bytearray(_SEQ.pack(self.seq))
        self._hasher = None
        self.seq += 1

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
        n = len(view)
        if self._hasher is None:
            if self._head is None:
                raise AssertionError("FrameMac.update before begin")
            if n < _HEAD_HOLD and len(self._head) < _HEAD_HOLD:
                self._head += view  # headers: the hasher's threads are chosen by the first payload
                return
            threads = blake3.blake3.AUTO if n >= _PARALLEL else 1
            self._hasher = blake3.blake3(self._head, key=self._key, max_threads=threads)
            self._head = None
        self._hasher.update(view)

    def tag(self) -> bytes:
        """The frame's tag; the frame is over."""
        if self._hasher is None:
            if self._head is None:
                raise AssertionError("FrameMac.tag before begin")
            self._hasher = blake3.blake3(self._head, key=self._key)
        out: bytes = self._hasher.digest(length=MAC_SIZE)
        self._head = self._hasher = None
        return out

    def seal(self, parts: Any) -> bytes:
        """Begin, update with each of ``parts``, and return the tag."""
        self.begin()
        for p in parts:
            self.update(p)
        return self.tag()

    def check(self, tag: bytes) -> None:
        """AuthError unless ``tag`` is this frame's (compared in constant time)."""
        if not hmac.compare_digest(self.tag(), bytes(tag)):
            raise AuthError(f"frame {self.seq - 1} failed its MAC: it was changed, dropped or replayed on the way")
