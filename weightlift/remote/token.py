"""The shared token of a server and its clients, read from a file (the CLI's ``--token-file``)."""

from __future__ import annotations

from weightlift.errors import FileError, OptionError

__all__ = ["read_token"]


def read_token(path: str | None) -> bytes | None:
    """The token in ``path`` (surrounding whitespace removed), or None without a path."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            token = f.read(64 * 1024).strip()
    except OSError as e:
        raise FileError(f"cannot read token file {path}: {e.strerror or e}", errno=e.errno) from None
    if not token:
        raise OptionError(f"token file {path} is empty")
    return token
