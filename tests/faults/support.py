"""What the fault tests share: a real ``weightlift serve`` process, a client stream that stalls
on cue, the descriptors and threads of a process, and byte-for-byte checks against the source."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import blake3
import numpy as np

from weightlift.digest.blake import PARALLEL_HASH_MIN, hash_buffer
from weightlift.remote.transport import TCP, Stream

__all__ = [
    "ServeProcess",
    "Stall",
    "StallingBackend",
    "fd_count",
    "thread_count",
    "warm_up_hashing",
    "cache_files",
    "assert_entries_sound",
    "source_bytes",
    "assert_same_tensors",
    "hex_digest",
]

_SERVING = re.compile(r"serving on ([^\s:]+):(\d+)")


class ServeProcess:
    """``weightlift serve`` in a subprocess, on a free port; its stderr goes to ``log``."""

    def __init__(self, *args: str, log: Path, env: dict[str, str] | None = None):
        self.log_path = log
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weightlift", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, **(env or {})},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        m = _SERVING.search(line)
        if m is None:
            self.stop()
            raise AssertionError(f"the server did not start: {line!r}; log: {self.log()}")
        self.address = (m.group(1), int(m.group(2)))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> int:
        """SIGKILL: no cleanup of any kind runs. Returns the exit status."""
        self.proc.kill()
        return self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Stall:
    """Lets ``limit`` bytes through the client's streams, then holds every further send until
    :meth:`release`; the send that crosses the limit goes out up to it first, so the stall can
    fall inside a tensor's bytes. ``stalled`` is set once a send is being held."""

    def __init__(self, limit: int):
        self.limit = limit
        self.sent = 0
        self.stalled = threading.Event()
        self._go = threading.Event()
        self._lock = threading.Lock()

    def release(self) -> None:
        self._go.set()

    def allow(self, n: int) -> int:
        """How many of the next ``n`` bytes may go now; the caller then calls :meth:`hold`."""
        with self._lock:
            k = max(0, min(n, self.limit - self.sent))
            self.sent += k
            return k

    def hold(self) -> None:
        self.stalled.set()
        self._go.wait()


class _StallingStream:
    def __init__(self, inner: Stream, stall: Stall):
        self._inner = inner
        self._stall = stall
        self.peer = inner.peer

    def send_parts(self, parts: Sequence[Any]) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        k = self._stall.allow(sum(v.nbytes for v in views))
        if k == sum(v.nbytes for v in views):
            self._inner.send_parts(views)
            return
        head, rest = [], []
        for v in views:
            take = min(k, v.nbytes)
            head.append(v[:take])
            rest.append(v[take:])
            k -= take
        if any(v.nbytes for v in head):
            self._inner.send_parts([v for v in head if v.nbytes])
        self._stall.hold()
        self._inner.send_parts([v for v in rest if v.nbytes])

    def sendfile(self, fd: int, offset: int, count: int) -> None:
        k = self._stall.allow(count)
        if k:
            self._inner.sendfile(fd, offset, k)
        if k < count:
            self._stall.hold()
            self._inner.sendfile(fd, offset + k, count - k)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class StallingBackend:
    """TCP whose client streams stall after ``stall.limit`` bytes (a client frozen mid-push)."""

    def __init__(self, stall: Stall):
        self.stall = stall

    def connect(self, address: Any, *, timeout: float | None = 30.0) -> Any:
        return _StallingStream(TCP.connect(address, timeout=timeout), self.stall)

    def listen(self, host: str, port: int, *, backlog: int = 64) -> Any:
        return TCP.listen(host, port, backlog=backlog)


def fd_count(pid: int | None = None, *, besides: Path | None = None) -> int:
    """Open descriptors of a process (this one by default), from /proc; ``besides``: not counting
    those open on that file (a client in the same process keeps its checkpoint mapped)."""
    folder = f"/proc/{pid or 'self'}/fd"
    n = 0
    for fd in os.listdir(folder):
        try:
            n += besides is None or os.readlink(f"{folder}/{fd}") != str(besides)
        except OSError:  # closed meanwhile (the descriptor listdir itself used)
            continue
    return n


def thread_count(pid: int | None = None) -> int:
    """Threads of a process (this one by default), from /proc: native ones too."""
    return len(os.listdir(f"/proc/{pid or 'self'}/task"))


def warm_up_hashing() -> None:
    """Start blake3's thread pool, which lives as long as the process once a parallel hash made
    it: a count of threads taken after this comes back to the same figure."""
    hash_buffer(np.zeros(PARALLEL_HASH_MIN * 4, dtype=np.uint8))


def cache_files(root: Path) -> tuple[list[Path], list[Path]]:
    """(entries, other files) under a cache root: entries are named by a full hex digest."""
    entries, other = [], []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            (entries if re.fullmatch(r"[0-9a-f]{64}", p.name) and p.parent.name == p.name[:2] else other).append(p)
    return entries, other


def assert_entries_sound(root: Path) -> list[Path]:
    """Every entry under ``root`` hashes to its name (no half-written or wrong entry); returns them."""
    entries, _ = cache_files(root)
    for e in entries:
        assert blake3.blake3(e.read_bytes()).hexdigest() == e.name, f"cache entry {e.name} is not its digest"
    return entries


def source_bytes(path: Path) -> dict[str, bytes]:
    """Each tensor's bytes as the file holds them, read by the format's definition, not weightlift."""
    data = Path(path).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    return {k: data[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]] for k, v in header.items()}


def assert_same_tensors(got: dict[str, Any], want: dict[str, bytes]) -> None:
    """``got`` (arrays) holds exactly the tensors of ``want``, byte for byte."""
    assert sorted(got) == sorted(want)
    for name, raw in want.items():
        arr = got[name]
        assert np.ascontiguousarray(arr).tobytes() == raw, f"tensor {name!r} differs from the source"


def hex_digest(data: bytes) -> str:
    """The BLAKE3 hex digest a cache entry for ``data`` is named by."""
    return blake3.blake3(data).hexdigest()
