"""Sharded to sharded over one process group: trainer shards into engine slices, point to point.

Theory of operation. Every process of one torch.distributed group calls
:func:`reshard_transfer`; a process that passes a state dict is a *sender* (a trainer rank, its
tensors as it holds them: DTensors, or plain tensors and arrays with a ``src`` layout), one that
passes ``dst`` is a *receiver* (an engine rank, its layout as the ``Shard`` rules a sharded load
takes); a process may be both. Then:

1. **Metadata, once.** Each process describes its role and, as a sender, each tensor's name,
   dtype, local shape and split dimension (a DTensor's ``Shard(d)``/``Replicate()`` on a 1-D
   mesh, never ``full_tensor()``); a receiver its rules. One ``all_gather`` of these few bytes
   (JSON on flat uint8 buffers) gives every process the same picture; the unsharded shapes follow
   from the senders' local shapes, and every sender's shard is checked to be the ``torch.chunk``
   slice its rank should hold.
2. **The plan**, :func:`weightlift.distributed.reshard.plan`, computed by every process from that
   picture alone: the same list everywhere, each needed byte sent once to each receiver.
3. **The moves.** Each process walks the plan in order and posts its own messages, sends and
   receives interleaved in that one order, at most ``inflight`` at a time, waiting for the
   oldest before posting more. Because the globally first unfinished message is always posted
   at both of its ends, the walk cannot deadlock. A run contiguous on the sending side is sent
   straight from the shard the sender holds, one contiguous on the receiving side lands straight
   in the destination tensor; otherwise its rows go through one of ``inflight`` reused staging
   buffers of ``chunk`` bytes. Pieces of at most :data:`SMALL` bytes (norms, biases, small
   experts) are packed per pair of processes into messages of up to a chunk, filled and posted
   at the same point of the plan at both ends. So a process holds, beyond what it owns, at most
   ``inflight`` chunks plus one open batch per peer. Bytes a process sends to itself are
   copied, not sent.
4. **The proof** (:func:`verify_resharded`, run by default): every sender sketches what it owns
   and every receiver what it received, in unsharded coordinates (:mod:`weightlift.digest.sketch`);
   one ``all_gather`` of 8 bytes per tensor and process lets every process check that the
   receivers' parts add up to the senders' parts, or, given a manifest written with
   ``weightlift manifest --sketch``, that both add up to the saved checkpoint's sketches.
   Every process raises the same :class:`~weightlift.errors.IntegrityError` naming the tensors
   that differ, so all receivers keep or drop an update together.

Torch's errors (a peer gone, a timeout) surface as :class:`~weightlift.errors.TransportError`
through :class:`~.comm.Comm`; inputs that cannot be resharded as OptionError naming the tensor.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from weightlift.distributed.comm import Comm
from weightlift.distributed.reshard import Layout, Run, TensorPlan, local_shape, plan, sketch_local
from weightlift.distributed.shard import Shard, parse_placement
from weightlift.dtypes import dtype_info, from_numpy, from_torch
from weightlift.errors import IntegrityError, OptionError, WeightliftError
from weightlift.formats import TensorInfo
from weightlift.memory.targets import as_bytes, view_as
from weightlift.options import Placement

__all__ = ["reshard_transfer", "verify_resharded", "Resharded", "CHUNK", "INFLIGHT"]

#: The most bytes in one message, and the size of each staging buffer.
CHUNK = 4 << 20
#: The most messages one process has posted and not yet waited for.
INFLIGHT = 8
#: Pieces of at most this many bytes (or a quarter chunk) travel together, up to a chunk a message, per pair of
#: processes: a message costs tens of microseconds whatever its size, and a model has thousands
#: of norms, biases and small experts.
SMALL = 64 << 10
_MASK = (1 << 64) - 1


@dataclass
class Resharded:
    """What one process of :func:`reshard_transfer` ended with.

    ``tensors``: a receiver's local tensors, exactly what ``weightlift.load(unsharded_checkpoint,
    shard=dst)`` returns (empty on a process that only sends). ``sent``/``received``: payload bytes
    this process sent to and received from other processes; ``copied``: bytes it moved to itself;
    ``needed``: the bytes its receiving layout needs; ``messages``: messages it posted;
    ``staged``: bytes that went through a staging buffer; ``seconds``: the moves' wall time;
    ``sketch_seconds``: CPU time this process spent sketching; ``verified``: tensors proven.
    """

    tensors: dict[str, Any]
    sent: int = 0
    received: int = 0
    copied: int = 0
    needed: int = 0
    messages: int = 0
    staged: int = 0
    seconds: float = 0.0
    sketch_seconds: float = 0.0
    verified: int = 0
    _ctx: Any = field(default=None, repr=False)


@dataclass
class _Ctx:
    """What :func:`verify_resharded` needs: the picture every process shares, and this one's buffers."""

    comm: Comm
    infos: list[TensorInfo]
    senders: Layout
    receivers: Layout
    send_proc: list[int]
    recv_proc: list[int]
    send_rank: int | None
    recv_rank: int | None
    src: dict[str, np.ndarray]  # a sender's local bytes per tensor
    dst: dict[str, np.ndarray]  # a receiver's local bytes per tensor
    nonce: bytes
    #: sketches begun during the moves, under ``early_seed``: (value, seconds) per tensor, of what
    #: this process sends (from the start) and of what it received (as each tensor lands)
    early_seed: bytes | None = None
    sent_early: dict[str, Future[tuple[int, float]]] = field(default_factory=dict)
    got_early: dict[str, Future[tuple[int, float]]] = field(default_factory=dict)


