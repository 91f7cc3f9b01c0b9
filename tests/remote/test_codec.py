"""The incremental decoder, its limits, the server session table and the AUTH proofs."""

from __future__ import annotations

import struct

import pytest

import weightlift.remote.protocol as P
from weightlift.errors import AuthError, LocalProtocolError, RemoteProtocolError
from weightlift.remote.protocol import (
    NEED_DATA,
    Alloc,
    Auth,
    Barrier,
    BarrierReply,
    Command,
    Decoder,
    Error,
    Free,
    Have,
    HaveReply,
    Hello,
    ListReply,
    Payload,
    Read,
    ReadReply,
    ServerSession,
    SessionState,
    WriteHeader,
    send,
)

D = bytes(range(32))


def _frame(cmd: int, body: bytes) -> bytes:
    return P.PREFIX.pack(cmd, len(body)) + body


def _decode(raw: bytes, role: str = "server", **kw) -> list:
    dec = Decoder(our_role=role, **kw)  # type: ignore[arg-type]
    dec.feed(raw)
    out = []
    while (ev := dec.next_event()) is not NEED_DATA:
        out.append(ev)
    return out


CLIENT_STREAM = [
    Hello(1, 1, 0, nonce=D),
    Auth(D),
    Alloc(0, "layer.0.weight", "F16", (4, 4), 32, D),
    WriteHeader(0, 0, 32),
    Have((D, D)),
    Read("layer.0.weight", 8, 8),
    Free(("a", "b")),
    Barrier(),
]


def test_decoder_fed_one_byte_at_a_time():
    payload = bytes(range(32))
    raw = b"".join(send(m) + (payload if isinstance(m, WriteHeader) else b"") for m in CLIENT_STREAM)
    dec = Decoder(our_role="server")
    events: list = []
    for i in range(len(raw)):
        dec.feed(raw[i : i + 1])
        while (ev := dec.next_event()) is not NEED_DATA:
            events.append(ev)
    msgs = [e for e in events if not isinstance(e, Payload)]
    assert msgs == CLIENT_STREAM
    assert b"".join(e.data for e in events if isinstance(e, Payload)) == payload
    assert dec.at_boundary


def test_bytes_wanted_never_reaches_past_a_frame():
    """A caller that reads exactly bytes_wanted() bytes never takes the next frame's bytes."""
    frames = [send(m) for m in CLIENT_STREAM if not isinstance(m, WriteHeader)]
    raw = b"".join(frames)
    dec = Decoder(our_role="server")
    pos = 0
    boundaries = []
    while pos < len(raw):
        n = dec.bytes_wanted()
        assert n > 0
        dec.feed(raw[pos : pos + n])
        pos += n
        ev = dec.next_event()
        if ev is not NEED_DATA:
            boundaries.append(pos)
            assert dec.at_boundary
    ends = []
    acc = 0
    for f in frames:
        acc += len(f)
        ends.append(acc)
    assert boundaries == ends


def test_payload_received_straight_into_the_callers_buffer():
    dec = Decoder(our_role="server")
    dec.feed(send(WriteHeader(1, 0, 10)))
    assert dec.next_event() == WriteHeader(1, 0, 10)
    assert dec.payload_remaining == 10 and dec.bytes_wanted() == 10
    dest = bytearray(10)
    dest[:4] = b"abcd"  # as if recv_into() had put them there
    dec.payload_received(4)
    assert dec.bytes_wanted() == 6
    dec.feed(b"efg")  # or some bytes came through the decoder
    assert dec.payload_into(memoryview(dest)[4:]) == 3
    with pytest.raises(LocalProtocolError):
        dec.payload_received(4)  # more than is due
    dec.payload_received(3)
    assert dec.payload_remaining == 0 and dec.at_boundary
    assert dec.next_event() is NEED_DATA


def test_payload_received_refuses_while_bytes_are_buffered():
    dec = Decoder(our_role="server")
    dec.feed(send(WriteHeader(1, 0, 10)) + b"xy")
    dec.next_event()
    with pytest.raises(LocalProtocolError):
        dec.payload_received(2)


def test_read_reply_payload_on_the_client_side():
    evs = _decode(send(ReadReply(3)) + b"abc" + send(BarrierReply(1, 3)), role="client")
    assert evs == [ReadReply(3), Payload(b"abc"), BarrierReply(1, 3)]


def test_zero_length_payload_needs_no_payload_step():
    assert _decode(send(WriteHeader(1, 0, 0)) + send(Barrier())) == [WriteHeader(1, 0, 0), Barrier()]


# ----- rejections -----------------------------------------------------------------------------


