"""The client side of the wire: push a checkpoint, pull, list and free against a tensor server."""

from __future__ import annotations

from weightlift.remote.client.client import Client, PushResult, RemoteTensor

__all__ = ["Client", "PushResult", "RemoteTensor"]
