"""The wire spec: commands, limits, and one frozen dataclass with one ``struct`` layout per message.

Framing (all integers little-endian)::

    frame   := prefix body [payload] [tag]
    tag     := 32 bytes after every frame of a protected connection (a token, minor 2: see ``mac``)
    prefix  := command:u8  pad:3 bytes (sent as 0, ignored)  body_len:u32        8 bytes
    body    := fixed head (the message's LAYOUT) then its variable part (names, dims, lists),
               then extension fields added by later minors, in the order they were added
    payload := WRITE and READ_REPLY only: exactly ``length`` raw bytes, where ``length`` is a
               field of the body. The payload is not part of the message object; the decoder
               hands it to the caller, who receives it straight into its destination.

    name    := len:u16 utf8[len]            dims := u64 * ndims
    digest  := 32 raw bytes (BLAKE3)

A conversation::

    client                                server
    HELLO(major, minor, flags, limits, nonce) ->
                                          <- HELLO(major, minor, flags, limits, nonce)
    [AUTH(mac) ->                         <- AUTH(mac)]          when the server wants auth
                                             (until here frames are at most MAX_HANDSHAKE_FRAME)
    [HAVE(digests) ->                     <- HAVE_REPLY(bitmap)] when the server keeps a cache
    ALLOC(id, name, dtype, shape, nbytes[, digest]) ->           no reply
    WRITE(id, offset, length) payload ->                         no reply
    FILL_FROM_CACHE(id, digest) ->                               no reply
    BARRIER(flags) ->                     <- BARRIER_REPLY(tensors, bytes, errors, need, digests)
    READ / LIST / FREE ->                 <- READ_REPLY + payload / LIST_REPLY / FREE_REPLY
    [MODEL(name) ->]                                             no reply (minor 5)
    STATS ->                              <- STATS_REPLY(figures, models)      (minor 5)
    REMOVE(model) ->                      <- FREE_REPLY(freed)                 (minor 5)
    BYE ->                                   (server closes)
                                          <- ERROR(code, message) in place of any reply;
                                             after a protocol violation it then closes

Writes have no reply so a client can keep the connection busy; errors of the writes between two
barriers come back in the BARRIER_REPLY. Versioning: a new minor may only append fields at the
end of a message or add commands. A decoder ignores bytes past the fields it knows (a newer
peer) and fills defaults for fields that are absent (an older peer); each side uses only what
both minors support. The ``*_PREVIOUS`` layouts pin what the previous minor sent.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import ClassVar

__all__ = [
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "PREVIOUS_MINOR",
    "MAX_FRAME",
    "MIN_FRAME",
    "MAX_HANDSHAKE_FRAME",
    "MAX_NAME",
    "MAX_DIMS",
    "MAX_TENSORS",
    "MAX_TENSOR_BYTES",
    "MAX_ERRORS",
    "MAX_MESSAGE",
    "MAX_DIGESTS",
    "MAC_SIZE",
    "DIGEST_SIZE",
    "NONCE_SIZE",
    "PREFIX",
    "Command",
    "Capability",
    "ErrorCode",
    "COMMAND_SINCE",
    "CLIENT_COMMANDS",
    "SERVER_COMMANDS",
    "PAYLOAD_COMMANDS",
    "Message",
    "Hello",
    "Auth",
    "Alloc",
    "WriteHeader",
    "Have",
    "HaveReply",
    "FillFromCache",
    "Read",
    "ReadReply",
    "ListRequest",
    "ListEntry",
    "ListReply",
    "Free",
    "FreeReply",
    "Barrier",
    "BarrierReply",
    "Error",
    "Bye",
    "Delta",
    "DeltaEncoding",
    "Update",
    "Commit",
    "CommitReply",
    "Stats",
    "StatsReply",
    "ModelStats",
    "UseModel",
    "Remove",
    "MAX_MODEL_NAME",
    "MAX_FIGURES",
    "MAX_FIGURE_NAME",
    "MAX_MODELS",
    "LayoutRequest",
    "LayoutReply",
    "Region",
    "SketchRequest",
    "SketchEntry",
    "SketchReply",
    "Expect",
    "REGIONS_SINCE",
    "SWITCH_SINCE",
    "MAX_REGION_BYTES",
    "MAX_SKETCH_BYTES",
    "SKETCH_ENTRY_LAYOUT",
    "Relay",
    "RelayEnd",
    "RelayReply",
    "Switch",
    "SwitchReply",
    "SET_LAYOUT",
    "MAX_HOPS",
    "MESSAGE_TYPES",
    "HELLO_LAYOUT",
    "HELLO_LAYOUT_PREVIOUS",
]

PROTOCOL_MAJOR = 1
# Minor 1 added the content cache (HAVE, FILL_FROM_CACHE, the CACHE flag, BARRIER_REPLY's need list) and
# HELLO's max_memory. Minor 2 added verification (ALLOC's VERIFY flag, BARRIER's flags and BARRIER_REPLY's
# digests, READ's flags and READ_REPLY's digest) and, on a connection with a token, a MAC after every frame
# (see ``weightlift.remote.protocol.mac``). Minor 3 added weight updates: DELTA (a tensor sent as what changed
# against a base the server holds, the DELTA flag), UPDATE and COMMIT (a set of tensors made visible at once)
# and COMMIT_REPLY (the set's digest). Minor 4 added DELTA's PLANES encoding; no message changed. Minor 5
# added models and operations: MODEL (the model a connection's later requests name), REMOVE (drop a model),
# STATS and STATS_REPLY (what the server holds and has done), UPDATE's push id and JOIN flag (one update over
# several connections), COMMIT's NO_ROOT flag and the BUSY error code. Minor 6 added sharded receivers:
# LAYOUT (the slices a server holds), REGION (a box of an unsharded tensor, placed into the server's slice),
# SKETCH (what the server assembled, with each tensor's linear sketch) and EXPECT (a set switched in at once).
# Minor 7 added relayed pushes: RELAY (the hops a server forwards what it receives to), RELAY_END and
# RELAY_REPLY; and the two-phase switch of a sharded update: EXPECT's HOLD flag and set id, SKETCH_REPLY's
# set state, SWITCH (switch a held set in, or drop it) and SWITCH_REPLY.
PROTOCOL_MINOR = 7
PREVIOUS_MINOR = 6
REGIONS_SINCE = 6  # the minor of LAYOUT, REGION, SKETCH and EXPECT
SWITCH_SINCE = 7  # the minor of SWITCH, SWITCH_REPLY, EXPECT's HOLD and SKETCH_REPLY's set state

# Limits checked by the decoder before anything is allocated from a length on the wire.
MAX_FRAME = 16 * 1024 * 1024  # body bytes of one frame (payloads are not frames)
# The smallest max_frame a client may state in HELLO (0: not stated, MAX_FRAME): every reply a server sends fits
# in it, the largest a BARRIER_REPLY with MAX_ERRORS errors of MAX_MESSAGE bytes and MAX_TENSORS need ids (513 KiB).
MIN_FRAME = 1024 * 1024
# Until a session is READY (HELLO, and AUTH where wanted) a server takes frames of at most this
# many body bytes: enough for HELLO and AUTH with room for later minors to append fields, and
# too little for an unauthenticated peer to make the server buffer anything worth having.
MAX_HANDSHAKE_FRAME = 256
MAX_NAME = 4096  # bytes of one UTF-8 tensor name
MAX_DIMS = 64
MAX_TENSORS = 65536  # entries in one HAVE / FREE / LIST_REPLY, and live allocations per connection
MAX_TENSOR_BYTES = 1 << 40
MAX_ERRORS = 256  # error strings in one BARRIER_REPLY; the server drops the rest and says so
MAX_MESSAGE = 1024  # bytes of one error string
# Digests one BARRIER_REPLY carries, and verified tensors a server remembers between barriers: a
# verifying client sends a BARRIER at least this often (a reply then stays within MIN_FRAME).
MAX_DIGESTS = 4096
MAX_MODEL_NAME = 255  # bytes of one UTF-8 model name (minor 5); "" is the default model
MAX_FIGURES = 256  # figures in one STATS_REPLY
MAX_FIGURE_NAME = 64  # bytes of one figure's name
MAX_MODELS = 1024  # models one STATS_REPLY describes; it counts the rest
# Payload bytes of one REGION: a box that is not one contiguous range of the receiver's slice is staged
# whole before it is scattered into place, so a sender cuts its boxes to at most this many bytes.
MAX_REGION_BYTES = 64 * 1024 * 1024
# Bytes of entries one SKETCH_REPLY carries at most (each its name and 27 bytes): with MAX_ERRORS errors
# it stays within MIN_FRAME. A server leaves out the entries past it; a client asks about fewer names.
MAX_SKETCH_BYTES = 512 * 1024
MAC_SIZE = 32  # the tag after every frame of a protected connection (keyed BLAKE3)
DIGEST_SIZE = 32
NONCE_SIZE = 32
MAX_HOPS = 64  # addresses in one RELAY: the servers a push reaches through one chain

PREFIX = struct.Struct("<B3xI")


class Command(IntEnum):
    """The first byte of every frame. Values are pinned by tests: never renumber, only append."""

    HELLO = 0  # both directions; always the first frame
    AUTH = 1  # both directions
    ALLOC = 2
    WRITE = 3
    HAVE = 4
    FILL_FROM_CACHE = 5
    READ = 6
    LIST = 7
    FREE = 8
    BARRIER = 9
    BYE = 10
    ERROR = 11  # server -> client
    DELTA = 12  # minor 3
    UPDATE = 13  # minor 3
    COMMIT = 14  # minor 3
    STATS = 15  # minor 5
    MODEL = 16  # minor 5
    REMOVE = 17  # minor 5
    RELAY = 25  # minor 7
    RELAY_END = 26  # minor 7
    SWITCH = 27  # minor 7
    HAVE_REPLY = 0x84
    READ_REPLY = 0x86
    LIST_REPLY = 0x87
    FREE_REPLY = 0x88
    BARRIER_REPLY = 0x89
    COMMIT_REPLY = 0x8E  # minor 3
    STATS_REPLY = 0x8F  # minor 5
    LAYOUT = 20  # minor 6 (REGIONS_SINCE)
    REGION = 21  # minor 6
    SKETCH = 22  # minor 6
    EXPECT = 23  # minor 6
    LAYOUT_REPLY = 0x94  # minor 6
    SKETCH_REPLY = 0x96  # minor 6
    RELAY_REPLY = 0x99  # minor 7
    SWITCH_REPLY = 0x9B  # minor 7


# The minor that introduced each command; a peer speaking an older minor never sees it.
COMMAND_SINCE: dict[Command, int] = {c: 0 for c in Command}
COMMAND_SINCE.update({Command.HAVE: 1, Command.FILL_FROM_CACHE: 1, Command.HAVE_REPLY: 1})
COMMAND_SINCE.update({Command.DELTA: 3, Command.UPDATE: 3, Command.COMMIT: 3, Command.COMMIT_REPLY: 3})
COMMAND_SINCE.update({Command.STATS: 5, Command.MODEL: 5, Command.REMOVE: 5, Command.STATS_REPLY: 5})
COMMAND_SINCE.update(
    {
        c: REGIONS_SINCE
        for c in (
            Command.LAYOUT,
            Command.REGION,
            Command.SKETCH,
            Command.EXPECT,
            Command.LAYOUT_REPLY,
            Command.SKETCH_REPLY,
        )
    }
)
COMMAND_SINCE.update({Command.RELAY: 7, Command.RELAY_END: 7, Command.RELAY_REPLY: 7})
COMMAND_SINCE.update({Command.SWITCH: SWITCH_SINCE, Command.SWITCH_REPLY: SWITCH_SINCE})

CLIENT_COMMANDS = frozenset(
    {
        Command.HELLO,
        Command.AUTH,
        Command.ALLOC,
        Command.WRITE,
        Command.HAVE,
        Command.FILL_FROM_CACHE,
        Command.READ,
        Command.LIST,
        Command.FREE,
        Command.BARRIER,
        Command.BYE,
        Command.DELTA,
        Command.UPDATE,
        Command.COMMIT,
        Command.STATS,
        Command.MODEL,
        Command.REMOVE,
        Command.LAYOUT,
        Command.REGION,
        Command.SKETCH,
        Command.EXPECT,
        Command.RELAY,
        Command.RELAY_END,
        Command.SWITCH,
    }
)
SERVER_COMMANDS = frozenset(
    {
        Command.HELLO,
        Command.AUTH,
        Command.ERROR,
        Command.HAVE_REPLY,
        Command.READ_REPLY,
        Command.LIST_REPLY,
        Command.FREE_REPLY,
        Command.BARRIER_REPLY,
        Command.COMMIT_REPLY,
        Command.STATS_REPLY,
        Command.LAYOUT_REPLY,
        Command.SKETCH_REPLY,
        Command.RELAY_REPLY,
        Command.SWITCH_REPLY,
    }
)
PAYLOAD_COMMANDS = frozenset({Command.WRITE, Command.READ_REPLY, Command.DELTA, Command.REGION})


class Capability(IntFlag):
    """HELLO flag bits. Bits a peer does not know are ignored, so new ones can be added freely."""

    CACHE = 1  # the server keeps a content cache: HAVE can answer yes
    AUTH = 2  # the server wants AUTH before anything else
    VERIFY = 4  # (minor 2) the server hashes ALLOCs flagged VERIFY and reports their digests
    MAC = 8  # (minor 2) after AUTH every frame carries a MAC; implied by minor 2 and a token
    DELTA = 16  # (minor 3) the server applies DELTA frames (else it answers each with "need")
    SHARDED = 64  # (minor 6) the server holds slices: ask LAYOUT, then send REGIONs


class ErrorCode(IntEnum):
    """ERROR reply codes."""

    PROTOCOL = 1  # malformed or forbidden frame; the server closes after replying
    VERSION = 2  # incompatible major version
    AUTH = 3  # AUTH missing or wrong
    LIMIT = 4  # a request exceeds a limit (memory, tensor size)
    NOT_FOUND = 5  # no such tensor
    INTERNAL = 6  # the server failed for its own reasons
    STALE = 7  # (minor 2) a READ named a version of the tensor that has since been replaced
    BUSY = 8  # (minor 5) a REMOVE of a model that a push is still filling: nothing was removed


class Message:
    """Base of every message: ``COMMAND`` says which frame it is, ``LAYOUT`` its fixed head."""

    __slots__ = ()

    COMMAND: ClassVar[Command]
    LAYOUT: ClassVar[struct.Struct]
    HAS_PAYLOAD: ClassVar[bool] = False


# HELLO's fixed part in minor 0, and since minor 1, which appended max_memory.
HELLO_LAYOUT_PREVIOUS = struct.Struct("<HHIIQ32s")
HELLO_LAYOUT = struct.Struct("<HHIIQ32sQ")


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """Version, capability flags, the sender's limits, and a fresh nonce for AUTH.

    A limit of 0 means "not stated". The client states what it accepts in replies; the server
    states what it accepts in requests and how much memory it will allocate in all.
    """

    COMMAND = Command.HELLO
    LAYOUT = HELLO_LAYOUT

    major: int
    minor: int
    flags: int = 0
    max_frame: int = MAX_FRAME
    max_tensor_bytes: int = MAX_TENSOR_BYTES
    nonce: bytes = bytes(NONCE_SIZE)
    max_memory: int = 0  # since minor 1

    def has(self, cap: Capability) -> bool:
        return bool(self.flags & cap)


@dataclass(frozen=True, slots=True)
class Auth(Message):
    """HMAC-SHA256 proof of the shared token over both nonces; the token itself never travels."""

    COMMAND = Command.AUTH
    LAYOUT = struct.Struct("<32s")

    mac: bytes


@dataclass(frozen=True, slots=True)
class Alloc(Message):
    """Make room for a named tensor under a connection-local id; it stays invisible until full.

    Wire: LAYOUT(id, dtype code, ndims, flags, nbytes, name_len) name dims [digest if flags&1].
    ``verify`` (flags&2, minor 2): hash the bytes as they land and report the digest of what was
    stored at the next BARRIER that asks for digests.
    """

    COMMAND = Command.ALLOC
    LAYOUT = struct.Struct("<IHBBQH")
    FLAG_DIGEST: ClassVar[int] = 1
    FLAG_VERIFY: ClassVar[int] = 2

    tensor_id: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    digest: bytes | None = None
    verify: bool = False  # since minor 2


@dataclass(frozen=True, slots=True)
class WriteHeader(Message):
    """Bytes [offset, offset+length) of an allocated tensor; ``length`` payload bytes follow."""

    COMMAND = Command.WRITE
    LAYOUT = struct.Struct("<IQQ")
    HAS_PAYLOAD = True

    tensor_id: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Have(Message):
    """Which of these digests does the server's cache hold? Wire: LAYOUT(count) digest*count."""

    COMMAND = Command.HAVE
    LAYOUT = struct.Struct("<I")

    digests: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class HaveReply(Message):
    """One bit per asked digest, LSB first. Wire: LAYOUT(count) bitmap[ceil(count/8)]."""

    COMMAND = Command.HAVE_REPLY
    LAYOUT = struct.Struct("<I")

    have: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class FillFromCache(Message):
    """Fill an allocated tensor from the server's cache entry ``digest`` instead of a WRITE."""

    COMMAND = Command.FILL_FROM_CACHE
    LAYOUT = struct.Struct("<I32s")

    tensor_id: int
    digest: bytes


