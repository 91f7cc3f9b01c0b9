"""Sharded to sharded: the plan of byte runs between two layouts, and a proof without a gather.

Theory of operation. A layout says, for each rank of a 1-D mesh, which region of each
unsharded tensor its local shard holds: ``Shard(d)`` cuts dimension ``d`` as ``torch.chunk``
does (:func:`~weightlift.distributed.shard.chunk_bounds`, the one copy of that geometry),
``Replicate()`` gives every rank the whole tensor, and a fused tensor (qkv, gate_up) whose
dim 0 stacks parts gives each rank its chunk of every part, stacked in part order. A region is
a list of *segments*: a box of the unsharded tensor (per-dimension ``[start, stop)``) and where
that box starts along the split dimension of the rank's local buffer. The plan intersects every
receiver segment with every sender segment; each non-empty box becomes one :class:`Transfer`,
its bytes as strided runs over the two row-major local buffers (trailing dimensions that are
whole on both sides merge into one contiguous run). Sender regions never overlap except under
replication, where exactly one sender is chosen per (tensor, receiver): the one with the fewest
bytes planned so far, lowest rank on ties. So every byte a receiver needs is sent to it exactly
once, nothing else is sent, and the plan is a pure function of its inputs: every process that
computes it gets the same list.

The proof is the linear sketch of :mod:`weightlift.digest.sketch` (``S = sum_i x_i * r**i mod
2**64`` over the unsharded tensor's words): :func:`sketch_local` is a rank's part from its local
buffer, the sum of its segments' parts; the senders' parts sum to the receivers' parts sum to the
sketch of the whole tensor, whatever the layouts. No I/O here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightlift.digest.sketch import Box, sketch, sketch_base, sketch_part
from weightlift.distributed.shard import Shard, chunk_bounds, parse_placement
from weightlift.dtypes import dtype_info
from weightlift.errors import OptionError
from weightlift.formats import TensorInfo

__all__ = [
    "Layout",
    "Segment",
    "Run",
    "Transfer",
    "TensorPlan",
    "plan",
    "region",
    "local_shape",
    "sketch",
    "sketch_base",
    "sketch_part",
    "sketch_local",
]

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Layout:
    """How tensors lie over ``world`` ranks: ``shard``'s rules (rank and world unset or ignored),
    and ``parts``: for fused tensors, the sizes of the parts stacked along dim 0 (each part is
    chunked over the ranks; the split dimension must then be 0)."""

    shard: Shard
    world: int
    parts: Mapping[str, Sequence[int]] | Callable[[str], Sequence[int] | None] | None = None
    #: the split dimension of each tensor by name (None: replicated), ahead of ``shard``'s rules:
    #: what a DTensor's placement says of it, with no pattern to match
    dims: Mapping[str, int | None] | None = None

    def placement(self, t: TensorInfo) -> int | None:
        """The split dimension of ``t`` (None: replicated); without rules, no name matching at all
        (FSDP's ``Shard(0)`` everywhere: half the plan's time on 50,000 names otherwise)."""
        if self.dims is not None and t.name in self.dims:
            dim = self.dims[t.name]
            if dim is None:
                return None
            nd = len(t.shape)
            if not -nd <= dim < nd:
                raise OptionError(f"tensor {t.name!r} of shape {list(t.shape)} has no dimension {dim} to split along")
            return dim % nd
        if self.shard.rules:
            return self.shard.placement(t)
        dim = parse_placement(self.shard.default)
        if dim is None:
            return None
        nd = len(t.shape)
        if not -nd <= dim < nd:
            return self.shard.placement(t)  # its error names the tensor
        return dim % nd

    def parts_of(self, name: str) -> Sequence[int] | None:
        if self.parts is None:
            return None
        if callable(self.parts):
            return self.parts(name)
        return self.parts.get(name)


@dataclass(frozen=True, slots=True)
class Segment:
    """A box of the unsharded tensor held by a rank, starting at ``local`` along ``dim`` of its buffer."""

    box: Box
    dim: int | None
    local: int


@dataclass(frozen=True, slots=True)
class Run:
    """``count`` runs of ``length`` bytes: from ``src + k*src_stride`` to ``dst + k*dst_stride``."""

    src: int
    dst: int
    length: int
    count: int
    src_stride: int
    dst_stride: int

    @property
    def nbytes(self) -> int:
        return self.length * self.count


@dataclass(frozen=True, slots=True)
class Transfer:
    """One box of tensor ``name`` from ``sender`` to ``receiver``, as byte runs over the local buffers."""

    name: str
    sender: int
    receiver: int
    box: Box
    runs: tuple[Run, ...]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.runs)


def _itemsize(t: TensorInfo) -> int:
    if t.quantized:
        raise OptionError(f"tensor {t.name!r} ({t.dtype}): quantized tensors cannot be resharded")
    bits = dtype_info(t.dtype).bits
    if bits % 8:
        raise OptionError(f"tensor {t.name!r} ({t.dtype}): sub-byte elements cannot be resharded")
    return bits // 8


def region(t: TensorInfo, layout: Layout, rank: int) -> tuple[Segment, ...]:
    """The segments of ``t`` that ``rank`` holds under ``layout``, in local order."""
    shape = t.shape
    dim = layout.placement(t)
    full = tuple((0, n) for n in shape)
    if dim is None:
        return (Segment(full, None, 0),)
    parts = layout.parts_of(t.name)
    if parts is None:
        a, b = chunk_bounds(shape[dim], rank, layout.world, uneven=layout.shard.uneven, what=f"tensor {t.name!r}: ")
        return (Segment(full[:dim] + ((a, b),) + full[dim + 1 :], dim, 0),) if b > a else ()
    if dim != 0 or sum(parts) != shape[0]:
        raise OptionError(f"tensor {t.name!r}: fused parts {list(parts)} must split dim 0 of size {shape[0]}")
    segs, base, local = [], 0, 0
    for n in parts:
        a, b = chunk_bounds(n, rank, layout.world, uneven=layout.shard.uneven, what=f"tensor {t.name!r}: part ")
        if b > a:
            segs.append(Segment(((base + a, base + b),) + full[1:], 0, local))
            local += b - a
        base += n
    return tuple(segs)


def local_shape(t: TensorInfo, layout: Layout, rank: int) -> tuple[int, ...]:
    """The shape of ``rank``'s local buffer of ``t``."""
    segs = region(t, layout, rank)
    dim = layout.placement(t)
    if dim is None:
        return t.shape
    n = sum(s.box[dim][1] - s.box[dim][0] for s in segs)
    return t.shape[:dim] + (n,) + t.shape[dim + 1 :]