# --- 1. metadata -------------------------------------------------------------------------------------------


def _local(name: str, value: Any, src: Shard | None) -> tuple[Any, str, int | None, int | None, int | None]:
    """(local array or tensor, dtype name, split dim, mesh rank, mesh size) of one state-dict entry."""
    kind = type(value).__name__
    if kind == "DTensor":
        mesh = value.device_mesh
        if mesh.ndim != 1:
            raise OptionError(
                f"tensor {name!r}: a DTensor on a {mesh.ndim}-D device mesh; resharding takes 1-D meshes "
                "(FSDP or tensor parallel alone) for now"
            )
        pl = value.placements[0]
        if type(pl).__name__ not in ("Shard", "Replicate"):
            raise OptionError(f"tensor {name!r}: placement {pl} cannot be resharded (Shard(d) and Replicate() can)")
        local = value.to_local().detach()
        return local, from_torch(local.dtype), parse_placement(pl), int(mesh.get_local_rank()), int(mesh.size())
    if src is None:
        raise OptionError(
            f"tensor {name!r} is a plain {kind}: say how the senders hold it with src=Shard(rules, rank=, world=)"
        )
    if isinstance(value, np.ndarray):
        dt = from_numpy(value.dtype)
    else:
        dt = from_torch(value.dtype)
        if value.device.type != "cpu":
            raise OptionError(f"tensor {name!r} is on {value.device}: this transfer moves host memory (gloo)")
    probe = TensorInfo(name, dt, tuple(value.shape), "", 0, 0)
    return value, dt, src.placement(probe), src.rank, src.world


def _sender(state: Mapping[str, Any], src: Shard | None) -> tuple[dict[str, np.ndarray], list[Any], list[int]]:
    """This sender's bytes per tensor, its tensor descriptions for the metadata, and [rank, world]."""
    if src is not None and (src.rank is None or src.world is None):
        raise OptionError("src: give the sender layout's rank and world: Shard(rules, rank=r, world=n)")
    out, meta, where = {}, [], None
    for name, value in state.items():
        local, dt, dim, rank, world = _local(name, value, src)
        if where is None:
            where = (rank, world)
        elif where != (rank, world):
            raise OptionError(
                f"tensor {name!r} is rank {rank} of {world}, another of this sender's rank {where[0]} of {where[1]}"
            )
        if not isinstance(local, np.ndarray) and not local.is_contiguous():
            local = local.contiguous()  # its own shard, copied once: the runs address row-major bytes
        info = dtype_info(dt)
        if info.bits not in (8, 16, 32, 64):
            raise OptionError(f"tensor {name!r} ({dt}): only elements of 1, 2, 4 or 8 bytes can be resharded")
        out[name] = as_bytes(np.ascontiguousarray(local) if isinstance(local, np.ndarray) else local)
        meta.append([name, dt, list(local.shape), dim])
    if where is None:
        if src is None:
            raise OptionError("an empty state dict with no src layout: nothing says which sender rank this is")
        where = (src.rank, src.world)
    return out, meta, [where[0], where[1]]  # type: ignore[list-item]