@dataclass(frozen=True, slots=True)
class Read(Message):
    """Bytes [offset, offset+length) of a complete tensor. Wire: LAYOUT(offset, length, name_len) name,
    then (minor 2) flags:u8 and version:u64. flags&1 asks the reply to state the BLAKE3 digest of
    those bytes; a non-zero ``version`` (from LIST) asks for that version only: if the tensor has
    been replaced since, the reply is ERROR(STALE), never another version's bytes."""

    COMMAND = Command.READ
    LAYOUT = struct.Struct("<QQH")
    FLAG_DIGEST: ClassVar[int] = 1

    name: str
    offset: int
    length: int
    flags: int = 0  # since minor 2
    version: int = 0  # since minor 2; 0: whichever version is there
    generation: int = 0  # since minor 3; 0: any; else STALE once another set was switched in


@dataclass(frozen=True, slots=True)
class ReadReply(Message):
    """Answer to READ: ``length`` payload bytes follow. Wire: LAYOUT(length), then (minor 2)
    flags:u8 and, when flags&1, the digest of the payload as the server holds it."""

    COMMAND = Command.READ_REPLY
    LAYOUT = struct.Struct("<Q")
    HAS_PAYLOAD = True

    length: int
    digest: bytes | None = None  # since minor 2


@dataclass(frozen=True, slots=True)
class ListRequest(Message):
    """Complete tensors whose names sort after ``after`` (paging). Wire: LAYOUT(name_len) name."""

    COMMAND = Command.LIST
    LAYOUT = struct.Struct("<H")

    after: str = ""


