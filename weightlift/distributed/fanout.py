"""Fan-out: one source reads a checkpoint, every rank of a group gets the same weights.

:func:`broadcast_load` runs on every rank. The source rank opens the checkpoint and sends a
small JSON description of the selected tensors (names, dtypes, shapes, where each lies in the
arena); every rank allocates its arena from it, so receivers need no copy of the files. Then
the arena goes out in chunks of ``chunk`` bytes: the source reads chunk k+1 (into its own
arena, which is its result) while chunk k's broadcast is in flight (``async_op=True``, at most
two outstanding), and each receiver's broadcast lands straight in the slice of its arena
where the bytes belong: no staging copy on the receivers, host or device.

A rank that dies or stalls fails the others' collectives; :class:`~.comm.Comm` turns that
into :class:`~weightlift.errors.TransportError`, after ``timeout`` seconds at most.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from weightlift.checkpoint import Checkpoint, Select, open_checkpoint
from weightlift.distributed.comm import Arena, Comm, pack
from weightlift.distributed.group import overlaps, read_all
from weightlift.distributed.reader import SliceReader
from weightlift.distributed.shard import Rows, whole
from weightlift.dtypes import byte_length, dtype_info
from weightlift.errors import GroupError, OptionError, RemoteProtocolError
from weightlift.formats import TensorInfo
from weightlift.memory.faulter import REGION, Faulter
from weightlift.options import Placement

__all__ = ["broadcast_load", "share_description", "BROADCAST_CHUNK", "MAX_DESCRIPTION"]

BROADCAST_CHUNK = 64 * 1024 * 1024
MAX_DESCRIPTION = 64 * 1024 * 1024
_FORMAT = "weightlift-broadcast/1"


def broadcast_load(
    path: Any = None,
    group: Any = None,
    *,
    src: int = 0,
    device: str = "cpu",
    framework: str = "numpy",
    select: Select = None,
    engine: str = "auto",
    chunk: int = BROADCAST_CHUNK,
    timeout: float | None = None,
    progress: Callable[[int], None] | None = None,
    report: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a checkpoint on rank ``src`` of ``group`` and broadcast it to every rank; call on all.

    ``path`` and ``select`` matter on the source only (other ranks may pass None). Returns
    ``{name: array}`` on every rank. ``timeout`` (seconds) bounds each wait on a collective.
    ``progress(nbytes)`` is called after each chunk has arrived. ``report`` gets ``bytes``,
    ``bytes_read`` (non-zero on the source only), ``chunks`` and ``seconds``.
    """
    t0 = time.perf_counter()
    if not isinstance(chunk, int) or chunk < 1:
        raise OptionError(f"chunk must be a positive number of bytes, got {chunk!r}")
    place = Placement(device=device, framework=framework)  # checked once: the value travels on
    comm = Comm(group, timeout=timeout)
    comm.check_device(place)
    if not 0 <= src < comm.world:
        raise OptionError(f"src must be a rank of the group, in [0, {comm.world}), got {src}")
    source = comm.rank == src
    infos, offs, total, reader = _plan(comm, path, select, engine, src, source)
    arena = Arena(total, place)
    at = arena.tensor()
    pending: deque[Any] = deque()
    done = 0
    chunks = 0
    faulter = _faulter(arena)
    try:
        for lo in range(0, total, chunk):
            hi = min(total, lo + chunk)
            if faulter is not None:
                # this chunk's fresh pages, faulted while the previous chunk is still in flight
                # (the helpers have usually done them already): a receive into untouched memory
                # measured two to three times slower than into touched memory
                faulter.ready(REGION, lo, hi)
            chunks += _step(comm, arena, at, reader if source else None, infos, offs, lo, hi, src, pending)
            if len(pending) > 1:
                done += _finish(comm, pending.popleft(), progress)
        while pending:
            done += _finish(comm, pending.popleft(), progress)
    finally:
        if faulter is not None:
            faulter.close()
    out = {t.name: arena.view(off, whole(t), place.framework) for t, off in zip(infos, offs, strict=False)}
    if report is not None:
        comm.landed()  # the time of the bytes on the device, not of the collectives queued
        report.update(
            tensors=len(out),
            bytes=sum(t.length for t in infos),
            arena=total,
            chunks=chunks,
            bytes_read=reader.bytes_read if reader is not None else 0,
            seconds=time.perf_counter() - t0,
            rank=comm.rank,
            world=comm.world,
            src=src,
        )
    return out


def _plan(
    comm: Comm, path: Any, select: Select, engine: str, src: int, source: bool
) -> tuple[list[TensorInfo], list[int], int, SliceReader | None]:
    """Every rank's tensors and their arena offsets, and the source's reader: the source opens
    the checkpoint and broadcasts its description; a source that fails tells the receivers
    first, then raises its own error."""
    reader = None
    infos: list[TensorInfo] = []
    offs: list[int] = []
    total = 0
    failure: BaseException | None = None
    desc = b""
    if source:
        try:
            if path is None:
                raise OptionError("the source rank needs a path")
            ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path)
            infos = ckpt.select(select)
            reader = SliceReader({f: ckpt.mapped(f) for f in dict.fromkeys(t.file for t in infos)}, engine=engine)
            offs, total = pack([t.length for t in infos])
            desc = _describe(infos, offs, total)
        except Exception as e:  # noqa: BLE001 - the receivers are told, then it is raised here
            failure = e
    desc = share_description(comm, desc, src, failed=failure is not None)
    if failure is not None:
        raise failure
    if not source:
        infos, offs, total = _parse(desc)
    return infos, offs, total, reader


