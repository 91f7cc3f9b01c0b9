"""The shared token of a server and its clients, read from a file (the CLI's ``--token-file``).

What ssh refuses for a private key is refused here: a token file that its group or others may
read (anyone who can read it can write the server's memory), and a token too short to resist
guessing (:data:`MIN_TOKEN`).
"""

from __future__ import annotations

import os
import stat

from weightlift.errors import FileError, OptionError

__all__ = ["read_token", "check_token", "token_bytes", "MIN_TOKEN"]

MIN_TOKEN = 16  # bytes: a token shorter than this is refused


def check_token(token: bytes, what: str = "the token") -> bytes:
    """``token`` itself, or OptionError if it is shorter than MIN_TOKEN bytes."""
    if len(token) < MIN_TOKEN:
        raise OptionError(
            f"{what} is {len(token)} bytes; a token must be at least {MIN_TOKEN} "
            "(e.g. `head -c 32 /dev/urandom | base64 > token && chmod 600 token`)"
        )
    return token


def token_bytes(token: str | bytes | None) -> bytes | None:
    """A token given in code, as bytes with surrounding whitespace removed, as :func:`read_token`
    reads a token file: ``token=open("tok").read()`` then matches ``serve --token-file tok``
    whether or not the file ends in a newline."""
    if token is None:
        return None
    return (token.encode() if isinstance(token, str) else bytes(token)).strip()


def read_token(path: str | None) -> bytes | None:
    """The token in ``path`` (surrounding whitespace removed), or None without a path.

    OptionError if the file is readable or writable by its group or others, or the token is
    shorter than MIN_TOKEN bytes."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise OptionError(
                    f"token file {path} is accessible by others (mode {stat.S_IMODE(mode):04o}): run `chmod 600 {path}`"
                )
            token = f.read(64 * 1024).strip()
    except OptionError:  # ours (a ValueError too): the file's mode
        raise
    except OSError as e:
        raise FileError(f"cannot read token file {path}: {e.strerror or e}", errno=e.errno) from None
    except ValueError as e:  # a NUL byte in the path (a config value): open() refuses it so
        raise OptionError(f"token file {path!r} is not a path: {e}") from None
    if not token:
        raise OptionError(f"token file {path} is empty")
    return check_token(token, f"the token in {path}")