@dataclass(frozen=True, slots=True)
class ListEntry:
    """One LIST_REPLY entry. Wire: LAYOUT(name_len, dtype code, ndims, nbytes) name dims.

    ``version`` (minor 2) names this version of the tensor: it changes whenever the name is
    published again with other bytes, so a READ can ask for exactly what was listed."""

    LAYOUT: ClassVar[struct.Struct] = struct.Struct("<HHBQ")

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    version: int = 0  # since minor 2


@dataclass(frozen=True, slots=True)
class ListReply(Message):
    """A page of tensors in name order; ``more`` says another LIST is needed. Wire: LAYOUT(more, count)
    entries, then (minor 2) each entry's version as u64, in the same order."""

    COMMAND = Command.LIST_REPLY
    LAYOUT = struct.Struct("<BI")

    entries: tuple[ListEntry, ...]
    more: bool = False
    generation: int = 0  # since minor 3: the store's switches so far, after the versions


@dataclass(frozen=True, slots=True)
class Free(Message):
    """Drop these tensors. Wire: LAYOUT(count) name*count."""

    COMMAND = Command.FREE
    LAYOUT = struct.Struct("<I")

    names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class FreeReply(Message):
    """How many of the named tensors existed and were dropped."""

    COMMAND = Command.FREE_REPLY
    LAYOUT = struct.Struct("<I")

    freed: int


