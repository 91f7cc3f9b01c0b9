"""The client side of the wire: push a checkpoint, pull, list and free against a tensor server."""

from __future__ import annotations

from weightlift.remote.client.client import MAX_LIST_BYTES, MAX_LIST_ENTRIES, Client, PushResult, RemoteTensor

__all__ = ["Client", "PushResult", "RemoteTensor", "MAX_LIST_ENTRIES", "MAX_LIST_BYTES"]
