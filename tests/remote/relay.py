"""A TCP relay for tests: forwards bytes between a client and a server, and can change one byte
on the way (an attacker on the path, after a valid handshake)."""

from __future__ import annotations

import socket
import threading


class Relay:
    """Listens on loopback and forwards every connection to ``target``.

    ``tamper``: ``(direction, pattern, index)`` flips the bits of byte ``index`` of the first
    occurrence of ``pattern`` in that direction ("c2s" or "s2c"), once over the relay's life.
    ``flipped`` says whether it happened. Until it has, the last ``len(pattern) - 1`` bytes are
    held back so that a pattern split between two receives is still found; they go out as soon
    as the source pauses, so a request never waits on them.
    """

    def __init__(self, target: tuple[str, int], tamper: tuple[str, bytes, int] | None = None):
        self.target = target
        self.tamper = tamper
        self.flipped = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = self._sock.getsockname()[:2]
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._lock = threading.Lock()
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            for src, dst, direction in ((client, server, "c2s"), (server, client, "s2c")):
                t = threading.Thread(target=self._pump, args=(src, dst, direction), daemon=True)
                t.start()
                self._threads.append(t)

    def _match(self, direction: str) -> tuple[bytes, int] | None:
        if self.tamper is None or self.tamper[0] != direction or self.flipped.is_set():
            return None
        return self.tamper[1], self.tamper[2]

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        held = b""
        try:
            while True:
                want = self._match(direction)
                src.settimeout(0.05 if held else None)
                try:
                    data = src.recv(1 << 20)
                except TimeoutError:
                    dst.sendall(held)  # the source paused: nothing more of a split pattern is coming soon
                    held = b""
                    continue
                if not data:
                    dst.sendall(held)
                    break
                buf = held + data
                held = b""
                if want is not None:
                    pattern, index = want
                    at = buf.find(pattern)
                    with self._lock:
                        if at >= 0 and not self.flipped.is_set():
                            raw = bytearray(buf)
                            raw[at + index] ^= 0xFF
                            buf = bytes(raw)
                            self.flipped.set()
                    if not self.flipped.is_set() and len(pattern) > 1:
                        keep = min(len(buf), len(pattern) - 1)
                        buf, held = buf[: len(buf) - keep], buf[len(buf) - keep :]
                dst.sendall(buf)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closing = True
        self._sock.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