@dataclass(frozen=True, slots=True)
class Barrier(Message):
    """Report what happened since the last barrier; the reply comes after every earlier frame.

    Wire (minor 2): flags:u8; flags&1 asks for the digests of the tensors ALLOCated with VERIFY
    that completed since the last barrier."""

    COMMAND = Command.BARRIER
    LAYOUT = struct.Struct("<")
    FLAG_DIGESTS: ClassVar[int] = 1

    flags: int = 0  # since minor 2


# The variable parts of a body (see the framing above), shared by the encoder and the decoder.
NAME_LAYOUT = struct.Struct("<H")  # a name's length; the UTF-8 bytes follow
DIM_LAYOUT = struct.Struct("<Q")  # one dimension; also each u64 field appended by a later minor
FLAGS_LAYOUT = struct.Struct("<B")  # a u8 flags field appended by a later minor
ID_LAYOUT = struct.Struct("<I")  # one tensor id of BARRIER_REPLY's need list

# BARRIER_REPLY's head; minor 1 appended need_count:u32 and need ids:u32*need_count after the errors,
# minor 2 digest_count:u32 and (id:u32, digest:32 bytes)*digest_count after those.
BARRIER_NEED_LAYOUT = struct.Struct("<I")
BARRIER_DIGEST_LAYOUT = struct.Struct("<I32s")


