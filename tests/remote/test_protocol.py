"""The wire spec: pinned command values, golden bytes per message, versioned layouts, limits."""

from __future__ import annotations

import struct

import pytest

import weightlift.remote.protocol as P
from weightlift.errors import LocalProtocolError, RemoteProtocolError
from weightlift.remote.protocol import (
    Alloc,
    Auth,
    Barrier,
    BarrierReply,
    Bye,
    Capability,
    Command,
    Decoder,
    Error,
    FillFromCache,
    Free,
    FreeReply,
    Have,
    HaveReply,
    Hello,
    ListEntry,
    ListReply,
    ListRequest,
    Read,
    ReadReply,
    WriteHeader,
    send,
)
from weightlift.remote.protocol.messages import PROTOCOL_MAJOR, PROTOCOL_MINOR

D1 = bytes(range(32))
D2 = bytes(range(32, 64))


def test_command_values_are_pinned():
    assert Command.HELLO == 0  # the handshake is always the first byte a server sees
    assert {c.name: int(c) for c in Command} == {
        "HELLO": 0,
        "AUTH": 1,
        "ALLOC": 2,
        "WRITE": 3,
        "HAVE": 4,
        "FILL_FROM_CACHE": 5,
        "READ": 6,
        "LIST": 7,
        "FREE": 8,
        "BARRIER": 9,
        "BYE": 10,
        "ERROR": 11,
        "HAVE_REPLY": 0x84,
        "READ_REPLY": 0x86,
        "LIST_REPLY": 0x87,
        "FREE_REPLY": 0x88,
        "BARRIER_REPLY": 0x89,
        "DELTA": 12,
        "UPDATE": 13,
        "COMMIT": 14,
        "COMMIT_REPLY": 0x8E,
        "STATS": 15,
        "MODEL": 16,
        "REMOVE": 17,
        "STATS_REPLY": 0x8F,
        "LAYOUT": 20,
        "REGION": 21,
        "SKETCH": 22,
        "EXPECT": 23,
        "LAYOUT_REPLY": 0x94,
        "SKETCH_REPLY": 0x96,
        "RELAY": 25,
        "RELAY_END": 26,
        "RELAY_REPLY": 0x99,
        "SWITCH": 27,
        "SWITCH_REPLY": 0x9B,
    }
    assert int(Capability.CACHE) == 1 and int(Capability.AUTH) == 2
    assert int(Capability.VERIFY) == 4 and int(Capability.MAC) == 8 and int(Capability.DELTA) == 16
    assert int(Capability.SHARDED) == 64 and P.LayoutReply.FLAG_UNEVEN_ERROR == 1
    assert (P.Delta.FLAG_VERIFY, P.Update.FLAG_IN_PLACE, P.Commit.FLAG_ABORT) == (1, 1, 1)
    assert [int(e) for e in P.DeltaEncoding] == [0, 1, 2, 3]
    assert (Alloc.FLAG_DIGEST, Alloc.FLAG_VERIFY, Barrier.FLAG_DIGESTS, Read.FLAG_DIGEST) == (1, 2, 1, 1)
    assert [int(c) for c in P.ErrorCode] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert (P.Update.FLAG_JOIN, P.Commit.FLAG_NO_ROOT) == (2, 2)
    assert (P.Expect.FLAG_HOLD, P.Switch.FLAG_ABORT) == (1, 1)
    assert (P.SketchReply.SET_NONE, P.SketchReply.SET_OPEN, P.SketchReply.SET_HELD) == (0, 1, 2)


def test_versions_and_limits_are_pinned():
    assert (P.PROTOCOL_MAJOR, P.PROTOCOL_MINOR, P.PREVIOUS_MINOR, P.REGIONS_SINCE) == (1, 7, 6, 6)
    assert P.MAX_REGION_BYTES == 64 << 20
    assert (P.MAX_MODEL_NAME, P.MAX_FIGURES, P.MAX_FIGURE_NAME, P.MAX_MODELS) == (255, 256, 64, 1024)
    assert P.MAX_HOPS == 64
    assert (P.MAX_DIGESTS, P.MAC_SIZE) == (4096, 32)
    assert P.MAX_FRAME == 16 << 20
    assert (P.MAX_NAME, P.MAX_DIMS, P.MAX_TENSORS) == (4096, 64, 65536)
    assert P.MAX_TENSOR_BYTES == 1 << 40
    assert (P.MAX_ERRORS, P.MAX_MESSAGE, P.DIGEST_SIZE, P.NONCE_SIZE) == (256, 1024, 32, 32)
    assert P.PREFIX.size == 8
    assert P.HELLO_LAYOUT_PREVIOUS.size == 52 and P.HELLO_LAYOUT.size == 60
    assert P.HELLO_LAYOUT.format.startswith(P.HELLO_LAYOUT_PREVIOUS.format)


