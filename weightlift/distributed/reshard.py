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

The proof is a linear sketch on the unsharded tensor: ``S = sum_i x_i * r**i mod 2**64`` with
``x_i`` the element's bits as an unsigned integer of its width and ``i`` its row-major index in
the unsharded tensor, ``r`` odd and derived from a seed and the tensor's name. A rank's part
over a box needs only the box's elements and their global indices, and parts add: the senders'
parts sum to the receivers' parts sum to the sketch of the whole tensor, whatever the layouts.
``r`` odd makes ``r**i`` a unit mod 2**64, so one changed element always changes ``S``; a
wrong slice, a skipped tensor or a stale base shift it too (with overwhelming probability for a
random seed). It is an integrity check against faults, not against an adversary who knows ``r``
(frames carry MACs, and a manifest's BLAKE3 stays the proof of publication). No I/O here; numpy
is imported only by the sketch functions.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightlift.distributed.shard import Shard, chunk_bounds, parse_placement
from weightlift.dtypes import dtype_info
from weightlift.errors import OptionError
from weightlift.formats import TensorInfo

if TYPE_CHECKING:
    import numpy as np

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
    "sketch_part",
]

Box = tuple[tuple[int, int], ...]
_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Layout:
    """How tensors lie over ``world`` ranks: ``shard``'s rules (rank and world unset or ignored),
    and ``parts``: for fused tensors, the sizes of the parts stacked along dim 0 (each part is
    chunked over the ranks; the split dimension must then be 0)."""

    shard: Shard
    world: int
    parts: Mapping[str, Sequence[int]] | Callable[[str], Sequence[int] | None] | None = None

    def placement(self, t: TensorInfo) -> int | None:
        """The split dimension of ``t`` (None: replicated); without rules, no name matching at all
        (FSDP's ``Shard(0)`` everywhere: half the plan's time on 50,000 names otherwise)."""
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


# --- the proof: a linear sketch that composes over any layout -------------------------------------------


def sketch_base(name: str, seed: bytes = b"") -> int:
    """The odd 64-bit multiplier ``r`` of tensor ``name`` under ``seed``."""
    h = hashlib.blake2b(seed + b"\0" + name.encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") | 1


def _powers(base: int, start: int, step: int, n: int) -> np.ndarray:
    """``base**(start + j*step) mod 2**64`` for j < n, as uint64."""
    import numpy as np

    first = pow(base, start, 1 << 64)
    stepv = pow(base, step, 1 << 64)
    out = np.empty(n, dtype=np.uint64)
    if n == 0:
        return out
    out[0] = first
    # doubling: out[m:2m] = out[:m] * step**m, wrap-around native in uint64
    m, mul = 1, stepv
    while m < n:
        k = min(m, n - m)
        np.multiply(out[:k], np.uint64(mul), out=out[m : m + k])
        mul = mul * mul & _MASK
        m += k
    return out


_UINT = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def sketch_part(array: Any, shape: Sequence[int], box: Box, r: int, *, rows_per_block: int = 0) -> int:
    """The sketch part of ``array`` (the elements of ``box`` of a tensor of ``shape``, any dtype
    of 1, 2, 4 or 8 bytes) under multiplier ``r``: add parts of disjoint boxes to compose."""
    import numpy as np

    a = np.ascontiguousarray(array)
    ext = tuple(hi - lo for lo, hi in box)
    if a.shape != ext and a.size != math.prod(ext):
        raise OptionError(f"sketch: {a.shape} elements do not fill the box {list(box)}")
    if a.itemsize not in _UINT:
        raise OptionError(f"sketch: elements of {a.itemsize} bytes are not supported (1, 2, 4 or 8)")
    nd = len(shape)
    if nd == 0:
        return int(a.reshape(-1).view(_UINT[a.itemsize])[0]) & _MASK if a.size else 0
    x = a.reshape(ext).view(_UINT[a.itemsize])
    strides = [1] * nd
    for k in range(nd - 2, -1, -1):
        strides[k] = strides[k + 1] * shape[k + 1]
    # weight of element g: prod_k r**(g_k * stride_k); contract the last dim, then the others
    inner = _powers(r, box[-1][0] * strides[-1], strides[-1], ext[-1])
    flat = x.reshape(-1, ext[-1]) if ext[-1] else x.reshape(0, 0)
    nrows = flat.shape[0]
    # rows' weights: product over the outer dims
    roww = np.ones(1, dtype=np.uint64)
    for k in range(nd - 1):
        pk = _powers(r, box[k][0] * strides[k], strides[k], ext[k])
        roww = np.multiply.outer(roww, pk).reshape(-1)
    if nrows == 0 or ext[-1] == 0:
        return 0
    step = rows_per_block or max(1, (1 << 20) // max(1, ext[-1]))
    total = np.uint64(0)
    buf = np.empty((min(step, nrows), ext[-1]), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(0, nrows, step):
            blk = flat[i : i + step]
            b = buf[: blk.shape[0]]
            b[...] = blk
            rs = b @ inner  # integer matmul wraps mod 2**64; twice the rate of multiply then sum
            rs *= roww[i : i + step]
            total = total + rs.sum(dtype=np.uint64)
    return int(total)


def sketch(array: Any, name: str, seed: bytes = b"") -> int:
    """The sketch of a whole (unsharded) tensor."""
    import numpy as np

    a = np.asarray(array)
    return sketch_part(a, a.shape, tuple((0, n) for n in a.shape), sketch_base(name, seed))


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
