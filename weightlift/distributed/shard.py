"""Shard rules and the geometry of a slice: which bytes of a tensor one rank gets. No I/O.

A rule maps a name pattern (the matcher ``select`` uses: globs, ``re:`` regexes) to a
placement; the first rule that matches a name wins, and names no rule matches take
``default`` (replicated unless told otherwise). A placement is one of:

=====================  ======================  ==========================================
placement              DTensor                 tensor parallelism (vLLM, torch TP)
=====================  ======================  ==========================================
``0`` or "colwise"     ``Shard(0)``            ColumnParallelLinear / ColwiseParallel
                                               weight ``[out, in]`` and its bias; also
                                               VocabParallelEmbedding (without vLLM's
                                               padding of the vocabulary)
``1`` or "rowwise"     ``Shard(1)``            RowParallelLinear / RowwiseParallel weight
``d`` (any int, -1..)  ``Shard(d)``            any other dimension
"replicate" or None    ``Replicate()``         RowParallelLinear's bias, norms, ...
=====================  ======================  ==========================================

DTensor placement objects (``Shard(1)``, ``Replicate()``) are accepted as they are. vLLM's
QKVParallelLinear and MergedColumnParallelLinear split q, k, v (gate, up) each along dim 0, so
checkpoints that store them apart take "colwise" each; a fused tensor (``qkv_proj`` stored as
one) needs a split per part, and vLLM's replication of kv heads when there are fewer of them
than ranks is not expressible as a rule.

Uneven sizes follow ``torch.chunk``, as DTensor's ``Shard(d)`` does: every rank but the last
few gets ``ceil(n / world)`` items, the rest get what is left, possibly nothing (5 rows over 4
ranks: 2, 2, 1, 0). vLLM instead requires ``n % world == 0``; ``uneven="error"`` asks for that,
and an uneven split is then an :class:`~weightlift.errors.OptionError`.

GGUF quantized tensors store their innermost dimension in blocks (``block_size`` elements in
``type_size`` bytes, from gguf's ``GGML_QUANT_SIZES``): a split along that dimension must cut
on block boundaries, else OptionError; splits along any other dimension keep whole rows. Packed
sub-byte types (F4, F6) split only where the cut falls on a byte.

In the file, a slice along the first dimension (or of a tensor whose leading dimensions are
all 1) is one contiguous byte range; any other slice is ``count`` rows of ``seg`` bytes lying
``stride`` bytes apart: :class:`Rows` describes both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from weightlift.checkpoint import matcher
from weightlift.dtypes import dtype_info
from weightlift.errors import OptionError
from weightlift.formats import TensorInfo

if TYPE_CHECKING:
    from typing import TypeAlias

    from torch.distributed.tensor import Placement as DTensorPlacement

    from weightlift.remote.server.config import Slices

__all__ = ["Shard", "Piece", "Rows", "chunk_bounds", "parse_placement", "Where", "Rules"]

#: Where a rule puts a tensor: a dimension, "colwise", "rowwise", "replicate", None (replicated),
#: or a DTensor placement (``Shard(d)``, ``Replicate()``).
Where: TypeAlias = Union[int, str, None, "DTensorPlacement"]
#: Shard rules: ``{pattern: placement}``, or (pattern, placement) pairs, tried in order.
Rules: TypeAlias = Mapping[str, Where] | Iterable[tuple[str, Where]]

_UNEVEN = ("chunk", "error")


@dataclass(frozen=True, slots=True)
class Rows:
    """Bytes of one file: ``count`` segments of ``seg`` bytes, ``stride`` bytes apart from ``offset``."""

    file: str
    offset: int
    seg: int
    stride: int
    count: int

    @property
    def nbytes(self) -> int:
        return self.seg * self.count

    @property
    def contiguous(self) -> bool:
        return self.count <= 1 or self.seg == self.stride

    @property
    def span(self) -> int:
        """Bytes from the first byte of the first segment to the last byte of the last."""
        return 0 if not self.count or not self.seg else (self.count - 1) * self.stride + self.seg

    def split(self, limit: int) -> Iterator[tuple[int, Rows]]:
        """(byte offset in the packed destination, sub-rows) pieces of at most ``limit`` bytes,
        or one whole row where a row alone is larger: a staging buffer of ``limit`` then suffices."""
        if self.contiguous:
            n = self.nbytes
            for i in range(0, n, max(1, limit)):
                yield i, Rows(self.file, self.offset + i, min(limit, n - i), min(limit, n - i), 1 if n else 0)
            return
        per = max(1, limit // self.seg) if self.seg else self.count
        if self.seg > limit:  # one row is more than a staging buffer: cut the row itself
            for r in range(self.count):
                for i in range(0, self.seg, limit):
                    n = min(limit, self.seg - i)
                    yield r * self.seg + i, Rows(self.file, self.offset + r * self.stride + i, n, n, 1)
            return
        for r in range(0, self.count, per):
            k = min(per, self.count - r)
            yield r * self.seg, Rows(self.file, self.offset + r * self.stride, self.seg, self.stride, k)


@dataclass(frozen=True, slots=True)
class Piece:
    """One rank's slice of one tensor: where its bytes lie in the file, and what it is.

    ``dim`` is None for a replicated (whole) tensor; else the slice is ``[start, stop)`` along
    ``dim`` of the logical shape. ``raw_shape`` is the shape of the bytes as a load returns them
    (GGUF quantized: rows of raw blocks, uint8); for other tensors it equals ``shape``.
    """

    tensor: TensorInfo
    dim: int | None
    start: int
    stop: int
    shape: tuple[int, ...]
    raw_shape: tuple[int, ...]
    rows: Rows

    @property
    def name(self) -> str:
        return self.tensor.name

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes


def parse_placement(value: Where) -> int | None:
    """A rule's placement as a dimension (may be negative), or None for replicated."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise OptionError(f"shard placement {value!r}: expected a dimension, 'colwise', 'rowwise' or 'replicate'")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("replicate", "replicated"):
            return None
        if v == "colwise":
            return 0
        if v == "rowwise":
            return 1
        raise OptionError(f"shard placement {value!r}: expected a dimension, 'colwise', 'rowwise' or 'replicate'")
    kind = type(value).__name__  # DTensor placements, without importing torch
    if kind == "Replicate":
        return None
    if kind == "Shard" and isinstance(getattr(value, "dim", None), int):
        return int(value.dim)
    raise OptionError(f"shard placement {value!r} is not supported (Shard(d) and Replicate() are)")


