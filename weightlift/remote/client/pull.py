"""Reading back what a tensor server holds: its listing, and the whole pull into a .safetensors file.

A pull lists the server's tensors (LIST, page by page, bounded in entries and bytes), lays them
out back to back behind one header, and READs each into its place in the file's mapping, a
window of READs in flight. Since protocol 1.2 each READ names the version LIST stated, so a
tensor replaced in between is refused as STALE and read again as its new version when its
layout is the same, or the pull starts over. Since 1.3 LIST states the server's generation
and each READ names it too: once an update is switched in (a whole set at once) every READ is
STALE and the pull starts over, so a file holds one set, never part of two. With ``verify`` the server states each tensor's
digest and the bytes are hashed as they land, a piece at a time while the piece is hot.

The file is written where nobody else chose: an exclusive temporary file of an unpredictable
name beside the target (never a link, never someone else's file), renamed into place only when
every tensor is in (and, with ``verify``, proven). Its mode is what the umask allows a new file,
and the user's alone when the server wanted a token. A listing whose header no safetensors
reader would open is refused before anything is written.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, NamedTuple

import blake3

from weightlift.errors import (
    FileError,
    IntegrityError,
    LocalProtocolError,
    RemoteProtocolError,
    StateError,
    WeightliftError,
)
from weightlift.formats.safetensors import build_header
from weightlift.remote.client.connection import Connection, Replaced
from weightlift.remote.protocol import ListEntry, ListReply, ListRequest, ModelStats, Read, ReadReply, Stats, StatsReply

__all__ = [
    "RemoteTensor",
    "ServerReport",
    "server_report",
    "MAX_LIST_ENTRIES",
    "MAX_LIST_BYTES",
    "READ_WINDOW",
    "PULL_ATTEMPTS",
    "PULL_PIECE",
    "listing",
    "Pull",
    "read_tensors",
    "pulled_mode",
]

READ_WINDOW = 32  # READs in flight during a pull
PULL_ATTEMPTS = 3  # a pull that finds tensors replaced under it starts over this many times at most
PULL_PIECE = 4 << 20  # a verifying pull hashes what it received this much at a time, while it is hot
#: The most tensors a listing takes from a server (a server states none of its own): a server
#: that answers every LIST with "more" cannot make the client loop or grow unbounded.
MAX_LIST_ENTRIES = 1 << 20
#: The most bytes of entries (names, shapes, the fixed fields, as on the wire) a listing takes
#: from a server: long names cannot make a listing of few entries huge.
MAX_LIST_BYTES = 128 << 20


class RemoteTensor(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class ServerReport:
    """A server's answer to STATS: ``figures`` by name (counters since start and state now, as
    :class:`~weightlift.remote.server.stats.ServerStats` names them), its ``models`` (at most
    :data:`~weightlift.remote.protocol.MAX_MODELS`, in name order) and ``models_total``, how
    many it holds (more than ``models`` lists when some were left out)."""

    figures: dict[str, int]
    models: tuple[ModelStats, ...]
    models_total: int

    def __getitem__(self, key: str) -> int:
        return self.figures[key]

    def model(self, name: str) -> ModelStats | None:
        """The model ``name`` ("" the default), or None where the reply does not list it."""
        return next((m for m in self.models if m.name == name), None)

    def as_dict(self) -> dict[str, object]:
        return {
            "figures": dict(self.figures),
            "models": [
                {"name": m.name, "tensors": m.tensors, "bytes": m.nbytes, "pushing": m.pushing} for m in self.models
            ],
            "models_total": self.models_total,
        }


def server_report(conn: Connection) -> ServerReport:
    """STATS, and its reply as a :class:`ServerReport`."""
    conn.send(conn.frame(Stats()))
    reply: StatsReply = conn.expect(StatsReply)
    return ServerReport(dict(reply.figures), reply.models, reply.models_total)


def listing(conn: Connection) -> list[ListEntry]:
    """LIST, page by page: every complete tensor in name order, with its version (minor 2; else 0).
    ``conn.listed_generations`` holds the generation each page stated (minor 3; else 0).

    RemoteProtocolError if the pages go out of order (else a server could repeat them forever)
    or the listing passes :data:`MAX_LIST_ENTRIES` entries or :data:`MAX_LIST_BYTES` bytes."""
    out: list[ListEntry] = []
    after = ""
    size = 0
    conn.listed_generations = generations = []
    while True:
        conn.send(conn.frame(ListRequest(after)))
        page: ListReply = conn.expect(ListReply)
        generations.append(page.generation)
        prev = after
        for e in page.entries:  # name order, each page after the last
            if (out or prev) and e.name <= prev:
                raise RemoteProtocolError(f"LIST reply is out of order: {e.name!r:.80} after {prev!r:.80}")
            prev = e.name
        if len(out) + len(page.entries) > MAX_LIST_ENTRIES:
            raise RemoteProtocolError(f"server lists more than {MAX_LIST_ENTRIES} tensors; stopped reading")
        size += sum(_entry_bytes(e) for e in page.entries)
        if size > MAX_LIST_BYTES:
            raise RemoteProtocolError(f"server lists more than {MAX_LIST_BYTES} bytes of tensors; stopped reading")
        out.extend(page.entries)
        if not page.more or not page.entries:
            return out
        after = page.entries[-1].name


def _entry_bytes(e: ListEntry) -> int:
    """What one listing entry takes on the wire: its fixed fields, name, dims and version."""
    return ListEntry.LAYOUT.size + len(e.name.encode("utf-8", "surrogatepass")) + 8 * len(e.shape) + 8


class Pull:
    """One pull of everything the server on ``conn`` (named ``where`` in errors) holds into
    ``path``, run by :meth:`run`. ``progress(done, total)`` is told the bytes received after each
    tensor (a pull that starts over starts its count over). ``protected``: the connection proved a token (the file is then
    0600). ``settled`` says afterwards whether the connection is still in step with the server
    (every reply read): if not, it is unusable."""

    def __init__(
        self,
        conn: Connection,
        path: str | os.PathLike[str],
        *,
        where: str,
        verify: bool,
        protected: bool,
        progress: Callable[[int, int], None] | None = None,
    ):
        if verify and not conn.verify:
            raise LocalProtocolError(
                f"pull(verify=True): the server speaks protocol 1.{conn.minor}, which cannot state digests "
                "(it needs minor 2)"
            )
        self.conn, self.path, self.where = conn, os.fspath(path), where
        self.verify, self.protected = verify, protected
        self.progress = progress  # (bytes done, bytes in all), as each tensor arrives
        self.settled = True
        self.generation = 0  # the server's generation as listed: a set switched in after makes READs STALE

    def run(self) -> list[RemoteTensor]:
        """Write the file; returns its tensors. A pull that keeps finding tensors replaced under
        it gives up after :data:`PULL_ATTEMPTS` with StateError."""
        for attempt in range(PULL_ATTEMPTS):
            try:
                return self._once()
            except Replaced as e:
                if attempt == PULL_ATTEMPTS - 1:
                    raise StateError(
                        f"pull from {self.where}: tensors kept being replaced while they were read "
                        f"({PULL_ATTEMPTS} attempts; last: {e})"
                    ) from None
        raise AssertionError("unreachable")

    def _once(self) -> list[RemoteTensor]:
        """One pass: list, then READ each tensor as listed (minor 2: that version only). A tensor
        replaced in between by one of the same dtype and shape is read again as its new version
        (each tensor in the file is then whole, as some version was); one replaced by another
        layout raises Replaced, and no file is written."""
        listed = listing(self.conn)
        gens = self.conn.listed_generations
        if len(set(gens)) > 1:
            raise Replaced("an update was switched in while the tensors were listed")
        self.generation = gens[0] if gens else 0  # minor 3: every READ names it
        entries = [RemoteTensor(e.name, e.dtype, e.shape, e.nbytes) for e in listed]
        # a header no loader would open is refused before anything is written
        header, offsets = build_header([(e.name, e.dtype, e.shape, e.nbytes) for e in entries], file=self.path)
        tmp: str | None = None
        try:
            # a fresh name nobody could have made or linked ahead (O_EXCL, O_NOFOLLOW, mode 0600),
            # in the target's folder so the rename is atomic
            fd, tmp = tempfile.mkstemp(
                dir=os.path.dirname(os.path.abspath(self.path)),
                prefix=f".{os.path.basename(self.path)}.",
                suffix=".wl-tmp",
            )
            with os.fdopen(fd, "w+b") as f:
                self._write(f, header, listed, [len(header) + o for o in offsets])
                os.fchmod(f.fileno(), pulled_mode(protected=self.protected))
            os.replace(tmp, self.path)
        except (IntegrityError, Replaced):
            _unlink(tmp)  # every reply was read: the connection is still in step
            raise
        except OSError as e:
            _unlink(tmp)
            if isinstance(e, WeightliftError):  # the connection's (TransportError is an OSError too)
                self.settled = False
                raise
            raise FileError(f"cannot write: {e.strerror or e}", file=self.path, errno=e.errno) from None
        except BaseException:
            _unlink(tmp)
            self.settled = False  # replies may still be in flight
            raise
        return entries

    def _write(self, f: IO[bytes], header: bytes, listed: list[ListEntry], starts: list[int]) -> None:
        """The header, then every tensor READ into its place in the file's mapping."""
        total = len(header) + sum(e.nbytes for e in listed)
        f.truncate(total)
        f.write(header)
        f.flush()
        mm = mmap.mmap(f.fileno(), total) if total > len(header) else None
        try:
            differ = self._read_current(listed, starts, mm)
            if differ:
                raise IntegrityError(
                    f"pull from {self.where}: {len(differ)} of {len(listed)} tensors "
                    "arrived other than the server states them: " + ", ".join(differ)
                )
            if mm is not None:
                mm.flush()
        finally:
            if mm is not None:
                mm.close()

    def _read_current(self, listed: list[ListEntry], starts: list[int], mm: mmap.mmap | None) -> list[str]:
        """READ every listed tensor; those replaced since by the same layout are read again as
        their new version. Returns the names that differ from their stated digest (``verify``)."""
        total, done = sum(e.nbytes for e in listed), 0

        def arrived(n: int) -> None:
            nonlocal done
            done = min(done + n, total)  # a tensor read again counts once
            if self.progress is not None:
                self.progress(done, total)

        differ, stale = read_tensors(self.conn, listed, starts, mm, self.verify, self.generation, arrived)
        for _ in range(PULL_ATTEMPTS):
            if not stale:
                return differ
            now = {e.name: e for e in listing(self.conn)}
            if self.generation and any(g != self.generation for g in self.conn.listed_generations):
                # an update switched in: what was read is of the old set, so all of it goes again
                raise Replaced("an update was switched in while the tensors were read")
            again = [now.get(listed[i].name) for i in stale]
            moved = [
                listed[i].name
                for i, e in zip(stale, again, strict=True)
                if e is None or _layout(e) != _layout(listed[i])
            ]
            if moved:
                raise Replaced(", ".join(map(repr, moved)) + " replaced by another layout since listed")
            more, stale_again = read_tensors(
                self.conn,
                [e for e in again if e is not None],
                [starts[i] for i in stale],
                mm,
                self.verify,
                self.generation,
                arrived,
            )
            differ += more
            stale = [stale[k] for k in stale_again]
        if stale:
            raise Replaced(", ".join(repr(listed[i].name) for i in stale) + " replaced again and again")
        return differ


