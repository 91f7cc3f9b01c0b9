"""The tensor server: accepts connections, receives pushed tensors into memory, serves reads."""

from __future__ import annotations

from weightlift.remote.server.server import Server

__all__ = ["Server"]
