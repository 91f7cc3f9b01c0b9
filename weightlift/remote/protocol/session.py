"""The two ends of a connection as state machines: which message may come next, and what the
handshake settled (the minor version both speak, the frame limit, whether the cache is usable).

Theory of operation. A connection opens with HELLO from each side, then AUTH from each side if
the server asks for it, then READY: the client sends requests and the server answers. The client
and the server each hold one session object and feed it the handshake messages they receive; the
session checks them, answers with the messages to send, and records what was negotiated. It does
no I/O: the caller moves the bytes (:mod:`weightlift.remote.transport`), so the same handshake
runs over any stream and back to back in memory in the tests.

What a minor version enables is said once, here (:func:`cache_usable`, :func:`verify_usable`,
:func:`mac_usable`, :func:`update_usable`, :func:`planes_usable`, :func:`models_usable`), and both ends ask.
"""

from __future__ import annotations

from enum import Enum

from weightlift.errors import AuthError, RemoteProtocolError
from weightlift.remote.protocol.auth import client_mac, new_nonce, server_mac, verify_mac
from weightlift.remote.protocol.mac import FrameMac, frame_keys
from weightlift.remote.protocol.messages import (
    CLIENT_COMMANDS,
    COMMAND_SINCE,
    MAX_FRAME,
    MIN_FRAME,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    REGIONS_SINCE,
    Auth,
    Capability,
    Command,
    Hello,
    Message,
)

__all__ = [
    "SessionState",
    "ServerSession",
    "ClientSession",
    "cache_usable",
    "verify_usable",
    "mac_usable",
    "update_usable",
    "regions_usable",
    "planes_usable",
    "models_usable",
    "relay_usable",
]

VERIFY_SINCE = 2  # ALLOC's VERIFY flag, BARRIER_REPLY's digests, READ_REPLY's digest
MAC_SINCE = 2  # a MAC after every frame once a token was proven
UPDATE_SINCE = 3  # DELTA, UPDATE, COMMIT
PLANES_SINCE = 4  # DELTA's PLANES encoding
MODELS_SINCE = 5  # MODEL, REMOVE, STATS, UPDATE's push id (a push over several connections as one unit)


def models_usable(minor: int) -> bool:
    """Whether a connection that speaks ``minor`` can name models, remove them, ask for the
    server's stats and push a checkpoint over several connections as one update."""
    return minor >= MODELS_SINCE


RELAY_SINCE = 7  # RELAY, RELAY_END, RELAY_REPLY


def update_usable(minor: int) -> bool:
    """Whether a connection that speaks ``minor`` can send DELTA, UPDATE and COMMIT."""
    return minor >= UPDATE_SINCE


def planes_usable(minor: int) -> bool:
    """Whether a connection that speaks ``minor`` can send a DELTA in the PLANES encoding."""
    return minor >= PLANES_SINCE


def regions_usable(minor: int) -> bool:
    """Whether a connection that speaks ``minor`` can send LAYOUT, REGION and SKETCH (a sharded server)."""
    return minor >= REGIONS_SINCE


def relay_usable(minor: int) -> bool:
    """Whether a connection that speaks ``minor`` can ask its server to relay a push (RELAY)."""
    return minor >= RELAY_SINCE


def cache_usable(minor: int) -> bool:
    """Whether a connection that speaks ``minor`` can use the server's content cache (HAVE, FILL)."""
    return minor >= COMMAND_SINCE[Command.HAVE]


def verify_usable(minor: int) -> bool:
    """Whether a connection that speaks ``minor`` can ask the server for the digests of what it stored."""
    return minor >= VERIFY_SINCE


def mac_usable(minor: int, token: bytes | None) -> bool:
    """Whether a connection that speaks ``minor`` protects its frames: whenever it authenticated.

    Not a flag either side may leave out: HELLO travels before anything is proven, so a relay
    could clear a flag; the minor is bound into the frame keys (:mod:`.mac`), so it cannot lower
    that without the first protected frame failing.
    """
    return token is not None and minor >= MAC_SINCE


class SessionState(Enum):
    AWAIT_HELLO = "await_hello"
    AWAIT_AUTH = "await_auth"
    READY = "ready"
    CLOSED = "closed"


_ALLOWED: dict[SessionState, frozenset[Command]] = {
    SessionState.AWAIT_HELLO: frozenset({Command.HELLO}),
    SessionState.AWAIT_AUTH: frozenset({Command.AUTH}),
    SessionState.READY: CLIENT_COMMANDS - {Command.HELLO, Command.AUTH},
    SessionState.CLOSED: frozenset(),
}


