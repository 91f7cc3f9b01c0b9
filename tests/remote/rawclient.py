"""A hand-driven client for the server tests, and the helpers they share: it sends exactly the
frames a test writes and reads the replies."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np

import weightlift.remote.protocol as P
from weightlift.memory.pool import held_bytes
from weightlift.remote.protocol import (
    NEED_DATA,
    Alloc,
    Auth,
    Barrier,
    BarrierReply,
    Decoder,
    Hello,
    WriteHeader,
    send,
)
from weightlift.remote.server.server import Server
from weightlift.remote.server.store import entry_cost


def _cost(name: str, nbytes: int, ndim: int = 1) -> int:
    """What one tensor in host memory counts against max_memory: the pages it holds."""
    return entry_cost(name, held_bytes(nbytes), ndim)


class Raw:
    """A hand-driven client: sends exactly the frames a test writes, reads replies."""

    def __init__(self, address, *, minor: int = P.PROTOCOL_MINOR, source: str | None = None):
        self.sock = socket.create_connection(address, timeout=10, source_address=(source, 0) if source else None)
        self.dec = Decoder(our_role="client")
        self.minor = minor
        self.mac_out: P.FrameMac | None = None  # a protected connection (token, minor 2)
        self.mac_in: P.FrameMac | None = None
        self._payload = b""

    @classmethod
    def connected(cls, address, *, token: bytes | None = None, **kw) -> Raw:
        """A Raw client past HELLO (and AUTH, given a token)."""
        raw = cls(address, **kw)
        raw.hello(token=token)
        return raw

    @classmethod
    def over(cls, sock: socket.socket, *, minor: int = P.PROTOCOL_MINOR) -> Raw:
        """A Raw client on a socket already connected (one end of a socketpair)."""
        raw = cls.__new__(cls)
        sock.settimeout(10)
        raw.sock, raw.dec, raw.minor = sock, Decoder(our_role="client"), minor
        raw.mac_out = raw.mac_in = None
        raw._payload = b""
        return raw

    def hello(self, *, token: bytes | None = None) -> Hello:
        nonce = P.new_nonce()
        ours = Hello(1, self.minor, nonce=nonce)
        self.send(ours)
        reply = self.recv()
        if token is not None:
            self.send(Auth(P.client_mac(token, nonce, reply.nonce)))
            assert isinstance(self.recv(), Auth)
            if P.mac_usable(min(self.minor, reply.minor), token):
                c2s, s2c = P.frame_keys(token, ours, reply)
                self.mac_out, self.mac_in = P.FrameMac(c2s), P.FrameMac(s2c)
        return reply

    def send(self, msg, payload: bytes = b"") -> None:
        raw = send(msg, minor=self.minor) + payload
        self.sock.sendall(raw + (self.mac_out.seal([raw]) if self.mac_out is not None else b""))

    def _exactly(self, n: int) -> bytes | None:
        out = b""
        while len(out) < n:
            data = self.sock.recv(n - len(out))
            if not data:
                return None
            out += data
        return out

    def recv(self):
        if self.mac_in is not None:  # frame by frame, each checked against the tag after it
            self.mac_in.begin()
            while (ev := self.dec.next_event()) is NEED_DATA:
                data = self._exactly(self.dec.bytes_wanted())
                if data is None:
                    return None
                self.dec.feed(data)
                self.mac_in.update(data)
            if ev.HAS_PAYLOAD:
                self._payload = self._exactly(ev.length)
                self.dec.payload_received(ev.length)
                self.mac_in.update(self._payload)
            self.mac_in.check(self._exactly(P.MAC_SIZE))
            return ev
        while True:
            ev = self.dec.next_event()
            if ev is not NEED_DATA:
                return ev
            data = self.sock.recv(65536)
            if not data:
                return None
            self.dec.feed(data)

    def read_payload(self, n: int) -> bytes:
        if self.mac_in is not None:
            out, self._payload = self._payload, b""
            assert len(out) == n
            return out
        out = b""
        while len(out) < n:
            ev = self.dec.next_event()
            if ev is NEED_DATA:
                self.dec.feed(self.sock.recv(65536))
            else:
                out += ev.data
        return out

    def closed(self) -> bool:
        """True once the server has closed its end (reads EOF)."""
        try:
            return self.sock.recv(1) == b""
        except OSError:
            return True

    def close(self) -> None:
        self.sock.close()


def _f32(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def _put(raw: Raw, tid: int, name: str, arr: np.ndarray, *, digest: bytes | None = None, dtype: str = "F32") -> None:
    raw.send(Alloc(tid, name, dtype, arr.shape, arr.nbytes, digest))
    raw.send(WriteHeader(tid, 0, arr.nbytes), arr.tobytes())


def _barrier(raw: Raw) -> BarrierReply:
    raw.send(Barrier())
    reply = raw.recv()
    assert isinstance(reply, BarrierReply), reply
    return reply


def _cache_push(raw: Raw, a: np.ndarray, tid: int, name: str, digest: bytes) -> None:
    _put(raw, tid, name, a, digest=digest)


def _fill(raw: Raw, a: np.ndarray, tid: int, name: str, digest: bytes) -> None:
    """Allocate ``name`` named by ``digest`` and ask the server to fill it from what it holds."""
    raw.send(Alloc(tid, name, "F32", a.shape, a.nbytes, digest))
    raw.send(P.FillFromCache(tid, digest))


def _entry(cache_dir: Path, digest: bytes) -> Path:
    """Where a disk cache keeps the bytes ``digest`` names."""
    return cache_dir / digest.hex()[:2] / digest.hex()


@contextlib.contextmanager
def _cached(cache_dir: Path, a: np.ndarray, digest: bytes) -> Iterator[tuple[Server, Raw]]:
    """A server caching in ``cache_dir`` that holds ``a`` as "w", pushed named by ``digest``, and
    the client that pushed it (past its BARRIER)."""
    with Server(cache_dir=cache_dir) as s:
        raw = Raw.connected(s.address)
        _cache_push(raw, a, 0, "w", digest)
        assert _barrier(raw).tensors == 1
        yield s, raw


def _stalled_reader(address, name: str, nbytes: int) -> Raw:
    """A client that asks for a tensor and takes one byte of the reply: the server is then inside
    its send, holding the tensor's memory, until this socket reads or closes."""
    raw = Raw(address)
    raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.hello()
    raw.send(P.Read(name, 0, nbytes))
    assert raw.sock.recv(1)
    return raw


def _serves(s: Server) -> None:
    ok = Raw.connected(s.address)
    _put(ok, 0, "ok", _f32(4))
    assert _barrier(ok).tensors == 1
    ok.close()


def _commit_traced(raw: Raw) -> tuple[object, int]:
    """COMMIT an open update: the reply, and the peak of the memory Python traced meanwhile (what
    the server allocated to apply and undo it, in this process)."""
    import tracemalloc

    from weightlift.remote.protocol import Commit

    tracemalloc.start()
    try:
        raw.send(Commit())
        reply = raw.recv()
        return reply, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
