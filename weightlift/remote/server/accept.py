"""Accepting connections: one thread accepts, one thread serves each connection.

An :class:`Acceptor` admits each accepted stream to a slot (:mod:`.slots`) or refuses it at once
with a best-effort ERROR, starts the connection's thread, and keeps the streams and threads it
must end and wait for when the server closes. When the process runs out of descriptors it says
so in the log and uses one descriptor kept spare to tell the waiting client why.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time

from weightlift.errors import TransportError
from weightlift.remote.protocol import Error, ErrorCode, send
from weightlift.remote.server.connection import Connection
from weightlift.remote.server.context import Context
from weightlift.remote.server.slots import Slot, Slots
from weightlift.remote.transport import Listener, Stream

__all__ = ["Acceptor"]

_log = logging.getLogger("weightlift.remote.server.server")
# one line per connection, key=value, for an operator's log shipper; never per frame or tensor
_conn_log = logging.getLogger("weightlift.server.connection")


def _spare_descriptor() -> int:
    try:
        return os.open(os.devnull, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return -1


class Acceptor:
    """Serves the connections ``listener`` accepts, under ``slots``, until :meth:`close`."""

    def __init__(self, ctx: Context, slots: Slots):
        self._ctx = ctx
        self.slots = slots
        self._lock = threading.Lock()  # guards the connections and their threads
        self._conns: set[Stream] = set()
        self._threads: set[threading.Thread] = set()
        self.closing = threading.Event()
        self._listener: Listener | None = None
        self._spare_fd = _spare_descriptor()  # given up to refuse a client when descriptors run out
        self._emfile_logged = -1e9

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def loop(self, listener: Listener) -> None:
        """Accept until :meth:`close`."""
        self._listener = listener
        while not self.closing.is_set():
            try:
                stream = self._listener.accept(timeout=0.2)
            except TransportError as e:
                if self.closing.is_set():
                    return
                if getattr(e.__context__, "errno", None) in (errno.EMFILE, errno.ENFILE):
                    self._out_of_descriptors(e)
                time.sleep(0.05)  # back off rather than spin
                continue
            if stream is None:
                continue
            slot = self.slots.admit(stream.peer.rpartition(":")[0], stream.shutdown)
            if isinstance(slot, str):
                self._refuse(stream, slot)
                continue
            with self._lock:
                if self.closing.is_set():
                    slot.release()
                    stream.close()
                    return
                self._conns.add(stream)
                self._ctx.store.count("connections")
                t = threading.Thread(
                    target=self._serve_one, args=(stream, slot), name=f"weightlift-conn {stream.peer}", daemon=True
                )
                self._threads.add(t)
            t.start()

    def _out_of_descriptors(self, e: TransportError) -> None:
        """The process has no descriptor left for a new connection: say so in the log, and use
        the one kept spare to accept the waiting client and tell it why, instead of leaving it
        hanging in the backlog."""
        now = time.monotonic()
        if now - self._emfile_logged > 10.0:
            self._emfile_logged = now
            _log.warning(
                "weightlift server: out of file descriptors (%s); refusing new connections "
                "until some close (raise the limit with `ulimit -n`)",
                e,
            )
        if self._spare_fd < 0 or self._listener is None:
            return
        os.close(self._spare_fd)
        self._spare_fd = -1
        try:
            stream = self._listener.accept(timeout=0)
            if stream is not None:
                self._refuse(stream, "the server is out of file descriptors; try again later")
        except TransportError:
            pass
        finally:
            self._spare_fd = _spare_descriptor()

    def _refuse(self, stream: Stream, why: str) -> None:
        """Close a connection over a limit at once, with a best-effort ERROR that cannot block."""
        _log.info("weightlift server: refused %s: %s", stream.peer, why)
        _conn_log.warning("event=refused peer=%s reason=%s", stream.peer, json.dumps(why))
        try:
            stream.set_timeout(0.0)
            stream.send_parts([send(Error(ErrorCode.LIMIT, why), minor=0)])
            stream.shutdown_write()
            stream.recv_into(memoryview(bytearray(256)))  # a HELLO already here: unread input would reset the reply
        except (TransportError, OSError):
            pass
        stream.close()

    def _serve_one(self, stream: Stream, slot: Slot) -> None:
        t0 = time.monotonic()
        _conn_log.info("event=connection_open peer=%s", stream.peer)
        try:
            Connection(self._ctx, stream, slot=slot).run()
        except Exception:  # a last resort: run() answers what it can; nothing may kill the server
            _log.exception("weightlift server: connection %s failed", stream.peer)
        finally:
            _conn_log.info("event=connection_close peer=%s seconds=%.3f", stream.peer, time.monotonic() - t0)
            stream.close()
            slot.release()
            with self._lock:
                self._conns.discard(stream)
                self._threads.discard(threading.current_thread())

    def close(self) -> None:
        """End every connection (their partial tensors are dropped) and wait for their threads."""
        self.closing.set()
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for s in conns:
            s.shutdown()
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=10)
        if self._spare_fd >= 0:
            os.close(self._spare_fd)
            self._spare_fd = -1