def _receiver(dst: Shard, parts: Mapping[str, Sequence[int]] | None) -> dict[str, Any]:
    if dst.rank is None or dst.world is None:
        raise OptionError("dst: give the receiving layout's rank and world: Shard(rules, rank=r, world=n)")
    return {
        "at": [dst.rank, dst.world],
        "rules": [[p, parse_placement(w)] for p, w in cast("Sequence[tuple[str, Any]]", dst.rules)],
        "default": parse_placement(dst.default),
        "uneven": dst.uneven,
        "parts": {k: [int(x) for x in v] for k, v in (parts or {}).items()},
    }


def _exchange(comm: Comm, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every process's metadata, by group rank: one all_gather of lengths, one of the bytes."""
    import torch

    raw = json.dumps(mine, separators=(",", ":")).encode()
    n = torch.tensor([len(raw)], dtype=torch.int64)
    lens = torch.zeros(comm.world, dtype=torch.int64)
    comm.all_gather(lens, n, what="reshard metadata sizes")
    width = int(lens.max())
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = torch.zeros(width * comm.world, dtype=torch.uint8)
    comm.all_gather(out, buf, what="reshard metadata")
    flat = out.numpy().tobytes()
    return [json.loads(flat[i * width : i * width + int(lens[i])]) for i in range(comm.world)]


def _roles(docs: list[dict[str, Any]], key: str, what: str) -> tuple[list[int], int]:
    """Group rank of each layout rank of ``key`` ('send' or 'recv'), and the layout's world."""
    seen = [(g, d[key]) for g, d in enumerate(docs) if d.get(key) is not None]
    if not seen:
        raise OptionError(f"reshard: no process of the group is a {what}")
    worlds = {at[1] for _, at in seen}
    if len(worlds) != 1:
        raise OptionError(f"reshard: the {what}s disagree on their world size: {sorted(worlds)}")
    world = worlds.pop()
    procs = [-1] * world
    for g, (r, _) in seen:
        if not 0 <= r < world or procs[r] != -1:
            raise OptionError(f"reshard: {what} rank {r} of {world} is claimed by group ranks {procs[r]} and {g}")
        procs[r] = g
    if -1 in procs:
        raise OptionError(f"reshard: {what} ranks {[r for r, g in enumerate(procs) if g == -1]} of {world} are missing")
    return procs, world


def _picture(docs: list[dict[str, Any]]) -> tuple[list[TensorInfo], Layout, Layout, list[int], list[int]]:
    """The tensors (unsharded), both layouts and the processes of each layout rank, from the metadata."""
    send_proc, sw = _roles(docs, "send", "sender")
    recv_proc, rw = _roles(docs, "recv_at", "receiver")
    first = docs[send_proc[0]]["tensors"]
    names = [m[0] for m in first]
    for s, g in enumerate(send_proc):
        have = docs[g]["tensors"]
        if [m[0] for m in have] != names or [(m[1], m[3], len(m[2])) for m in have] != [
            (m[1], m[3], len(m[2])) for m in first
        ]:
            diff = sorted(set(names) ^ {m[0] for m in have}) or [
                a[0] for a, b in zip(first, have, strict=False) if (a[1], a[3]) != (b[1], b[3])
            ]
            raise OptionError(
                f"reshard: sender rank {s} holds other tensors than sender rank 0 (or in another order, dtype or "
                f"placement): {diff[:8]}"
            )
    infos, dims = [], {}
    for k, (name, dt, shape0, dim) in enumerate(first):
        shape = list(shape0)
        if dim is not None:
            dim %= len(shape)
            shape[dim] = sum(docs[g]["tensors"][k][2][dim] for g in send_proc)
        item = dtype_info(dt).bits // 8
        infos.append(TensorInfo(name, dt, tuple(shape), "", 0, int(np.prod(shape, dtype=np.int64)) * item))
        dims[name] = dim
    senders = Layout(Shard(), sw, dims=dims)
    for k, t in enumerate(infos):
        for s, g in enumerate(send_proc):
            have = tuple(docs[g]["tensors"][k][2])
            want = local_shape(t, senders, s)
            if have != want:
                raise OptionError(
                    f"tensor {t.name!r}: sender rank {s} of {sw} holds {list(have)}, not the torch.chunk slice "
                    f"{list(want)} of {list(t.shape)} its rank holds under Shard({dims[t.name]})"
                )
    rx = [{k: v for k, v in docs[g]["recv"].items() if k != "at"} for g in recv_proc]
    if any(r != rx[0] for r in rx):
        bad = [r for r, d in enumerate(rx) if d != rx[0]]
        raise OptionError(f"reshard: receiver ranks {bad} state other rules or fused parts than receiver rank 0")
    spec = rx[0]
    rules = Shard([(p, d) for p, d in spec["rules"]], default=spec["default"], uneven=spec["uneven"])
    receivers = Layout(rules, rw, parts=spec["parts"] or None)
    return infos, senders, receivers, send_proc, recv_proc


# --- 3. the moves ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Piece:
    """Rows ``[k0, k1)`` of a run, bytes ``[b0, b1)`` of each: one message's worth."""

    run: Run
    k0: int
    k1: int
    b0: int
    b1: int

    @property
    def nbytes(self) -> int:
        return (self.k1 - self.k0) * (self.b1 - self.b0)

    def contiguous(self, stride: int) -> bool:
        return self.k1 - self.k0 == 1 or (self.b0 == 0 and self.b1 == self.run.length == stride)

    def rows(self, base: int, stride: int) -> Iterator[tuple[int, int]]:
        n = self.b1 - self.b0
        for k in range(self.k0, self.k1):
            yield base + k * stride + self.b0, n


def _pieces(run: Run, chunk: int) -> Iterator[_Piece]:
    if run.length > chunk:  # a row larger than a chunk: cut the row
        for k in range(run.count):
            for b in range(0, run.length, chunk):
                yield _Piece(run, k, k + 1, b, min(run.length, b + chunk))
        return
    per = max(1, chunk // max(1, run.length))
    for k in range(0, run.count, per):
        yield _Piece(run, k, min(run.count, k + per), 0, run.length)


def _gather(buf: np.ndarray, piece: _Piece, base: int, stride: int, out: np.ndarray) -> None:
    at = 0
    for off, n in piece.rows(base, stride):
        out[at : at + n] = buf[off : off + n]
        at += n


def _scatter(buf: np.ndarray, piece: _Piece, base: int, stride: int, data: np.ndarray) -> None:
    at = 0
    for off, n in piece.rows(base, stride):
        buf[off : off + n] = data[at : at + n]
        at += n


def _torch(a: np.ndarray) -> Any:
    import torch

    with warnings.catch_warnings():  # a read-only shard is only ever sent from, never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


@dataclass
class _Batch:
    """Small pieces for one pair of processes, packed back to back in ``buf``."""

    buf: np.ndarray
    used: int = 0
    pieces: list[tuple[str, Run, _Piece, int]] = field(default_factory=list)


class _Window:
    """The messages this process has posted, oldest first; at most ``limit``, with their staging."""

    def __init__(self, comm: Comm, limit: int, chunk: int):
        self.comm, self.limit, self.chunk = comm, max(1, limit), chunk
        self.posted: list[tuple[Any, Any]] = []
        self.free: list[np.ndarray] = []
        self.made = 0

    def stage(self) -> np.ndarray:
        while not self.free and self.made >= self.limit:
            self.retire()
        if self.free:
            return self.free.pop()
        self.made += 1
        return np.empty(self.chunk, dtype=np.uint8)

    def post(self, work: Any, done: Any) -> None:
        self.posted.append((work, done))
        while len(self.posted) >= self.limit:
            self.retire()

    def retire(self) -> None:
        work, done = self.posted.pop(0)
        self.comm.wait(work, "reshard transfer")
        if done is not None:
            done()

    def drain(self) -> None:
        while self.posted:
            self.retire()


class _Mover:
    """Posts this process's messages in plan order (the walk of the module docstring) and says,
    through ``landed(name)``, when each tensor it receives is whole."""

    def __init__(self, ctx: _Ctx, res: Resharded, chunk: int, inflight: int, landed: Any = None):
        self.ctx, self.res, self.chunk, self.landed = ctx, res, chunk, landed
        self.win = _Window(ctx.comm, inflight, chunk)
        self.left: dict[str, int] = {}  # receives not yet landed, +1 while the tensor's moves are being posted
        # small pieces gathered per (sender process, receiver process) into one message of up to a
        # chunk; both ends fill and post a pair's batch at the same point of the plan, so the
        # messages keep one global order. Buffers: at most one open batch per peer and direction,
        # plus those in flight.
        self.batches: dict[tuple[int, int], _Batch] = {}
        self.spare: list[np.ndarray] = []
        self.small = min(SMALL, chunk // 4)  # a batch always holds several

    def run(self, plans: list[TensorPlan]) -> None:
        ctx, me = self.ctx, self.ctx.comm.rank
        for tp in plans:
            name = tp.tensor.name
            self.left[name] = 1
            for s, r, _box, runs in tp.moves:
                sp, rp = ctx.send_proc[s], ctx.recv_proc[r]
                if me not in (sp, rp):
                    continue
                for run in runs:
                    if sp == rp:
                        self.copy(name, run)
                        continue
                    for p in _pieces(run, self.chunk):
                        if p.nbytes <= self.small:
                            self.batch(name, run, p, (sp, rp))
                            continue
                        self.res.messages += 1
                        if me == sp:
                            self.send(name, run, p, rp)
                        else:
                            self.recv(name, run, p, sp)
            self.arrived(name)  # every move posted, every copy made
        for pair in sorted(self.batches):  # what is left, in one order on every process
            self.flush(pair)
        self.win.drain()

    def batch(self, name: str, run: Run, p: _Piece, pair: tuple[int, int]) -> None:
        """Add a small piece to the pair's open batch (posting the batch first if it is full)."""
        n = p.nbytes
        b = self.batches.get(pair)
        if b is not None and b.used + n > self.chunk:
            self.flush(pair)
            b = None
        if b is None:
            b = self.batches[pair] = _Batch(self.spare.pop() if self.spare else np.empty(self.chunk, np.uint8))
        if pair[0] == self.ctx.comm.rank:
            _gather(self.ctx.src[name], p, run.src, run.src_stride, b.buf[b.used :])
            self.res.sent += n
        else:
            self.left[name] += 1
            self.res.received += n
        b.pieces.append((name, run, p, b.used))
        b.used += n
        self.res.staged += n

    def flush(self, pair: tuple[int, int]) -> None:
        b = self.batches.pop(pair)
        self.res.messages += 1
        data = _torch(b.buf[: b.used])
        if pair[0] == self.ctx.comm.rank:
            self.win.post(self.ctx.comm.isend(data, pair[1]), lambda: self.spare.append(b.buf))
            return

        def land() -> None:
            for name, run, p, off in b.pieces:
                _scatter(self.ctx.dst[name], p, run.dst, run.dst_stride, b.buf[off:])
                self.arrived(name)
            self.spare.append(b.buf)

        self.win.post(self.ctx.comm.irecv(data, pair[0]), land)

    def arrived(self, name: str) -> None:
        self.left[name] -= 1
        if self.left[name] == 0:
            del self.left[name]
            if self.landed is not None and self.ctx.recv_rank is not None:
                self.landed(name)

    def copy(self, name: str, run: Run) -> None:
        """Bytes a process sends to itself."""
        src, dst = self.ctx.src[name], self.ctx.dst[name]
        for k in range(run.count):
            a, b = run.src + k * run.src_stride, run.dst + k * run.dst_stride
            dst[b : b + run.length] = src[a : a + run.length]
        self.res.copied += run.nbytes

    def send(self, name: str, run: Run, p: _Piece, peer: int) -> None:
        src, n, win = self.ctx.src[name], p.nbytes, self.win
        if p.contiguous(run.src_stride):  # straight from the shard the sender owns
            a = run.src + p.k0 * run.src_stride + p.b0
            win.post(self.ctx.comm.isend(_torch(src[a : a + n]), peer), None)
        else:
            st = win.stage()
            _gather(src, p, run.src, run.src_stride, st)
            self.res.staged += n
            win.post(self.ctx.comm.isend(_torch(st[:n]), peer), lambda: win.free.append(st))
        self.res.sent += n

    def recv(self, name: str, run: Run, p: _Piece, peer: int) -> None:
        dst, n, win = self.ctx.dst[name], p.nbytes, self.win
        self.left[name] += 1
        if p.contiguous(run.dst_stride):  # straight into the destination tensor
            b = run.dst + p.k0 * run.dst_stride + p.b0
            win.post(self.ctx.comm.irecv(_torch(dst[b : b + n]), peer), lambda: self.arrived(name))
        else:
            st = win.stage()

            def land() -> None:
                _scatter(dst, p, run.dst, run.dst_stride, st)
                win.free.append(st)
                self.arrived(name)

            self.res.staged += n
            win.post(self.ctx.comm.irecv(_torch(st[:n]), peer), land)
        self.res.received += n


# --- 4. the proof ------------------------------------------------------------------------------------------


def _words(buf: np.ndarray, t: TensorInfo, shape: tuple[int, ...]) -> np.ndarray:
    return buf.view(f"<u{dtype_info(t.dtype).bits // 8}").reshape(shape)


def _sketch_one(t: TensorInfo, layout: Layout, rank: int, buf: np.ndarray, seed: bytes) -> tuple[int, float]:
    """``rank``'s sketch part of ``t`` from its local bytes, and the CPU seconds it took (on a
    busy machine a thread's wall time would count the time it waited for a core)."""
    t0 = time.thread_time()
    v = sketch_local(t, layout, rank, _words(buf, t, local_shape(t, layout, rank)), seed)
    return v, time.thread_time() - t0


def _parts(
    ctx: _Ctx,
    early: dict[str, Future[tuple[int, float]]],
    layout: Layout,
    rank: int,
    bufs: dict[str, np.ndarray],
    seed: bytes,
) -> tuple[list[int], float]:
    """This process's part of every tensor's sketch (begun early where the seed matches), and its cost."""
    out, took = [], 0.0
    for t in ctx.infos:
        f = early.get(t.name) if ctx.early_seed == seed else None
        v, dt = f.result() if f is not None else _sketch_one(t, layout, rank, bufs[t.name], seed)
        out.append(v)
        took += dt
    return out, took


def _seed(ctx: _Ctx, manifest: Any) -> bytes:
    """A manifest's sketches are under the empty seed; else the transfer's own random one."""
    return b"" if manifest is not None else ctx.nonce


def _expected(manifest: Any, infos: list[TensorInfo]) -> dict[str, int]:
    from weightlift.digest.published import Manifest, read_manifest

    m = manifest if isinstance(manifest, Manifest) else read_manifest(manifest)
    want = m.sketches()
    if not want:
        raise OptionError("the manifest has no sketches: write it with `weightlift manifest --sketch`")
    return want


def verify_resharded(result: Resharded, *, manifest: Any = None) -> int:
    """Prove what :func:`reshard_transfer` moved, without a gather: collective, on every process.

    Each sender's sketch of what it owns and each receiver's of what it holds now are exchanged
    (8 bytes per tensor and process); per tensor, the receivers' parts must add up to the
    senders' (replicas must each equal the whole). With ``manifest`` (a :class:`Manifest` or its
    path, written with ``weightlift manifest --sketch``), both must add up to the saved
    checkpoint's sketch, and every tensor it sketches must have been moved. Returns the number of
    tensors proven; IntegrityError on every process, naming the tensors, otherwise."""
    import torch

    ctx: _Ctx = result._ctx
    seed = _seed(ctx, manifest)
    n = len(ctx.infos)
    mine = np.zeros((2, n), dtype=np.uint64)
    if ctx.send_rank is not None:
        mine[0], took = _parts(ctx, ctx.sent_early, ctx.senders, ctx.send_rank, ctx.src, seed)
        result.sketch_seconds += took
    if ctx.recv_rank is not None:
        mine[1], took = _parts(ctx, ctx.got_early, ctx.receivers, ctx.recv_rank, ctx.dst, seed)
        result.sketch_seconds += took
    everyone = torch.zeros(ctx.comm.world * 2 * n, dtype=torch.int64)
    ctx.comm.all_gather(everyone, torch.from_numpy(mine.reshape(-1).view(np.int64)), what="reshard proof")
    parts = everyone.numpy().view(np.uint64).reshape(ctx.comm.world, 2, n)
    want = _expected(manifest, ctx.infos) if manifest is not None else None
    bad = []
    for k, t in enumerate(ctx.infos):
        s = _total([int(parts[g, 0, k]) for g in ctx.send_proc], ctx.senders.placement(t) is None)
        r = _total([int(parts[g, 1, k]) for g in ctx.recv_proc], ctx.receivers.placement(t) is None)
        if s is None:
            bad.append(f"{t.name} (the senders' replicas differ)")
        elif r is None:
            bad.append(f"{t.name} (the receivers' replicas differ)")
        elif want is not None and t.name not in want:
            bad.append(f"{t.name} (no sketch of it in the manifest)")
        elif want is not None and s != want[t.name]:
            bad.append(f"{t.name} (what the senders hold differs from the manifest)")
        elif r != s:
            bad.append(f"{t.name} (what the receivers hold differs from what the senders hold)")
    if want is not None:
        moved = {t.name for t in ctx.infos}
        bad += [f"{name} (in the manifest, not moved)" for name in want if name not in moved]
    if bad:
        raise IntegrityError(f"reshard: {len(bad)} tensor(s) not proven: {'; '.join(bad[:8])}")
    result.verified = n
    return n


def _total(parts: list[int], replicated: bool) -> int | None:
    if replicated:
        return parts[0] if all(p == parts[0] for p in parts) else None
    return sum(parts) & _MASK


def _begin_proof(ctx: _Ctx, pool: ThreadPoolExecutor, manifest: Any) -> Any:
    """Start the proof beside the moves, on another core: a sender sketches what it owns (it does
    not change while it is sent), a receiver each tensor once its last byte has landed (the
    callback returned, for :class:`_Mover`)."""
    seed = ctx.early_seed = _seed(ctx, manifest)
    if ctx.send_rank is not None:
        for t in ctx.infos:
            ctx.sent_early[t.name] = pool.submit(_sketch_one, t, ctx.senders, ctx.send_rank, ctx.src[t.name], seed)
    by_name, rank = {t.name: t for t in ctx.infos}, ctx.recv_rank

    def landed(name: str) -> None:
        assert rank is not None  # called on a receiver only
        ctx.got_early[name] = pool.submit(_sketch_one, by_name[name], ctx.receivers, rank, ctx.dst[name], seed)

    return landed


# --- the verb ----------------------------------------------------------------------------------------------


def _describe(
    comm: Comm, state: Mapping[str, Any] | None, src: Shard | None, dst: Shard | None, parts: Any
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, np.ndarray]]:
    """Every process's metadata (this one's too), and this sender's bytes per tensor. A rank that
    refuses its input still joins the exchange, so that every rank refuses and none waits for it."""
    mine: dict[str, Any] = {}
    src_bufs: dict[str, np.ndarray] = {}
    refused: WeightliftError | None = None
    try:
        if state is not None:
            src_bufs, mine["tensors"], mine["send"] = _sender(state, src)
        if dst is not None:
            mine["recv"] = _receiver(dst, parts)
            mine["recv_at"] = mine["recv"]["at"]
    except Exception as e:  # noqa: BLE001 - any input this rank cannot describe is refused by every rank
        refused = e if isinstance(e, WeightliftError) else OptionError(f"reshard: {type(e).__name__}: {e}")
        mine = {"error": str(refused)}
    if comm.rank == 0:
        mine["nonce"] = os.urandom(16).hex()
    docs = _exchange(comm, mine)
    if refused is not None:
        raise refused
    for g, d in enumerate(docs):
        if "error" in d:
            raise OptionError(f"reshard: group rank {g} refused its input: {d['error']}")
    return docs, mine, src_bufs


def reshard_transfer(
    state: Mapping[str, Any] | None = None,
    *,
    dst: Shard | None = None,
    src: Shard | None = None,
    parts: Mapping[str, Sequence[int]] | None = None,
    group: Any = None,
    framework: str = "numpy",
    verify: bool = True,
    manifest: Any = None,
    chunk: int = CHUNK,
    inflight: int = INFLIGHT,
    timeout: float | None = None,
) -> Resharded:
    """Move a sharded state dict into another sharded layout over ``group``; collective.

    ``state``: on a sender, its tensors as it holds them: DTensors on a 1-D mesh (FSDP2's
    ``Shard(0)``, tensor parallel ``Shard(d)`` or ``Replicate()``; the rank and world are the
    mesh's), or numpy arrays and CPU tensors that are this rank's ``torch.chunk`` slices under
    ``src`` (``Shard(rules, rank=, world=)``, the rules a sharded load takes). None on a process
    that only receives. ``dst``: on a receiver, ``Shard(rules, rank=, world=)``: it ends with what
    ``weightlift.load(unsharded_checkpoint, shard=dst)`` returns, byte for byte; ``parts``: fused
    tensors of the receiving layout (``{"qkv_proj.weight": [q_rows, k_rows, v_rows]}``), each
    part chunked over the receivers and stacked, as vLLM's QKV and merged column layers hold them.
    ``framework``: "numpy" or "torch" for the received tensors. ``verify``: prove the result
    with :func:`verify_resharded` (against ``manifest`` when given). ``chunk``, ``inflight``: the
    largest message and the most messages in flight per process (the staging bound).
    """
    if chunk < 1 or inflight < 1:
        raise OptionError(f"chunk ({chunk}) and inflight ({inflight}) must be positive")
    if framework not in ("numpy", "torch"):
        raise OptionError(f"framework must be 'numpy' or 'torch', not {framework!r}")
    comm = Comm(group, timeout=timeout)
    comm.check_device(Placement())  # host memory: gloo moves it
    docs, mine, src_bufs = _describe(comm, state, src, dst, parts)
    infos, senders, receivers, send_proc, recv_proc = _picture(docs)
    ctx = _Ctx(
        comm,
        infos,
        senders,
        receivers,
        send_proc,
        recv_proc,
        None if state is None else mine["send"][0],
        None if dst is None else dst.rank,
        src_bufs,
        {},
        bytes.fromhex(docs[0]["nonce"]),
    )
    plans = plan(infos, senders, receivers)
    res = Resharded({}, _ctx=ctx)
    if ctx.recv_rank is not None:
        for t in infos:
            shape = local_shape(t, receivers, ctx.recv_rank)
            ctx.dst[t.name] = np.zeros(int(np.prod(shape, dtype=np.int64)) * (dtype_info(t.dtype).bits // 8), np.uint8)
            res.needed += ctx.dst[t.name].size
    pool = ThreadPoolExecutor(1) if verify else None
    try:
        landed = _begin_proof(ctx, pool, manifest) if pool is not None else None
        t0 = time.perf_counter()
        _Mover(ctx, res, chunk, inflight, landed).run(plans)
        res.seconds = time.perf_counter() - t0
        if verify:
            verify_resharded(res, manifest=manifest)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    if ctx.recv_rank is not None:
        for t in infos:
            res.tensors[t.name] = view_as(ctx.dst[t.name], t.dtype, local_shape(t, receivers, ctx.recv_rank), framework)
    return res