def _hello() -> Hello:
    return Hello(1, 1, Capability.CACHE | Capability.AUTH, 1 << 20, 1 << 30, D1, 5 << 30)


# (message, exact frame bytes in hex) - written out by hand from the layouts in messages.py
GOLDEN = [
    (
        _hello(),
        "000000003c0000000100010003000000000010000000004000000000" + D1.hex() + "0000004001000000",
    ),
    (Auth(D2), "0100000020000000" + D2.hex()),
    (
        Alloc(3, "a.b", "BF16", (2, 3), 12, D1),
        "020000004500000003000000080002010c000000000000000300612e6202000000000000000300000000000000" + D1.hex(),
    ),
    (
        Alloc(7, "x", "F32", (), 4),
        "0200000013000000070000000b0000000400000000000000010078",
    ),
    (WriteHeader(3, 16, 4096), "03000000140000000300000010000000000000000010000000000000"),
    (Have((D1, D2)), "040000004400000002000000" + D1.hex() + D2.hex()),
    (FillFromCache(9, D2), "050000002400000009000000" + D2.hex()),
    (
        Alloc(7, "x", "F32", (), 4, None, True),
        "0200000013000000070000000b0000020400000000000000010078",
    ),
    (Read("w", 8, 24), "0600000024000000080000000000000018000000000000000100770000000000000000000000000000000000"),
    (Read("w", 0, 4, 1), "0600000024000000000000000000000004000000000000000100770100000000000000000000000000000000"),
    (Read("w", 0, 4, 0, 7), "0600000024000000000000000000000004000000000000000100770007000000000000000000000000000000"),
    (
        Read("w", 0, 4, 0, 7, 5),
        "0600000024000000000000000000000004000000000000000100770007000000000000000500000000000000",
    ),
    (ListRequest("ab"), "070000000400000002006162"),
    (ListRequest(), "07000000020000000000"),
    (Free(("a", "bc")), "080000000b0000000200000001006102006263"),
    (Barrier(), "090000000100000000"),
    (Barrier(1), "090000000100000001"),
    (Bye(), "0a00000000000000"),
    (Error(4, "full"), "0b000000080000000400040066756c6c"),
    (
        HaveReply((True, False, True, False, False, False, False, False, True)),
        "8400000006000000090000000501",
    ),
    (ReadReply(24), "8600000009000000180000000000000000"),
    (ReadReply(24, D1), "8600000029000000180000000000000001" + D1.hex()),
    (
        ListReply((ListEntry("a", "I64", (2,), 16),), more=True),
        "870000002b000000010100000001000d00011000000000000000610200000000000000"
        + "0000000000000000"
        + "0000000000000000",
    ),
    (
        ListReply((ListEntry("a", "I64", (2,), 16, 9),), generation=3),
        "870000002b000000000100000001000d00011000000000000000610200000000000000"
        + "0900000000000000"
        + "0300000000000000",
    ),
    (ListReply((), generation=4), "870000000d00000000000000000400000000000000"),
    (FreeReply(2), "880000000400000002000000"),
    (
        P.Delta(5, "w", "BF16", (4,), 8, P.DeltaEncoding.XOR, D1, D2, 10, True),
        "0c00000064000000"
        + "05000000"
        + "0800"
        + "01"
        + "02"
        + "01"
        + "0800000000000000"
        + "0a00000000000000"
        + D1.hex()
        + D2.hex()
        + "0100770400000000000000",
    ),
    (
        P.Delta(7, "w", "F32", (2,), 8, P.DeltaEncoding.PLANES, D1, D2, 12),
        "0c00000064000000"
        + "07000000"
        + "0b00"
        + "01"
        + "03"  # PLANES
        + "00"
        + "0800000000000000"
        + "0c00000000000000"
        + D1.hex()
        + D2.hex()
        + "0100770200000000000000",
    ),
    (
        P.Delta(6, "w", "F32", (), 4, P.DeltaEncoding.SAME, D2, D2, 0),
        "0c0000005c000000"
        + "06000000"
        + "0b00"
        + "00"
        + "00"
        + "00"
        + "0400000000000000"
        + "0000000000000000"
        + D2.hex()
        + D2.hex()
        + "010077",
    ),
    (P.Update(), "0d0000000900000000" + "0000000000000000"),
    (P.Update(1), "0d0000000900000001" + "0000000000000000"),
    (P.Update(2, 0x0102030405060708), "0d0000000900000002" + "0807060504030201"),
    (P.Commit(2), "0e0000000100000002"),
    (P.Stats(), "0f00000000000000"),
    (P.UseModel("ab"), "100000000400000002006162"),
    (P.UseModel(), "10000000020000000000"),
    (P.Remove("m"), "110000000300000001006d"),
    (
        P.StatsReply((("tensors", 3),), (P.ModelStats("m", 2, 16, True), P.ModelStats("", 1, 4)), 5),
        "8f00000042000000"
        + "0100"
        + "02000000"
        + "05000000"
        + "0700"
        + b"tensors".hex()
        + "0300000000000000"
        + "0200000000000000"
        + "1000000000000000"
        + "01"
        + "0100"
        + "6d"
        + "0100000000000000"
        + "0400000000000000"
        + "00"
        + "0000",
    ),
    (P.Commit(), "0e0000000100000000"),
    (P.Commit(1), "0e0000000100000001"),
    (P.CommitReply(True, 3, 7, D1), "8e0000002f00000001030000000700000000000000" + D1.hex() + "0000"),
    (
        P.CommitReply(False, 0, 2, bytes(32), "x"),
        "8e00000030000000" + "00" + "00000000" + "0200000000000000" + bytes(32).hex() + "0100" + "78",
    ),
    (
        BarrierReply(2, 4096, ("bad",), (5, 6)),
        "8900000025000000020000000010000000000000010000000300626164020000000500000006000000" + "00000000",
    ),
    # RELAY: count 2, then "a:1" and "bc:23" name-encoded
    (P.Relay(("a:1", "bc:23")), "190000000e000000" + "0200" + "0300613a31" + "050062633a3233"),
    (P.RelayEnd(), "1a00000000000000"),
    # RELAY_REPLY: ok, tensors, bytes, failed hop (empty), message (empty)
    (P.RelayReply(True, 3, 7), "9900000013000000" + "01" + "03000000" + "0700000000000000" + "0000" + "0000" + "0000"),
    (
        P.RelayReply(False, 1, 8, "h:9", "x", ("a:1",)),
        "990000001c000000" + "00" + "01000000" + "0800000000000000" + "0300683a39" + "010078" + "0100" + "0300613a31",
    ),
    (
        BarrierReply(1, 8, (), (), ((7, D2),)),
        # head (tensors 1, bytes 8, no errors), need count 0, digest count 1, id 7, digest
        "890000003c000000" + "01000000" + "0800000000000000" + "00000000" + "0000000001000000" + "07000000" + D2.hex(),
    ),
    (P.LayoutRequest(), "1400000000000000"),
    (
        P.LayoutReply(1, 2, (("q*", 0), ("n", None)), None, "error", (("qkv", (4, 2)),)),
        "940000003e000000"
        + "01000000"
        + "02000000"
        + "01"
        + "00"
        + "00000000"
        + "02000000"
        + "01000000"  # head
        + "0200712a"
        + "01"
        + "00000000"  # rule q* -> dim 0
        + "01006e"
        + "00"
        + "00000000"  # rule n -> replicated
        + "0300716b76"
        + "0200"
        + "0400000000000000"
        + "0200000000000000",  # qkv of parts 4, 2
    ),
    (
        P.Region("w", "F32", (4, 3), (1, 0), (3, 3), 24),
        "150000003f000000"
        + "0b00"
        + "02"
        + "00"
        + "1800000000000000"
        + "0100"
        + "77"
        + "0400000000000000"
        + "0300000000000000"  # shape
        + "0100000000000000"
        + "0000000000000000"  # start
        + "0300000000000000"
        + "0300000000000000",  # stop
    ),
    (P.SketchRequest(("a",)), "1600000008000000" + "01000000" + "010061" + "00"),
    (P.SketchRequest((), 1), "160000000500000000000000" + "01"),
    # EXPECT: count, names, then (minor 7) flags and set id
    (P.Expect(("a", "bc")), "1700000014000000" + "02000000" + "010061" + "02006263" + "00" + "0000000000000000"),
    (P.Expect(("a",), 1, 7), "1700000010000000" + "01000000" + "010061" + "01" + "0700000000000000"),
    (
        P.SketchReply((P.SketchEntry("a", True, 8, 16, 5),), ("no",), P.SketchReply.SET_HELD, 9),
        "9600000031000000"
        + "01000000"
        + "01000000"
        + "010061"
        + "01"
        + "0800000000000000"
        + "1000000000000000"
        + "0500000000000000"
        + "02006e6f"
        + "02"  # set state: held
        + "0900000000000000",  # set id
    ),
    # SWITCH: flags (1: ABORT), set id
    (P.Switch(7), "1b00000009000000" + "00" + "0700000000000000"),
    (P.Switch(7, 1), "1b00000009000000" + "01" + "0700000000000000"),
    # SWITCH_REPLY: ok, tensors, generation, message
    (P.SwitchReply(True, 3, 5), "9b0000000f000000" + "01" + "03000000" + "0500000000000000" + "0000"),
    (P.SwitchReply(False, 0, 0, "no"), "9b00000011000000" + "00" + "00000000" + "0000000000000000" + "0200" + "6e6f"),
]


