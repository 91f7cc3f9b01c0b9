"""The push client: sends a checkpoint's tensors to a tensor server, and lists and pulls them back.

Theory of operation: a push is a pipeline, not a conversation. For each tensor the client sends
ALLOC and WRITE headers and the payload in one scatter-gather send, straight from the file's
mapping (or with sendfile for large payloads): no staging copy, no zero-fill, and no reply to
wait for. One BARRIER at the end collects what the server completed and any errors.

Hashing happens only where it can pay: when the server's HELLO says it keeps a cache, and only
for tensors of at least ``hash_threshold`` bytes (1 MiB by default, so the experts of a
mixture-of-experts checkpoint are covered). Their digests come from the file's sidecar
manifest when it has them (so a second push of the same file hashes nothing) and are otherwise
computed on worker threads while the sender moves the small tensors. Each batch of large
tensors whose digests are ready is asked about in one HAVE; the server fills the ones it has
from its cache, and the rest are sent with their digest so the server can cache them. If a
cache entry turns out to be bad, the BARRIER reply lists the tensor and the client sends it.

``streams=N`` spreads the tensors over N connections, balanced by bytes, one thread each.
``WEIGHTLIFT_LOAD_OPT=0`` restores the naive client for A/B runs: every tensor of at least
10 MiB hashed inline whatever the server, header and payload copied into a fresh zero-filled
buffer, and a BARRIER round trip after every tensor.
"""

from __future__ import annotations

import builtins
import mmap
import os
import ssl
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, overload

import blake3

from weightlift import env
from weightlift.checkpoint import Checkpoint, Select, open_checkpoint
from weightlift.digest.blake import HASH_THRESHOLD, NAIVE_HASH_THRESHOLD
from weightlift.errors import (
    FileError,
    FormatError,
    IntegrityError,
    LocalProtocolError,
    OptionError,
    PushError,
    RemoteProtocolError,
    StateError,
)
from weightlift.formats.safetensors import MAX_HEADER_SIZE, PREFIX_SIZE, build_header
from weightlift.profile import Profiler
from weightlift.remote.client.connection import Connection, Replaced
from weightlift.remote.client.push import Hashing, Plan, Pusher, Tally, balance, wire_form
from weightlift.remote.protocol import (
    MAX_TENSORS,
    PROTOCOL_MINOR,
    Free,
    FreeReply,
    Hello,
    ListEntry,
    ListReply,
    ListRequest,
    Read,
    ReadReply,
)
from weightlift.remote.transport import TCP, Backend, TlsBackend

__all__ = ["Client", "PushResult", "RemoteTensor"]

READ_WINDOW = 32  # READs in flight during a pull
PULL_ATTEMPTS = 3  # a pull that finds tensors replaced under it starts over this many times at most
PULL_PIECE = 4 << 20  # a verifying pull hashes what it received this much at a time, while it is hot
#: The most tensors :meth:`Client.list` takes from a server (a server states none of its own):
#: a server that answers every LIST with "more" cannot make the client loop or grow unbounded.
MAX_LIST_ENTRIES = 1 << 20
#: The most bytes of entries (names, shapes, the fixed fields, as on the wire) that
#: :meth:`Client.list` takes from a server: long names cannot make a listing of few entries huge.
MAX_LIST_BYTES = 128 << 20


@dataclass(frozen=True)
class PushResult:
    """What a push did. ``bytes``: tensor bytes now on the server; ``bytes_sent``: payload that
    crossed the wire; ``bytes_hashed``: bytes hashed by this push; ``cached``: tensors the server
    filled from its cache; ``profile``: the profiler report when profiling was on; ``verified``:
    tensors proven to be on the server as they are in the file (``verify=True``)."""

    tensors: int
    bytes: int
    bytes_sent: int
    bytes_hashed: int
    cached: int
    seconds: float
    profile: dict[str, Any] | None = None
    verified: int = 0  # tensors whose digest the server reported and the client matched (verify=True)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class RemoteTensor(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def _address_key(addr: Any) -> str:
    return addr if isinstance(addr, str) else f"{addr[0]}:{addr[1]}"