@dataclass(frozen=True, slots=True)
class BarrierReply(Message):
    """Tensors completed and bytes received since the last barrier, errors, and ids to resend.

    ``need`` lists tensors that FILL_FROM_CACHE could not fill (entry gone or corrupt): the client
    sends their bytes with WRITE. ``digests`` (minor 2, when the BARRIER asked) pairs the id of
    each tensor ALLOCated with VERIFY that completed since the last barrier with the BLAKE3 digest
    of the bytes the server stored. Wire: LAYOUT(tensors, bytes, error_count) name-encoded errors,
    then (minor 1) need_count:u32 u32*need_count, then (minor 2) digest_count:u32 and
    (id:u32, digest)*digest_count.
    """

    COMMAND = Command.BARRIER_REPLY
    LAYOUT = struct.Struct("<IQI")

    tensors: int
    nbytes: int
    errors: tuple[str, ...] = ()
    need: tuple[int, ...] = field(default=())  # since minor 1
    digests: tuple[tuple[int, bytes], ...] = field(default=())  # since minor 2


@dataclass(frozen=True, slots=True)
class Error(Message):
    """A request failed. Wire: LAYOUT(code, message_len) message."""

    COMMAND = Command.ERROR
    LAYOUT = struct.Struct("<HH")

    code: int
    message: str


@dataclass(frozen=True, slots=True)
class Bye(Message):
    """The client is done; the server closes the connection."""

    COMMAND = Command.BYE
    LAYOUT = struct.Struct("<")


class DeltaEncoding(IntEnum):
    """How a DELTA's payload encodes the new tensor against its base (see ``weightlift.remote.delta``)."""

    SAME = 0  # the tensor is its base: no payload
    SPARSE = 1  # per chunk: the changed elements' positions and new values, zstd-compressed
    XOR = 2  # per chunk: the new bytes XOR the base's, zstd-compressed
    PLANES = 3  # per chunk: XOR's bytes as byte planes (byte k of every element together), zstd-compressed; minor 4