@pytest.mark.parametrize("msg,hexbytes", GOLDEN, ids=[f"{m.COMMAND.name}{i}" for i, (m, _) in enumerate(GOLDEN)])
def test_golden_bytes(msg, hexbytes):
    raw = bytes.fromhex(hexbytes)
    assert send(msg) == raw
    role = "server" if msg.COMMAND in P.CLIENT_COMMANDS else "client"
    dec = Decoder(our_role=role)
    dec.feed(raw)
    assert dec.next_event() == msg
    assert dec.at_boundary or msg.COMMAND in P.PAYLOAD_COMMANDS


def test_minor_four_update_has_no_push_id_and_the_minor_five_commands_do_not_exist():
    raw = bytes.fromhex("0d0000000100000001")
    assert send(P.Update(1), minor=4) == raw
    dec = Decoder(our_role="server", minor=4)
    dec.feed(raw)
    assert dec.next_event() == P.Update(1, 0)
    for msg in (P.Update(2, 9), P.Update(0, 9), P.Commit(2)):
        with pytest.raises(LocalProtocolError, match="minor 5"):
            send(msg, minor=4)
    for msg in (P.Stats(), P.UseModel("m"), P.Remove("m"), P.StatsReply(())):
        with pytest.raises(LocalProtocolError, match="needs minor 5"):
            send(msg, minor=4)
    for cmd, role in ((Command.STATS, "server"), (Command.MODEL, "server"), (Command.STATS_REPLY, "client")):
        dec = Decoder(our_role=role, minor=4)  # an older peer: the command is unknown to it
        dec.feed(P.PREFIX.pack(cmd, 0))
        with pytest.raises(RemoteProtocolError, match="not valid in this direction or minor"):
            dec.next_event()


