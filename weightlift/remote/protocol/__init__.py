"""The weightlift wire protocol, with no I/O: message types in ``messages``, messages to bytes
in ``encode``, bytes to messages in ``decode``, the two ends' state machines in ``session``, the
token challenge-response in ``auth``, the frame MACs of an authenticated connection in ``mac``.

See ``messages`` for the framing and the conversation, ``decode`` for the decoder's contract,
``session`` for the handshake.
"""

from __future__ import annotations

from weightlift.remote.protocol.auth import client_mac, new_nonce, server_mac, verify_mac
from weightlift.remote.protocol.decode import NEED_DATA, Decoder, Event, Payload
from weightlift.remote.protocol.encode import model_name, send
from weightlift.remote.protocol.mac import FrameMac, frame_keys
from weightlift.remote.protocol.messages import *  # noqa: F403 - the wire spec is this package's vocabulary
from weightlift.remote.protocol.messages import __all__ as _messages_all
from weightlift.remote.protocol.session import (
    ClientSession,
    ServerSession,
    SessionState,
    cache_usable,
    mac_usable,
    models_usable,
    planes_usable,
    regions_usable,
    relay_usable,
    update_usable,
    verify_usable,
)

__all__ = [
    "NEED_DATA",
    "Decoder",
    "Event",
    "FrameMac",
    "frame_keys",
    "Payload",
    "ClientSession",
    "ServerSession",
    "SessionState",
    "cache_usable",
    "mac_usable",
    "models_usable",
    "planes_usable",
    "regions_usable",
    "relay_usable",
    "update_usable",
    "verify_usable",
    "client_mac",
    "new_nonce",
    "send",
    "model_name",
    "server_mac",
    "verify_mac",
    *_messages_all,
]