class ServerSession:
    """Which client commands are allowed now: HELLO first, then AUTH if wanted, then the rest."""

    def __init__(self, *, minor: int = PROTOCOL_MINOR, auth_required: bool = False):
        self.state = SessionState.AWAIT_HELLO
        self.our_minor = minor
        self.minor = minor  # negotiated at HELLO
        self.auth_required = auth_required

    def check(self, msg: Message) -> None:
        """RemoteProtocolError if ``msg`` may not come now."""
        if msg.COMMAND not in _ALLOWED[self.state]:
            raise RemoteProtocolError(f"{msg.COMMAND.name} is not allowed in state {self.state.value}")

    def hello(self, msg: Hello) -> int:
        """Take the client's HELLO; returns the minor both sides will use.

        RemoteProtocolError for another major, or a stated max_frame below MIN_FRAME (the server
        could not send every reply within it).
        """
        self.check(msg)
        if msg.major != PROTOCOL_MAJOR:
            self.state = SessionState.CLOSED
            raise RemoteProtocolError(
                f"client speaks protocol {msg.major}.{msg.minor}; this server speaks {PROTOCOL_MAJOR}.x"
            )
        if 0 < msg.max_frame < MIN_FRAME:
            self.state = SessionState.CLOSED
            raise RemoteProtocolError(f"HELLO max_frame {msg.max_frame} is below the minimum of {MIN_FRAME}")
        self.minor = min(self.our_minor, msg.minor)
        if self.auth_required and self.our_minor >= MAC_SINCE and not mac_usable(self.minor, b""):
            # a relay could have lowered the minor to switch the MACs off: refuse, never downgrade
            self.state = SessionState.CLOSED
            raise AuthError(
                f"client speaks protocol {msg.major}.{msg.minor}, which cannot protect its frames; "
                f"this server wants {PROTOCOL_MAJOR}.{MAC_SINCE} or later with a token"
            )
        self.state = SessionState.AWAIT_AUTH if self.auth_required else SessionState.READY
        return self.minor

    def cache_usable(self) -> bool:
        """Whether the negotiated minor lets this connection use the cache."""
        return cache_usable(self.minor)

    def authenticated(self) -> None:
        if self.state is not SessionState.AWAIT_AUTH:
            raise RemoteProtocolError("AUTH is not expected now")
        self.state = SessionState.READY

    def close(self) -> None:
        self.state = SessionState.CLOSED


class ClientSession:
    """The client's handshake: our HELLO, the server's HELLO, AUTH both ways if asked, then READY.

    ``start()`` gives the HELLO to send; ``server_hello(msg)`` takes the server's and gives the
    AUTH to send, or None when the server wants none (then the session is READY);
    ``server_auth(msg)`` checks the server's proof. A client holding a token refuses a server
    that does not ask for it: such a server has not proven it knows the token, so it could be
    anyone listening on that address.
    """

    def __init__(self, *, minor: int = PROTOCOL_MINOR, token: bytes | None = None):
        self.state = SessionState.AWAIT_HELLO
        self.our_minor = minor
        self.minor = minor  # negotiated at the server's HELLO
        self.max_frame = MAX_FRAME  # what the server accepts, once it said so
        self.cache = False  # the server keeps a cache this connection can use
        self.verify = False  # the server reports digests of what it stored (minor 2)
        self.update = False  # the server takes UPDATE and COMMIT (minor 3)
        self.delta = False  # ... and applies DELTA frames (its DELTA flag)
        self.models = False  # the server takes MODEL, REMOVE, STATS and shared updates (minor 5)
        self.hello: Hello | None = None  # the HELLO we sent
        self.server: Hello | None = None
        self._token = token
        self._nonce = new_nonce()

    def start(self) -> Hello:
        """The HELLO that opens the connection."""
        self.hello = Hello(PROTOCOL_MAJOR, self.our_minor, 0, MAX_FRAME, 0, self._nonce)
        return self.hello

    def server_hello(self, hello: Hello) -> Auth | None:
        """Take the server's HELLO; returns the AUTH to send, or None if the session is now READY."""
        if self.state is not SessionState.AWAIT_HELLO:
            raise RemoteProtocolError("HELLO is not expected now")
        if hello.major != PROTOCOL_MAJOR:
            self.state = SessionState.CLOSED
            raise RemoteProtocolError(
                f"server speaks protocol {hello.major}.{hello.minor}; this client speaks {PROTOCOL_MAJOR}.x"
            )
        self.server = hello
        self.minor = min(self.our_minor, hello.minor)
        self.max_frame = min(hello.max_frame or MAX_FRAME, MAX_FRAME)
        # A server of an older minor cannot have a cache we can use, whatever its flag byte says.
        self.cache = hello.has(Capability.CACHE) and cache_usable(self.minor)
        self.verify = verify_usable(self.minor)
        self.update = update_usable(self.minor)
        self.delta = self.update and hello.has(Capability.DELTA)
        self.models = models_usable(self.minor)
        if hello.has(Capability.AUTH):
            if self._token is None:
                self.state = SessionState.CLOSED
                raise AuthError("the server wants a token; pass one (--token-file)")
            if self.our_minor >= MAC_SINCE and not mac_usable(self.minor, self._token):
                self.state = SessionState.CLOSED
                raise AuthError(
                    f"server speaks protocol {hello.major}.{hello.minor}, which cannot protect its frames: "
                    "refusing (pass protocol_minor=1 to accept unprotected frames)"
                )
            self.state = SessionState.AWAIT_AUTH
            return Auth(client_mac(self._token, self._nonce, hello.nonce))
        if self._token is not None:
            self.state = SessionState.CLOSED
            raise AuthError("this client has a token but the server did not ask for one: refusing an unproven server")
        self.state = SessionState.READY
        return None

    def server_auth(self, proof: Auth) -> None:
        """Check the server's AUTH: AuthError unless it proves the server holds the token."""
        if self.state is not SessionState.AWAIT_AUTH or self.server is None or self._token is None:
            raise RemoteProtocolError("AUTH is not expected now")
        verify_mac(server_mac(self._token, self._nonce, self.server.nonce), proof.mac, who="server")
        self.state = SessionState.READY

    def frame_macs(self) -> tuple[FrameMac, FrameMac] | None:
        """(outgoing, incoming) frame MACs once READY on a protected connection, else None."""
        if self.state is not SessionState.READY or self._token is None or self.server is None or self.hello is None:
            return None
        if not mac_usable(self.minor, self._token):
            return None
        c2s, s2c = frame_keys(self._token, self.hello, self.server)
        return FrameMac(c2s), FrameMac(s2c)

    def close(self) -> None:
        self.state = SessionState.CLOSED