def test_model_names_and_stats_replies_are_bounded():
    with pytest.raises(LocalProtocolError, match="limit is 255"):
        send(P.UseModel("m" * 256))
    with pytest.raises(LocalProtocolError, match="NUL"):
        send(P.Remove("a\x00b"))
    with pytest.raises(LocalProtocolError, match="256"):
        send(P.StatsReply((("x", 1),) * 257))
    with pytest.raises(LocalProtocolError, match="1 to 64"):
        send(P.StatsReply((("x" * 65, 1),)))
    with pytest.raises(LocalProtocolError, match="1024"):
        send(P.StatsReply((), (P.ModelStats("m", 0, 0),) * 1025, 1025))
    for body in (
        struct.pack("<H", 256) + b"m" * 256,  # too long
        struct.pack("<H", 3) + b"a\x00b",  # NUL
    ):
        dec = Decoder(our_role="server")
        dec.feed(P.PREFIX.pack(Command.MODEL, len(body)) + body)
        with pytest.raises(RemoteProtocolError, match="model name"):
            dec.next_event()
    dec = Decoder(our_role="client")
    head = P.StatsReply.LAYOUT.pack(0, P.MAX_MODELS + 1, P.MAX_MODELS + 1)
    dec.feed(P.PREFIX.pack(Command.STATS_REPLY, len(head)) + head)
    with pytest.raises(RemoteProtocolError, match="models exceed"):
        dec.next_event()
    # the largest reply a server may send fits the smallest frame a client may state
    worst = P.StatsReply(
        tuple((f"{i:064d}", 2**64 - 1) for i in range(P.MAX_FIGURES)),
        tuple(P.ModelStats(f"{i:0255d}", 2**64 - 1, 2**64 - 1, True) for i in range(P.MAX_MODELS)),
        2**32 - 1,
    )
    assert len(send(worst, max_frame=P.MIN_FRAME)) <= 8 + P.MIN_FRAME