def read_tensors(
    conn: Connection,
    entries: list[ListEntry],
    starts: list[int],
    mm: mmap.mmap | None,
    verify: bool = False,
    generation: int = 0,
    arrived: Callable[[int], None] | None = None,
) -> tuple[list[str], list[int]]:
    """READ every entry into its place in ``mm``; with ``verify`` each is hashed as it lands,
    a piece at a time while the piece is hot, and the names that differ are returned.

    Each READ asks for the version listed; the positions in ``entries`` of those the server
    answers were replaced since are returned beside the names that differ, their bytes not
    read. A non-zero ``generation`` (minor 3) makes every READ STALE once another set was
    switched in since the listing. ``arrived(nbytes)`` is called after each tensor received."""
    view = memoryview(mm) if mm is not None else memoryview(b"")
    flags = Read.FLAG_DIGEST if verify else 0
    differ: list[str] = []
    replaced: list[int] = []
    dest = view
    try:
        sent = 0
        for i, e in enumerate(entries):
            while sent < len(entries) and sent < i + READ_WINDOW:
                x = entries[sent]
                version = x.version if conn.minor >= 2 else 0
                conn.send(conn.frame(Read(x.name, 0, x.nbytes, flags, version, generation if conn.minor >= 3 else 0)))
                sent += 1
            try:
                reply: ReadReply = conn.expect(ReadReply)
            except Replaced:
                replaced.append(i)
                continue
            if reply.length != e.nbytes:
                raise RemoteProtocolError(f"READ of {e.name!r} returned {reply.length} bytes, not {e.nbytes}")
            dest = view[starts[i] : starts[i] + e.nbytes]
            if not verify:
                conn.recv_payload(dest)
            elif _received_digest(conn, dest, e.name, reply.digest) != reply.digest:
                differ.append(repr(e.name))
            if arrived is not None:
                arrived(e.nbytes)
    except BaseException as exc:
        _drop_locals(exc)  # the frames it passed through hold slices of the mapping
        raise
    finally:
        # released here, not when the frames of a traceback go: the mapping closes next
        for v in (dest, view):
            v.release()
    return differ, replaced