@dataclass(frozen=True, slots=True)
class Delta(Message):
    """A tensor sent as what changed against a base the server holds; ``length`` payload bytes follow.

    Wire: LAYOUT(id, dtype code, ndims, encoding, flags, nbytes, length, base, digest, name_len)
    name dims payload. An ALLOC whose bytes are the stored ``name`` (hashing to ``base``, of this
    dtype and shape) with the payload applied, which must hash to ``digest``; a server without
    that base allocates it and lists the id in BARRIER_REPLY's need (the client WRITEs it whole).
    ``verify`` (flags&1): as ALLOC's."""

    COMMAND = Command.DELTA
    LAYOUT = struct.Struct("<IHBBBQQ32s32sH")
    HAS_PAYLOAD = True
    FLAG_VERIFY: ClassVar[int] = 1

    tensor_id: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    encoding: int
    base: bytes
    digest: bytes
    length: int
    verify: bool = False


@dataclass(frozen=True, slots=True)
class Update(Message):
    """Open an update: tensors completing from now on stay invisible until COMMIT shows them all
    at once. Wire: flags:u8; flags&1 (IN_PLACE): DELTAs are applied into their bases' own memory
    at COMMIT (no second copy; readers wait meanwhile), not into a copy as they arrive. Then
    (minor 5) push:u64: a non-zero id names the update so that other connections of the same
    push can take part; flags&2 (JOIN): this connection's tensors go into the open update of
    that id (opened on another connection), whose COMMIT shows them with the rest."""

    COMMAND = Command.UPDATE
    LAYOUT = struct.Struct("<B")
    FLAG_IN_PLACE: ClassVar[int] = 1
    FLAG_JOIN: ClassVar[int] = 2

    flags: int = 0
    push: int = 0  # since minor 5


@dataclass(frozen=True, slots=True)
class Commit(Message):
    """End the open update: publish every tensor it holds at once (flags&1, ABORT: drop them,
    leaving what was visible as it was). Answered by COMMIT_REPLY after every earlier frame.
    flags&2 (NO_ROOT, minor 5): the reply's root is zeros, so tensors sent without a digest are
    not hashed for it (a checkpoint pushed as one unit)."""

    COMMAND = Command.COMMIT
    LAYOUT = struct.Struct("<B")
    FLAG_ABORT: ClassVar[int] = 1
    FLAG_NO_ROOT: ClassVar[int] = 2
    flags: int = 0


@dataclass(frozen=True, slots=True)
class CommitReply(Message):
    """What a COMMIT made visible. Wire: LAYOUT(ok, tensors, generation, root, message_len) message.
    ``root`` is the set digest (:func:`weightlift.digest.set_digest`) over the names and BLAKE3
    digests of the update's tensors as the server holds them after the switch; ``generation``
    counts the switches of the server's store. ``ok`` false: nothing was switched, ``message``
    says why."""

    COMMAND = Command.COMMIT_REPLY
    LAYOUT = struct.Struct("<BIQ32sH")

    ok: bool
    tensors: int
    generation: int
    root: bytes
    message: str = ""


@dataclass(frozen=True, slots=True)
class Stats(Message):
    """What does the server hold and what has it done? Answered by STATS_REPLY. Wire: empty."""

    COMMAND = Command.STATS
    LAYOUT = struct.Struct("<")


# One model of a STATS_REPLY: tensors, bytes, flags (1: a push to it is in flight), name_len; the name follows.
MODEL_STATS_LAYOUT = struct.Struct("<QQBH")
FIGURE_VALUE_LAYOUT = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class ModelStats:
    """One model in a STATS_REPLY: its complete tensors and their bytes, and whether a push to it
    is in flight. ``name`` "" is the default model (what a client that names none pushes to)."""

    name: str
    tensors: int
    nbytes: int
    pushing: bool = False


@dataclass(frozen=True, slots=True)
class StatsReply(Message):
    """The server's figures (counters since start, state now) and its models. Wire:
    LAYOUT(figure_count, model_count, models_total), then per figure name value:u64, then per
    model MODEL_STATS_LAYOUT name. At most MAX_FIGURES figures (names of at most MAX_FIGURE_NAME
    bytes) and MAX_MODELS models: the reply stays within MIN_FRAME; ``models_total`` counts every
    model, so a reader knows when some were left out."""

    COMMAND = Command.STATS_REPLY
    LAYOUT = struct.Struct("<HII")

    figures: tuple[tuple[str, int], ...]
    models: tuple[ModelStats, ...] = ()
    models_total: int = 0


@dataclass(frozen=True, slots=True)
class UseModel(Message):
    """The model this connection's later requests name (ALLOC, DELTA, READ, LIST, FREE, UPDATE):
    each model is a namespace of its own. "" is the default model, where a connection starts.
    Wire: LAYOUT(name_len) name: at most MAX_MODEL_NAME bytes of UTF-8, no NUL. No reply."""

    COMMAND = Command.MODEL
    LAYOUT = struct.Struct("<H")

    model: str = ""