# READ and LIST_REPLY as minor 2 lays them out, before minor 3 appended the generation
MINOR_TWO = [
    (Read("w", 8, 24), "060000001c0000000800000000000000180000000000000001007700" + "0000000000000000"),
    (Read("w", 0, 4, 0, 7), "060000001c0000000000000000000000040000000000000001007700" + "0700000000000000"),
    (
        ListReply((ListEntry("a", "I64", (2,), 16, 9),)),
        "8700000023000000000100000001000d00011000000000000000610200000000000000" + "0900000000000000",
    ),
]


@pytest.mark.parametrize("msg,hexbytes", MINOR_TWO)
def test_minor_two_layouts_are_unchanged(msg, hexbytes):
    raw = bytes.fromhex(hexbytes)
    assert send(msg, minor=2) == raw
    dec = Decoder(our_role="server" if msg.COMMAND in P.CLIENT_COMMANDS else "client", minor=2)
    dec.feed(raw)
    assert dec.next_event() == msg  # the generation absent: 0
    with pytest.raises(LocalProtocolError, match="minor 3"):
        send(Read("w", 0, 4, 0, 0, 1), minor=2)


def test_planes_needs_minor_four_and_the_rest_of_delta_does_not():
    planes = P.Delta(7, "w", "F32", (2,), 8, P.DeltaEncoding.PLANES, D1, D2, 12)
    with pytest.raises(LocalProtocolError, match="PLANES encoding requires minor 4"):
        send(planes, minor=3)
    xor = P.Delta(7, "w", "F32", (2,), 8, P.DeltaEncoding.XOR, D1, D2, 12)
    assert send(xor, minor=3) == send(xor)  # minor 4 changed no layout
    assert [P.planes_usable(m) for m in range(6)] == [False] * 4 + [True] * 2


def test_every_command_has_a_message_type_and_golden_case():
    assert set(P.MESSAGE_TYPES) == set(Command)
    assert {m.COMMAND for m, _ in GOLDEN} == set(Command)
    for cmd, cls in P.MESSAGE_TYPES.items():
        assert cls.COMMAND is cmd
        assert cls.HAS_PAYLOAD == (cmd in P.PAYLOAD_COMMANDS)


def test_messages_are_frozen():
    m = WriteHeader(1, 2, 3)
    with pytest.raises(AttributeError):
        m.offset = 5  # type: ignore[misc]


