"""Tensors a push takes from memory: numpy arrays and torch tensors, as the push's tensor list.

Each becomes a :class:`~weightlift.formats.TensorInfo` with no file, whose bytes come from
:func:`host_bytes`: a flat uint8 view of the array's own memory (no copy) for a contiguous numpy
array or torch CPU tensor, so the sender hands the tensor's memory itself to ``sendmsg``. A
non-contiguous tensor is made contiguous once (a copy); a torch tensor on a device is copied to
host memory each time its bytes are needed (hashed, then sent: the staging copy), one tensor at
a time, so a push never holds more than a tensor or two of staging. A device tensor is read as
it stands after the work queued on the caller's current stream when ``push`` was called: work
queued later, or on another stream the caller did not wait for, is not waited for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from weightlift.checkpoint import Select, matcher
from weightlift.dtypes import from_numpy, from_torch
from weightlift.errors import NotFoundError, OptionError
from weightlift.formats import TensorInfo
from weightlift.memory.targets import as_bytes

__all__ = ["memory_tensors", "host_bytes", "is_memory"]

MEMORY = "<memory>"  # the file of a tensor that lives in memory


def _numpy(a: np.ndarray) -> tuple[str, tuple[int, ...], Callable[[], np.ndarray]]:
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return from_numpy(a.dtype), tuple(int(d) for d in a.shape), lambda: flat


def _torch(t: Any) -> tuple[str, tuple[int, ...], Callable[[], np.ndarray]]:
    import torch

    t = t.detach()
    name, shape = from_torch(t.dtype), tuple(int(d) for d in t.shape)
    if t.device.type == "cpu":
        flat = as_bytes(t.contiguous())
        return name, shape, lambda: flat
    # Device memory, staged through host memory whenever the bytes are needed, on a push thread:
    # its stream knows nothing of the caller's, where the bytes may still be being written (a
    # trainer's side stream). The push sends the tensor as it is once the work the caller queued
    # before push() has run: an event recorded now, on the caller's current stream.
    t = t.contiguous()
    ready = torch.cuda.Event(blocking=True)  # blocking: the push thread sleeps, it does not spin
    ready.record(torch.cuda.current_stream(t.device))
    return name, shape, lambda: as_bytes(t, after=ready)


def _describe(value: Any) -> tuple[str, tuple[int, ...], Callable[[], np.ndarray]]:
    if isinstance(value, np.ndarray):
        return _numpy(value)
    kind = type(value).__name__
    if kind in ("DTensor", "ShardOf"):  # a shard: sending it whole would take a gather
        raise OptionError(
            f"push: a {kind} is a shard of a tensor: weightlift.distributed.push_shards sends it to servers "
            "that hold slices (Server(shard=...)) without a gather"
        )
    if type(value).__module__.startswith("torch") and hasattr(value, "dtype") and hasattr(value, "detach"):
        return _torch(value)
    raise OptionError(f"push: expected numpy arrays or torch tensors, got {kind}")


def memory_tensors(tensors: Mapping[str, Any], select: Select = None) -> list[TensorInfo]:
    """The selected tensors of ``{name: array or tensor}``, in the mapping's order."""
    match = matcher(select) if select is not None else None
    out = []
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise OptionError(f"push: tensor names are non-empty strings, got {name!r}")
        if match is not None and not match(name):
            continue
        dtype, shape, data = _describe(value)
        nbytes = int(value.nbytes)
        out.append(TensorInfo(name, dtype, shape, MEMORY, 0, nbytes, extra={"data": data}))
    if select is not None and not out:
        raise NotFoundError(f"selection {select!r} matches no tensor of the {len(tensors)} given")
    return out


def is_memory(t: TensorInfo) -> bool:
    return "data" in t.extra


def host_bytes(t: TensorInfo) -> np.ndarray:
    """The bytes of an in-memory tensor as a flat uint8 array (its own memory where it is on the host)."""
    data: Callable[[], np.ndarray] = t.extra["data"]
    return data()