FAULT_WINDOW = 256 * 1024 * 1024  # how far the helpers may fault ahead of the chunk in flight


def _faulter(arena: Arena) -> Faulter | None:
    """Helpers faulting a host arena in ahead of the chunks landing in it (the fill policy's
    helper count; 0: none, each chunk's pages are faulted by its receive)."""
    if arena.host is None:
        return None
    return Faulter.ahead(arena.host, window=FAULT_WINDOW, name="wl-bcast-fault")


def _step(
    comm: Comm,
    arena: Arena,
    at: Any,
    reader: SliceReader | None,
    infos: list[TensorInfo],
    offs: list[int],
    lo: int,
    hi: int,
    src: int,
    pending: deque[Any],
) -> int:
    """One chunk: the source reads its bytes into the arena; every rank posts its broadcast."""
    if reader is not None:
        read_all(
            arena,
            reader,
            [(Rows(t.file, t.offset + a, b - a, b - a, 1), off + a) for t, off, a, b in overlaps(infos, offs, lo, hi)],
        )
    pending.append((comm.broadcast(at[lo:hi], src, async_op=True, what="broadcast of weights"), hi - lo))
    return 1


def _finish(comm: Comm, item: tuple[Any, int], progress: Callable[[int], None] | None) -> int:
    work, n = item
    comm.wait(work, "broadcast of weights")
    if progress is not None:
        progress(n)
    return n


def share_description(comm: Comm, desc: bytes, src: int, *, failed: bool = False) -> bytes:
    """The source's description to every rank: its length, then its bytes (uint8 tensors). A
    length of -1 says the source failed before it could describe anything."""
    import torch

    dev = comm.device
    n = torch.tensor([-1 if failed else len(desc)], dtype=torch.int64, device=dev)
    comm.broadcast(n, src, what="broadcast of the tensor list")
    size = int(n.item())
    if size == -1:
        if failed:
            return b""
        raise GroupError(f"the source rank {src} failed to open its checkpoint (its own error says why)")
    if not 0 < size <= MAX_DESCRIPTION:
        raise RemoteProtocolError(f"rank {src} announced a tensor list of {size} bytes (limit {MAX_DESCRIPTION})")
    buf = (
        torch.frombuffer(bytearray(desc), dtype=torch.uint8).to(dev)
        if desc
        else torch.empty(size, dtype=torch.uint8, device=dev)
    )
    comm.broadcast(buf, src, what="broadcast of the tensor list")
    return bytes(buf.cpu().numpy()) if not desc else desc


def _describe(infos: list[TensorInfo], offs: list[int], total: int) -> bytes:
    rows = [
        [t.name, t.dtype, list(t.shape), list(t.extra.get("raw_shape", t.shape)), t.ggml_type, t.length, off]
        for t, off in zip(infos, offs, strict=False)
    ]
    return json.dumps({"format": _FORMAT, "total": total, "tensors": rows}, separators=(",", ":")).encode()


def _parse(desc: bytes) -> tuple[list[TensorInfo], list[int], int]:
    """The source's description, checked: every tensor inside the arena, no two overlapping,
    every length what its dtype and shape say."""
    try:
        obj = json.loads(desc)
        if obj.get("format") != _FORMAT:
            raise ValueError(f"format {obj.get('format')!r}, expected {_FORMAT!r}")
        total = obj["total"]
        if not isinstance(total, int) or total < 0:
            raise ValueError("bad arena size")
        infos, offs, end = [], [], 0
        for name, dtype, shape, raw_shape, ggml_type, length, off in obj["tensors"]:
            if not (
                isinstance(name, str)
                and isinstance(off, int)
                and isinstance(length, int)
                and all(isinstance(x, int) and x >= 0 for x in shape + raw_shape)
            ):
                raise ValueError(f"bad entry for {name!r}")
            if off < end or off + length > total:
                raise ValueError(f"tensor {name!r} at [{off}, {off + length}) overlaps another or leaves the arena")
            end = off + length
            if ggml_type is not None and not isinstance(ggml_type, int):
                raise ValueError(f"bad ggml type for {name!r}")
            t = TensorInfo(
                name, dtype, tuple(shape), "", 0, length, ggml_type=ggml_type, extra={"raw_shape": tuple(raw_shape)}
            )
            if not t.quantized:
                dtype_info(dtype)
                if byte_length(dtype, t.shape) != length:
                    raise ValueError(f"tensor {name!r}: {length} bytes for {dtype} {shape}")
            elif math.prod(raw_shape) != length:
                raise ValueError(f"tensor {name!r}: {length} bytes for raw blocks {raw_shape}")
            infos.append(t)
            offs.append(off)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise RemoteProtocolError(f"the source's tensor list is malformed: {e}") from None
    except Exception as e:  # noqa: BLE001 - whatever else a malformed entry makes the checks above raise
        raise RemoteProtocolError(f"the source's tensor list is malformed: {e}") from None
    return infos, offs, total
