#!/usr/bin/env python3
"""Fuzz the frame decoder, or a live server's dispatch, under atheris (libFuzzer), for long runs.

The properties are those tests/remote/test_protocol_fuzz.py checks for a few seconds:

- ``decoder`` (default): any bytes, cut where the input says, in either role, decode to messages
  and payload or raise RemoteProtocolError; an accepted message encodes again to a frame that
  decodes to the same message. Anything else is a crash, and libFuzzer writes the input behind
  it (``crash-<sha1>``) to the working directory.
- ``server``: the input, after a valid HELLO, is sent to a server running in this process (8 MiB
  limit, a cache folder) and the connection half-closed; a crash is an ERROR the server logs (an
  exception outside the protocol's error tree) or a charge left behind once everything it holds
  is freed, checked every 500 inputs.

    pip install atheris
    mkdir -p /tmp/fuzz-proto   # libFuzzer adds new inputs to the first folder only
    python bench/fuzz_protocol.py /tmp/fuzz-proto tests/remote/corpus -max_total_time=600
    python bench/fuzz_protocol.py --target server /tmp/fuzz-srv tests/remote/corpus -max_total_time=600
    python bench/fuzz_protocol.py crash-1234abcd   # replay one input

``--write-corpus DIR`` writes the seed inputs (valid frame streams) and exits. Options other than
``--target`` go to libFuzzer (``-help=1`` lists them).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile

import atheris

with atheris.instrument_imports():
    import weightlift.remote.protocol as P
    from weightlift.errors import RemoteProtocolError
    from weightlift.remote.protocol import (
        NEED_DATA,
        Alloc,
        Barrier,
        Decoder,
        FillFromCache,
        Free,
        Have,
        Hello,
        ListRequest,
        Read,
        WriteHeader,
        send,
    )

SEEDS = {
    "push": [
        Alloc(1, "layer.0.weight", "F32", (2, 4), 32),
        WriteHeader(1, 0, 32),
        Barrier(),
    ],
    "cache": [
        Have((bytes(32),)),
        Alloc(2, "layer.1.weight", "BF16", (16,), 32, bytes(32)),
        FillFromCache(2, bytes(32)),
        Barrier(),
    ],
    "read": [ListRequest(""), Read("layer.0.weight", 0, 8), Free(("layer.0.weight",))],
}


def stream(msgs: list) -> bytes:
    out = b""
    for m in msgs:
        out += send(m)
        if isinstance(m, WriteHeader):
            out += bytes(i % 256 for i in range(m.length))
    return out


def decode(data: bytes) -> None:
    if not data:
        return
    role = "client" if data[0] & 1 else "server"
    step = 1 + data[0] % 97  # the fragmentation
    body = data[1:]
    dec = Decoder(our_role=role)
    try:
        for i in range(0, len(body), step):
            dec.feed(body[i : i + step])
            while True:
                if dec.bytes_wanted() < 0:
                    raise AssertionError("bytes_wanted below zero")
                ev = dec.next_event()
                if ev is NEED_DATA:
                    break
                # HELLO's layout follows the version it states, so it is encoded again only
                # by a peer of that version: the round trip is checked for every other message
                if isinstance(ev, P.Message) and not isinstance(ev, Hello):
                    again = Decoder(our_role=role)
                    again.feed(send(ev))
                    if again.next_event() != ev:
                        raise AssertionError(f"{ev!r} does not survive a round trip")
    except RemoteProtocolError:
        pass


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)

    def emit(self, record: logging.LogRecord) -> None:
        raise AssertionError(f"the server logged an error: {record.getMessage()}")


_server = None
_count = 0


def serve(data: bytes) -> None:
    global _server, _count
    if _server is None:
        from weightlift.remote.server.server import Server

        logging.getLogger("weightlift.remote.server").addHandler(_Errors())
        _server = Server(max_memory=8 << 20, cache_dir=tempfile.mkdtemp(prefix="wl-fuzz-cache-"))
        _server.start()
    sock = socket.create_connection(_server.address, timeout=10)
    try:
        # the first byte picks the decoder's role and steps in the other target: skipped here, so
        # both targets share one corpus
        sock.sendall(send(Hello(1, P.PROTOCOL_MINOR, nonce=bytes(P.NONCE_SIZE))) + data[1:])
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(65536):
            pass
    except OSError:
        pass
    finally:
        sock.close()
    _count += 1
    if _count % 500 == 0:
        from weightlift.remote.client.client import Client

        with Client(_server.address) as c:
            names = [e.name for e in c.list()]
            if names:
                c.free(names)
        import time

        end = time.monotonic() + 5
        while _server.memory_used and time.monotonic() < end:
            time.sleep(0.01)
        if _server.memory_used:
            raise AssertionError(f"{_server.memory_used} bytes still charged with nothing held")


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--write-corpus"]:
        os.makedirs(args[1], exist_ok=True)
        for name, msgs in SEEDS.items():
            with open(os.path.join(args[1], name), "wb") as f:
                f.write(b"\x00" + stream(msgs))  # first byte: role server, whole-frame steps
        return
    target = decode
    if args[:1] == ["--target"]:
        target = {"decoder": decode, "server": serve}[args[1]]
        args = args[2:]
    atheris.Setup([sys.argv[0], *args], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