def _received_digest(conn: Connection, dest: memoryview, name: str, stated: bytes | None) -> bytes:
    """Receive the payload into ``dest`` a piece at a time, hashing each piece while it is hot."""
    if stated is None:
        raise RemoteProtocolError(f"READ of {name!r}: the server stated no digest")
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO if len(dest) >= PULL_PIECE else 1)
    for pos in range(0, len(dest), PULL_PIECE):
        with dest[pos : pos + PULL_PIECE] as piece:
            conn.recv_payload(piece)
            hasher.update(piece)
    return hasher.digest()


def _layout(e: ListEntry) -> tuple[str, tuple[int, ...], int]:
    return e.dtype, e.shape, e.nbytes


def _drop_locals(e: BaseException | None) -> None:
    """Clear the finished frames of ``e``'s traceback and of the errors it arose from, so that no
    view they held keeps a mapping from closing."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__context__


def umask() -> int:
    """The process's umask, read without changing it where the system tells (Linux's
    /proc/self/status); else set and restored, briefly the strictest mask rather than none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def pulled_mode(*, protected: bool) -> int:
    """The mode of a pulled file: what the umask allows a new file, and the user's alone when the
    server wanted a token (its tensors are as private as the server's memory)."""
    return 0o600 if protected else 0o666 & ~umask()


def _unlink(path: str | None) -> None:
    if path is None:
        return
    try:
        os.unlink(path)
    except OSError:
        pass