@dataclass(frozen=True, slots=True)
class Remove(Message):
    """Drop every tensor of a model. Answered by FREE_REPLY (how many were held), or ERROR(BUSY),
    nothing removed, while a push to that model is in flight. Wire: as MODEL's."""

    COMMAND = Command.REMOVE
    LAYOUT = struct.Struct("<H")

    model: str = ""


# LAYOUT_REPLY's head: rank, world, flags (UNEVEN_ERROR), the default placement (has_dim, dim), and the
# counts of the rules and fused tensors that follow.
LAYOUT_HEAD = struct.Struct("<IIBBiII")
PLACEMENT_LAYOUT = struct.Struct("<Bi")  # one rule's placement after its pattern: has_dim:u8 dim:i32
PART_COUNT_LAYOUT = struct.Struct("<H")  # a fused tensor's part count after its name; u64 sizes follow
SKETCH_ENTRY_LAYOUT = struct.Struct("<BQQQ")  # complete, received bytes, needed bytes, sketch
# (minor 7) appended to EXPECT (flags, set id) and to SKETCH_REPLY (the open set's state, its id)
SET_LAYOUT = struct.Struct("<BQ")


@dataclass(frozen=True, slots=True)
class LayoutRequest(Message):
    """(minor 6) Which slices does the server hold? Answered by LAYOUT_REPLY. Empty body."""

    COMMAND = Command.LAYOUT
    LAYOUT = struct.Struct("<")


@dataclass(frozen=True, slots=True)
class LayoutReply(Message):
    """(minor 6) The server's slices as :class:`~weightlift.distributed.Shard` rules: ``rank`` of
    ``world``; ``rules`` (pattern, dimension or None: replicated), first match wins, else
    ``default``; ``uneven`` as Shard's; ``parts`` the fused tensors (name, part sizes along dim 0).
    ``world`` 0: the server takes no REGIONs. Wire: LAYOUT_HEAD(rank, world, flags, has_default,
    default, rule_count, part_count), then per rule name PLACEMENT(has_dim, dim), then per fused
    tensor name count:u16 u64*count."""

    COMMAND = Command.LAYOUT_REPLY
    LAYOUT = LAYOUT_HEAD
    FLAG_UNEVEN_ERROR: ClassVar[int] = 1

    rank: int
    world: int
    rules: tuple[tuple[str, int | None], ...] = ()
    default: int | None = None
    uneven: str = "chunk"
    parts: tuple[tuple[str, tuple[int, ...]], ...] = ()


@dataclass(frozen=True, slots=True)
class Region(Message):
    """(minor 6) A box of the unsharded tensor ``name`` (``dtype``, ``shape``): ``[start, stop)``
    per dimension, its elements in row-major order as ``length`` payload bytes. The server places
    them into its own slice; the tensor is visible once its slice is covered, by any connections.
    Wire: LAYOUT(dtype code, ndims, flags, length, name_len) name dims start*ndims stop*ndims payload."""

    COMMAND = Command.REGION
    LAYOUT = struct.Struct("<HBBQH")
    HAS_PAYLOAD = True

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: tuple[int, ...]
    stop: tuple[int, ...]
    length: int


@dataclass(frozen=True, slots=True)
class SketchRequest(Message):
    """(minor 6) How far are these tensors assembled, and their sketches (none named: every tensor
    REGIONs have touched)? Answered by SKETCH_REPLY after every earlier frame. flags&1
    (RECOMPUTE): sketch each complete tensor from the memory it is in now (a byte changed since
    it landed shows), not as its boxes landed. Wire: LAYOUT(count) name*count flags:u8."""

    COMMAND = Command.SKETCH
    LAYOUT = struct.Struct("<I")
    FLAG_RECOMPUTE: ClassVar[int] = 1

    names: tuple[str, ...] = ()
    flags: int = 0


@dataclass(frozen=True, slots=True)
class SketchEntry:
    """One tensor of a SKETCH_REPLY: bytes of its slice received and needed, whether it is complete
    (visible), and the linear sketch (:mod:`weightlift.distributed.reshard`) of what was received,
    in the unsharded tensor's coordinates. Wire: name SKETCH_ENTRY_LAYOUT(complete, received, needed, sketch)."""

    name: str
    complete: bool
    received: int
    needed: int
    sketch: int


@dataclass(frozen=True, slots=True)
class SketchReply(Message):
    """(minor 6) Answer to SKETCH: an entry per tensor, unknown names left out, and the errors of
    this connection's REGIONs since the last SKETCH. Wire: LAYOUT(entry_count, error_count) entries errors."""

    COMMAND = Command.SKETCH_REPLY
    LAYOUT = struct.Struct("<II")
    #: ``set_state`` (minor 7, appended SET_LAYOUT(state, set id)): no set open; a set open, some
    #: tensor of it incomplete; a held set (EXPECT HOLD) complete, waiting for SWITCH.
    SET_NONE: ClassVar[int] = 0
    SET_OPEN: ClassVar[int] = 1
    SET_HELD: ClassVar[int] = 2

    entries: tuple[SketchEntry, ...] = ()
    errors: tuple[str, ...] = ()
    set_state: int = 0
    set_id: int = 0


