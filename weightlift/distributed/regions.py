"""Sharded pushes: each trainer rank sends the boxes it holds, each server keeps only its slices.

Theory of operation. A sharded tensor server (``Server(shard=Shard(rules, rank=r, world=w))``)
holds rank ``r``'s slices of every tensor, at :func:`~.reshard.local_shape`, and says so in
LAYOUT_REPLY: the same rules, rank and world (and fused part sizes) a load takes. A sender
describes what it holds as a box of the unsharded tensor: a torch DTensor's box comes from its
``placements`` and ``device_mesh`` (never ``full_tensor()``), a numpy array or plain tensor's
from :class:`ShardOf`, and a plain array is the whole box. From the server's layout alone it
computes :func:`~.reshard.region` of the receiver, intersects every segment with its own box,
and sends each non-empty intersection as REGION frames (the box in unsharded coordinates and its
elements in row-major order, cut to at most ``chunk`` bytes): exactly the bytes the receiver
needs from this sender, nothing gathered. The server checks every box against its own slices,
the tensor's declared dtype and shape and the boxes it already has (out of bounds, overlapping,
mismatched: an error naming the tensor, nothing placed), places it, and publishes a tensor once
its slice is covered, whichever connections the boxes came from.

The proof is :mod:`.reshard`'s linear sketch: each sender adds the sketch parts of the boxes it
sent (:attr:`ShardPush.sketches`), the server those of the boxes it placed (SKETCH_REPLY);
:func:`check_sketches` compares the senders' sum with the server's, and the servers' sum of a
sharded tensor equals ``reshard.sketch`` of the unsharded tensor. A replicated DTensor is sent by
the ranks at coordinate 0 of its replicated mesh dimensions only, so no byte is sent twice.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from weightlift.distributed.reshard import Layout, local_shape, region, sketch_base, sketch_part
from weightlift.distributed.shard import Shard, parse_placement
from weightlift.dtypes import byte_length, dtype_info
from weightlift.errors import IntegrityError, OptionError, RemoteProtocolError, TransportTimeout
from weightlift.formats import TensorInfo
from weightlift.remote.client.memory import host_bytes, memory_tensors
from weightlift.remote.protocol import (
    MAX_DIMS,
    MAX_REGION_BYTES,
    MAX_SKETCH_BYTES,
    MAX_TENSORS,
    REGIONS_SINCE,
    SKETCH_ENTRY_LAYOUT,
    SWITCH_SINCE,
    Capability,
    Expect,
    LayoutReply,
    LayoutRequest,
    Region,
    SketchEntry,
    SketchReply,
    SketchRequest,
    Switch,
    SwitchReply,
)

if TYPE_CHECKING:
    from weightlift.remote.client import Client

__all__ = [
    "Served",
    "ShardOf",
    "ShardPush",
    "push_shards",
    "server_sketches",
    "check_sketches",
    "switch_all",
    "abort_all",
    "REGION_CHUNK",
]

Box = tuple[tuple[int, int], ...]
#: Payload bytes of one REGION a sender makes: a box larger than this goes as several.
REGION_CHUNK = 8 * 1024 * 1024
_MASK = (1 << 64) - 1


class Served:
    """``shard``'s slices for its rank, as a server holds them and a sender computes them:
    :class:`~weightlift.remote.server.config.Slices`. ``parts``: the fused tensors' part sizes."""

    def __init__(self, shard: Shard, *, parts: Mapping[str, Sequence[int]] | None = None):
        if shard.rank is None or shard.world is None:
            raise OptionError("a sharded server needs Shard(rules, rank=..., world=...)")
        self._rank = shard.rank
        self.shard = shard
        self.parts = {k: tuple(int(n) for n in v) for k, v in (parts or {}).items()}
        for name, sizes in self.parts.items():  # LAYOUT_REPLY carries them as dims
            if len(sizes) > MAX_DIMS:
                raise OptionError(f"fused tensor {name!r}: {len(sizes)} parts; a server takes at most {MAX_DIMS}")
        self.layout = Layout(shard, shard.world, parts=self.parts or None)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world(self) -> int:
        return self.layout.world

    def _info(self, name: str, dtype: str, shape: tuple[int, ...]) -> TensorInfo:
        return TensorInfo(name, dtype, tuple(shape), "", 0, byte_length(dtype, shape))

    def segments(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[tuple[Box, int | None, int], ...]:
        return tuple((s.box, s.dim, s.local) for s in region(self._info(name, dtype, shape), self.layout, self._rank))

    def local_shape(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return local_shape(self._info(name, dtype, shape), self.layout, self._rank)

    def sketch(self, array: Any, shape: tuple[int, ...], box: Box, name: str) -> int:
        return sketch_part(array, shape, box, sketch_base(name))

    def describe(self) -> LayoutReply:
        pairs = cast("tuple[tuple[str, Any], ...]", self.shard.rules)  # Shard keeps its rules as pairs
        rules = tuple((pattern, parse_placement(where)) for pattern, where in pairs)
        return LayoutReply(
            self._rank,
            self.world,
            rules,
            parse_placement(self.shard.default),
            self.shard.uneven,
            tuple(sorted(self.parts.items())),
        )

    @classmethod
    def from_reply(cls, reply: LayoutReply) -> Served:
        """The server's slices from its LAYOUT_REPLY (a sender's view of one receiver)."""
        if reply.world < 1:
            raise OptionError("the server holds no slices (it was started without shard=)")
        shard = Shard(list(reply.rules), rank=reply.rank, world=reply.world, default=reply.default, uneven=reply.uneven)
        return cls(shard, parts=dict(reply.parts))


@dataclass(frozen=True)
class ShardOf:
    """A numpy array or torch tensor holding the box of an unsharded tensor of ``shape`` that
    starts at ``offsets`` (per dimension) and spans the array's own shape."""

    array: Any
    shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        local = tuple(int(d) for d in self.array.shape)
        full, off = tuple(int(d) for d in self.shape), tuple(int(d) for d in self.offsets)
        if len(full) != len(local) or len(off) != len(local):
            raise OptionError(f"ShardOf: a {len(local)}-d array, shape {list(full)} and offsets {list(off)} disagree")
        if any(o < 0 or o + n > d for o, n, d in zip(off, local, full, strict=True)):
            raise OptionError(f"ShardOf: an array of {list(local)} at {list(off)} runs outside {list(full)}")
        object.__setattr__(self, "shape", full)
        object.__setattr__(self, "offsets", off)

    @property
    def box(self) -> Box:
        return tuple((o, o + int(n)) for o, n in zip(self.offsets, self.array.shape, strict=True))


def _dtensor_shard(value: Any) -> ShardOf | None:
    """A DTensor's local tensor and its box (None: another rank sends this replicated box)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = value.device_mesh, value.placements
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the mesh: it holds nothing
        return None
    for k, p in enumerate(placements):
        if p.is_partial():
            raise OptionError(f"a DTensor with a Partial placement ({p}) holds no bytes of the tensor: reduce it first")
        if p.is_replicate() and coord[k] != 0:
            return None
    shape, offset = compute_local_shape_and_global_offset(value.shape, mesh, placements)
    local = value.to_local()
    if tuple(local.shape) != tuple(shape):
        raise OptionError(f"a DTensor's local tensor of {list(local.shape)} is not its placements' {list(shape)}")
    return ShardOf(local, tuple(int(d) for d in value.shape), tuple(int(o) for o in offset))


def _held(value: Any) -> ShardOf | None:
    if isinstance(value, ShardOf):
        return value
    if type(value).__name__ == "DTensor" and hasattr(value, "device_mesh"):
        return _dtensor_shard(value)
    shape = tuple(int(d) for d in value.shape)
    return ShardOf(value, shape, (0,) * len(shape))


def _meet(a: Box, b: Box) -> Box | None:
    lo = [max(x[0], y[0]) for x, y in zip(a, b, strict=True)]
    hi = [min(x[1], y[1]) for x, y in zip(a, b, strict=True)]
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return tuple(zip(lo, hi, strict=True))


def _pieces(box: Box, item: int, chunk: int) -> Iterator[Box]:
    """``box`` cut into boxes of at most ``chunk`` bytes (or one innermost row where a row is more):
    along the outermost dimension whose inner block fits, each outer index on its own."""
    ext = [b - a for a, b in box]
    nd = len(box)
    if nd == 0 or math.prod(ext) * item <= chunk:
        yield box
        return
    k, inner = nd - 1, item
    while k > 0 and inner * ext[k] <= chunk:
        inner *= ext[k]
        k -= 1
    step = max(1, chunk // inner)
    outer = [range(box[j][0], box[j][1]) for j in range(k)]
    for idx in np.ndindex(*[len(r) for r in outer]) if outer else [()]:
        head = tuple((outer[j][i], outer[j][i] + 1) for j, i in enumerate(idx))
        for s in range(box[k][0], box[k][1], step):
            yield head + ((s, min(s + step, box[k][1])),) + box[k + 1 :]


@dataclass
class ShardPush:
    """What one sender's push to one server did: ``bytes_sent`` REGION payload bytes in
    ``regions`` frames, ``wire_bytes`` those frames whole (prefix, head, payload, tag); ``sketches`` this sender's sketch part of each tensor it sent (a tensor it
    sent nothing of is absent); ``status`` the server's entries (SKETCH_REPLY) right after."""

    bytes_sent: int = 0
    regions: int = 0
    wire_bytes: int = 0
    sketches: dict[str, int] = field(default_factory=dict)
    status: dict[str, SketchEntry] = field(default_factory=dict)
    seconds: float = 0.0


def _connection(client: Client) -> Any:
    hello = client.server_hello
    conn = client.connections[0]
    if conn.minor < REGIONS_SINCE or not hello.has(Capability.SHARDED):
        raise OptionError(f"server {client.address}: it takes no REGIONs (protocol minor 6 and shard= needed)")
    return conn


def server_layout(client: Client) -> Served:
    """The slices ``client``'s server holds (its LAYOUT_REPLY)."""
    conn = _connection(client)
    conn.send(conn.frame(LayoutRequest()))
    return Served.from_reply(conn.expect(LayoutReply))


def push_shards(
    client: Client,
    tensors: Mapping[str, Any],
    *,
    layout: Served | None = None,
    chunk: int = REGION_CHUNK,
    atomic: bool = True,
    set_id: int = 0,
) -> ShardPush:
    """Send what this rank holds of ``tensors`` that ``client``'s server needs, as REGIONs.

    Values: torch DTensors (their local shard, placed by ``placements`` and ``device_mesh``),
    :class:`ShardOf`, or whole numpy arrays / torch tensors. ``layout``: the server's, when the
    caller asked already (:func:`server_layout`). ``atomic``: the names of ``tensors`` are one
    set (EXPECT, sent first): the server shows all of them at once when every sender has sent
    its part of every one (the senders of one update pass the same names), and none of them if
    a sender fails; else each tensor becomes visible as its slice is covered.
    :func:`server_sketches` waits for visibility. ``set_id`` (non-zero, the same on every sender
    of one update; a new one per update): the complete set is held, invisible, until
    :func:`switch_all` switches it in on every server at once, or drops it. Errors the server
    found in these REGIONs raise :class:`~weightlift.errors.RemoteProtocolError` naming each.
    """
    if not 0 < chunk <= MAX_REGION_BYTES:
        raise OptionError(f"chunk must be in (0, {MAX_REGION_BYTES}], got {chunk}")
    if set_id and not atomic:
        raise OptionError("set_id holds the update's set: it needs atomic=True")
    if not 0 <= set_id < 1 << 64:
        raise OptionError(f"set_id must be in [0, 2**64), got {set_id}")
    t0 = time.perf_counter()
    rx = layout if layout is not None else server_layout(client)
    conn = _connection(client)
    if set_id and conn.minor < SWITCH_SINCE:
        raise OptionError(f"server {client.address}: it cannot hold a set (protocol minor {SWITCH_SINCE} needed)")
    out = ShardPush()
    names = tuple(tensors)
    if atomic:
        hold = Expect.FLAG_HOLD if set_id else 0
        for batch in _batches(names) if names else ():
            conn.send(conn.frame(Expect(batch, hold, set_id)))
    for name, value in tensors.items():
        held = _held(value)
        if held is None:
            continue
        (t,) = memory_tensors({name: held.array})
        item = dtype_info(t.dtype).bits // 8
        if item * 8 != dtype_info(t.dtype).bits or item not in (1, 2, 4, 8):
            raise OptionError(f"tensor {name!r} ({t.dtype}): only whole elements of 1, 2, 4 or 8 bytes go as regions")
        local = host_bytes(t).view(f"<u{item}").reshape(t.shape)
        full = held.shape
        segs = rx.segments(name, t.dtype, full)
        r = sketch_base(name)
        total = 0
        sent_any = False
        if not segs and all(a == 0 for a in held.offsets):  # the server's slice is empty: say so, once
            segs, boxes = (), [tuple((0, 0) for _ in full)]
        else:
            boxes = [b for s in segs if (b := _meet(held.box, s[0])) is not None]
        for box in boxes:
            for piece in _pieces(box, item, chunk):
                sl = tuple(slice(a - o, b - o) for (a, b), o in zip(piece, held.offsets, strict=True))
                data = np.ascontiguousarray(local[sl])
                raw = data.reshape(-1).view(np.uint8)
                msg = Region(name, t.dtype, full, tuple(a for a, _ in piece), tuple(b for _, b in piece), raw.nbytes)
                head = conn.frame(msg)
                tag = conn.payload_tag(raw)
                conn.send(head, raw, tag)
                out.wire_bytes += len(head) + raw.nbytes + len(tag)
                total += sketch_part(data, full, piece, r)
                out.bytes_sent += raw.nbytes
                out.regions += 1
                sent_any = True
        if sent_any:
            out.sketches[name] = total & _MASK
    reply = _ask(conn, tuple(out.sketches))
    out.status = {e.name: e for e in reply.entries}
    out.seconds = time.perf_counter() - t0
    if reply.errors:
        raise RemoteProtocolError(f"server {client.address} refused regions: " + "; ".join(reply.errors))
    return out


def _batches(names: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    """``names`` in batches whose SKETCH_REPLY fits MAX_SKETCH_BYTES (and MAX_TENSORS names): an
    EXPECT or SKETCH of one batch, and its reply, fit any frame limit."""
    batch: list[str] = []
    room = MAX_SKETCH_BYTES
    for n in names:
        size = SKETCH_ENTRY_LAYOUT.size + 2 + len(n.encode("utf-8"))
        if batch and (size > room or len(batch) == MAX_TENSORS):
            yield tuple(batch)
            batch, room = [], MAX_SKETCH_BYTES
        batch.append(n)
        room -= size
    yield tuple(batch)


def _ask(conn: Any, names: tuple[str, ...], flags: int = 0) -> SketchReply:
    entries: list[SketchEntry] = []
    errors: list[str] = []
    for batch in _batches(names):
        conn.send(conn.frame(SketchRequest(batch, flags)))
        reply = conn.expect(SketchReply)
        entries.extend(reply.entries)
        errors.extend(reply.errors)
    # the set's state as of the last batch: a set held then was complete for every batch before
    return SketchReply(tuple(entries), tuple(errors), reply.set_state, reply.set_id)


def server_sketches(
    client: Client,
    names: Sequence[str],
    *,
    timeout: float = 0.0,
    poll: float = 0.01,
    recompute: bool = False,
    set_id: int = 0,
) -> dict[str, SketchEntry]:
    """The server's entry for each of ``names`` once all are complete (visible), waiting up to
    ``timeout`` seconds for other senders; TransportTimeout naming each tensor still incomplete
    (with its bytes received of needed) or never seen. ``recompute``: the server sketches each
    tensor from the memory it is in now (a byte changed since it landed shows), not as it landed.
    ``set_id``: wait instead until the held set of that id is complete (its tensors invisible
    until SWITCH)."""
    conn = _connection(client)
    end = time.monotonic() + timeout
    while True:
        reply = _ask(conn, tuple(names), SketchRequest.FLAG_RECOMPUTE if recompute else 0)
        if reply.errors:
            raise RemoteProtocolError(f"server {client.address} refused regions: " + "; ".join(reply.errors))
        got = {e.name: e for e in reply.entries}
        if set_id:
            held = (reply.set_state, reply.set_id) == (SketchReply.SET_HELD, set_id)
            missing = [] if held else [n for n in names if n not in got or got[n].received < got[n].needed]
            done = held
        else:
            missing = [n for n in names if n not in got or not got[n].complete]
            done = not missing
        if done:
            return got
        if time.monotonic() >= end:
            what = [_progress(n, got.get(n)) for n in missing]
            if not what:  # every tensor named is in, but the set is not (yet) held
                state = ("none", "open", "held")[reply.set_state]
                what = [f"set {set_id} not held (the server's open set: {reply.set_id}, {state})"]
            raise TransportTimeout(
                f"server {client.address}: tensors incomplete after {timeout:g} s: " + ", ".join(what)
            )
        time.sleep(poll)


def _progress(name: str, e: SketchEntry | None) -> str:
    if e is None:
        return f"{name!r} (nothing)"
    if e.received == e.needed:
        return f"{name!r} (all {e.needed} bytes, held until the rest of its set is complete)"
    return f"{name!r} ({e.received} of {e.needed} bytes)"


def check_sketches(pushes: Sequence[ShardPush], status: Mapping[str, SketchEntry]) -> None:
    """IntegrityError naming every tensor whose server sketch differs from the sum of the
    senders' parts sent to that server (a flipped byte, a wrong or missing box)."""
    want: dict[str, int] = {}
    for p in pushes:
        for name, s in p.sketches.items():
            want[name] = (want.get(name, 0) + s) & _MASK
    bad = [n for n, s in want.items() if n not in status or status[n].sketch != s]
    bad += [n for n in status if n not in want and status[n].received]
    if bad:
        raise IntegrityError(
            f"sketch mismatch (the server holds other bytes than were sent) for tensors: {sorted(bad)}"
        )


def _switch(clients: Sequence[Client], set_id: int, flags: int) -> list[SwitchReply]:
    """SWITCH sent to every server first, then every reply read: the servers switch within one
    round trip of one another."""
    conns = [_connection(c) for c in clients]
    for c, conn in zip(clients, conns, strict=True):
        if conn.minor < SWITCH_SINCE:
            raise OptionError(f"server {c.address}: it cannot hold a set (protocol minor {SWITCH_SINCE} needed)")
    for conn in conns:
        conn.send(conn.frame(Switch(set_id, flags)))
    return [conn.expect(SwitchReply) for conn in conns]


def abort_all(clients: Sequence[Client], set_id: int) -> list[SwitchReply]:
    """Drop the held set ``set_id`` on every server (SWITCH with ABORT): its tensors are released
    unpublished, each server keeps the version it showed. A server where no such set is open
    answers ``ok`` false; nothing changes there."""
    return _switch(clients, set_id, Switch.FLAG_ABORT)


def switch_all(
    clients: Sequence[Client],
    set_id: int,
    names: Sequence[str],
    pushes: Sequence[Sequence[ShardPush]],
    *,
    timeout: float = 30.0,
) -> list[int]:
    """The coordinator's half of a two-phase switch: every receiver of one update shows it, or
    none does. ``clients``: one per server; ``pushes[i]``: what every sender's
    :func:`push_shards` (with this ``set_id``) did to server ``i``; ``names``: the update's tensors.

    Waits up to ``timeout`` seconds for each server to hold the complete set, checks each one's
    sketches against the senders' (:func:`check_sketches`), and only when every server passes
    sends SWITCH to all of them; each switches its set in at once. Returns each server's store
    generation after its switch. Where a server does not get there (a sender died: TransportTimeout;
    other bytes than were sent: IntegrityError; a refused region: RemoteProtocolError) the set is
    dropped on every server (:func:`abort_all`) and the error raised: every receiver keeps the old
    version. A SWITCH refused after the checks passed (a server restarted, or another update replaced
    the set meanwhile) raises RemoteProtocolError naming which servers switched and which did not."""
    if len(pushes) != len(clients):
        raise OptionError(f"switch_all: {len(clients)} servers but pushes for {len(pushes)}")
    if not 0 < set_id < 1 << 64:
        raise OptionError(f"set_id must be in (0, 2**64), got {set_id}")
    end = time.monotonic() + timeout
    try:
        for client, sent in zip(clients, pushes, strict=True):
            status = server_sketches(client, names, timeout=max(0.0, end - time.monotonic()), set_id=set_id)
            try:
                check_sketches(sent, status)
            except IntegrityError as e:
                raise IntegrityError(f"server {client.address}: {e}") from None
    except BaseException:
        try:
            abort_all(clients, set_id)
        except Exception:  # noqa: S110 - the first error is the one to raise; a server that cannot be reached drops the set when its senders are gone
            pass
        raise
    replies = _switch(clients, set_id, 0)
    failed = [(c.address, r.message) for c, r in zip(clients, replies, strict=True) if not r.ok]
    if failed:
        done = [c.address for c, r in zip(clients, replies, strict=True) if r.ok]
        raise RemoteProtocolError(
            f"set {set_id}: switched on {done}, refused by " + "; ".join(f"{a}: {m}" for a, m in failed)
        )
    return [r.generation for r in replies]