class Client:
    """A connection (or ``streams`` connections) to a tensor server.

    ``address`` is ``"host:port"`` or ``(host, port)``. ``token`` (str or bytes) answers a server
    that wants AUTH. ``profile``: None reads WEIGHTLIFT_LOADPROF, a bool forces it, or pass a
    :class:`~weightlift.profile.Profiler`. ``protocol_minor`` speaks an older minor version.
    ``timeout`` (seconds, None for none) bounds the connect and every blocking send and receive
    after it: a server that stops reading or answering makes a call fail with TransportError.
    ``tls``: a client ``ssl.SSLContext`` (:func:`~weightlift.remote.transport.client_tls_context`)
    to speak TLS to a server started with one; every connection, and every server of
    ``push(to=...)``, uses it.
    """

    def __init__(
        self,
        address: str | tuple[str, int],
        *,
        token: str | bytes | None = None,
        streams: int = 1,
        profile: Profiler | bool | None = None,
        timeout: float | None = 30.0,
        protocol_minor: int = PROTOCOL_MINOR,
        backend: Backend = TCP,
        tls: ssl.SSLContext | None = None,
    ):
        if tls is not None:
            if backend is not TCP:
                raise OptionError("pass tls= or backend=, not both")
            backend = TlsBackend(tls)
        if not isinstance(streams, int) or streams < 1:
            raise OptionError(f"streams must be a positive integer, got {streams!r}")
        if not 0 <= protocol_minor <= PROTOCOL_MINOR:
            raise OptionError(f"protocol_minor must be between 0 and {PROTOCOL_MINOR}")
        self.address = address
        self._token = token.encode() if isinstance(token, str) else token
        self.streams = streams
        self._minor = protocol_minor
        self._timeout = timeout
        self._backend = backend
        self._opt = env.load_opt()
        self.profiler = profile if isinstance(profile, Profiler) else Profiler(profile)
        # A profiler of our own reports one push at a time; one passed in accumulates as its owner wishes.
        self._own_profiler = not isinstance(profile, Profiler)
        self._conns: list[Connection] = [self._connect()]

    def _connect(self) -> Connection:
        return Connection(
            self._backend.connect(self.address, timeout=self._timeout),
            token=self._token,
            minor=self._minor,
            timeout=self._timeout,
        )

    @property
    def server_hello(self) -> Hello:
        """The server's HELLO: its version, capability flags and limits."""
        return self._conn().server

    def _conn(self) -> Connection:
        if not self._conns:
            raise StateError("the client is closed")
        return self._conns[0]

    def close(self) -> None:
        """Say BYE and close every connection."""
        conns, self._conns = self._conns, []
        for c in conns:
            c.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- push ----------------------------------------------------------------------------------

    @overload
    def push(
        self,
        source: str | os.PathLike[str] | Checkpoint,
        *,
        select: Select = None,
        hash_threshold: int | None = None,
        verify: bool = False,
        to: None = None,
    ) -> PushResult: ...

    @overload
    def push(
        self,
        source: str | os.PathLike[str] | Checkpoint,
        *,
        select: Select = None,
        hash_threshold: int | None = None,
        verify: bool = False,
        to: Mapping[Any, Select] | Sequence[Any],
    ) -> dict[str, PushResult]: ...

    def push(
        self,
        source: str | os.PathLike[str] | Checkpoint,
        *,
        select: Select = None,
        hash_threshold: int | None = None,
        verify: bool = False,
        to: Mapping[Any, Select] | Sequence[Any] | None = None,
    ) -> PushResult | dict[str, PushResult]:
        """Send the selected tensors of a checkpoint to the server; returns when all have landed.

        ``hash_threshold``: tensors of at least this many bytes are hashed and asked about when
        the server keeps a cache (default :data:`~weightlift.digest.blake.HASH_THRESHOLD`).

        ``to`` pushes to more servers at the same time (a model split over several workers):
        ``{address: select}`` gives each its own selection, a list of addresses sends each
        ``select``. This client's server gets ``select`` as well; every push runs on its own
        thread with this client's token, streams and timeout, the checkpoint opened once. Returns
        ``{address: PushResult}`` once every push has landed; if any failed, every push still
        runs to its end and :class:`~weightlift.errors.PushError` holds each error and result.

        ``verify``: the server hashes every tensor as it lands and reports the digests of what it
        stored; the client compares them with the file's (its sidecar manifest, else hashed
        while it sends) and raises :class:`~weightlift.errors.IntegrityError` naming every
        tensor that differs. Needs a server of protocol minor 2 (LocalProtocolError otherwise).
        Without it a push reports what the server received, not that the bytes are right: on a
        connection without a token, bytes changed in flight are stored and the push succeeds.
        """
        if to is not None:
            return self._push_to(source, select, hash_threshold, to, verify)
        if hash_threshold is None:
            hash_threshold = HASH_THRESHOLD if self._opt else NAIVE_HASH_THRESHOLD
        ck = source if isinstance(source, Checkpoint) else open_checkpoint(source)
        plans = [wire_form(t) for t in ck.select(select)]
        self._conn()
        while len(self._conns) < self.streams:
            self._conns.append(self._connect())
        conns = self._conns[: self.streams]
        if verify and not all(c.verify for c in conns):
            raise LocalProtocolError(
                f"push(verify=True): the server speaks protocol 1.{conns[0].minor}, which cannot report "
                "digests (it needs minor 2)"
            )
        prof = self.profiler
        if self._own_profiler:
            prof.reset()
        tally = Tally()
        t0 = time.perf_counter()
        hashing = Hashing(
            plans, threshold=hash_threshold, prof=prof, enabled=self._opt and conns[0].cache, verify=verify
        )
        ok = False
        pushers = [Pusher(c, self._opt, prof, tally, hashing, hash_threshold, verify) for c in conns]
        try:
            groups = balance(plans, len(conns))
            if len(conns) == 1:
                pushers[0].run(groups[0])
            else:
                self._push_parallel(pushers, groups)
            ok = True
        except BaseException:
            # Unless every connection ended at a BARRIER reply (the server's errors), one may be
            # mid-message or hold tensors allocated ahead and never written: it is unusable.
            if not all(p.settled for p in pushers):
                self.close()
            raise
        finally:
            hashing.close(ok=ok)
        seconds = time.perf_counter() - t0
        if tally.differ:
            raise IntegrityError(
                f"push to {_address_key(self.address)}: {len(tally.differ)} of {len(plans)} tensors are not on "
                "the server as they are in the file: " + ", ".join(tally.differ)
            )
        return PushResult(
            tally.tensors,
            tally.bytes,
            tally.sent,
            tally.hashed + hashing.hashed_bytes,
            tally.cached,
            seconds,
            prof.report() if prof.enabled else None,
            tally.verified,
        )

    def _push_to(
        self,
        source: str | os.PathLike[str] | Checkpoint,
        select: Select,
        hash_threshold: int | None,
        to: Mapping[Any, Select] | Sequence[Any],
        verify: bool,
    ) -> dict[str, PushResult]:
        ck = source if isinstance(source, Checkpoint) else open_checkpoint(source)
        others = dict(to) if isinstance(to, Mapping) else {a: select for a in to}
        targets = {_address_key(self.address): select, **{_address_key(a): s for a, s in others.items()}}
        if len(targets) != len(others) + 1:
            raise OptionError("push(to=...): every server once, this client's own not again")
        for sel in targets.values():
            ck.select(sel)  # a selection that matches nothing fails here, before any byte is sent
        results: dict[str, PushResult] = {}
        errors: dict[str, BaseException] = {}
        lock = threading.Lock()

        def run(addr: Any, sel: Select) -> None:
            key = _address_key(addr)
            try:
                if key == _address_key(self.address):
                    res = self.push(ck, select=sel, hash_threshold=hash_threshold, verify=verify)
                else:
                    with Client(
                        addr,
                        token=self._token,
                        streams=self.streams,
                        timeout=self._timeout,
                        protocol_minor=self._minor,
                        backend=self._backend,
                    ) as c:
                        res = c.push(ck, select=sel, hash_threshold=hash_threshold, verify=verify)
                with lock:
                    results[key] = res
            except Exception as e:  # noqa: BLE001 - gathered and raised in the caller's thread
                with lock:
                    errors[key] = e

        pairs = [(self.address, select), *others.items()]
        threads = [
            threading.Thread(target=run, args=pair, name=f"weightlift-push {i}", daemon=True)
            for i, pair in enumerate(pairs)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise PushError(errors, results)
        return results

    def _push_parallel(self, pushers: list[Pusher], groups: list[list[Plan]]) -> None:
        errors: list[BaseException] = []

        def run(pusher: Pusher, group: list[Plan]) -> None:
            try:
                pusher.run(group)
            except BaseException as e:  # re-raised in the caller's thread
                errors.append(e)

        threads = [
            threading.Thread(target=run, args=(p, g), name=f"weightlift-push {i}", daemon=True)
            for i, (p, g) in enumerate(zip(pushers, groups, strict=False))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    # -- list / pull / free --------------------------------------------------------------------------

    def list(self) -> list[RemoteTensor]:
        """Every complete tensor the server holds, in name order."""
        return [RemoteTensor(e.name, e.dtype, e.shape, e.nbytes) for e in self._listing()]

    def _listing(self) -> builtins.list[ListEntry]:
        """LIST, page by page: the entries with their versions (minor 2; else 0)."""
        conn = self._conn()
        out: builtins.list[ListEntry] = []
        after = ""
        size = 0
        while True:
            conn.send(conn.frame(ListRequest(after)))
            page = conn.expect(ListReply)
            prev = after
            for e in page.entries:  # name order, each page after the last: else it could repeat forever
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

    def free(self, names: Sequence[str]) -> int:
        """Drop the named tensors on the server; returns how many existed."""
        conn = self._conn()
        freed = 0
        batch: list[str] = []
        size = 0
        for n in [names] if isinstance(names, str) else names:
            cost = len(n.encode()) + 2
            if batch and (len(batch) >= MAX_TENSORS or size + cost > conn.max_frame - 64):
                freed += self._free_batch(conn, batch)
                batch, size = [], 0
            batch.append(n)
            size += cost
        return freed + (self._free_batch(conn, batch) if batch else 0)

    @staticmethod
    def _free_batch(conn: Connection, names: builtins.list[str]) -> int:
        conn.send(conn.frame(Free(tuple(names))))
        return conn.expect(FreeReply).freed

    def pull(self, path: str | os.PathLike[str], *, verify: bool = False) -> builtins.list[RemoteTensor]:
        """Write every tensor the server holds to ``path`` as a .safetensors file; returns them.

        ``verify``: the server states the digest of each tensor as it sends it, the client hashes
        the bytes as they land, and the file is kept only if every tensor matches (else
        :class:`~weightlift.errors.IntegrityError` naming each one that differs, and no file).
        Needs a server of protocol minor 2 (LocalProtocolError otherwise).
        """
        conn = self._conn()
        if verify and not conn.verify:
            raise LocalProtocolError(
                f"pull(verify=True): the server speaks protocol 1.{conn.minor}, which cannot state digests "
                "(it needs minor 2)"
            )
        for attempt in range(PULL_ATTEMPTS):
            try:
                return self._pull_once(conn, os.fspath(path), verify)
            except Replaced as e:
                if attempt == PULL_ATTEMPTS - 1:
                    raise StateError(
                        f"pull from {_address_key(self.address)}: tensors kept being replaced while they were "
                        f"read ({PULL_ATTEMPTS} attempts; last: {e})"
                    ) from None
        raise AssertionError("unreachable")

    def _pull_once(self, conn: Connection, path: str, verify: bool) -> builtins.list[RemoteTensor]:
        """One pass of :meth:`pull`: list, then READ each tensor as listed (minor 2: that version
        only). A tensor replaced in between by one of the same dtype and shape is read again as
        its new version (each tensor in the file is then whole, as some version was); one
        replaced by another layout raises Replaced, and no file is written."""
        listed = self._listing()
        entries = [RemoteTensor(e.name, e.dtype, e.shape, e.nbytes) for e in listed]
        header, offsets = build_header([(e.name, e.dtype, e.shape, e.nbytes) for e in entries])
        if len(header) - PREFIX_SIZE > MAX_HEADER_SIZE:  # neither weightlift nor safetensors would open it
            raise FormatError(
                f"pull from {_address_key(self.address)}: the header of {len(entries)} tensors would be "
                f"{len(header) - PREFIX_SIZE} bytes, which exceeds the limit of {MAX_HEADER_SIZE} bytes that "
                "safetensors readers accept; nothing written",
                file=path,
            )
        total = len(header) + sum(e.nbytes for e in entries)
        tmp: str | None = None
        try:
            # a fresh name nobody could have made or linked ahead (O_EXCL, O_NOFOLLOW, mode 0600),
            # in the target's folder so the rename is atomic
            fd, tmp = tempfile.mkstemp(
                dir=os.path.dirname(os.path.abspath(path)), prefix=f".{os.path.basename(path)}.", suffix=".wl-tmp"
            )
            with os.fdopen(fd, "w+b") as f:
                f.truncate(total)
                f.write(header)
                f.flush()
                mm = mmap.mmap(f.fileno(), total) if total > len(header) else None
                try:
                    starts = [len(header) + o for o in offsets]
                    differ, stale = self._read_all(conn, listed, starts, mm, verify)
                    for _ in range(PULL_ATTEMPTS):
                        if not stale:
                            break
                        now = {e.name: e for e in self._listing()}
                        again = [now.get(listed[i].name) for i in stale]
                        moved = [
                            listed[i].name
                            for i, e in zip(stale, again, strict=False)
                            if e is None or _layout(e) != _layout(listed[i])
                        ]
                        if moved:
                            raise Replaced(", ".join(map(repr, moved)) + " replaced by another layout since listed")
                        more, stale_again = self._read_all(
                            conn, [e for e in again if e is not None], [starts[i] for i in stale], mm, verify
                        )
                        differ += more
                        stale = [stale[k] for k in stale_again]
                    if stale:
                        raise Replaced(", ".join(repr(listed[i].name) for i in stale) + " replaced again and again")
                    if differ:
                        raise IntegrityError(
                            f"pull from {_address_key(self.address)}: {len(differ)} of {len(entries)} tensors "
                            "arrived other than the server states them: " + ", ".join(differ)
                        )
                    if mm is not None:
                        mm.flush()
                finally:
                    if mm is not None:
                        mm.close()
                os.fchmod(f.fileno(), pulled_mode(protected=self._token is not None))
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            raise FileError(f"cannot write: {e.strerror or e}", file=str(path), errno=e.errno) from None
        except (IntegrityError, Replaced):
            _unlink(tmp)  # every reply was read: the connection is still in step
            raise
        except BaseException:
            _unlink(tmp)
            self.close()  # replies may still be in flight: the connection is unusable
            raise
        return entries

    def _read_all(
        self,
        conn: Connection,
        entries: builtins.list[ListEntry],
        starts: builtins.list[int],
        mm: mmap.mmap | None,
        verify: bool = False,
    ) -> tuple[builtins.list[str], builtins.list[int]]:
        """READ every entry into its place in ``mm``; with ``verify`` each is hashed as it lands,
        a piece at a time while the piece is hot, and the names that differ are returned.

        Each READ asks for the version listed; the positions in ``entries`` of those the server
        answers were replaced since are returned beside the names that differ, their bytes not
        read."""
        view = memoryview(mm) if mm is not None else memoryview(b"")
        flags = Read.FLAG_DIGEST if verify else 0
        differ: builtins.list[str] = []
        replaced: builtins.list[int] = []
        dest = piece = view
        try:
            sent = 0
            for i, e in enumerate(entries):
                while sent < len(entries) and sent < i + READ_WINDOW:
                    x = entries[sent]
                    conn.send(conn.frame(Read(x.name, 0, x.nbytes, flags, x.version if conn.minor >= 2 else 0)))
                    sent += 1
                try:
                    reply = conn.expect(ReadReply)
                except StateError as exc:
                    if not isinstance(exc, Replaced):
                        raise
                    replaced.append(i)
                    continue
                if reply.length != e.nbytes:
                    raise RemoteProtocolError(f"READ of {e.name!r} returned {reply.length} bytes, not {e.nbytes}")
                dest = view[starts[i] : starts[i] + e.nbytes]
                if not verify:
                    conn.recv_payload(dest)
                    continue
                if reply.digest is None:
                    raise RemoteProtocolError(f"READ of {e.name!r}: the server stated no digest")
                hasher = blake3.blake3(max_threads=blake3.blake3.AUTO if e.nbytes >= PULL_PIECE else 1)
                for pos in range(0, e.nbytes, PULL_PIECE):
                    piece = dest[pos : pos + PULL_PIECE]
                    conn.recv_payload(piece)
                    hasher.update(piece)
                if hasher.digest() != reply.digest:
                    differ.append(repr(e.name))
        except BaseException as e:
            _drop_locals(e)  # the frames it passed through hold slices of the mapping
            raise
        finally:
            # released here, not when the frames of a traceback go: the mapping closes next
            for v in (piece, dest, view):
                v.release()
        return differ, replaced


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


def _entry_bytes(e: ListEntry) -> int:
    """What one listing entry takes on the wire: its fixed fields, name, dims and version."""
    return ListEntry.LAYOUT.size + len(e.name.encode("utf-8", "surrogatepass")) + 8 * len(e.shape) + 8


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