def _intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if hi <= lo:
            return None
        out.append((lo, hi))
    return tuple(out)


def _origin(seg: Segment, box: Box) -> list[int]:
    """``box``'s first corner in the local coordinates of ``seg``'s buffer."""
    org = [lo - s0 for (lo, _), (s0, _) in zip(box, seg.box, strict=True)]
    if seg.dim is not None:
        org[seg.dim] += seg.local
    return org


def _runs(
    box: Box, src: Segment, src_shape: Sequence[int], dst: Segment, dst_shape: Sequence[int], item: int
) -> tuple[Run, ...]:
    nd = len(box)
    ext = [hi - lo for lo, hi in box]
    so, do = _origin(src, box), _origin(dst, box)
    # row-major byte strides of both local buffers
    ss, ds = [item] * nd, [item] * nd
    for k in range(nd - 2, -1, -1):
        ss[k] = ss[k + 1] * src_shape[k + 1]
        ds[k] = ds[k + 1] * dst_shape[k + 1]
    # merge trailing dimensions the box covers whole on both sides into one contiguous run
    k = nd - 1
    length = item
    while k >= 0:
        length *= ext[k]
        if k == 0 or ext[k] != src_shape[k] or ext[k] != dst_shape[k]:
            break
        k -= 1
    # dims [0, k) are outer; dim k is the last merged (its extent folded into length)
    if k <= 0:
        return (Run(_dot(so, ss), _dot(do, ds), length, 1, length, length),)
    cdim = k - 1  # one strided dimension per Run; any further outer ones enumerate Runs
    outer = range(k - 1)
    out = []
    for idx in _product([range(ext[j]) for j in outer]):
        s0 = sum((so[j] + idx[j]) * ss[j] for j in outer) + sum(so[j] * ss[j] for j in range(cdim, nd))
        d0 = sum((do[j] + idx[j]) * ds[j] for j in outer) + sum(do[j] * ds[j] for j in range(cdim, nd))
        out.append(Run(s0, d0, length, ext[cdim], ss[cdim], ds[cdim]))
    return tuple(out)


