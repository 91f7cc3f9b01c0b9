"""Sharded loads and group loads: ``weightlift.load(path, shard=..., group=...)``.

Without a group, a rank reads its own slices (:class:`~.shard.Shard`) through the
:class:`~.reader.SliceReader` into one arena. With a group, the ranks split the reading and
the collectives deliver; every rank derives the same plan from the headers alone (never from
what it finds in its page cache), so all issue the same collectives in the same order.
Tensors fall in three sets:

* **replicated** (no shard, or a rule saying so): laid out back to back in the same region of
  every rank's arena; the region is cut into rounds of ``world`` stripes of up to
  :data:`STRIPE` bytes, rank ``r`` reads stripe ``r`` of each round (byte ranges, tensors cut
  anywhere) and an in-place ``all_gather`` fills everyone's region. Each rank reads 1/world of
  the bytes; the read of round k+1 overlaps the gather of round k.
* **direct**: slices that are one byte range, or rows of at least
  :data:`~.reader.ROW_READ_MIN`: each rank reads its own; together the ranks read each byte once.
* **redistributed**: strided slices with smaller rows, which no rank can read efficiently for
  itself. Each such tensor gets an owner rank (largest first, to the least loaded owner); the
  owner reads the whole tensor once, scattering every rank's slice into a send buffer as it
  reads (``preadv`` with an iovec per row and rank), and an ``all_to_all`` delivers the slices
  straight into each rank's arena. Rounds of up to :data:`ROUND` bytes per owner, double
  buffered.

Each rank's reads are settled before the collective they feed (one byte per rank,
``all_gather``): a rank whose read failed (a file error, an object replaced in a store) raises
its own error and every other rank a GroupError naming it, where they would otherwise wait in a
collective the failed rank never posts until the timeout. A checkpoint in a store is read the
same way, through :class:`~.fromstore.StoreReader` (:mod:`.fromstore`).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import logging
import os
import time
import warnings
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np

from weightlift.checkpoint import Checkpoint, open_checkpoint
from weightlift.digest.published import announce, reference
from weightlift.disk.source import MappedFile
from weightlift.distributed.comm import ALIGN, Arena, Comm, pack
from weightlift.distributed.fromstore import StoreReader, in_store, landed_check, share_checkpoint
from weightlift.distributed.reader import SliceReader, strided
from weightlift.distributed.shard import Piece, Rows, Shard, slice_piece, whole
from weightlift.errors import GroupError, OptionError
from weightlift.formats import TensorInfo
from weightlift.options import LoadOptions, Placement
from weightlift.sources.objects import IDENTITY

if TYPE_CHECKING:
    from weightlift.digest.published import ManifestSource, Reference

__all__ = ["distributed_load", "STRIPE", "ROUND"]

_log = logging.getLogger("weightlift")
T = TypeVar("T")
#: what reads a load's bytes: files through their mappings, or objects in a store by ranged GETs
Reader = SliceReader | StoreReader

STRIPE = 16 * 1024 * 1024
ROUND = 64 * 1024 * 1024
READ_CHUNK = 16 * 1024 * 1024
READERS = 4  # as the local loader's cold readers (source.MAX_WARMERS)


def distributed_load(
    path: str | os.PathLike[str] | Checkpoint, opts: LoadOptions, *, timeout: float | None = None
) -> dict[str, Any]:
    """A rank's slices (``opts.shard``), and/or one read of the checkpoint shared over ``opts.group``.

    Returns ``{name: array}`` in file order, each the rank's slice of the tensor (or the whole
    tensor where replicated). ``opts.report`` gets ``bytes_read`` (bytes this rank read from the
    files), ``requests``, and ``paths`` (how many tensors took each path). The options a
    distributed load does not support are refused before it gets here (:mod:`weightlift.api`).
    ``timeout`` (seconds) bounds each wait on a collective.

    ``path`` may be a URL (``s3://``, ``https://``): rank 0 reads the header and the ranks read
    the bytes with ranged GETs, each byte once across the group (:mod:`.fromstore`), and
    ``verify=True`` checks each rank's tensors against the published manifest.
    """
    t0 = time.perf_counter()
    group, place = opts.group, opts.placement
    if opts.shard is not None and not isinstance(opts.shard, Shard):
        raise OptionError(f"shard must be a weightlift.Shard, got {type(opts.shard).__name__}")
    store = in_store(path)
    _refuse_verify(opts, store)  # before any collective: every rank was given the same options
    comm, shard = _comm_and_shard(opts.shard, group, place, timeout)
    if comm is not None and not opts.copy:
        raise OptionError("copy=False gives views of this machine's files: not with group=")
    failure: Exception | None = None
    reader: Reader | None = None
    ref = None
    try:
        try:
            if store and comm is not None and not isinstance(path, Checkpoint):
                ckpt = share_checkpoint(comm, os.fspath(path))  # the header read once, by rank 0
            else:
                ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path)
            infos = ckpt.select(opts.select)
            if ckpt.source is not None:
                reader = StoreReader(ckpt.source, checked=opts.verify)
                if opts.verify:
                    ref = reference(ckpt, infos, cast("ManifestSource | None", opts.manifest))
            else:
                maps = {f: ckpt.mapped(f) for f in dict.fromkeys(t.file for t in infos)}
                reader = SliceReader(maps, engine=opts.engine)
            # every rank's slices are checked on every rank, so a bad split fails everywhere alike
            pieces = _all_pieces(infos, shard)
        except Exception as e:  # noqa: BLE001 - in a group, the others are told before it is raised
            if comm is None:
                raise
            failure = e
        if comm is not None:
            # one tiny collective before the big ones: a rank that failed to plan, or planned
            # something else, stops everyone now instead of leaving them in a collective
            _agree(comm, None if failure is not None or reader is None else _plan_digest(infos, pieces, reader.row_min))
            if failure is not None:
                raise failure
        assert reader is not None
        return _run(infos, pieces, comm, shard, reader, ref, opts, t0, borrow=not opts.copy and ckpt.source is None)
    finally:
        if isinstance(reader, StoreReader):
            reader.close()


def _refuse_verify(opts: LoadOptions, store: bool) -> None:
    """``verify=True`` in a distributed load: only of whole tensors from a store (a rank that
    verified local files would read them again; one that holds slices has no digest of them)."""
    if opts.manifest is not None and not opts.verify:
        raise OptionError("manifest= is only used with verify=True")
    if opts.verify and not store:
        raise OptionError("verify=True is not supported together with shard= or group= of local files")
    if opts.verify and opts.shard is not None:
        raise OptionError("verify=True is not supported together with shard=: a rank holds slices of the tensors")


def _run(
    infos: list[TensorInfo],
    pieces: list[list[Piece] | None],
    comm: Comm | None,
    shard: Shard | None,
    reader: Reader,
    ref: Reference | None,
    opts: LoadOptions,
    t0: float,
    *,
    borrow: bool,
) -> dict[str, Any]:
    place, framework = opts.placement, opts.placement.framework
    me = shard.rank if shard is not None and shard.rank is not None else (comm.rank if comm is not None else 0)
    said: dict[str, Any] = {}
    if comm is None:
        mine = [p[me] if p is not None else whole(t) for t, p in zip(infos, pieces, strict=False)]
        if borrow:
            assert isinstance(reader, SliceReader)  # files have mappings; objects in a store do not
            out = {p.name: _borrowed(reader.maps[p.tensor.file], p, framework) for p in mine}
        else:
            out = _local(mine, reader, place)
        paths = {"local": len(mine)}
    else:
        out, paths = _GroupLoad(infos, pieces, comm, reader, place).run()
        if ref is not None:
            # each rank proves what landed in its own memory, collectives included; then the
            # group agrees, so a rank whose bytes differ stops every rank before any returns
            said = _settled(comm, lambda: landed_check(ref, infos, out), "its check of what landed")
    if said:
        if opts.report is not None:
            opts.report.update(said)
        else:
            announce(said, _log)
    if opts.report is not None:
        if comm is not None:
            comm.landed()  # the time of the bytes on the device, not of the collectives queued
        seconds = time.perf_counter() - t0
        nbytes = sum(_nbytes(v) for v in out.values())
        opts.report.update(
            tensors=len(out),
            bytes=nbytes,
            bytes_read=reader.bytes_read,
            requests=reader.requests,
            seconds=seconds,
            gbps=nbytes / seconds / 1e9 if seconds > 0 else 0.0,
            paths=paths,
            rank=me,
            world=shard.world if shard is not None else (comm.world if comm else 1),
            device=place.device,
            framework=framework,
        )
    return out


def _comm_and_shard(
    shard: Shard | None, group: Any, place: Placement, timeout: float | None
) -> tuple[Comm | None, Shard | None]:
    """The group's collectives (None without a group) and the shard with its rank and world
    (taken from the default group where the Shard names none)."""
    comm = None
    if group is not None:
        comm = Comm(group, timeout=timeout)
        comm.check_device(place)
    elif shard is not None and shard.world is None:
        try:
            comm = Comm(None)
        except OptionError:
            raise OptionError(
                "a Shard without rank and world takes them from a process group: "
                "pass group=, or Shard(rank=..., world=...)"
            ) from None
    if shard is not None:
        if shard.world is None:
            assert comm is not None  # made above for a Shard without rank and world
            shard = shard.resolved(comm.rank, comm.world)
        elif comm is not None and group is not None and (shard.rank, shard.world) != (comm.rank, comm.world):
            raise OptionError(
                f"Shard(rank={shard.rank}, world={shard.world}) disagrees with the group "
                f"(rank {comm.rank} of {comm.world})"
            )
    if group is None:
        comm = None  # rank and world came from the default group; the load itself is local
    return comm, shard


def _plan_digest(infos: list[TensorInfo], pieces: list[list[Piece] | None], row_min: int) -> bytes:
    h = hashlib.sha256(str(row_min).encode())
    for t, ps in zip(infos, pieces, strict=False):
        h.update(repr((t.name, t.dtype, t.shape, t.length)).encode())
        seen = t.extra.get(IDENTITY)  # in a store: the version of the object each rank reads
        if seen is not None:
            h.update(repr((seen.size, seen.etag, seen.version)).encode())
        if ps is not None:
            h.update(repr([(p.dim, p.start, p.stop) for p in ps]).encode())
    return h.digest()[:8]


def _agree(comm: Comm, digest: bytes | None) -> None:
    """All ranks planned, and planned the same load; else every rank raises (a failed rank its own error)."""
    import torch

    mine = torch.tensor(list(b"\1" + digest) if digest is not None else [0] * 9, dtype=torch.uint8)
    out = torch.zeros(9 * comm.world, dtype=torch.uint8, device=comm.device)
    comm.all_gather(out, mine.to(comm.device), what="agreement on the load plan")
    rows = out.cpu().numpy().reshape(comm.world, 9)
    if digest is None:
        return
    for r in range(comm.world):
        if not rows[r, 0]:
            raise GroupError(f"rank {r} failed to plan the group load (its own error says why)")
    for r in range(comm.world):
        if bytes(rows[r, 1:]) != bytes(rows[0, 1:]):
            raise OptionError(
                f"ranks 0 and {r} planned different loads: the checkpoint, select, shard rules "
                "and WEIGHTLIFT_ROW_READ_MIN must be the same on every rank"
            )


def _settle(comm: Comm, failure: BaseException | None, what: str) -> None:
    """Every rank says whether its last step worked: a rank that failed raises its own error, the
    others GroupError naming it, so that none goes on into a collective a failed rank never posts
    (and waits there for the timeout)."""
    import torch

    mine = torch.tensor([0 if failure is None else 1], dtype=torch.uint8, device=comm.device)
    out = torch.zeros(comm.world, dtype=torch.uint8, device=comm.device)
    comm.all_gather(out, mine, what="check that every rank did its part of the group load")
    if failure is not None:
        raise failure
    bad = [r for r, flag in enumerate(out.cpu().tolist()) if flag]
    if bad:
        raise GroupError(
            f"rank {bad[0]} of {comm.world} failed in {what} (its own error says why): the group load stops on every rank"
        )


def _settled(comm: Comm, step: Callable[[], T], what: str) -> T:
    """``step()``'s result once every rank's step worked (:func:`_settle`)."""
    try:
        got = step()
    except Exception as e:  # noqa: BLE001 - the others are told, then it is raised here
        _settle(comm, e, what)
        raise
    _settle(comm, None, what)
    return got


def _nbytes(v: Any) -> int:
    return int(v.nbytes) if isinstance(v, np.ndarray) else int(v.numel() * v.element_size())


def _all_pieces(infos: list[TensorInfo], shard: Shard | None) -> list[list[Piece] | None]:
    """Per tensor, every rank's piece; None where the tensor is replicated."""
    out: list[list[Piece] | None] = []
    for t in infos:
        dim = shard.placement(t) if shard is not None else None
        if dim is None:
            out.append(None)
        else:
            out.append([slice_piece(t, dim, r, shard.world, uneven=shard.uneven) for r in range(shard.world)])  # type: ignore[union-attr, arg-type]
    return out


def _local(pieces: list[Piece], reader: Reader, place: Placement) -> dict[str, Any]:
    offs, total = pack([p.nbytes for p in pieces])
    arena = Arena(total, place)
    read_all(arena, reader, [(p.rows, off) for p, off in zip(pieces, offs, strict=False)])
    return {p.name: arena.view(off, p, place.framework) for p, off in zip(pieces, offs, strict=False)}


def read_all(arena: Arena, reader: Reader, jobs: list[tuple[Rows, int]]) -> None:
    """Read each (rows, arena offset) job into the arena, in pieces of at most :data:`READ_CHUNK`
    bytes, on up to :data:`READERS` threads for a host arena (a cold file wants parallel
    readers; a device arena has one staging buffer, so one thread)."""
    subs = [(sub, off + at) for rows, off in jobs for at, sub in rows.split(min(arena.limit, READ_CHUNK))]

    def one(job: tuple[Rows, int]) -> None:
        sub, off = job
        arena.fill(off, sub.nbytes, lambda buf: reader.read(sub, buf))

    if arena.cuda or len(subs) < 2:
        for job in subs:
            one(job)
        return
    with ThreadPoolExecutor(min(READERS, len(subs)), thread_name_prefix="wl-dist-read") as ex:
        for _ in ex.map(one, subs):
            pass


def _borrowed(m: MappedFile, p: Piece, framework: str) -> Any:
    """``copy=False``: the piece as a read-only (possibly strided) view of the file's mapping."""
    from weightlift.dtypes import dtype_info, numpy_dtype, torch_dtype

    t = p.tensor
    packed = not t.quantized and dtype_info(t.dtype).bits % 8 != 0
    if not p.nbytes:
        if framework == "numpy":
            return np.empty(
                p.raw_shape if not packed else (0,), np.uint8 if t.quantized or packed else numpy_dtype(t.dtype)
            )
        import torch

        return torch.empty(
            p.raw_shape if not packed else (0,), dtype=torch.uint8 if t.quantized or packed else torch_dtype(t.dtype)
        )
    if p.rows.contiguous:
        rows = np.frombuffer(m.view(p.rows.offset, p.nbytes), dtype=np.uint8).reshape(1, p.nbytes)
    elif packed:
        raise OptionError(
            f"copy=False: a strided slice of packed {t.dtype} tensor {t.name!r} is no flat view; use copy=True"
        )
    else:
        rows = strided(m, p.rows)
    if framework == "numpy":
        if t.quantized:
            return rows.reshape(p.raw_shape)
        if packed:
            return rows.reshape(-1)
        return rows.view(numpy_dtype(t.dtype)).reshape(p.shape)
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only mapping, as copy=False documents
        raw = torch.from_numpy(rows)
    if t.quantized:
        return raw.view(p.raw_shape)
    if packed:
        return raw.view(-1)
    return raw.view(torch_dtype(t.dtype)).view(p.shape)


class _GroupLoad:
    """One group load: the three sets, their layout in this rank's arena, and the pipeline."""

    def __init__(
        self,
        infos: list[TensorInfo],
        pieces: list[list[Piece] | None],
        comm: Comm,
        reader: Reader,
        place: Placement,
    ):
        self.comm, self.reader, self.place, self.framework = comm, reader, place, place.framework
        w, me = comm.world, comm.rank
        self.rep: list[TensorInfo] = []
        self.direct: list[Piece] = []
        self.redist: list[list[Piece]] = []
        for t, ps in zip(infos, pieces, strict=False):
            if ps is None:
                self.rep.append(t)
            elif ps[0].rows.contiguous or ps[0].rows.seg >= reader.row_min or w == 1:
                self.direct.append(ps[me])
            else:
                self.redist.append(ps)
        self.order = [t.name for t in infos]

    def run(self) -> tuple[dict[str, Any], dict[str, int]]:
        comm = self.comm
        w, me = comm.world, comm.rank
        # replicated region: tensors back to back, padded to whole rounds of world stripes
        rep_offs, rep_end = pack([t.length for t in self.rep])
        rounds, rep_size = _stripes(rep_end, w, STRIPE)
        # redistributed region: rounds of (owner, tensor) slices, as all_to_all lays them out
        xplan = _redistribution(self.redist, w)
        x_start = -(-rep_size // ALIGN) * ALIGN
        x_sizes = [sum(xr.recv_splits(me)) for xr in xplan]
        x_offs, x_end = pack(x_sizes, x_start)
        d_offs, total = pack([p.nbytes for p in self.direct], x_end)
        arena = Arena(total, self.place)
        at = arena.tensor()
        pending: deque[Any] = deque()

        def post(work: Any, what: str) -> None:
            pending.append((work, what))
            if len(pending) > 1:
                comm.wait(*pending.popleft())

        try:
            self._rounds(arena, at, rounds, rep_offs, xplan, x_offs, x_sizes, d_offs, post)
            while pending:
                comm.wait(*pending.popleft())
        except BaseException:
            # posted by every rank, so they complete: never leave one writing into a freed arena
            while pending:
                try:
                    comm.wait(*pending.popleft())
                except Exception:  # noqa: BLE001, S112 - the first error is the one raised
                    continue
            raise
        out: dict[str, Any] = {}
        for t, off in zip(self.rep, rep_offs, strict=False):
            out[t.name] = arena.view(off, whole(t), self.framework)
        for xr, xo in zip(xplan, x_offs, strict=False):
            for p, off in xr.received(me, xo):
                out[p.name] = arena.view(off, p, self.framework)
        for p, off in zip(self.direct, d_offs, strict=False):
            out[p.name] = arena.view(off, p, self.framework)
        paths = {"replicated": len(self.rep), "direct": len(self.direct), "redistributed": len(self.redist)}
        return {n: out[n] for n in self.order}, paths

    def _rounds(
        self,
        arena: Arena,
        at: Any,
        rounds: list[tuple[int, int]],
        rep_offs: list[int],
        xplan: list[_Round],
        x_offs: list[int],
        x_sizes: list[int],
        d_offs: list[int],
        post: Callable[[Any, str], None],
    ) -> None:
        """Read this rank's parts and post the collectives. Each rank's reads are settled
        (:func:`_settle`) before the collective they feed: one rank's failed read (an object
        replaced in the store, a file error) stops every rank there, not at the timeout."""
        comm = self.comm
        w, me = comm.world, comm.rank
        for base, c in rounds:
            lo = base + me * c
            jobs = [
                (Rows(t.file, t.offset + a, b - a, b - a, 1), off + a)
                for t, off, a, b in overlaps(self.rep, rep_offs, lo, lo + c)
            ]
            _settled(comm, functools.partial(read_all, arena, self.reader, jobs), "reading its stripe")
            if w == 1:
                continue  # the stripe is the round: nothing to gather (gloo would copy it through a buffer)
            post(
                comm.all_gather(
                    at[base : base + w * c], at[lo : lo + c], async_op=True, what="all_gather of replicated tensors"
                ),
                "all_gather of replicated tensors",
            )
        sends: list[Arena | None] = [None, None]
        for k, (xr, xo) in enumerate(zip(xplan, x_offs, strict=False)):
            send = sends[k % 2] = self._send_buffer(sends[k % 2], sum(xr.send_splits(me)))
            _settled(comm, functools.partial(xr.fill, me, send, self.reader), "reading the tensors it owns")
            send_t = send.tensor()
            n_in = sum(xr.send_splits(me))
            post(
                comm.all_to_all(
                    at[xo : xo + x_sizes[k]],
                    send_t[:n_in],
                    xr.recv_splits(me),
                    xr.send_splits(me),
                    async_op=True,
                    what="all_to_all of sharded tensors",
                ),
                "all_to_all of sharded tensors",
            )
        direct = [(p.rows, off) for p, off in zip(self.direct, d_offs, strict=False)]
        # overlaps the last collectives
        _settled(comm, lambda: read_all(arena, self.reader, direct), "reading its own slices")

    def _send_buffer(self, old: Arena | None, n: int) -> Arena:
        # host memory for gloo; for NCCL a device buffer filled through pinned staging
        if old is not None and old.nbytes >= n:
            return old
        return Arena(max(n, 1), self.place)


def _stripes(total: int, world: int, stripe: int) -> tuple[list[tuple[int, int]], int]:
    """Rounds (base, stripe bytes per rank) covering [0, total), and the padded size."""
    rounds, base = [], 0
    while base < total:
        c = -(-min(total - base, world * stripe) // world)
        rounds.append((base, c))
        base += world * c
    return rounds, base


def overlaps(tensors: list[TensorInfo], starts: list[int], lo: int, hi: int) -> list[tuple[TensorInfo, int, int, int]]:
    """(tensor, its arena offset, a, b): the bytes [a, b) of each tensor lying in arena [lo, hi)."""
    out = []
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(tensors) and starts[i] < hi:
        t, s = tensors[i], starts[i]
        a, b = max(lo, s) - s, min(hi, s + t.length) - s
        if a < b:
            out.append((t, s, a, b))
        i += 1
    return out


class _Round:
    """One all_to_all: per owner rank, the tensors it reads and scatters in this round."""

    def __init__(self, world: int, groups: list[list[list[Piece]]]):
        self.world = world
        self.groups = groups  # groups[owner] = [every rank's pieces of one tensor, ...]

    def _split(self, owner: int, dest: int) -> int:
        return pack([ps[dest].nbytes for ps in self.groups[owner]])[1] if self.groups[owner] else 0

    def send_splits(self, me: int) -> list[int]:
        return [_aligned(self._split(me, q)) for q in range(self.world)]

    def recv_splits(self, me: int) -> list[int]:
        return [_aligned(self._split(o, me)) for o in range(self.world)]

    def fill(self, me: int, send: Arena, reader: Reader) -> None:
        """Read this owner's tensors, each rank's slice to its place in the send buffer."""
        splits = self.send_splits(me)
        split_at = pack(splits)[0] if splits else []
        per_dest = [pack([ps[q].nbytes for ps in self.groups[me]])[0] for q in range(self.world)]
        for i, ps in enumerate(self.groups[me]):
            dst_offs = [split_at[q] + per_dest[q][i] for q in range(self.world)]
            segs = [p.rows.seg if p.rows.count else 0 for p in ps]
            count, first = ps[0].rows.count, ps[0].tensor.offset
            if send.host is not None:
                dsts = [send.host[o : o + p.nbytes] for o, p in zip(dst_offs, ps, strict=False)]
                reader.scatter(ps[0].tensor.file, first, count, segs, dsts)
            else:  # through host memory of the tensor's size, then one copy per rank's slice
                host = np.empty(sum(p.nbytes for p in ps), dtype=np.uint8)
                hoffs = np.cumsum([0] + [p.nbytes for p in ps])
                reader.scatter(
                    ps[0].tensor.file, first, count, segs, [host[hoffs[q] : hoffs[q + 1]] for q in range(self.world)]
                )
                for q, p in enumerate(ps):
                    for at_, sub in Rows("", 0, p.nbytes, p.nbytes, 1).split(send.limit):
                        chunk = host[hoffs[q] + at_ : hoffs[q] + at_ + sub.nbytes]
                        send.fill(dst_offs[q] + at_, sub.nbytes, lambda buf, c=chunk: np.copyto(buf, c))  # type: ignore[misc]

    def received(self, me: int, base: int) -> list[tuple[Piece, int]]:
        out: list[Any] = []
        at = base
        for o in range(self.world):
            offs, _ = pack([ps[me].nbytes for ps in self.groups[o]], at)
            out.extend((ps[me], off) for ps, off in zip(self.groups[o], offs, strict=False))
            at += self.recv_splits(me)[o]
        return out


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _redistribution(tensors: list[list[Piece]], world: int) -> list[_Round]:
    """Owners by bytes (largest tensor first, to the least loaded rank), then rounds of up to
    :data:`ROUND` bytes per owner, each owner's tensors in file order."""
    load = [0] * world
    owned: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(tensors)), key=lambda i: (-tensors[i][0].tensor.length, i)):
        o = min(range(world), key=lambda r: (load[r], r))
        owned[o].append(i)
        load[o] += tensors[i][0].tensor.length
    per_owner: list[list[list[list[Piece]]]] = []
    for o in range(world):
        rounds: list[list[list[Piece]]] = []
        size = ROUND
        for i in sorted(owned[o]):
            n = tensors[i][0].tensor.length
            if size + n > ROUND and size:
                rounds.append([])
                size = 0
            rounds[-1].append(tensors[i])
            size += n
        per_owner.append(rounds)
    k = max((len(r) for r in per_owner), default=0)
    return [_Round(world, [r[j] if j < len(r) else [] for r in per_owner]) for j in range(k)]
