"""Challenge-response over a shared token: each side proves it holds the token without sending it.

Both sides send a fresh nonce in HELLO; the client answers with an HMAC-SHA256 over both nonces
labelled "client", the server with one labelled "server", so neither proof can be replayed as the
other and a recorded conversation proves nothing on a new connection.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from weightlift.errors import AuthError
from weightlift.remote.protocol.messages import NONCE_SIZE

__all__ = ["new_nonce", "client_mac", "server_mac", "verify_mac"]


def new_nonce() -> bytes:
    """A fresh random nonce for HELLO."""
    return os.urandom(NONCE_SIZE)


def _mac(token: bytes, role: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    # The role label keeps a client's proof from being replayed back as the server's.
    return hmac.new(token, b"weightlift-auth-" + role + client_nonce + server_nonce, hashlib.sha256).digest()


def client_mac(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The proof a client sends in AUTH."""
    return _mac(token, b"client", client_nonce, server_nonce)


def server_mac(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The proof a server sends back, so the client knows it reached a holder of the token."""
    return _mac(token, b"server", client_nonce, server_nonce)


def verify_mac(expected: bytes, got: bytes, *, who: str) -> None:
    """AuthError unless the MACs match (compared in constant time)."""
    if not hmac.compare_digest(expected, got):
        raise AuthError(f"{who} did not prove it holds the token")
