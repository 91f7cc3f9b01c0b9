"""Encoding frames: a message becomes the bytes of its prefix and body, with no I/O.

``send(msg)`` lays a message out for the negotiated minor (the fields that minor knows, in the
order the wire spec in :mod:`~weightlift.remote.protocol.messages` gives); a payload (WRITE,
READ_REPLY) is never copied in - the caller sends it after the header from wherever it lies.
A message that cannot be encoded (a field out of range, a name over its limit, a command the
peer's minor lacks, a body over the peer's frame limit) raises LocalProtocolError: the fault is
ours, and nothing was sent. Decoding is in ``decode``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from weightlift.dtypes import CODES
from weightlift.errors import LocalProtocolError
from weightlift.remote.protocol.messages import (
    BARRIER_DIGEST_LAYOUT,
    BARRIER_NEED_LAYOUT,
    COMMAND_SINCE,
    DIGEST_SIZE,
    DIM_LAYOUT,
    FIGURE_VALUE_LAYOUT,
    FLAGS_LAYOUT,
    HELLO_LAYOUT,
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
    MAX_TENSORS,
    MODEL_STATS_LAYOUT,
    NAME_LAYOUT,
    NONCE_SIZE,
    PART_COUNT_LAYOUT,
    PLACEMENT_LAYOUT,
    PREFIX,
    PROTOCOL_MINOR,
    SET_LAYOUT,
    SKETCH_ENTRY_LAYOUT,
    SWITCH_SINCE,
    Alloc,
    Auth,
    Barrier,
    BarrierReply,
    Bye,
    Commit,
    CommitReply,
    Delta,
    DeltaEncoding,
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
    Read,
    ReadReply,
    Region,
    Relay,
    RelayEnd,
    RelayReply,
    Remove,
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

__all__ = ["send", "model_name"]


def _name(s: str, what: str) -> bytes:
    raw = s.encode("utf-8")
    if len(raw) > MAX_NAME:
        raise LocalProtocolError(f"{what} is {len(raw)} bytes; the limit is {MAX_NAME}")
    return NAME_LAYOUT.pack(len(raw)) + raw


def _dims(shape: tuple[int, ...]) -> bytes:
    if len(shape) > MAX_DIMS:
        raise LocalProtocolError(f"shape {shape} has more than {MAX_DIMS} dimensions")
    return b"".join(DIM_LAYOUT.pack(d) for d in shape)


def _code(dtype: str) -> int:
    try:
        return CODES[dtype]
    except KeyError:
        raise LocalProtocolError(f"dtype {dtype!r} has no wire code") from None


def _digest(d: bytes, what: str) -> bytes:
    if len(d) != DIGEST_SIZE:
        raise LocalProtocolError(f"{what} is {len(d)} bytes, not {DIGEST_SIZE}")
    return bytes(d)


def _enc_hello(m: Hello, minor: int) -> bytes:
    if len(m.nonce) != NONCE_SIZE:
        raise LocalProtocolError(f"HELLO nonce is {len(m.nonce)} bytes, not {NONCE_SIZE}")
    head = (m.major, m.minor, m.flags, m.max_frame, m.max_tensor_bytes, m.nonce)
    # A HELLO is laid out for the minor it announces: that is the only minor its reader can assume.
    if m.minor < 1:
        return HELLO_LAYOUT_PREVIOUS.pack(*head)
    return HELLO_LAYOUT.pack(*head, m.max_memory)


def _since(minor: int, needed: int, what: str) -> None:
    if minor < needed:
        raise LocalProtocolError(f"{what} requires minor {needed}; peer speaks {minor}")


def _enc_alloc(m: Alloc, minor: int) -> bytes:
    flags = Alloc.FLAG_DIGEST if m.digest is not None else 0
    if m.verify:
        _since(minor, 2, "ALLOC's VERIFY flag")
        flags |= Alloc.FLAG_VERIFY
    if any(d < 0 for d in m.shape) or m.nbytes < 0:
        raise LocalProtocolError(f"ALLOC {m.name!r}: negative shape {m.shape} or size {m.nbytes}")
    name = _name(m.name, "tensor name")
    out = Alloc.LAYOUT.pack(m.tensor_id, _code(m.dtype), len(m.shape), flags, m.nbytes, len(name) - 2)
    out += name[2:] + _dims(m.shape)
    if m.digest is not None:
        out += _digest(m.digest, "ALLOC digest")
    return out


def _enc_have(m: Have, minor: int) -> bytes:
    if len(m.digests) > MAX_TENSORS:
        raise LocalProtocolError(f"HAVE asks about {len(m.digests)} digests; the limit is {MAX_TENSORS}")
    return Have.LAYOUT.pack(len(m.digests)) + b"".join(_digest(d, "HAVE digest") for d in m.digests)


def _enc_have_reply(m: HaveReply, minor: int) -> bytes:
    bits = bytearray((len(m.have) + 7) // 8)
    for i, h in enumerate(m.have):
        if h:
            bits[i >> 3] |= 1 << (i & 7)
    return HaveReply.LAYOUT.pack(len(m.have)) + bytes(bits)


def _enc_read(m: Read, minor: int) -> bytes:
    name = _name(m.name, "tensor name")
    out = Read.LAYOUT.pack(m.offset, m.length, len(name) - 2) + name[2:]
    if minor >= 3:
        return out + FLAGS_LAYOUT.pack(m.flags) + DIM_LAYOUT.pack(m.version) + DIM_LAYOUT.pack(m.generation)
    if m.generation:
        _since(minor, 3, "READ generation")
    if minor >= 2:
        return out + FLAGS_LAYOUT.pack(m.flags) + DIM_LAYOUT.pack(m.version)
    if m.flags:
        _since(minor, 2, "READ flags")
    if m.version:
        _since(minor, 2, "READ version")
    return out


def _enc_read_reply(m: ReadReply, minor: int) -> bytes:
    out = ReadReply.LAYOUT.pack(m.length)
    if minor >= 2:
        if m.digest is None:
            return out + FLAGS_LAYOUT.pack(0)
        return out + FLAGS_LAYOUT.pack(1) + _digest(m.digest, "READ_REPLY digest")
    if m.digest is not None:
        _since(minor, 2, "READ_REPLY digest")
    return out


def _enc_barrier(m: Barrier, minor: int) -> bytes:
    if minor >= 2:
        return FLAGS_LAYOUT.pack(m.flags)
    if m.flags:
        _since(minor, 2, "BARRIER flags")
    return b""


def _enc_list_reply(m: ListReply, minor: int) -> bytes:
    parts = [ListReply.LAYOUT.pack(1 if m.more else 0, len(m.entries))]
    for e in m.entries:
        name = _name(e.name, "tensor name")
        parts.append(ListEntry.LAYOUT.pack(len(name) - 2, _code(e.dtype), len(e.shape), e.nbytes))
        parts.append(name[2:] + _dims(e.shape))
    if minor >= 2:  # an older peer cannot ask for a version: it is not told them
        parts.extend(DIM_LAYOUT.pack(e.version) for e in m.entries)
    if minor >= 3:
        parts.append(DIM_LAYOUT.pack(m.generation))
    return b"".join(parts)


def _text(s: str) -> bytes:
    # Error strings are advisory: cut at MAX_MESSAGE on a character boundary rather than refuse.
    raw = s.encode("utf-8")[:MAX_MESSAGE].decode("utf-8", "ignore").encode("utf-8")
    return NAME_LAYOUT.pack(len(raw)) + raw


def _enc_barrier_reply(m: BarrierReply, minor: int) -> bytes:
    if len(m.errors) > MAX_ERRORS:
        raise LocalProtocolError(f"BARRIER_REPLY carries {len(m.errors)} errors; the limit is {MAX_ERRORS}")
    out = BarrierReply.LAYOUT.pack(m.tensors, m.nbytes, len(m.errors))
    out += b"".join(_text(e) for e in m.errors)
    if minor >= 1:
        out += BARRIER_NEED_LAYOUT.pack(len(m.need)) + b"".join(ID_LAYOUT.pack(i) for i in m.need)
    elif m.need:
        raise LocalProtocolError("BARRIER_REPLY need list requires minor 1")
    if len(m.need) > MAX_TENSORS:
        raise LocalProtocolError(f"BARRIER_REPLY needs {len(m.need)} tensors; the limit is {MAX_TENSORS}")
    if len(m.digests) > MAX_DIGESTS:
        raise LocalProtocolError(f"BARRIER_REPLY carries {len(m.digests)} digests; the limit is {MAX_DIGESTS}")
    if minor >= 2:
        out += BARRIER_NEED_LAYOUT.pack(len(m.digests))
        out += b"".join(BARRIER_DIGEST_LAYOUT.pack(i, _digest(d, "BARRIER_REPLY digest")) for i, d in m.digests)
    elif m.digests:
        _since(minor, 2, "BARRIER_REPLY digests")
    return out


def _enc_delta(m: Delta, minor: int) -> bytes:
    if any(d < 0 for d in m.shape) or m.nbytes < 0 or m.length < 0:
        raise LocalProtocolError(f"DELTA {m.name!r}: negative shape {m.shape}, size or length")
    name = _name(m.name, "tensor name")
    if m.encoding == DeltaEncoding.PLANES:
        _since(minor, 4, "DELTA's PLANES encoding")
    flags = Delta.FLAG_VERIFY if m.verify else 0
    head = (m.tensor_id, _code(m.dtype), len(m.shape), m.encoding, flags, m.nbytes, m.length)
    digests = (_digest(m.base, "DELTA base digest"), _digest(m.digest, "DELTA digest"))
    return Delta.LAYOUT.pack(*head, *digests, len(name) - 2) + name[2:] + _dims(m.shape)


def _enc_update(m: Update, minor: int) -> bytes:
    out = Update.LAYOUT.pack(m.flags)
    if minor >= 5:
        return out + DIM_LAYOUT.pack(m.push)
    if m.push or m.flags & Update.FLAG_JOIN:
        _since(minor, 5, "UPDATE's push id")
    return out


def _enc_commit(m: Commit, minor: int) -> bytes:
    if m.flags & Commit.FLAG_NO_ROOT:
        _since(minor, 5, "COMMIT's NO_ROOT flag")
    return Commit.LAYOUT.pack(m.flags)


def model_name(s: str) -> bytes:
    """A model name as the wire carries it; LocalProtocolError for one the wire cannot."""
    raw = s.encode("utf-8")
    if len(raw) > MAX_MODEL_NAME:
        raise LocalProtocolError(f"model name is {len(raw)} bytes; the limit is {MAX_MODEL_NAME}")
    if "\x00" in s:
        raise LocalProtocolError(f"model name {s!r} holds a NUL character")
    return NAME_LAYOUT.pack(len(raw)) + raw


def _enc_stats_reply(m: StatsReply, minor: int) -> bytes:
    if len(m.figures) > MAX_FIGURES:
        raise LocalProtocolError(f"STATS_REPLY carries {len(m.figures)} figures; the limit is {MAX_FIGURES}")
    if len(m.models) > MAX_MODELS:
        raise LocalProtocolError(f"STATS_REPLY describes {len(m.models)} models; the limit is {MAX_MODELS}")
    if m.models_total < len(m.models):
        raise LocalProtocolError(f"STATS_REPLY counts {m.models_total} models but describes {len(m.models)}")
    parts = [StatsReply.LAYOUT.pack(len(m.figures), len(m.models), m.models_total)]
    for key, value in m.figures:
        raw = key.encode("utf-8")
        if not 0 < len(raw) <= MAX_FIGURE_NAME:
            raise LocalProtocolError(f"figure name {key!r} is {len(raw)} bytes; 1 to {MAX_FIGURE_NAME} are allowed")
        parts.append(NAME_LAYOUT.pack(len(raw)) + raw + FIGURE_VALUE_LAYOUT.pack(value))
    for ms in m.models:
        name = model_name(ms.name)
        parts.append(MODEL_STATS_LAYOUT.pack(ms.tensors, ms.nbytes, 1 if ms.pushing else 0, len(name) - 2) + name[2:])
    return b"".join(parts)


def _enc_commit_reply(m: CommitReply, minor: int) -> bytes:
    raw = _text(m.message)[NAME_LAYOUT.size :]
    root = _digest(m.root, "COMMIT_REPLY root")
    return CommitReply.LAYOUT.pack(1 if m.ok else 0, m.tensors, m.generation, root, len(raw)) + raw


def _placement(dim: int | None) -> bytes:
    return PLACEMENT_LAYOUT.pack(0, 0) if dim is None else PLACEMENT_LAYOUT.pack(1, dim)


def _enc_layout_reply(m: LayoutReply, minor: int) -> bytes:
    if len(m.rules) > MAX_TENSORS or len(m.parts) > MAX_TENSORS:
        raise LocalProtocolError(
            f"LAYOUT_REPLY: {len(m.rules)} rules, {len(m.parts)} fused tensors; the limit is {MAX_TENSORS}"
        )
    flags = LayoutReply.FLAG_UNEVEN_ERROR if m.uneven == "error" else 0
    has, dim = (0, 0) if m.default is None else (1, m.default)
    out = [LAYOUT_HEAD.pack(m.rank, m.world, flags, has, dim, len(m.rules), len(m.parts))]
    for pattern, where in m.rules:
        out.append(_name(pattern, "shard rule pattern") + _placement(where))
    for name, sizes in m.parts:
        out.append(_name(name, "fused tensor name") + PART_COUNT_LAYOUT.pack(len(sizes)) + _dims(sizes))
    return b"".join(out)


def _enc_region(m: Region, minor: int) -> bytes:
    nd = len(m.shape)
    if len(m.start) != nd or len(m.stop) != nd:
        raise LocalProtocolError(f"REGION {m.name!r}: a box of {len(m.start)} dimensions in a tensor of {nd}")
    if any(not 0 <= a <= b <= n for a, b, n in zip(m.start, m.stop, m.shape, strict=True)) or m.length < 0:
        raise LocalProtocolError(f"REGION {m.name!r}: box {m.start}..{m.stop} is not inside {m.shape}")
    name = _name(m.name, "tensor name")
    head = Region.LAYOUT.pack(_code(m.dtype), nd, 0, m.length, len(name) - 2)
    return head + name[2:] + _dims(m.shape) + _dims(m.start) + _dims(m.stop)


def _enc_sketch_reply(m: SketchReply, minor: int) -> bytes:
    if len(m.entries) > MAX_TENSORS or len(m.errors) > MAX_ERRORS:
        raise LocalProtocolError(f"SKETCH_REPLY: {len(m.entries)} entries, {len(m.errors)} errors over the limits")
    out = [SketchReply.LAYOUT.pack(len(m.entries), len(m.errors))]
    for e in m.entries:
        out.append(_name(e.name, "tensor name") + SKETCH_ENTRY_LAYOUT.pack(e.complete, e.received, e.needed, e.sketch))
    out.extend(_text(e) for e in m.errors)
    if minor >= SWITCH_SINCE:  # an older peer cannot hold a set: it is not told of one
        out.append(SET_LAYOUT.pack(m.set_state, m.set_id))
    return b"".join(out)


def _enc_expect(m: Expect, minor: int) -> bytes:
    out = Expect.LAYOUT.pack(len(m.names)) + b"".join(_name(n, "tensor name") for n in m.names)
    if m.flags & ~Expect.FLAG_HOLD or (m.flags & Expect.FLAG_HOLD and not m.set_id):
        raise LocalProtocolError(f"EXPECT: flags {m.flags} with set id {m.set_id} (HOLD needs a non-zero id)")
    if minor >= SWITCH_SINCE:
        return out + SET_LAYOUT.pack(m.flags, m.set_id)
    if m.flags or m.set_id:
        _since(minor, SWITCH_SINCE, "EXPECT's HOLD flag and set id")
    return out


def _enc_switch(m: Switch, minor: int) -> bytes:
    if not m.set_id or m.flags & ~Switch.FLAG_ABORT:
        raise LocalProtocolError(f"SWITCH: set id {m.set_id}, flags {m.flags} (a non-zero id, flags ABORT only)")
    return SET_LAYOUT.pack(m.flags, m.set_id)


def _enc_switch_reply(m: SwitchReply, minor: int) -> bytes:
    raw = _text(m.message)[NAME_LAYOUT.size :]
    return SwitchReply.LAYOUT.pack(1 if m.ok else 0, m.tensors, m.generation, len(raw)) + raw


def _enc_relay(m: Relay, minor: int) -> bytes:
    if not m.hops or len(m.hops) > MAX_HOPS:
        raise LocalProtocolError(f"RELAY names {len(m.hops)} hops; between 1 and {MAX_HOPS}")
    return Relay.LAYOUT.pack(len(m.hops)) + b"".join(_name(h, "relay hop") for h in m.hops)


def _enc_relay_reply(m: RelayReply, minor: int) -> bytes:
    failed = _name(m.failed, "RELAY_REPLY hop") if m.failed else NAME_LAYOUT.pack(0)
    head = RelayReply.LAYOUT.pack(1 if m.ok else 0, m.tensors, m.nbytes, len(failed) - 2)
    if len(m.skipped) > MAX_HOPS:
        raise LocalProtocolError(f"RELAY_REPLY skips {len(m.skipped)} hops; the limit is {MAX_HOPS}")
    skipped = Relay.LAYOUT.pack(len(m.skipped)) + b"".join(_name(h, "skipped hop") for h in m.skipped)
    return head + failed[2:] + _text(m.message) + skipped


def _enc_error(m: Error, minor: int) -> bytes:
    raw = _text(m.message)[NAME_LAYOUT.size :]
    return Error.LAYOUT.pack(m.code, len(raw)) + raw


_ENCODERS: dict[type, Callable[[Any, int], bytes]] = {
    Hello: _enc_hello,
    Auth: lambda m, minor: Auth.LAYOUT.pack(_digest(m.mac, "AUTH mac")),
    Alloc: _enc_alloc,
    WriteHeader: lambda m, minor: WriteHeader.LAYOUT.pack(m.tensor_id, m.offset, m.length),
    Have: _enc_have,
    HaveReply: _enc_have_reply,
    FillFromCache: lambda m, minor: FillFromCache.LAYOUT.pack(m.tensor_id, _digest(m.digest, "digest")),
    Read: _enc_read,
    ReadReply: _enc_read_reply,
    ListRequest: lambda m, minor: _name(m.after, "LIST cursor"),
    ListReply: _enc_list_reply,
    Free: lambda m, minor: Free.LAYOUT.pack(len(m.names)) + b"".join(_name(n, "tensor name") for n in m.names),
    FreeReply: lambda m, minor: FreeReply.LAYOUT.pack(m.freed),
    Barrier: _enc_barrier,
    BarrierReply: _enc_barrier_reply,
    Error: _enc_error,
    Bye: lambda m, minor: b"",
    Delta: _enc_delta,
    Update: _enc_update,
    Commit: _enc_commit,
    CommitReply: _enc_commit_reply,
    Stats: lambda m, minor: b"",
    StatsReply: _enc_stats_reply,
    UseModel: lambda m, minor: model_name(m.model),
    Remove: lambda m, minor: model_name(m.model),
    LayoutRequest: lambda m, minor: b"",
    LayoutReply: _enc_layout_reply,
    Region: _enc_region,
    SketchRequest: lambda m, minor: (
        SketchRequest.LAYOUT.pack(len(m.names))
        + b"".join(_name(n, "tensor name") for n in m.names)
        + FLAGS_LAYOUT.pack(m.flags)
    ),
    SketchReply: _enc_sketch_reply,
    Expect: _enc_expect,
    Relay: _enc_relay,
    RelayEnd: lambda m, minor: b"",
    RelayReply: _enc_relay_reply,
    Switch: _enc_switch,
    SwitchReply: _enc_switch_reply,
}


def send(msg: Message, *, minor: int = PROTOCOL_MINOR, max_frame: int = MAX_FRAME) -> bytes:
    """The prefix and body of ``msg`` laid out for ``minor`` (a payload is sent separately).

    LocalProtocolError if the message is invalid, too large for ``max_frame``, or uses a command
    the negotiated minor does not have.
    """
    if COMMAND_SINCE[msg.COMMAND] > minor:
        raise LocalProtocolError(f"{msg.COMMAND.name} needs minor {COMMAND_SINCE[msg.COMMAND]}; peer speaks {minor}")
    try:
        body = _ENCODERS[type(msg)](msg, minor)
    except struct.error as e:
        raise LocalProtocolError(f"{msg.COMMAND.name}: a field is out of range: {e}") from None
    if len(body) > max_frame:
        raise LocalProtocolError(f"{msg.COMMAND.name} body is {len(body)} bytes; the peer's limit is {max_frame}")
    return PREFIX.pack(msg.COMMAND, len(body)) + body
