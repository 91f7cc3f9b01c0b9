"""The error tree of weightlift.

Every error weightlift raises on purpose is one of these; foreign exceptions (OSError from a
file, socket errors, struct errors) are mapped at the boundary where they happen, so callers
catch one root::

    WeightliftError                                          also a built-in:
    ├── FormatError            a checkpoint file is malformed         ValueError
    │                          (names the file and tensor)
    ├── NotFoundError          a path, shard, tensor or remote name   FileNotFoundError
    │                          that does not exist
    ├── FileError              reading or writing a file failed: an   OSError
    │                          OSError, or a file ended early
    ├── OptionError            a bad argument or option from the      ValueError
    │                          caller (a bad type too)
    ├── StateError             a call the object's state does not     RuntimeError
    │                          allow (closed, not started, busy)
    ├── IntegrityError         bytes differ from what was written     ValueError
    │                          or from their digest
    ├── ProtocolError          the wire protocol was violated
    │   ├── LocalProtocolError   we were asked to send something invalid
    │   └── RemoteProtocolError  the peer sent something invalid, or reported an error
    ├── AuthError              the HELLO challenge-response failed    PermissionError
    ├── TransportError         a connection could not be made, broke  ConnectionError
    │   └── TransportTimeout   or timed out (a timeout: this one)     TimeoutError
    ├── CacheError             the content-addressed cache failed (never fatal to a load)
    ├── DeviceError            a target device is missing or a copy   RuntimeError
    │                          to it failed
    ├── GroupError             another rank of a process group        RuntimeError
    │                          failed (its own error says why)
    └── PushError              some of several pushes failed (per server: error or result)

The benchmark harness adds two of its own under the root (``ArmFailed``, ``ArmSkipped`` in
:mod:`weightlift.benchmark.harness`); the arm bodies it runs in child processes import nothing
from weightlift and report through their exit line instead.

Each error is also the built-in exception a Python user would catch for its kind of failure (the
right-hand column), so code written for ``open()``, ``json`` or ``socket`` catches weightlift's too:
``except FileNotFoundError`` a missing checkpoint, ``except ValueError`` a bad option or a bad
file (as for gguf-py's reader), ``except RuntimeError`` a closed object or a device failure (as for
threading and torch), ``except ConnectionError`` a server gone. The classes without one (the
protocol's, the cache's, PushError) say why in their docstrings. weightlift's own code never catches a built-in where one of these
may pass through unless it means to (see :func:`os_error`). The OSError ones keep ``str(e)`` as
the message alone, and carry ``errno`` (and ``filename``, where one is named) as an OSError does.

A not-found is not a format error: a server's "no such tensor" or a missing shard says nothing
about whether a file is well formed. A broken invariant inside weightlift (a bug, not a
condition to handle) raises ``AssertionError``.
"""

from __future__ import annotations

import errno as _errno
from typing import Any

__all__ = [
    "WeightliftError",
    "FormatError",
    "NotFoundError",
    "FileError",
    "OptionError",
    "StateError",
    "IntegrityError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "AuthError",
    "TransportError",
    "TransportTimeout",
    "CacheError",
    "DeviceError",
    "GroupError",
    "PushError",
    "os_error",
    "install_hint",
]


class WeightliftError(Exception):
    """Root of every error weightlift raises on purpose."""

    # the message alone, as raised: an OSError among the bases would otherwise print
    # "[Errno 2] ..." once ``errno`` is set
    __str__ = Exception.__str__


def _os_fields(e: OSError, code: int | None, reason: str, file: str | None) -> None:
    # what code written for OSError reads: errno, strerror, filename
    e.errno = code
    e.strerror = reason
    e.filename = file


def _located(message: str, file: str | None, tensor: str | None) -> str:
    parts = []
    if file is not None:
        parts.append(str(file))
    if tensor is not None:
        parts.append(f"tensor {tensor!r}")
    prefix = ": ".join(parts)
    return f"{prefix}: {message}" if prefix else message


class _Located(WeightliftError):
    # an error about a file and, where known, one of its tensors, named in the message
    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        super().__init__(_located(message, file, tensor))
        self.file = file
        self.tensor = tensor
        self.reason = message


class FormatError(_Located, ValueError):
    """A checkpoint file is malformed; the message names the file and, where known, the tensor.

    Also a :class:`ValueError`: what gguf-py's ``GGUFReader`` and ``json`` raise for a bad file.
    (safetensors' ``SafetensorError`` derives from ``Exception`` alone, so no built-in shares it.)"""


