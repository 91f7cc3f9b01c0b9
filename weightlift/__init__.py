"""weightlift: model weights from disk or another machine into memory, fast, every byte checked.

The public API is a handful of verbs; everything else lives in submodules::

    weightlift.load(path, *, device="cpu", framework="numpy", select=None, dtype=None, copy=True, ...)
    weightlift.open(path) -> Checkpoint      # tensors listed, no data read
    weightlift.Server(...)                  # a tensor server that receives pushed weights
    weightlift.Client(address, ...)         # push, pull, list against a server
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightlift.api import Prefetch, load, prefetch
from weightlift.checkpoint import Checkpoint
from weightlift.checkpoint import open_checkpoint as open
from weightlift.errors import (
    AuthError,
    CacheError,
    DeviceError,
    FileError,
    FormatError,
    GroupError,
    IntegrityError,
    NotFoundError,
    OptionError,
    ProtocolError,
    PushError,
    StateError,
    TransportError,
    WeightliftError,
)
from weightlift.formats import TensorInfo

if TYPE_CHECKING:  # loaded on first use at run time (module __getattr__ below); typed for checkers
    from weightlift.distributed.shard import Shard
    from weightlift.remote.client import Client
    from weightlift.remote.server import Server

__version__ = "0.1.0"

__all__ = [
    "load",
    "prefetch",
    "Prefetch",
    "open",
    "Checkpoint",
    "TensorInfo",
    "Shard",
    "Server",
    "Client",
    "WeightliftError",
    "FormatError",
    "NotFoundError",
    "OptionError",
    "ProtocolError",
    "AuthError",
    "TransportError",
    "CacheError",
    "DeviceError",
    "FileError",
    "StateError",
    "IntegrityError",
    "GroupError",
    "PushError",
]


def __getattr__(name: str) -> Any:
    # the remote half imports sockets and threads; a plain local load should not pay for it
    if name == "Shard":  # the distributed layer is for process groups; a plain load does not import it
        from weightlift.distributed.shard import Shard

        return Shard
    if name == "Server":
        from weightlift.remote.server import Server

        return Server
    if name == "Client":
        from weightlift.remote.client import Client

        return Client
    raise AttributeError(f"module 'weightlift' has no attribute {name!r}")
