"""The tensor server: accepts connections, receives pushed tensors into memory, serves reads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightlift.remote.server.server import Server

__all__ = ["Server"]


def __getattr__(name: str) -> Any:
    # loaded on first use: a client command that reads a default from .config must not pay for
    # the whole server (its receive path imports ml_dtypes, half a second)
    if name == "Server":
        from weightlift.remote.server.server import Server

        return Server
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
