"""Checkpoints of byte tensors for the client-and-server tests, and the check that a server holds
exactly their bytes."""

from __future__ import annotations

from pathlib import Path

from tests.checkpoints import write
from weightlift.remote.server.server import Server


def write_u8(path: Path, tensors: dict[str, bytes]) -> tuple[str, dict[str, bytes]]:
    """``tensors`` written at ``path`` as one-dimensional U8 tensors; the file's path and the tensors."""
    return str(write(path, [(n, "U8", (len(b),), b) for n, b in tensors.items()])), tensors


def holds(server: Server, tensors: dict[str, bytes]) -> None:
    """The server holds these tensors, no others, each with exactly these bytes."""
    got = server.tensors()
    assert sorted(got) == sorted(tensors)
    for n, b in tensors.items():
        assert got[n].tobytes() == b, n
