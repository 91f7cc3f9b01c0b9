"""Every tensor a weightlift tensor server holds, read over the wire into one block of this
process's memory, as torch tensors that view it.

The whole pull of :meth:`weightlift.remote.client.Client.pull` without its file: the server's
listing laid out back to back in one anonymous mapping, every tensor READ straight into its
place (a window of READs in flight, on the client's authenticated, MAC'd connection), and, with
``verify``, hashed as it lands against the digest the server states. The tensors view that
mapping, so vLLM's weight loaders copy from it into their parameters and nothing else is copied.
"""

from __future__ import annotations

import mmap
import ssl
from typing import Any

from weightlift import env
from weightlift.dtypes import torch_dtype
from weightlift.errors import DeviceError, IntegrityError, StateError
from weightlift.remote.client import Client
from weightlift.remote.client.pull import listing, read_tensors
from weightlift.remote.transport import client_tls_context

__all__ = ["pull_tensors", "tls_context"]

ALIGN = 64  # each tensor starts at a multiple of this in the block, as the kernels like


def tls_context(tls: bool | str) -> ssl.SSLContext | None:
    """The client TLS context ``tls`` asks for: none, the system's roots (True) or a CA file."""
    if tls is False:
        return None
    return client_tls_context(None if tls is True else tls)


def pull_tensors(
    address: str,
    *,
    token: bytes | None = None,
    tls: ssl.SSLContext | None = None,
    verify: bool = False,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """``{name: torch.Tensor}`` for every complete tensor the server at ``address`` holds, in
    name order. ``verify``: each tensor is hashed as it lands and an IntegrityError names every
    one that differs from the digest the server states (nothing is returned)."""
    import torch

    with Client(address, token=token, tls=tls, timeout=timeout) as client:
        conn = client.connections[0]
        listed = listing(conn)
        starts, pos = [], 0
        for e in listed:
            starts.append(pos)
            pos += -(-e.nbytes // ALIGN) * ALIGN
        block = _block(address, len(listed), pos)
        differ, replaced = read_tensors(conn, listed, starts, block, verify)
    if differ:
        raise IntegrityError(
            f"from the server at {address}: {len(differ)} of {len(listed)} tensors arrived other than "
            "the server states them: " + ", ".join(differ)
        )
    if replaced:
        raise StateError(
            f"from the server at {address}: tensors were replaced while they were read: "
            + ", ".join(repr(listed[i].name) for i in replaced)
        )
    raw = torch.frombuffer(block, dtype=torch.uint8) if pos else torch.empty(0, dtype=torch.uint8)
    out: dict[str, Any] = {}
    for e, start in zip(listed, starts, strict=True):
        out[e.name] = raw[start : start + e.nbytes].view(torch_dtype(e.dtype)).reshape(e.shape)
    return out


def _block(address: str, count: int, size: int) -> mmap.mmap:
    """Anonymous memory for ``size`` bytes of tensors, refused (DeviceError naming the server and
    the size) where this host's available memory cannot hold them: a server's listing is not to
    be mapped, and then faulted in, blindly."""
    available = env.available_memory()
    what = f"from the server at {address}: its {count} tensors take {size:,} bytes"
    if available is not None and size > available:
        raise DeviceError(f"{what}, more than the {available:,} bytes of memory available here")
    try:
        return mmap.mmap(-1, max(size, 1))
    except (OSError, OverflowError, ValueError) as e:
        raise DeviceError(f"{what}, which cannot be mapped here: {e}") from None