def _rejects(raw: bytes, match: str, role: str = "server", **kw) -> None:
    dec = Decoder(our_role=role, **kw)  # type: ignore[arg-type]
    dec.feed(raw)
    with pytest.raises(RemoteProtocolError, match=match):
        while dec.next_event() is not NEED_DATA:
            pass
    with pytest.raises(RemoteProtocolError):  # a failed decoder stays failed
        dec.next_event()


def test_unknown_command():
    _rejects(_frame(0x55, b""), "unknown command 85")


def test_command_from_the_wrong_side():
    _rejects(send(Error(1, "x")), "not valid")
    _rejects(send(Barrier()), "not valid", role="client")


def test_cache_commands_unknown_to_a_previous_minor_decoder():
    _rejects(send(Have((D,))), "not valid", minor=0)
    _rejects(send(HaveReply((True,))), "not valid", role="client", minor=0)


def test_oversize_frame_rejected_from_the_prefix_alone():
    dec = Decoder(our_role="server")
    dec.feed(P.PREFIX.pack(Command.HAVE, P.MAX_FRAME + 1))  # no body: nothing may be buffered for it
    with pytest.raises(RemoteProtocolError, match="frame limit"):
        dec.bytes_wanted()
    _rejects(P.PREFIX.pack(Command.HAVE, P.MAX_FRAME + 1), "frame limit")
    _rejects(send(Have((D,) * 4)), "frame limit", max_frame=100)


def _alloc_body(*, tid=1, code=11, ndims=1, flags=0, nbytes=4, name=b"t", dims=(1,), digest=b""):
    return (
        Alloc.LAYOUT.pack(tid, code, ndims, flags, nbytes, len(name))
        + name
        + b"".join(struct.pack("<Q", d) for d in dims)
        + digest
    )


@pytest.mark.parametrize(
    "body,match",
    [
        (_alloc_body(code=200), "unknown dtype code 200"),
        (_alloc_body(name=b""), "empty"),
        (_alloc_body(name=b"\xff\xfe"), "UTF-8"),
        (_alloc_body(name=b"x" * (P.MAX_NAME + 1)), "limit"),
        (_alloc_body(ndims=P.MAX_DIMS + 1, dims=(1,) * (P.MAX_DIMS + 1)), "dimensions"),
        (_alloc_body(nbytes=8), "is 4 bytes, not 8"),
        (_alloc_body(dims=(1 << 62,), nbytes=1 << 64 - 1), "4611686018427387904"),
        (_alloc_body(dims=(1 << 39,), nbytes=1 << 41), "limit"),
        (_alloc_body(code=19, dims=(3,), nbytes=1), "whole number"),  # three 4-bit values
        (_alloc_body(flags=1, digest=b"short"), "digest needs 32 bytes"),
        (_alloc_body()[:-3], "needs"),  # truncated body
    ],
)
def test_alloc_fields_checked(body, match):
    _rejects(_frame(Command.ALLOC, body), match)


def test_write_and_read_ranges_checked():
    _rejects(_frame(Command.WRITE, WriteHeader.LAYOUT.pack(1, P.MAX_TENSOR_BYTES, 1)), "tensor limit")
    _rejects(_frame(Command.WRITE, WriteHeader.LAYOUT.pack(1, 0, 1 << 20)), "tensor limit", max_tensor_bytes=1 << 19)
    _rejects(_frame(Command.READ, Read.LAYOUT.pack(1 << 63, 1 << 63, 1) + b"t"), "tensor limit")
    _rejects(_frame(ReadReply.COMMAND, ReadReply.LAYOUT.pack(1 << 41)), "tensor limit", role="client")
    _rejects(_frame(Command.WRITE, b"\0" * 10), "needs 20 bytes")


def test_counts_checked_before_anything_is_built():
    _rejects(_frame(Command.HAVE, struct.pack("<I", P.MAX_TENSORS + 1)), "limit")
    _rejects(_frame(Command.HAVE, struct.pack("<I", 1000) + D), "need at least 32000")
    _rejects(_frame(Command.FREE, struct.pack("<I", P.MAX_TENSORS + 1)), "limit")
    _rejects(_frame(Command.FREE, struct.pack("<I", 1) + b"\0\0\0"), "empty")
    _rejects(_frame(HaveReply.COMMAND, struct.pack("<I", P.MAX_TENSORS + 1)), "limit", role="client")
    _rejects(_frame(ListReply.COMMAND, struct.pack("<BI", 0, P.MAX_TENSORS + 1)), "limit", role="client")
    over_errors = BarrierReply.LAYOUT.pack(0, 0, P.MAX_ERRORS + 1)
    _rejects(_frame(BarrierReply.COMMAND, over_errors), "limit", role="client")
    long_error = BarrierReply.LAYOUT.pack(0, 0, 1) + struct.pack("<H", P.MAX_MESSAGE + 1) + b"e" * (P.MAX_MESSAGE + 1)
    _rejects(_frame(BarrierReply.COMMAND, long_error), "limit", role="client")
    big_need = BarrierReply.LAYOUT.pack(0, 0, 0) + struct.pack("<I", P.MAX_TENSORS + 1)
    _rejects(_frame(BarrierReply.COMMAND, big_need), "limit", role="client")
    long_msg = Error.LAYOUT.pack(1, P.MAX_MESSAGE + 1) + b"e" * (P.MAX_MESSAGE + 1)
    _rejects(_frame(Command.ERROR, long_msg), "limit", role="client")