def test_dtype_codes_on_the_wire_follow_the_dtype_table():
    from weightlift.dtypes import CODES, DTYPES

    for d in DTYPES:
        raw = send(Alloc(0, "t", d.name, (8,), 8 * d.bits // 8))
        assert struct.unpack_from("<H", raw, 8 + 4)[0] == CODES[d.name]


# ----- versioning -----------------------------------------------------------------------------


def test_previous_minor_hello_is_the_shorter_layout():
    old = Hello(1, 0, 0, 1 << 20, 1 << 30, D1, max_memory=123)
    raw = send(old)
    assert len(raw) == 8 + P.HELLO_LAYOUT_PREVIOUS.size
    assert raw[8:] == P.HELLO_LAYOUT_PREVIOUS.pack(1, 0, 0, 1 << 20, 1 << 30, D1)
    dec = Decoder(our_role="client")
    dec.feed(raw)
    got = dec.next_event()
    assert got == Hello(1, 0, 0, 1 << 20, 1 << 30, D1, max_memory=0)  # absent field -> default


def test_longer_message_from_a_newer_minor_is_accepted_and_tail_ignored():
    body = P.HELLO_LAYOUT.pack(1, 7, 0xFF00 | 1, 1 << 20, 1 << 30, D1, 99) + b"future fields"
    raw = P.PREFIX.pack(Command.HELLO, len(body)) + body
    dec = Decoder(our_role="server")
    dec.feed(raw + send(Barrier()))
    hello = dec.next_event()
    assert hello == Hello(1, 7, 0xFF01, 1 << 20, 1 << 30, D1, 99)
    assert hello.has(Capability.CACHE) and not hello.has(Capability.AUTH)  # unknown bits ignored
    assert dec.next_event() == Barrier()  # the tail did not bleed into the next frame


def test_barrier_reply_need_list_is_minor_one():
    msg = BarrierReply(1, 10, ("x",))
    old = send(msg, minor=0)
    new = send(msg, minor=1)
    assert new == old[:4] + struct.pack("<I", len(new) - 8) + old[8:] + b"\0\0\0\0"
    dec = Decoder(our_role="client", minor=0)
    dec.feed(send(BarrierReply(1, 10, (), (3,)), minor=1))
    assert dec.next_event() == BarrierReply(1, 10, (), (3,))  # old reader just skips; ours knows it
    with pytest.raises(LocalProtocolError):
        send(BarrierReply(0, 0, (), (1,)), minor=0)


def test_versions_are_minor_two():
    """LIST states versions and READ may ask for one since minor 2; a minor-1 peer is not told
    them (the listing is laid out as before) and cannot be asked for one."""
    with pytest.raises(LocalProtocolError, match="minor 2"):
        send(Read("t", 0, 1, 0, 5), minor=1)
    listed = ListReply((ListEntry("a", "I64", (2,), 16, 9),))
    assert send(listed, minor=1) == send(ListReply((ListEntry("a", "I64", (2,), 16),)), minor=1)
    old = Decoder(our_role="client", minor=1)
    old.feed(send(listed, minor=1))
    assert old.next_event() == ListReply((ListEntry("a", "I64", (2,), 16, 0),))
    dec = Decoder(our_role="server")
    dec.feed(send(Read("t", 0, 1, 0, 5)) + send(Read("t", 0, 1), minor=1))
    assert dec.next_event() == Read("t", 0, 1, 0, 5)
    assert dec.next_event() == Read("t", 0, 1)  # a minor-1 READ: any version


def test_verify_fields_are_minor_two():
    for msg in (
        Barrier(1),
        Read("t", 0, 1, 1),
        ReadReply(1, D1),
        BarrierReply(0, 0, (), (), ((1, D1),)),
        Alloc(1, "t", "U8", (1,), 1, None, True),
    ):
        with pytest.raises(LocalProtocolError, match="minor 2"):
            send(msg, minor=1)
    # without the new fields a minor-2 message is laid out as minor 1 laid it out
    assert send(Barrier(), minor=1) == bytes.fromhex("0900000000000000")
    assert send(ReadReply(24), minor=1) == bytes.fromhex("86000000080000001800000000000000")
    # a minor-2 reply read by a decoder that stops at minor 1's fields: the tail is skipped
    dec = Decoder(our_role="client")
    dec.feed(send(BarrierReply(1, 10, (), (3,), ((3, D1),))) + send(FreeReply(1)))
    assert dec.next_event() == BarrierReply(1, 10, (), (3,), ((3, D1),))
    assert dec.next_event() == FreeReply(1)


def test_a_barrier_reply_holds_at_most_max_digests():
    with pytest.raises(LocalProtocolError, match="digests"):
        send(BarrierReply(0, 0, (), (), tuple((i, D1) for i in range(P.MAX_DIGESTS + 1))))
    raw = bytearray(send(BarrierReply(0, 0, (), (), ((1, D1),))))
    raw[8 + 16 + 4 : 8 + 16 + 8] = struct.pack("<I", P.MAX_DIGESTS + 1)
    dec = Decoder(our_role="client")
    dec.feed(bytes(raw))
    with pytest.raises(RemoteProtocolError, match="digests"):
        dec.next_event()


def test_cache_commands_do_not_exist_in_the_previous_minor():
    for msg in (Have((D1,)), FillFromCache(1, D1), HaveReply((True,))):
        with pytest.raises(LocalProtocolError, match="minor"):
            send(msg, minor=0)
        send(msg, minor=P.PROTOCOL_MINOR)


# ----- encoding refuses what it cannot represent ----------------------------------------------


@pytest.mark.parametrize(
    "msg",
    [
        Alloc(1, "t", "F32", (-1,), 4),
        Alloc(1, "t", "F32", (1,), -4),
        Alloc(1, "t", "NOPE", (1,), 4),
        Alloc(1, "x" * (P.MAX_NAME + 1), "F32", (1,), 4),
        Alloc(1, "t", "U8", (1,) * (P.MAX_DIMS + 1), 1),
        Alloc(1, "t", "U8", (1,), 1, b"short"),
        Alloc(-1, "t", "U8", (1,), 1),
        WriteHeader(1, -1, 4),
        WriteHeader(1 << 32, 0, 4),
        Hello(1, 1, nonce=b"short"),
        Auth(b"short"),
        Read("t", -1, 1),
        Have(tuple([D1] * (P.MAX_TENSORS + 1))),
        BarrierReply(0, 0, ("e",) * (P.MAX_ERRORS + 1)),
        BarrierReply(0, 0, (), tuple(range(P.MAX_TENSORS + 1))),
    ],
)
def test_send_rejects_invalid_fields(msg):
    with pytest.raises(LocalProtocolError):
        send(msg)


def test_send_rejects_a_body_over_the_peers_frame_limit():
    msg = Have(tuple([D1] * 100))
    assert len(send(msg, max_frame=3204)) == 8 + 3204
    with pytest.raises(LocalProtocolError, match="limit"):
        send(msg, max_frame=3203)


def test_handshake_and_frame_floor_limits_are_pinned():
    assert P.MIN_FRAME == 1 << 20 and P.MAX_HANDSHAKE_FRAME == 256


def test_handshake_frames_fit_the_handshake_limit():
    for msg in (Hello(1, 1, 0, nonce=D1, max_memory=1 << 40), Hello(1, 0, nonce=D1), Auth(D1)):
        assert len(send(msg, max_frame=P.MAX_HANDSHAKE_FRAME)) <= 8 + P.MAX_HANDSHAKE_FRAME


def test_the_largest_reply_fits_the_smallest_frame_a_client_may_state():
    # A server holds its errors to MAX_ERRORS and its need list to MAX_TENSORS, so a client that
    # states MIN_FRAME can always be answered; nothing else a server sends is larger.
    worst = BarrierReply(
        1,
        1,
        ("x" * P.MAX_MESSAGE,) * P.MAX_ERRORS,
        tuple(range(P.MAX_TENSORS)),
        tuple((i, D1) for i in range(P.MAX_DIGESTS)),
    )
    assert len(send(worst, max_frame=P.MIN_FRAME)) <= 8 + P.MIN_FRAME
    assert len(send(HaveReply((True,) * P.MAX_TENSORS), max_frame=P.MIN_FRAME)) <= 8 + P.MIN_FRAME
    assert len(send(Error(6, "x" * 5000), max_frame=P.MIN_FRAME)) <= 8 + 4 + P.MAX_MESSAGE


def test_long_error_text_is_cut_on_a_character_boundary():
    raw = send(Error(6, "é" * 1000))
    (n,) = struct.unpack_from("<H", raw, 10)
    assert n <= P.MAX_MESSAGE and n % 2 == 0
    dec = Decoder(our_role="client")
    dec.feed(raw)
    assert dec.next_event().message == "é" * (n // 2)


def test_protocol_package_does_no_io():
    import ast
    import pathlib

    forbidden = {"socket", "threading", "asyncio", "torch", "selectors", "ssl"}
    pkg = pathlib.Path(P.__file__).parent
    for path in pkg.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for n in names:
                assert n.split(".")[0] not in forbidden, f"{path.name} imports {n}"


def test_client_and_server_sessions_back_to_back_in_memory():
    """The handshake as two state machines wired together, no sockets: HELLO, AUTH, READY."""
    from weightlift.remote.protocol import Auth, Capability, ClientSession, ServerSession, SessionState, server_mac

    token = b"sesame"
    client = ClientSession(token=token)
    server = ServerSession(auth_required=True)
    hello = client.start()
    minor = server.hello(hello)
    server_nonce = bytes(range(32))[: len(hello.nonce)]
    auth = client.server_hello(Hello(hello.major, minor, Capability.AUTH | Capability.CACHE, 1 << 20, 0, server_nonce))
    assert isinstance(auth, Auth) and client.state is SessionState.AWAIT_AUTH
    server.check(auth)
    server.authenticated()
    client.server_auth(Auth(server_mac(token, hello.nonce, server_nonce)))
    assert client.state is server.state is SessionState.READY
    assert client.minor == server.minor and client.cache and client.max_frame == 1 << 20


def test_client_session_refuses_what_it_must():
    from weightlift.errors import AuthError, RemoteProtocolError
    from weightlift.remote.protocol import Auth, Capability, ClientSession, cache_usable

    nonce = bytes(len(ClientSession().start().nonce))
    with pytest.raises(RemoteProtocolError, match="server speaks protocol"):
        ClientSession().server_hello(Hello(PROTOCOL_MAJOR + 1, 0, 0, 0, 0, nonce))
    with pytest.raises(AuthError, match="wants a token"):
        ClientSession().server_hello(Hello(PROTOCOL_MAJOR, PROTOCOL_MINOR, Capability.AUTH, 0, 0, nonce))
    with pytest.raises(AuthError, match="did not ask"):
        ClientSession(token=b"t").server_hello(Hello(PROTOCOL_MAJOR, PROTOCOL_MINOR, 0, 0, 0, nonce))
    c = ClientSession(token=b"t")
    c.server_hello(Hello(PROTOCOL_MAJOR, PROTOCOL_MINOR, Capability.AUTH, 0, 0, nonce))
    with pytest.raises(AuthError, match="did not prove"):
        c.server_auth(Auth(bytes(32)))
    # an older server's cache flag is not usable: the rule is stated once, in the session module
    old = ClientSession()
    assert old.server_hello(Hello(PROTOCOL_MAJOR, 0, Capability.CACHE, 0, 0, nonce)) is None
    assert not old.cache and not cache_usable(0) and cache_usable(PROTOCOL_MINOR)


def test_the_two_phase_switch_is_minor_seven_and_its_fields_are_bounded():
    # a minor-6 peer: EXPECT and SKETCH_REPLY without the set fields, no SWITCH at all
    raw = bytes.fromhex("170000000b000000" + "02000000" + "010061" + "02006263")
    assert send(P.Expect(("a", "bc")), minor=6) == raw
    dec = Decoder(our_role="server", minor=6)
    dec.feed(raw)
    assert dec.next_event() == P.Expect(("a", "bc"), 0, 0)
    with pytest.raises(LocalProtocolError, match="minor 7"):
        send(P.Expect(("a",), 1, 7), minor=6)
    assert send(P.SketchReply((), (), 2, 7), minor=6) == bytes.fromhex("9600000008000000" + "00" * 8)
    for msg in (P.Switch(7), P.SwitchReply(True)):
        with pytest.raises(LocalProtocolError, match="needs minor 7"):
            send(msg, minor=6)
    with pytest.raises(LocalProtocolError, match="non-zero"):
        send(P.Expect(("a",), 1, 0))
    with pytest.raises(LocalProtocolError, match="non-zero"):
        send(P.Switch(0))
    names = struct.pack("<I", 1) + b"\x01\x00a"
    for cmd, body, why in (
        (Command.EXPECT, names + struct.pack("<BQ", 1, 0), "non-zero set id"),
        (Command.EXPECT, names + struct.pack("<BQ", 2, 7), "unknown flags"),
        (Command.EXPECT, names + b"\x01\x07", "EXPECT set"),  # a field cut short
        (Command.SWITCH, struct.pack("<BQ", 0, 0), "set id 0"),
        (Command.SWITCH, struct.pack("<BQ", 4, 7), "unknown flags"),
        (Command.SWITCH, struct.pack("<B", 0), "SWITCH head"),
        (Command.SKETCH_REPLY, struct.pack("<IIBQ", 0, 0, 3, 7), "set state 3"),
        (Command.SWITCH_REPLY, struct.pack("<BIQH", 1, 0, 0, 2000) + b"x" * 2000, "message"),
    ):
        role = "server" if cmd in P.CLIENT_COMMANDS else "client"
        dec = Decoder(our_role=role)
        dec.feed(P.PREFIX.pack(cmd, len(body)) + body)
        with pytest.raises(RemoteProtocolError, match=why):
            dec.next_event()
    dec = Decoder(our_role="server", minor=6)  # an older server does not know SWITCH
    dec.feed(P.PREFIX.pack(Command.SWITCH, 9) + struct.pack("<BQ", 0, 7))
    with pytest.raises(RemoteProtocolError, match="not valid in this direction or minor"):
        dec.next_event()