@dataclass(frozen=True, slots=True)
class Expect(Message):
    """(minor 6) These tensors are one set: the server holds each as its slice completes and
    shows them all at once when the last one does (added to any set other connections opened,
    until it switches). flags&1 (HOLD, minor 7): the complete set waits, charged and invisible,
    for a SWITCH naming ``set_id`` (non-zero), so that several servers switch one update
    together. No reply. Wire: LAYOUT(count) name*count, then (minor 7) SET_LAYOUT(flags, set id)."""

    COMMAND = Command.EXPECT
    LAYOUT = struct.Struct("<I")
    FLAG_HOLD: ClassVar[int] = 1

    names: tuple[str, ...]
    flags: int = 0
    set_id: int = 0


@dataclass(frozen=True, slots=True)
class Switch(Message):
    """(minor 7) Switch the held set ``set_id`` (EXPECT HOLD) in at once, or with flags&1 (ABORT)
    drop it, its tensors released unpublished. Answered by SWITCH_REPLY; a set not open under
    that id, not held, or incomplete is refused there with nothing changed. Wire: SET_LAYOUT(flags, set id)."""

    COMMAND = Command.SWITCH
    LAYOUT = SET_LAYOUT
    FLAG_ABORT: ClassVar[int] = 1

    set_id: int
    flags: int = 0


@dataclass(frozen=True, slots=True)
class SwitchReply(Message):
    """(minor 7) Answer to SWITCH: ``ok``, the set's ``tensors``, the store ``generation`` after
    the switch (0: nothing switched), ``message`` why not. Wire: LAYOUT(ok, tensors, generation,
    message_len) message."""

    COMMAND = Command.SWITCH_REPLY
    LAYOUT = struct.Struct("<BIQH")

    ok: bool
    tensors: int = 0
    generation: int = 0
    message: str = ""


@dataclass(frozen=True, slots=True)
class Relay(Message):
    """Forward every tensor this connection completes, once its bytes are proven against the
    digest its ALLOC named, to ``hops[0]``, which forwards them to ``hops[1]``, and so on: the
    server pushes onward with its own peer credentials (no secret crosses the wire). It opens
    an update: what the connection completes is held until COMMIT (after RELAY_END), which the
    server passes down the chain once it has switched in. Sent before
    the first ALLOC; answered by RELAY_REPLY (``ok`` false: the server does not relay, ``message``
    says why). Wire: count:u16 then count addresses ("host:port"), each name-encoded."""

    COMMAND = Command.RELAY
    LAYOUT = struct.Struct("<H")

    hops: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RelayEnd(Message):
    """Every tensor of the relayed push has been sent (after its last BARRIER): answered by
    RELAY_REPLY once every hop holds its whole set, waiting for the COMMIT (the prepare), or with
    the first hop that does not (it and the hops after it dropped theirs)."""

    COMMAND = Command.RELAY_END
    LAYOUT = struct.Struct("<")


@dataclass(frozen=True, slots=True)
class RelayReply(Message):
    """How a relay went. Wire: LAYOUT(ok, tensors, nbytes, failed_len) failed, message_len:u16
    message, skipped_count:u16 skipped hops (name-encoded). ``tensors`` and ``nbytes``: what the
    answering server forwarded; ``failed``: the first hop that did not get every tensor, it and
    the hops after it holding nothing of the push ("" when ``ok``, and when the answering server
    itself does not hold its whole set); ``skipped``: hops that died or stalled and were routed
    around by the hop before them, the hops after them served from there (each holds nothing of
    the push); ``message``: why."""

    COMMAND = Command.RELAY_REPLY
    LAYOUT = struct.Struct("<BIQH")

    ok: bool
    tensors: int = 0
    nbytes: int = 0
    failed: str = ""
    message: str = ""
    skipped: tuple[str, ...] = ()


MESSAGE_TYPES: dict[Command, type[Message]] = {
    m.COMMAND: m
    for m in (
        Hello,
        Auth,
        Alloc,
        WriteHeader,
        Have,
        HaveReply,
        FillFromCache,
        Read,
        ReadReply,
        ListRequest,
        ListReply,
        Free,
        FreeReply,
        Barrier,
        BarrierReply,
        Error,
        Bye,
        Delta,
        Update,
        Commit,
        CommitReply,
        Stats,
        StatsReply,
        UseModel,
        Remove,
        LayoutRequest,
        LayoutReply,
        Region,
        SketchRequest,
        SketchReply,
        Expect,
        Relay,
        RelayEnd,
        RelayReply,
        Switch,
        SwitchReply,
    )
}