def _dot(a: Sequence[int], b: Sequence[int]) -> int:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _product(ranges: list[range]) -> Iterable[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i, *rest)


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """The transfers of one tensor: ``moves`` are (sender, receiver, box, runs), in order; tensors
    of one shape, dtype and placement share one ``moves`` tuple (the plan's cost is per geometry)."""

    tensor: TensorInfo
    moves: tuple[tuple[int, int, Box, tuple[Run, ...]], ...]

    @property
    def transfers(self) -> list[Transfer]:
        return [Transfer(self.tensor.name, s, r, box, runs) for s, r, box, runs in self.moves]


def _moves(t: TensorInfo, senders: Layout, receivers: Layout, chosen: Sequence[int] | None) -> tuple[Any, ...]:
    item = _itemsize(t)
    if t.length != math.prod(t.shape) * item:
        raise OptionError(f"tensor {t.name!r}: {t.length} bytes do not make shape {list(t.shape)} of {t.dtype}")
    out = []
    src_regions = [region(t, senders, s) for s in range(senders.world)]
    src_shapes = [local_shape(t, senders, s) for s in range(senders.world)]
    for r in range(receivers.world):
        dsegs = region(t, receivers, r)
        if not dsegs:
            continue
        dshape = local_shape(t, receivers, r)
        for s in range(senders.world) if chosen is None else (chosen[r],):
            for sseg in src_regions[s]:
                for dseg in dsegs:
                    box = _intersect(sseg.box, dseg.box)
                    if box is not None:
                        out.append((s, r, box, _runs(box, sseg, src_shapes[s], dseg, dshape, item)))
    return tuple(out)


def plan(tensors: Iterable[TensorInfo], senders: Layout, receivers: Layout) -> list[TensorPlan]:
    """Every transfer that moves ``tensors`` from the ``senders`` layout to the ``receivers`` layout.

    One :class:`TensorPlan` per tensor, in input order; its moves by receiver, then sender,
    then box: the same list on every process given the same inputs. A replicated tensor goes
    to each receiver from the sender with the fewest bytes planned so far (lowest on ties).
    """
    out: list[TensorPlan] = []
    load = [0] * senders.world
    cache: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for t in tensors:
        sdim = senders.placement(t)
        rdim = receivers.placement(t)
        sparts, rparts = senders.parts_of(t.name), receivers.parts_of(t.name)
        chosen: tuple[int, ...] | None = None
        if sdim is None:
            item = _itemsize(t)
            picks = []
            for r in range(receivers.world):
                s = min(range(senders.world), key=lambda i: (load[i], i))
                picks.append(s)
                load[s] += math.prod(local_shape(t, receivers, r)) * item
            chosen = tuple(picks)
        key = (t.shape, t.dtype, t.length, sdim, rdim, _key(sparts), _key(rparts), chosen)
        moves = cache.get(key)
        if moves is None:
            moves = cache[key] = _moves(t, senders, receivers, chosen)
        out.append(TensorPlan(t, moves))
    return out


def _key(parts: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if parts is None else tuple(parts)


# --- the proof: the linear sketch (weightlift.digest.sketch) of each rank's boxes -----------------------


def sketch_local(t: TensorInfo, layout: Layout, rank: int, local: Any, seed: bytes = b"") -> int:
    """``rank``'s part of ``t``'s sketch from its local buffer under ``layout`` (replicated: the
    whole sketch, which a sum must then count once)."""
    import numpy as np

    a = np.asarray(local)
    r = sketch_base(t.name, seed)
    total = 0
    for seg in region(t, layout, rank):
        if seg.dim is None:
            sl: tuple[slice, ...] = tuple(slice(None) for _ in t.shape)
        else:
            n = seg.box[seg.dim][1] - seg.box[seg.dim][0]
            sl = tuple(slice(seg.local, seg.local + n) if k == seg.dim else slice(None) for k in range(len(t.shape)))
        total += sketch_part(a[sl], t.shape, seg.box, r)
    return total & _MASK
