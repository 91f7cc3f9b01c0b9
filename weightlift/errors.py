"""The error tree of weightlift.

Every error weightlift raises on purpose is one of these; foreign exceptions (OSError from a
file, socket errors, struct errors) are mapped at the boundary where they happen, so callers
catch one root::

    WeightliftError
    ├── FormatError            a checkpoint file is malformed (names the file and tensor)
    │   └── NotFoundError      a path, shard or tensor that does not exist
    ├── OptionError            a bad argument or option from the caller
    ├── ProtocolError          the wire protocol was violated
    │   ├── LocalProtocolError   we were asked to send something invalid
    │   └── RemoteProtocolError  the peer sent something invalid, or reported an error
    ├── AuthError              the HELLO challenge-response failed
    ├── TransportError         a connection could not be made, broke, or timed out
    ├── CacheError             the content-addressed cache failed (never fatal to a load)
    └── DeviceError            a target device is missing or a copy to it failed
"""

from __future__ import annotations

__all__ = [
    "WeightliftError",
    "FormatError",
    "NotFoundError",
    "OptionError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "AuthError",
    "TransportError",
    "CacheError",
    "DeviceError",
]


class WeightliftError(Exception):
    """Root of every error weightlift raises on purpose."""


class FormatError(WeightliftError):
    """A checkpoint file is malformed; the message names the file and, where known, the tensor."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        parts = []
        if file is not None:
            parts.append(str(file))
        if tensor is not None:
            parts.append(f"tensor {tensor!r}")
        prefix = ": ".join(parts)
        super().__init__(f"{prefix}: {message}" if prefix else message)
        self.file = file
        self.tensor = tensor
        self.reason = message


class NotFoundError(FormatError):
    """A path, a shard named by an index, or a selected tensor does not exist."""


class OptionError(WeightliftError):
    """An argument or option passed by the caller is invalid."""


class ProtocolError(WeightliftError):
    """The wire protocol was violated."""


class LocalProtocolError(ProtocolError):
    """We were asked to send a message that the protocol does not allow."""


class RemoteProtocolError(ProtocolError):
    """The peer sent a malformed or forbidden message, or replied with an error."""


class AuthError(WeightliftError):
    """The HELLO challenge-response failed: wrong or missing token."""


class TransportError(WeightliftError):
    """A connection could not be made, broke, or timed out."""


class CacheError(WeightliftError):
    """The content-addressed cache failed; a load goes on without it."""


class DeviceError(WeightliftError):
    """A target device is unavailable, or a copy to it failed."""