def test_truncated_hello_rejected():
    _rejects(_frame(Command.HELLO, P.HELLO_LAYOUT_PREVIOUS.pack(1, 0, 0, 0, 0, D)[:-1]), "needs 52 bytes")


# ----- a conversation through two decoders, no sockets -----------------------------------------


def test_in_memory_conversation_with_session_table():
    server = ServerSession(auth_required=True)
    to_server = Decoder(our_role="server")
    to_client = Decoder(our_role="client")

    def deliver(msg, dec):
        dec.feed(send(msg))
        return dec.next_event()

    cn, sn, token = P.new_nonce(), P.new_nonce(), b"secret"
    assert cn != sn and len(cn) == 32
    hello = deliver(Hello(1, 2, nonce=cn), to_server)
    with pytest.raises(RemoteProtocolError):
        server.check(Barrier())  # nothing before HELLO
    assert server.hello(hello) == 2
    assert server.state is SessionState.AWAIT_AUTH
    with pytest.raises(RemoteProtocolError, match="not allowed"):
        server.check(Alloc(0, "t", "U8", (1,), 1))  # nothing but AUTH once auth is wanted
    reply = deliver(Hello(1, 2, P.Capability.AUTH, nonce=sn), to_client)
    assert reply.has(P.Capability.AUTH)
    auth = deliver(Auth(P.client_mac(token, cn, reply.nonce)), to_server)
    server.check(auth)
    P.verify_mac(P.client_mac(token, hello.nonce, sn), auth.mac, who="client")
    server.authenticated()
    back = deliver(Auth(P.server_mac(token, hello.nonce, sn)), to_client)
    P.verify_mac(P.server_mac(token, cn, sn), back.mac, who="server")
    server.check(Barrier())
    with pytest.raises(RemoteProtocolError):
        server.check(Hello(1, 1))  # only once


def test_macs_bind_role_token_and_both_nonces():
    a, b = P.new_nonce(), P.new_nonce()
    c = P.client_mac(b"t", a, b)
    assert c != P.server_mac(b"t", a, b)
    assert c != P.client_mac(b"u", a, b)
    assert c != P.client_mac(b"t", b, a)
    with pytest.raises(AuthError):
        P.verify_mac(c, P.client_mac(b"u", a, b), who="client")


def test_session_negotiates_the_lower_minor_and_refuses_another_major():
    s = ServerSession(minor=1)
    assert s.hello(Hello(1, 0)) == 0 and s.state is SessionState.READY
    s = ServerSession(minor=0)
    assert s.hello(Hello(1, 5)) == 0
    s = ServerSession()
    with pytest.raises(RemoteProtocolError, match="protocol 2"):
        s.hello(Hello(2, 0))


def test_session_refuses_a_hello_frame_limit_below_the_floor():
    s = ServerSession()
    with pytest.raises(RemoteProtocolError, match="max_frame 1 is below"):
        s.hello(Hello(1, 1, max_frame=1))
    assert s.state is SessionState.CLOSED
    with pytest.raises(RemoteProtocolError, match="below"):
        ServerSession().hello(Hello(1, 1, max_frame=P.MIN_FRAME - 1))
    assert ServerSession().hello(Hello(1, 1, max_frame=P.MIN_FRAME)) == 1
    assert ServerSession().hello(Hello(1, 1, max_frame=0)) == 1  # not stated: the protocol's limit


def test_handshake_decoder_refuses_a_big_frame_from_its_prefix():
    # What a server's pre-READY decoder does with an unauthenticated 16 MiB ALLOC: refused
    # from the 8-byte prefix, before any of the body is buffered.
    dec = Decoder(our_role="server", max_frame=P.MAX_HANDSHAKE_FRAME)
    dec.feed(P.PREFIX.pack(Command.ALLOC, P.MAX_FRAME))
    with pytest.raises(RemoteProtocolError, match="frame limit of 256"):
        dec.next_event()
    ok = Decoder(our_role="server", max_frame=P.MAX_HANDSHAKE_FRAME)
    ok.feed(send(Hello(1, 1, nonce=D)) + send(Auth(D)))
    assert isinstance(ok.next_event(), Hello) and isinstance(ok.next_event(), Auth)