class NotFoundError(_Located, FileNotFoundError):
    """A path, a shard named by an index, a selected tensor or a server's tensor does not exist.

    Also a :class:`FileNotFoundError` (``errno`` ENOENT, ``filename`` the file where one is named)."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        super().__init__(message, file=file, tensor=tensor)
        _os_fields(self, _errno.ENOENT, message, file)


class FileError(WeightliftError, OSError):
    """Reading or writing a file failed (the OSError's reason is in the message), or a file ended before its tensors.

    Also an :class:`OSError` with the ``errno`` of the failure (None for a file that ended early)."""

    def __init__(self, message: str, *, file: str | None = None, errno: int | None = None):
        super().__init__(_located(message, file, None))
        _os_fields(self, errno, message, file)
        self.file = file
        self.reason = message


def os_error(e: OSError, file: Any, what: str) -> WeightliftError:
    """The boundary for OSError: a missing file is a :class:`NotFoundError`, anything else a :class:`FileError`.

    ``what`` says what was being done ("cannot open", "cannot read", ...); the message is
    ``"<file>: <what>: <strerror>"``.
    """
    if e.errno == _errno.ENOENT:
        return NotFoundError("no such file", file=str(file))
    return FileError(f"{what}: {e.strerror or e}", file=str(file), errno=e.errno)


def install_hint(extra: str) -> str:
    """How to install one of weightlift's extras, for a message that needs it: the line that works
    from a checkout today, and the one that will work from a package index once it is published."""
    return f"pip install -e '.[{extra}]' from a checkout of weightlift (or 'weightlift[{extra}]' once published)"


class OptionError(WeightliftError, ValueError):
    """An argument or option passed by the caller is invalid (its value or its type); also a :class:`ValueError`."""


class StateError(WeightliftError, RuntimeError):
    """The call is not allowed in the object's current state: it is closed, or not started yet.

    Also a :class:`RuntimeError`: what threading and concurrent.futures raise for a call their
    state forbids (a thread started twice, a submit after shutdown)."""


class IntegrityError(WeightliftError, ValueError):
    """Bytes that were read back differ from what was written, or from their recorded digest.

    Also a :class:`ValueError`: a file whose bytes are not the ones recorded is a bad file, caught
    by the same ``except ValueError`` as a malformed one (:class:`FormatError`)."""


class ProtocolError(WeightliftError):
    """The wire protocol was violated.

    No built-in base: none means "the peer broke the protocol" (http.client, h11 and httpx keep
    theirs apart too), and a ConnectionError would have the transport's handlers re-wrap it."""


class LocalProtocolError(ProtocolError):
    """We were asked to send a message that the protocol does not allow (no built-in base, as :class:`ProtocolError`)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent a malformed or forbidden message, or replied with an error.

    No built-in base, as :class:`ProtocolError`: a server's refusal is neither a bad value of ours
    nor a broken connection (that one is a :class:`TransportError`)."""


class AuthError(WeightliftError, PermissionError):
    """The HELLO challenge-response failed: wrong or missing token; also a :class:`PermissionError`."""

    def __init__(self, message: str):
        super().__init__(message)
        _os_fields(self, _errno.EACCES, message, None)


class TransportError(WeightliftError, ConnectionError):
    """A connection could not be made, broke, or timed out; also a :class:`ConnectionError`."""

    def __init__(self, message: str):
        super().__init__(message)
        _os_fields(self, None, message, None)


class TransportTimeout(TransportError, TimeoutError):
    """A connect, a send or a reply took longer than its deadline; also a :class:`TimeoutError`."""

    def __init__(self, message: str):
        super().__init__(message)
        _os_fields(self, _errno.ETIMEDOUT, message, None)


class CacheError(WeightliftError):
    """The content-addressed cache failed; a load goes on without it.

    No built-in base: it never reaches a caller's ``except``, the server handles it itself."""


class DeviceError(WeightliftError, RuntimeError):
    """A target device is unavailable, or a copy to it failed.

    Also a :class:`RuntimeError`: what torch raises for a CUDA failure (an out-of-memory too)."""


class GroupError(WeightliftError, RuntimeError):
    """Another rank of a process group failed; this rank stops too, and that rank's error says why.

    Also a :class:`RuntimeError`: what torch.distributed raises when a peer fails (``DistError``)."""


class PushError(WeightliftError):
    """One or more pushes of :func:`weightlift.distributed.push_many` failed; ``errors`` and ``results`` say which.

    No built-in base: its failures are of several kinds, and each in ``errors`` keeps its own."""

    def __init__(self, errors: dict[str, BaseException], results: dict[str, Any]):
        first = next(iter(errors.items()))
        ok = f"; {len(results)} succeeded" if results else ""
        super().__init__(
            f"{len(errors)} of {len(errors) + len(results)} pushes failed, first {first[0]}: {first[1]}{ok}"
        )
        self.errors = errors
        self.results = results
