"""Incremental decoding of frames, with no I/O (encoding is in ``encode``).

Theory of operation: a :class:`Decoder` is fed whatever bytes arrived, in any fragmentation,
and ``next_event()`` returns a message once its whole frame is buffered, or ``NEED_DATA``.
After a payload-bearing header it switches to payload mode: ``bytes_wanted()`` says how many
payload bytes are still due, and the caller either receives them straight into its own buffer
and reports them with ``payload_received(n)`` (the fast path: the decoder never sees them), or
feeds them and gets :class:`Payload` events. ``bytes_wanted()`` never asks past the end of the
current frame, so a caller that reads exactly that many bytes never over-reads a socket.

Every count and length is checked against a named limit before anything is sized from it; any
violation raises RemoteProtocolError (the peer's fault) and the decoder stays failed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

from weightlift.dtypes import DTYPES, byte_length
from weightlift.errors import LocalProtocolError, RemoteProtocolError, WeightliftError
from weightlift.remote.protocol.messages import (
    BARRIER_DIGEST_LAYOUT,
    BARRIER_NEED_LAYOUT,
    CLIENT_COMMANDS,
    COMMAND_SINCE,
    DIGEST_SIZE,
    DIM_LAYOUT,
    FIGURE_VALUE_LAYOUT,
    FLAGS_LAYOUT,
    HELLO_LAYOUT_PREVIOUS,
    ID_LAYOUT,
    LAYOUT_HEAD,
    MAX_DIGESTS,
    MAX_DIMS,
    MAX_ERRORS,
    MAX_FIGURE_NAME,
    MAX_FIGURES,
    MAX_FRAME,
    MAX_HOPS,
    MAX_MESSAGE,
    MAX_MODEL_NAME,
    MAX_MODELS,
    MAX_NAME,
    MAX_REGION_BYTES,
    MAX_TENSOR_BYTES,
    MAX_TENSORS,
    MODEL_STATS_LAYOUT,
    NAME_LAYOUT,
    PART_COUNT_LAYOUT,
    PLACEMENT_LAYOUT,
    PREFIX,
    PROTOCOL_MINOR,
    SERVER_COMMANDS,
    SET_LAYOUT,
    SKETCH_ENTRY_LAYOUT,
    Alloc,
    Auth,
    Barrier,
    BarrierReply,
    Bye,
    Command,
    Commit,
    CommitReply,
    Delta,
    Error,
    Expect,
    FillFromCache,
    Free,
    FreeReply,
    Have,
    HaveReply,
    Hello,
    LayoutReply,
    LayoutRequest,
    ListEntry,
    ListReply,
    ListRequest,
    Message,
    ModelStats,
    Read,
    ReadReply,
    Region,
    Relay,
    RelayEnd,
    RelayReply,
    Remove,
    SketchEntry,
    SketchReply,
    SketchRequest,
    Stats,
    StatsReply,
    Switch,
    SwitchReply,
    Update,
    UseModel,
    WriteHeader,
)

__all__ = ["Decoder", "Payload", "NEED_DATA", "Event"]

_DTYPE_NAMES = [d.name for d in DTYPES]


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData()
"""``next_event()`` returns this when the buffered bytes do not yet complete an event."""


@dataclass(frozen=True, slots=True)
class Payload:
    """Payload bytes that were fed to the decoder (the slow path; see ``payload_received``)."""

    data: bytes


Event = Message | Payload | _NeedData


class _Reader:
    """Cursor over one frame body; every take is bounds-checked and names the command."""

    __slots__ = ("buf", "pos", "cmd")

    def __init__(self, buf: memoryview, cmd: Command):
        self.buf = buf
        self.pos = 0
        self.cmd = cmd

    @property
    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def fail(self, why: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"{self.cmd.name}: {why}")

    def take(self, n: int, what: str) -> memoryview:
        if n > self.remaining:
            raise self.fail(f"{what} needs {n} bytes at body offset {self.pos}; the body has {self.remaining} left")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, layout: struct.Struct, what: str) -> tuple[Any, ...]:
        return layout.unpack(self.take(layout.size, what))

    def count(self, layout: struct.Struct, item_size: int, limit: int, what: str) -> int:
        n: int = self.unpack(layout, f"{what} count")[0]
        if n > limit:
            raise self.fail(f"{n} {what} exceed the limit of {limit}")
        if n * item_size > self.remaining:
            raise self.fail(f"{n} {what} need at least {n * item_size} bytes; the body has {self.remaining} left")
        return n

    def text(self, n: int, limit: int, what: str, *, empty_ok: bool = False) -> str:
        if n > limit:
            raise self.fail(f"{what} is {n} bytes; the limit is {limit}")
        if n == 0 and not empty_ok:
            raise self.fail(f"{what} is empty")
        try:
            return str(self.take(n, what), "utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def name(self, what: str = "name", *, empty_ok: bool = False, limit: int = MAX_NAME) -> str:
        (n,) = self.unpack(NAME_LAYOUT, f"{what} length")
        return self.text(n, limit, what, empty_ok=empty_ok)

    def dtype(self, code: int) -> str:
        if code >= len(_DTYPE_NAMES):
            raise self.fail(f"unknown dtype code {code}")
        return _DTYPE_NAMES[code]

    def shape(self, ndims: int) -> tuple[int, ...]:
        if ndims > MAX_DIMS:
            raise self.fail(f"{ndims} dimensions exceed the limit of {MAX_DIMS}")
        raw = self.take(ndims * DIM_LAYOUT.size, "dims")
        return struct.unpack(f"<{ndims}Q", raw)

    def sized(self, dtype: str, shape: tuple[int, ...], nbytes: int, limit: int, what: str) -> None:
        try:
            expected = byte_length(dtype, shape)
        except WeightliftError:
            raise self.fail(f"{what}: {dtype} {shape} is not a whole number of bytes") from None
        if expected != nbytes:
            raise self.fail(f"{what}: {dtype} {shape} is {expected} bytes, not {nbytes}")
        if nbytes > limit:
            raise self.fail(f"{what}: {nbytes} bytes exceed the limit of {limit}")


def _dec_hello(r: _Reader, lim: _Limits) -> Hello:
    major, minor, flags, max_frame, max_tensor, nonce = r.unpack(HELLO_LAYOUT_PREVIOUS, "HELLO")
    max_memory = 0
    if r.remaining >= DIM_LAYOUT.size:  # appended in minor 1; an older peer leaves the default
        (max_memory,) = r.unpack(DIM_LAYOUT, "max_memory")
    return Hello(major, minor, flags, max_frame, max_tensor, bytes(nonce), max_memory)


def _dec_alloc(r: _Reader, lim: _Limits) -> Alloc:
    tid, code, ndims, flags, nbytes, name_len = r.unpack(Alloc.LAYOUT, "ALLOC head")
    dtype = r.dtype(code)
    name = r.text(name_len, MAX_NAME, "tensor name")
    shape = r.shape(ndims)
    r.sized(dtype, shape, nbytes, lim.max_tensor_bytes, f"tensor {name!r}")
    digest = bytes(r.take(DIGEST_SIZE, "digest")) if flags & Alloc.FLAG_DIGEST else None
    return Alloc(tid, name, dtype, shape, nbytes, digest, bool(flags & Alloc.FLAG_VERIFY))


def _dec_write(r: _Reader, lim: _Limits) -> WriteHeader:
    tid, offset, length = r.unpack(WriteHeader.LAYOUT, "WRITE head")
    if offset + length > lim.max_tensor_bytes:
        raise r.fail(f"bytes [{offset}, {offset + length}) exceed the tensor limit of {lim.max_tensor_bytes}")
    return WriteHeader(tid, offset, length)


def _dec_have(r: _Reader, lim: _Limits) -> Have:
    n = r.count(Have.LAYOUT, DIGEST_SIZE, MAX_TENSORS, "digests")
    raw = bytes(r.take(n * DIGEST_SIZE, "digests"))
    return Have(tuple(raw[i : i + DIGEST_SIZE] for i in range(0, len(raw), DIGEST_SIZE)))


def _dec_have_reply(r: _Reader, lim: _Limits) -> HaveReply:
    (n,) = r.unpack(HaveReply.LAYOUT, "bit count")
    if n > MAX_TENSORS:
        raise r.fail(f"{n} bits exceed the limit of {MAX_TENSORS}")
    bits = r.take((n + 7) // 8, "bitmap")
    return HaveReply(tuple(bool(bits[i >> 3] >> (i & 7) & 1) for i in range(n)))


def _dec_read(r: _Reader, lim: _Limits) -> Read:
    offset, length, name_len = r.unpack(Read.LAYOUT, "READ head")
    name = r.text(name_len, MAX_NAME, "tensor name")
    if offset + length > lim.max_tensor_bytes:
        raise r.fail(f"bytes [{offset}, {offset + length}) exceed the tensor limit of {lim.max_tensor_bytes}")
    flags = r.unpack(FLAGS_LAYOUT, "READ flags")[0] if r.remaining else 0  # appended in minor 2
    version = r.unpack(DIM_LAYOUT, "READ version")[0] if r.remaining else 0  # appended in minor 2
    generation = r.unpack(DIM_LAYOUT, "READ generation")[0] if r.remaining else 0  # appended in minor 3
    return Read(name, offset, length, flags, version, generation)


def _dec_read_reply(r: _Reader, lim: _Limits) -> ReadReply:
    (length,) = r.unpack(ReadReply.LAYOUT, "length")
    if length > lim.max_tensor_bytes:
        raise r.fail(f"{length} payload bytes exceed the tensor limit of {lim.max_tensor_bytes}")
    digest = None
    if r.remaining:  # appended in minor 2
        (flags,) = r.unpack(FLAGS_LAYOUT, "READ_REPLY flags")
        if flags & 1:
            digest = bytes(r.take(DIGEST_SIZE, "READ_REPLY digest"))
    return ReadReply(length, digest)


def _dec_list_reply(r: _Reader, lim: _Limits) -> ListReply:
    more, n = r.unpack(ListReply.LAYOUT, "LIST_REPLY head")
    if n > MAX_TENSORS:
        raise r.fail(f"{n} entries exceed the limit of {MAX_TENSORS}")
    entries = []
    for _ in range(n):
        name_len, code, ndims, nbytes = r.unpack(ListEntry.LAYOUT, "entry head")
        dtype = r.dtype(code)
        name = r.text(name_len, MAX_NAME, "tensor name")
        shape = r.shape(ndims)
        r.sized(dtype, shape, nbytes, MAX_TENSOR_BYTES, f"tensor {name!r}")
        entries.append(ListEntry(name, dtype, shape, nbytes))
    if r.remaining and entries:  # appended in minor 2: one version per entry
        entries = [
            ListEntry(e.name, e.dtype, e.shape, e.nbytes, r.unpack(DIM_LAYOUT, "entry version")[0]) for e in entries
        ]
    generation = r.unpack(DIM_LAYOUT, "LIST_REPLY generation")[0] if r.remaining else 0  # appended in minor 3
    return ListReply(tuple(entries), bool(more), generation)


def _dec_free(r: _Reader, lim: _Limits) -> Free:
    n = r.count(Free.LAYOUT, NAME_LAYOUT.size + 1, MAX_TENSORS, "names")
    return Free(tuple(r.name("tensor name") for _ in range(n)))


def _dec_barrier_reply(r: _Reader, lim: _Limits) -> BarrierReply:
    tensors, nbytes, n_err = r.unpack(BarrierReply.LAYOUT, "BARRIER_REPLY head")
    if n_err > MAX_ERRORS:
        raise r.fail(f"{n_err} errors exceed the limit of {MAX_ERRORS}")
    errors = tuple(r.name("error message", limit=MAX_MESSAGE) for _ in range(n_err))
    need: tuple[int, ...] = ()
    if r.remaining:  # appended in minor 1
        n = r.count(BARRIER_NEED_LAYOUT, ID_LAYOUT.size, MAX_TENSORS, "needed tensors")
        need = struct.unpack(f"<{n}I", r.take(n * ID_LAYOUT.size, "need list"))
    digests: tuple[tuple[int, bytes], ...] = ()
    if r.remaining:  # appended in minor 2
        n = r.count(BARRIER_NEED_LAYOUT, BARRIER_DIGEST_LAYOUT.size, MAX_DIGESTS, "digests")
        raw = r.take(n * BARRIER_DIGEST_LAYOUT.size, "digest list")
        digests = tuple((i, bytes(d)) for i, d in BARRIER_DIGEST_LAYOUT.iter_unpack(raw))
    return BarrierReply(tensors, nbytes, errors, need, digests)


def _dec_delta(r: _Reader, lim: _Limits) -> Delta:
    tid, code, ndims, encoding, flags, nbytes, length, base, digest, name_len = r.unpack(Delta.LAYOUT, "DELTA head")
    dtype = r.dtype(code)
    name = r.text(name_len, MAX_NAME, "tensor name")
    shape = r.shape(ndims)
    r.sized(dtype, shape, nbytes, lim.max_tensor_bytes, f"tensor {name!r}")
    if length > lim.max_tensor_bytes:
        raise r.fail(f"{length} payload bytes exceed the tensor limit of {lim.max_tensor_bytes}")
    verify = bool(flags & Delta.FLAG_VERIFY)
    return Delta(tid, name, dtype, shape, nbytes, encoding, bytes(base), bytes(digest), length, verify)


def _dec_commit_reply(r: _Reader, lim: _Limits) -> CommitReply:
    ok, tensors, generation, root, n = r.unpack(CommitReply.LAYOUT, "COMMIT_REPLY head")
    return CommitReply(bool(ok), tensors, generation, bytes(root), r.text(n, MAX_MESSAGE, "message", empty_ok=True))


def _dec_update(r: _Reader, lim: _Limits) -> Update:
    (flags,) = r.unpack(Update.LAYOUT, "UPDATE flags")
    push = r.unpack(DIM_LAYOUT, "UPDATE push id")[0] if r.remaining else 0  # appended in minor 5
    return Update(flags, push)


def _model(r: _Reader) -> str:
    name = r.name("model name", empty_ok=True, limit=MAX_MODEL_NAME)
    if "\x00" in name:
        raise r.fail("model name holds a NUL character")
    return name


def _dec_stats_reply(r: _Reader, lim: _Limits) -> StatsReply:
    n_fig, n_models, total = r.unpack(StatsReply.LAYOUT, "STATS_REPLY head")
    if n_fig > MAX_FIGURES:
        raise r.fail(f"{n_fig} figures exceed the limit of {MAX_FIGURES}")
    if n_models > MAX_MODELS:
        raise r.fail(f"{n_models} models exceed the limit of {MAX_MODELS}")
    if total < n_models:
        raise r.fail(f"{total} models counted, {n_models} described")
    figures = []
    for _ in range(n_fig):
        key = r.name("figure name", limit=MAX_FIGURE_NAME)
        figures.append((key, r.unpack(FIGURE_VALUE_LAYOUT, "figure value")[0]))
    models = []
    for _ in range(n_models):
        tensors, nbytes, flags, n = r.unpack(MODEL_STATS_LAYOUT, "model head")
        name = r.text(n, MAX_MODEL_NAME, "model name", empty_ok=True)
        if "\x00" in name:
            raise r.fail("model name holds a NUL character")
        models.append(ModelStats(name, tensors, nbytes, bool(flags & 1)))
    return StatsReply(tuple(figures), tuple(models), total)


def _dec_relay(r: _Reader, lim: _Limits) -> Relay:
    n = r.count(Relay.LAYOUT, NAME_LAYOUT.size + 1, MAX_HOPS, "relay hops")
    if n == 0:
        raise r.fail("RELAY names no hop")
    return Relay(tuple(r.name("relay hop") for _ in range(n)))


def _dec_relay_reply(r: _Reader, lim: _Limits) -> RelayReply:
    ok, tensors, nbytes, n = r.unpack(RelayReply.LAYOUT, "RELAY_REPLY head")
    failed = r.text(n, MAX_NAME, "relay hop", empty_ok=True)
    message = r.name("message", empty_ok=True, limit=MAX_MESSAGE)
    count = r.count(Relay.LAYOUT, NAME_LAYOUT.size + 1, MAX_HOPS, "skipped hops")
    return RelayReply(bool(ok), tensors, nbytes, failed, message, tuple(r.name("skipped hop") for _ in range(count)))


def _dec_error(r: _Reader, lim: _Limits) -> Error:
    code, n = r.unpack(Error.LAYOUT, "ERROR head")
    return Error(code, r.text(n, MAX_MESSAGE, "message", empty_ok=True))


def _dec_layout_reply(r: _Reader, lim: _Limits) -> LayoutReply:
    rank, world, flags, has, dim, n_rules, n_parts = r.unpack(LAYOUT_HEAD, "LAYOUT_REPLY head")
    if world and rank >= world:
        raise r.fail(f"rank {rank} of a world of {world}")
    for n, what in ((n_rules, "rules"), (n_parts, "fused tensors")):
        if n > MAX_TENSORS or n * (NAME_LAYOUT.size + 1) > r.remaining:
            raise r.fail(f"{n} {what} exceed the limit of {MAX_TENSORS} or the body")
    rules = []
    for _ in range(n_rules):
        pattern = r.name("shard rule pattern")
        d_has, d = r.unpack(PLACEMENT_LAYOUT, "rule placement")
        rules.append((pattern, d if d_has else None))
    parts = []
    for _ in range(n_parts):
        name = r.name("fused tensor name")
        (k,) = r.unpack(PART_COUNT_LAYOUT, "part count")
        parts.append((name, r.shape(k)))
    uneven = "error" if flags & LayoutReply.FLAG_UNEVEN_ERROR else "chunk"
    return LayoutReply(rank, world, tuple(rules), dim if has else None, uneven, tuple(parts))


def _dec_region(r: _Reader, lim: _Limits) -> Region:
    code, ndims, _flags, length, name_len = r.unpack(Region.LAYOUT, "REGION head")
    dtype = r.dtype(code)
    name = r.text(name_len, MAX_NAME, "tensor name")
    shape, start, stop = r.shape(ndims), r.shape(ndims), r.shape(ndims)
    try:
        full = byte_length(dtype, shape)
    except WeightliftError:
        raise r.fail(f"tensor {name!r}: {dtype} {shape} is not a whole number of bytes") from None
    # the unsharded tensor is never held here, only the server's slice of it (charged as it is
    # made): the protocol's bound, not the server's memory, which a slice of it may well fit
    if full > MAX_TENSOR_BYTES:
        raise r.fail(f"tensor {name!r}: {full} bytes exceed the limit of {MAX_TENSOR_BYTES}")
    for k, (a, b, n) in enumerate(zip(start, stop, shape, strict=True)):
        if not a <= b <= n:
            raise r.fail(f"tensor {name!r}: dimension {k} of the box, [{a}, {b}), is not inside [0, {n})")
    ext = tuple(b - a for a, b in zip(start, stop, strict=True))
    r.sized(dtype, ext, length, MAX_REGION_BYTES, f"tensor {name!r}: box {list(start)}..{list(stop)}")
    return Region(name, dtype, shape, start, stop, length)


def _dec_sketch_reply(r: _Reader, lim: _Limits) -> SketchReply:
    n, n_err = r.unpack(SketchReply.LAYOUT, "SKETCH_REPLY head")
    if n > MAX_TENSORS or n_err > MAX_ERRORS:
        raise r.fail(f"{n} entries or {n_err} errors exceed the limits ({MAX_TENSORS}, {MAX_ERRORS})")
    entries = []
    for _ in range(n):
        name = r.name("tensor name")
        complete, received, needed, sk = r.unpack(SKETCH_ENTRY_LAYOUT, "sketch entry")
        entries.append(SketchEntry(name, bool(complete), received, needed, sk))
    errors = tuple(r.name("error message", limit=MAX_MESSAGE) for _ in range(n_err))
    state, set_id = r.unpack(SET_LAYOUT, "SKETCH_REPLY set") if r.remaining else (0, 0)  # appended in minor 7
    if state > SketchReply.SET_HELD:
        raise r.fail(f"set state {state} is none of 0 (none), 1 (open), 2 (held)")
    return SketchReply(tuple(entries), errors, state, set_id)


def _dec_expect(r: _Reader, lim: _Limits) -> Expect:
    names = _names(r, Expect.LAYOUT)
    flags, set_id = r.unpack(SET_LAYOUT, "EXPECT set") if r.remaining else (0, 0)  # appended in minor 7
    if flags & ~Expect.FLAG_HOLD:
        raise r.fail(f"unknown flags {flags:#x}")
    if flags & Expect.FLAG_HOLD and not set_id:
        raise r.fail("a held set (HOLD) needs a non-zero set id")
    return Expect(names, flags, set_id)


def _dec_switch(r: _Reader, lim: _Limits) -> Switch:
    flags, set_id = r.unpack(SET_LAYOUT, "SWITCH head")
    if flags & ~Switch.FLAG_ABORT:
        raise r.fail(f"unknown flags {flags:#x}")
    if not set_id:
        raise r.fail("set id 0 names no set")
    return Switch(set_id, flags)


def _dec_switch_reply(r: _Reader, lim: _Limits) -> SwitchReply:
    ok, tensors, generation, n = r.unpack(SwitchReply.LAYOUT, "SWITCH_REPLY head")
    return SwitchReply(bool(ok), tensors, generation, r.text(n, MAX_MESSAGE, "message", empty_ok=True))


def _names(r: _Reader, layout: struct.Struct) -> tuple[str, ...]:
    n = r.count(layout, NAME_LAYOUT.size + 1, MAX_TENSORS, "names")
    return tuple(r.name("tensor name") for _ in range(n))


@dataclass(frozen=True, slots=True)
class _Limits:
    max_frame: int
    max_tensor_bytes: int


_DECODERS: dict[Command, Callable[[_Reader, _Limits], Message]] = {
    Command.HELLO: _dec_hello,
    Command.AUTH: lambda r, lim: Auth(bytes(r.take(DIGEST_SIZE, "mac"))),
    Command.ALLOC: _dec_alloc,
    Command.WRITE: _dec_write,
    Command.HAVE: _dec_have,
    Command.HAVE_REPLY: _dec_have_reply,
    Command.FILL_FROM_CACHE: lambda r, lim: FillFromCache(*r.unpack(FillFromCache.LAYOUT, "FILL_FROM_CACHE")),
    Command.READ: _dec_read,
    Command.READ_REPLY: _dec_read_reply,
    Command.LIST: lambda r, lim: ListRequest(r.name("LIST cursor", empty_ok=True)),
    Command.LIST_REPLY: _dec_list_reply,
    Command.FREE: _dec_free,
    Command.FREE_REPLY: lambda r, lim: FreeReply(*r.unpack(FreeReply.LAYOUT, "FREE_REPLY")),
    Command.BARRIER: lambda r, lim: Barrier(r.unpack(FLAGS_LAYOUT, "BARRIER flags")[0] if r.remaining else 0),
    Command.BARRIER_REPLY: _dec_barrier_reply,
    Command.ERROR: _dec_error,
    Command.BYE: lambda r, lim: Bye(),
    Command.DELTA: _dec_delta,
    Command.UPDATE: _dec_update,
    Command.COMMIT: lambda r, lim: Commit(*r.unpack(Commit.LAYOUT, "COMMIT flags")),
    Command.COMMIT_REPLY: _dec_commit_reply,
    Command.STATS: lambda r, lim: Stats(),
    Command.STATS_REPLY: _dec_stats_reply,
    Command.MODEL: lambda r, lim: UseModel(_model(r)),
    Command.REMOVE: lambda r, lim: Remove(_model(r)),
    Command.LAYOUT: lambda r, lim: LayoutRequest(),
    Command.LAYOUT_REPLY: _dec_layout_reply,
    Command.REGION: _dec_region,
    Command.SKETCH: lambda r, lim: SketchRequest(
        _names(r, SketchRequest.LAYOUT), r.unpack(FLAGS_LAYOUT, "SKETCH flags")[0] if r.remaining else 0
    ),
    Command.EXPECT: _dec_expect,
    Command.SKETCH_REPLY: _dec_sketch_reply,
    Command.RELAY: _dec_relay,
    Command.RELAY_END: lambda r, lim: RelayEnd(),
    Command.RELAY_REPLY: _dec_relay_reply,
    Command.SWITCH: _dec_switch,
    Command.SWITCH_REPLY: _dec_switch_reply,
}


class Decoder:
    """Incremental frame decoder for one direction of one connection.

    ``our_role`` is the side doing the decoding: a server's decoder accepts only client commands
    and vice versa. ``minor`` is the minor this side speaks: commands added later are unknown to
    it, exactly as they would be to an older implementation.
    """

    def __init__(
        self,
        *,
        our_role: Literal["client", "server"],
        minor: int = PROTOCOL_MINOR,
        max_frame: int = MAX_FRAME,
        max_tensor_bytes: int = MAX_TENSOR_BYTES,
    ):
        if our_role not in ("client", "server"):
            raise LocalProtocolError(f"our_role must be 'client' or 'server', not {our_role!r}")
        peer = CLIENT_COMMANDS if our_role == "server" else SERVER_COMMANDS
        self._accept = frozenset(c for c in peer if COMMAND_SINCE[c] <= minor)
        self._limits = _Limits(min(max_frame, MAX_FRAME), min(max_tensor_bytes, MAX_TENSOR_BYTES))
        self._buf = bytearray()
        self._frame_len = -1  # body length of the frame being assembled, once its prefix is in
        self._cmd: Command | None = None
        self._payload_left = 0
        self._failed: RemoteProtocolError | None = None

    @property
    def payload_remaining(self) -> int:
        """Payload bytes of the current WRITE / READ_REPLY not yet delivered (0 between frames)."""
        return self._payload_left

    @property
    def buffered(self) -> int:
        """Bytes fed and not yet taken out as messages or payload."""
        return len(self._buf)

    @property
    def at_boundary(self) -> bool:
        """True between frames with nothing buffered: the peer may close here cleanly."""
        return not self._buf and self._payload_left == 0 and self._frame_len < 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer bytes as they arrived; nothing is decoded until ``next_event()``."""
        self._buf += data

    def bytes_wanted(self) -> int:
        """How many more bytes complete the next step, never counting past the current frame."""
        if self._payload_left:
            return max(0, self._payload_left - len(self._buf))
        if self._frame_len < 0:
            if len(self._buf) < PREFIX.size:
                return PREFIX.size - len(self._buf)
            return max(0, PREFIX.size + self._peek_length() - len(self._buf))
        return max(0, PREFIX.size + self._frame_len - len(self._buf))

    def complete_frame(self) -> Command | None:
        """The command of a frame whose prefix and body are all buffered but not yet decoded, else
        None: a protected connection checks the frame's MAC here, before its body is parsed."""
        if self._failed is not None or self._payload_left or len(self._buf) < PREFIX.size:
            return None
        code, n = PREFIX.unpack_from(self._buf)
        cmd = self._check_prefix(code, n)
        return cmd if len(self._buf) >= PREFIX.size + n else None

    def _peek_length(self) -> int:
        code: int
        n: int
        code, n = PREFIX.unpack_from(self._buf)
        self._check_prefix(code, n)
        return n

    def _check_prefix(self, code: int, n: int) -> Command:
        try:
            cmd = Command(code)
        except ValueError:
            raise self._fail(f"unknown command {code}") from None
        if cmd not in self._accept:
            raise self._fail(f"command {cmd.name} is not valid in this direction or minor")
        if n > self._limits.max_frame:
            raise self._fail(f"{cmd.name} body of {n} bytes exceeds the frame limit of {self._limits.max_frame}")
        return cmd

    def _fail(self, why: str) -> RemoteProtocolError:
        self._failed = RemoteProtocolError(why)
        return self._failed

    def next_event(self) -> Event:
        """The next message, a :class:`Payload` chunk, or NEED_DATA; RemoteProtocolError on a bad frame."""
        if self._failed is not None:
            raise self._failed
        if self._payload_left:
            if not self._buf:
                return NEED_DATA
            n = min(len(self._buf), self._payload_left)
            chunk = bytes(self._buf[:n])
            del self._buf[:n]
            self._payload_left -= n
            return Payload(chunk)
        if self._frame_len < 0:
            if len(self._buf) < PREFIX.size:
                return NEED_DATA
            code, n = PREFIX.unpack_from(self._buf)
            self._cmd = self._check_prefix(code, n)
            self._frame_len = n
        end = PREFIX.size + self._frame_len
        if len(self._buf) < end:
            return NEED_DATA
        cmd = self._cmd
        assert cmd is not None
        with memoryview(self._buf) as view:
            body = view[PREFIX.size : end]
            try:
                msg = _DECODERS[cmd](_Reader(body, cmd), self._limits)
            except RemoteProtocolError as e:
                self._failed = e
                raise
            except struct.error as e:  # a layout and its bounds check disagree: still the peer's bytes
                raise self._fail(f"{cmd.name}: {e}") from None
            finally:
                body.release()
        del self._buf[:end]
        self._frame_len = -1
        self._cmd = None
        if msg.HAS_PAYLOAD:
            self._payload_left = msg.length  # type: ignore[attr-defined]
        return msg

    def payload_into(self, dest: memoryview) -> int:
        """Move already-buffered payload bytes into ``dest``; returns how many (maybe 0)."""
        n = min(len(self._buf), self._payload_left, len(dest))
        if n:
            dest[:n] = self._buf[:n]
            del self._buf[:n]
            self._payload_left -= n
        return n

    def payload_received(self, n: int) -> None:
        """Account for ``n`` payload bytes the caller received itself, bypassing the decoder."""
        if self._buf and self._payload_left:
            raise LocalProtocolError("payload bytes are buffered in the decoder; take them with payload_into first")
        if n < 0 or n > self._payload_left:
            raise LocalProtocolError(f"{n} payload bytes reported; {self._payload_left} were due")
        self._payload_left -= n
