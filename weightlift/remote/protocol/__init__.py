"""The weightlift wire protocol, with no I/O: message types in ``messages``, bytes in ``codec``.

See ``messages`` for the framing and the conversation, ``codec`` for the decoder's contract.
"""

from __future__ import annotations

from weightlift.remote.protocol.codec import (
    NEED_DATA,
    Decoder,
    Event,
    Payload,
    ServerSession,
    SessionState,
    client_mac,
    new_nonce,
    send,
    server_mac,
    verify_mac,
)
from weightlift.remote.protocol.messages import *  # noqa: F403 - the wire spec is this package's vocabulary
from weightlift.remote.protocol.messages import __all__ as _messages_all

__all__ = [
    "NEED_DATA",
    "Decoder",
    "Event",
    "Payload",
    "ServerSession",
    "SessionState",
    "client_mac",
    "new_nonce",
    "send",
    "server_mac",
    "verify_mac",
    *_messages_all,
]