def chunk_bounds(n: int, rank: int, world: int, *, uneven: str = "chunk", what: str = "") -> tuple[int, int]:
    """``[start, stop)`` of rank's part of ``n`` items, as ``torch.chunk(x, world)[rank]`` (empty
    where torch.chunk returns fewer parts); with ``uneven="error"``, OptionError unless divisible."""
    if n % world and uneven == "error":
        raise OptionError(f"{what}{n} is not divisible by the world size {world} (uneven='error')")
    c = -(-n // world)
    a = min(n, rank * c)
    return a, min(n, a + c)


@dataclass(frozen=True)
class Shard:
    """Which slice of each tensor a rank loads: ``rules`` ``{pattern: placement}``, rank and world.

    ``rank`` and ``world`` may be left out when ``load`` gets a ``group`` (or the default process
    group is initialised): they are then taken from it. See this module's docstring for the
    placements and the uneven-split convention.
    """

    rules: Rules = ()
    rank: int | None = None
    world: int | None = None
    default: Where = None
    uneven: str = "chunk"
    _compiled: tuple[tuple[Callable[[str], bool], int | None], ...] = field(
        default=(), init=False, repr=False, compare=False
    )
    _default: int | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        items: Sequence[tuple[str, Where]]
        if isinstance(self.rules, Mapping):
            items = list(self.rules.items())
        else:
            items = list(self.rules)
        compiled = []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise OptionError(
                    f"shard rules: expected {{pattern: placement}} or (pattern, placement) pairs, got {item!r}"
                )
            compiled.append((matcher(item[0]), parse_placement(item[1])))
        object.__setattr__(self, "rules", tuple(items))
        object.__setattr__(self, "_compiled", tuple(compiled))
        object.__setattr__(self, "_default", parse_placement(self.default))
        if self.uneven not in _UNEVEN:
            raise OptionError(f"uneven must be one of {_UNEVEN}, not {self.uneven!r}")
        if (self.rank is None) != (self.world is None):
            raise OptionError("Shard: give both rank and world, or neither (to take them from the process group)")
        if self.world is not None:
            _check_rank(self.rank, self.world)  # type: ignore[arg-type]

    def resolved(self, rank: int, world: int) -> Shard:
        """The same rules for ``rank`` of ``world``."""
        return Shard(self.rules, rank=rank, world=world, default=self.default, uneven=self.uneven)

    def serving(self, parts: Mapping[str, Sequence[int]] | None = None) -> Slices:
        """These rules as a tensor server holds them (``Server(shard=...)``): this rank's slices of
        each tensor, ``parts`` giving the fused tensors' part sizes along dim 0 (qkv, gate_up)."""
        from weightlift.distributed.regions import Served

        return Served(self, parts=parts)

    def placement(self, t: TensorInfo) -> int | None:
        """The dimension ``t`` is split along (normalised to 0..ndim-1), or None: replicated."""
        dim = self._default
        for match, d in self._compiled:
            if match(t.name):
                dim = d
                break
        if dim is None:
            return None
        nd = len(t.shape)
        if not -nd <= dim < nd:
            raise OptionError(f"tensor {t.name!r} of shape {list(t.shape)} has no dimension {dim} to split along")
        return dim % nd

    def piece(self, t: TensorInfo, rank: int | None = None) -> Piece:
        """This rank's (or ``rank``'s) slice of ``t``."""
        r = self.rank if rank is None else rank
        if r is None or self.world is None:
            raise OptionError("Shard has no rank and world yet: pass them, or a process group")
        return slice_piece(t, self.placement(t), r, self.world, uneven=self.uneven)


def _check_rank(rank: int, world: int) -> None:
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise OptionError(f"world must be a positive integer, got {world!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
        raise OptionError(f"rank must be an integer in [0, {world}), got {rank!r}")


def whole(t: TensorInfo) -> Piece:
    """A replicated piece: the whole tensor."""
    raw = tuple(t.extra.get("raw_shape", t.shape)) if t.quantized else t.shape
    return Piece(t, None, 0, 0, t.shape, raw, Rows(t.file, t.offset, t.length, t.length, 1 if t.length else 0))


def slice_piece(t: TensorInfo, dim: int | None, rank: int, world: int, *, uneven: str = "chunk") -> Piece:
    """Rank's slice of ``t`` along ``dim`` (None: the whole tensor), as a :class:`Piece`."""
    if dim is None:
        return whole(t)
    n = t.shape[dim]
    a, b = chunk_bounds(n, rank, world, uneven=uneven, what=f"tensor {t.name!r}: dimension {dim} of size ")
    shape = t.shape[:dim] + (b - a,) + t.shape[dim + 1 :]
    if t.quantized:
        # raw bytes: the logical shape with the innermost dimension in bytes of whole blocks
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        assert t.ggml_type is not None  # a quantized tensor has its ggml type
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
        dims = tuple(t.extra["raw_shape"])
        last = len(t.shape) - 1
        if dim == last:
            for edge in (a, b):
                if edge % block:
                    raise OptionError(
                        f"tensor {t.name!r} ({t.dtype}): a split of its {n} columns over {world} ranks cuts at "
                        f"column {edge}, inside a block of {block}; GGUF quantized tensors split only on block "
                        f"boundaries (block sizes from gguf's GGML_QUANT_SIZES)"
                    )
            ua, ub = a // block * type_size, b // block * type_size
        else:
            ua, ub = a, b
        unit_bits = 8
        raw_shape = dims[:dim] + (ub - ua,) + dims[dim + 1 :]
    else:
        dims, ua, ub = t.shape, a, b
        unit_bits = dtype_info(t.dtype).bits
        raw_shape = shape
    outer = math.prod(dims[:dim])
    inner_bits = math.prod(dims[dim + 1 :]) * unit_bits
    bits = (ua * inner_bits, (ub - ua) * inner_bits, dims[dim] * inner_bits)
    if any(x % 8 for x in bits):
        raise OptionError(
            f"tensor {t.name!r} ({t.dtype}): a split along dimension {dim} over {world} ranks does not fall on a byte"
        )
    first, seg, stride = (x // 8 for x in bits)
    if outer == 0 or seg == 0:
        rows = Rows(t.file, t.offset, 0, 0, 0)
    elif outer == 1 or seg == stride:
        rows = Rows(t.file, t.offset + first, seg * outer, seg * outer, 1)
    else:
        rows = Rows(t.file, t.offset + first, seg, stride, outer)
    return Piece(t, dim, a, b, shape, raw_shape, rows)
