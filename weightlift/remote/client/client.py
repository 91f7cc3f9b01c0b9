"""The client of a tensor server: push a checkpoint, list, pull and free, over one connection or
``streams`` of them.

:class:`Client` holds the connections and what every call shares (the token, the timeout, the
strategy a push follows); the work is elsewhere: one push in :mod:`~weightlift.remote.client.job`
(the theory of operation is there), pushes to several servers at once in
:mod:`~weightlift.remote.client.servers`, the listing and the whole pull in
:mod:`~weightlift.remote.client.pull`.
"""

from __future__ import annotations

import builtins
import os
import ssl
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

from weightlift.checkpoint import Checkpoint, Select, open_checkpoint
from weightlift.errors import LocalProtocolError, OptionError, StateError
from weightlift.profile import Profiler
from weightlift.remote.client.connection import MAX_TIMEOUT, Connection
from weightlift.remote.client.job import PIPELINE, Push, PushResult, strategy
from weightlift.remote.client.memory import host_bytes, memory_tensors
from weightlift.remote.client.pull import (
    MAX_LIST_BYTES,
    MAX_LIST_ENTRIES,
    Pull,
    RemoteTensor,
    ServerReport,
    listing,
    server_report,
)
from weightlift.remote.client.servers import Address, address_key, push_each
from weightlift.remote.client.update import Bases, UpdateSpec, given_bases
from weightlift.remote.protocol import MAX_TENSORS, PROTOCOL_MINOR, Free, FreeReply, Hello, Remove
from weightlift.remote.token import token_bytes
from weightlift.remote.transport import TCP, Backend, TlsBackend

if TYPE_CHECKING:
    from weightlift.digest.published import ManifestSource

__all__ = ["Client", "PushResult", "RemoteTensor", "ServerReport", "MAX_LIST_ENTRIES", "MAX_LIST_BYTES"]

Source = str | os.PathLike[str] | Checkpoint
#: What a push takes from memory: ``{name: numpy array or torch tensor}``.
Tensors = Mapping[str, Any]


class Client:
    """A connection (or ``streams`` connections) to a tensor server.

    ``address`` is ``"host:port"`` or ``(host, port)``. ``token`` (str or bytes) answers a server
    that wants AUTH. ``profile``: None reads WEIGHTLIFT_LOADPROF, a bool forces it, or pass a
    :class:`~weightlift.profile.Profiler`. ``protocol_minor`` speaks an older minor version.
    ``timeout`` (seconds, None for none) bounds the connect and every blocking send after it, and
    is the deadline of every reply (a payload gets its length at
    :data:`~weightlift.remote.client.connection.MIN_PAYLOAD_RATE` besides): a server that stops
    reading or answering, or trickles its answer, makes a call fail with TransportError.
    ``tls``: a client ``ssl.SSLContext`` (:func:`~weightlift.remote.transport.client_tls_context`)
    to speak TLS to a server started with one; every connection, and every server of
    ``push(to=...)``, uses it.
    ``keep_base``: keep a host copy of every tensor pushed from memory (one more copy of them),
    so that the next push of those tensors sends only what changed (see :meth:`push`).
    """

    def __init__(
        self,
        address: Address,
        *,
        token: str | bytes | None = None,
        streams: int = 1,
        profile: Profiler | bool | None = None,
        timeout: float | None = 30.0,
        protocol_minor: int = PROTOCOL_MINOR,
        backend: Backend = TCP,
        tls: ssl.SSLContext | None = None,
        keep_base: bool = False,
    ):
        if tls is not None:
            if backend is not TCP:
                raise OptionError("pass tls= or backend=, not both")
            backend = TlsBackend(tls)
        if not isinstance(streams, int) or streams < 1:
            raise OptionError(f"streams must be a positive integer, got {streams!r}")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= MAX_TIMEOUT
        ):  # NaN and infinity too: the socket would raise ValueError or OverflowError at connect
            raise OptionError(
                f"timeout must be None or a number of seconds over 0, up to {MAX_TIMEOUT:.0f}; got {timeout!r}"
            )
        if not 0 <= protocol_minor <= PROTOCOL_MINOR:
            raise OptionError(f"protocol_minor must be between 0 and {PROTOCOL_MINOR}")
        self.address = address
        self._token = token_bytes(token)  # as read_token reads a token file: whitespace around it dropped
        self.streams = streams
        self._minor = protocol_minor
        self._timeout = timeout
        self._backend = backend
        self._strategy = strategy()  # how this client's pushes move their tensors, chosen once
        self.profiler = profile if isinstance(profile, Profiler) else Profiler(profile)
        # A profiler of our own reports one push at a time; one passed in accumulates as its owner wishes.
        self._own_profiler = not isinstance(profile, Profiler)
        self.bases: Bases | None = Bases() if keep_base else None  # what this client last pushed from memory
        self._conns: list[Connection] = [self._connect()]

    def _connect(self) -> Connection:
        return Connection(
            self._backend.connect(self.address, timeout=self._timeout),
            token=self._token,
            minor=self._minor,
            timeout=self._timeout,
        )

    def _sibling(self, address: Address) -> Client:
        """A client of another server with this one's token, streams, timeout, minor and backend."""
        return Client(
            address,
            token=self._token,
            streams=self.streams,
            timeout=self._timeout,
            protocol_minor=self._minor,
            backend=self._backend,
        )

    @property
    def connections(self) -> tuple[Connection, ...]:
        """The open connections (one until a push with ``streams`` opens more; none once closed)."""
        return tuple(self._conns)

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
        source: Source | Tensors,
        *,
        select: Select = None,
        hash_threshold: int | None = None,
        verify: bool = False,
        to: None = None,
        base: Tensors | None = None,
        in_place: bool = False,
        manifest: ManifestSource | None = None,
        model: str | None = None,
    ) -> PushResult: ...

    @overload
    def push(
        self,
        source: Source,
        *,
        select: Select = None,
        hash_threshold: int | None = None,
        verify: bool = False,
        to: Mapping[Address, Select] | Sequence[Address],
        manifest: ManifestSource | None = None,
        model: None = None,
    ) -> dict[str, PushResult]: ...

    def push(
        self,
        source: Source | Tensors,
        *,
        select: Select = None,
        hash_threshold: int | None = None,
        verify: bool = False,
        to: Mapping[Address, Select] | Sequence[Address] | None = None,
        base: Tensors | None = None,
        in_place: bool = False,
        manifest: ManifestSource | None = None,
        model: str | None = None,
    ) -> PushResult | dict[str, PushResult]:
        """Send the selected tensors of a checkpoint, or of ``{name: array or tensor}``, to the
        server; returns when all have landed.

        **From memory** (numpy arrays, torch tensors; CUDA ones staged through host memory), each
        tensor goes from its own memory, with the same ``select``, ``verify``, token and MAC. To a
        server of protocol minor 3 it is an update (:mod:`~weightlift.remote.client.update`): all
        visible at once or not at all, proven by the server's set digest (``PushResult.set_digest``,
        IntegrityError if it differs), and a tensor whose previous version the client has
        (``Client(keep_base=True)``, or ``base={name: previous}``) sent as what changed.
        ``in_place``: the server applies the changes into the tensors' own memory at the switch
        (no second copy; readers wait while it runs) instead of into new memory as they arrive.

        ``hash_threshold``: tensors of at least this many bytes are hashed and asked about when
        the server keeps a cache (default :data:`~weightlift.digest.blake.HASH_THRESHOLD`).

        ``to`` pushes to more servers at the same time (a model split over several workers):
        ``{address: select}`` gives each its own selection, a list of addresses sends each
        ``select``. This client's server gets ``select`` as well; every push runs on its own
        thread with this client's token, streams and timeout, the checkpoint opened once. Returns
        ``{address: PushResult}`` once every push has landed; if any failed, every push still
        runs to its end and :class:`~weightlift.errors.PushError` holds each error and result.

        ``verify``: the server hashes every tensor as it lands and reports the digests of what it
        stored; the client compares them with the published manifest (``manifest``, else the one
        published beside the checkpoint, :func:`~weightlift.digest.published.reference`), else
        only with the file's bytes as they are now (hashed while it sends, or from the cache of
        hashes), and raises :class:`~weightlift.errors.IntegrityError` naming every tensor that
        differs. ``PushResult.manifest`` says which manifest, None for the file's own bytes. Needs a server of protocol minor 2 (LocalProtocolError otherwise). Without it a
        push reports what the server received, not that the bytes are right: on a connection
        without a token, bytes changed in flight are stored and the push succeeds.

        ``manifest`` (with ``verify``, as for a load): a published manifest (path, URL or
        ``Manifest``; :mod:`weightlift.digest.published`) whose digests the server must report
        (a URL without one: NotFoundError unless one is published beside it); the client hashes
        only what it asks a caching server about, whose fills are then the file's bytes, never
        what the manifest names. IntegrityError before any byte is sent if it lacks a selected
        tensor or gives it another size.

        ``model`` (a server of protocol minor 5): push into that model, a namespace of its own on
        the server (None: the default model, where a client that names none pushes); see
        :meth:`list`, :meth:`pull`, :meth:`remove`. To such a server a checkpoint arrives as one
        unit: none of its tensors is visible (LIST, READ, HAVE) until every one has landed, and
        none ever is if the push fails or the client goes away (their memory goes back).
        """
        _check_push_options(source, to=to, base=base, in_place=in_place, verify=verify, manifest=manifest)
        if to is not None and model is not None:
            raise OptionError("push(to=..., model=...): push each server's model with its own client")
        if isinstance(source, Mapping):
            self._conn().use(model or "")
            return self._push_memory(source, select, hash_threshold, verify, base, in_place)
        if to is not None:
            return self._push_to(source, select, to, hash_threshold=hash_threshold, verify=verify, manifest=manifest)
        from weightlift.digest.published import reference  # a store's manifest: the store clients, on demand

        ck = source if isinstance(source, Checkpoint) else open_checkpoint(source)
        tensors = ck.select(select)
        ref = reference(ck, tensors, manifest) if verify else None
        self._conn()
        while len(self._conns) < self.streams:
            self._conns.append(self._connect())
        conns = self._conns[: self.streams]
        for c in conns:
            c.use(model or "")
        if self._own_profiler:
            self.profiler.reset()
        job = Push(
            tensors,
            conns,
            where=address_key(self.address),
            how=self._strategy,
            profiler=self.profiler,
            hash_threshold=hash_threshold,
            verify=verify,
            expected=ref.digests if ref is not None else None,
            manifest=ref.manifest if ref is not None else None,
            unit=conns[0].session.models,
        )
        try:
            return job.run()
        except BaseException:
            # Unless every connection ended at a BARRIER reply (the server's errors), one may be
            # mid-message or hold tensors allocated ahead and never written: it is unusable.
            if not job.settled:
                self.close()
            raise

    def _push_memory(
        self,
        tensors: Tensors,
        select: Select,
        hash_threshold: int | None,
        verify: bool,
        base: Tensors | None,
        in_place: bool,
    ) -> PushResult:
        infos = memory_tensors(tensors, select)
        conn = self._conn()
        spec = None
        if conn.session.update:
            bases = given_bases(base) if base is not None else (self.bases if self.bases is not None else {})
            spec = UpdateSpec(bases, in_place=in_place, delta=conn.session.delta)
        if self._own_profiler:
            self.profiler.reset()
        job = Push(
            infos,
            [conn],
            where=address_key(self.address),
            how=PIPELINE,  # the naive arm reads files only
            profiler=self.profiler,
            hash_threshold=hash_threshold,
            verify=verify,
            update=spec,
        )
        try:
            result = job.run()
        except BaseException:
            if not job.settled:
                self.close()
            if self.bases is not None:
                self.bases.forget()  # the server holds some version of each: none is a sure base
            raise
        if self.bases is not None and spec is not None:
            for t in infos:
                self.bases.record(t.name, t.dtype, t.shape, spec.digests[t.name], host_bytes(t))
        return result

    def _push_to(
        self,
        source: Source,
        select: Select,
        to: Mapping[Address, Select] | Sequence[Address],
        *,
        hash_threshold: int | None,
        verify: bool,
        manifest: ManifestSource | None,
    ) -> dict[str, PushResult]:
        others = dict(to) if isinstance(to, Mapping) else {a: select for a in to}
        me = address_key(self.address)
        targets: dict[Address, Select] = {me: select, **{address_key(a): s for a, s in others.items()}}
        if len(targets) != len(others) + 1:
            raise OptionError("push(to=...): every server once, this client's own not again")
        return push_each(
            source,
            targets,
            connect=self._sibling,
            own={me: self},
            hash_threshold=hash_threshold,
            verify=verify,
            manifest=manifest,
        )

    # -- list / pull / free --------------------------------------------------------------------------

    def list(self, *, model: str | None = None) -> builtins.list[RemoteTensor]:
        """Every complete tensor the server holds (of ``model``; None: the default model), in name order."""
        return [RemoteTensor(e.name, e.dtype, e.shape, e.nbytes) for e in listing(self._model_conn(model))]

    def free(self, names: str | Sequence[str], *, model: str | None = None) -> int:
        """Drop the named tensors on the server (of ``model``; None: the default model); returns how many existed."""
        return _free(self._model_conn(model), [names] if isinstance(names, str) else names)

    def remove(self, model: str | None = None) -> int:
        """Drop every tensor of ``model`` on the server (None: the default model); returns how many
        there were. :class:`~weightlift.remote.client.connection.Busy` (a StateError), nothing
        removed, while a push to that model is in flight. Needs a server of protocol minor 5."""
        conn = self._conn()
        _needs_models(conn, "remove")
        conn.send(conn.frame(Remove(model or "")))
        reply: FreeReply = conn.expect(FreeReply)
        return reply.freed

    def stats(self) -> ServerReport:
        """What the server holds and has done: its figures (those of
        :meth:`~weightlift.remote.server.server.Server.stats`) and its models. Needs a server of
        protocol minor 5 (LocalProtocolError naming the server's minor otherwise)."""
        conn = self._conn()
        _needs_models(conn, "stats")
        return server_report(conn)

    def _model_conn(self, model: str | None) -> Connection:
        conn = self._conn()
        conn.use(model or "")
        return conn

    def pull(
        self, path: str | os.PathLike[str], *, verify: bool = False, model: str | None = None
    ) -> builtins.list[RemoteTensor]:
        """Write every tensor the server holds to ``path`` as a .safetensors file; returns them.

        The file appears whole or not at all, with the mode the umask allows a new file (0600
        when the server wanted a token). ``verify``: the server states the digest of each tensor
        as it sends it, the client hashes the bytes as they land, and the file is kept only if
        every tensor matches (else :class:`~weightlift.errors.IntegrityError` naming each one
        that differs, and no file). Needs a server of protocol minor 2 (LocalProtocolError
        otherwise). FormatError, before anything is written, if the file's header would pass
        the limit safetensors readers accept.
        """
        job = Pull(
            self._model_conn(model),
            path,
            where=address_key(self.address),
            verify=verify,
            protected=self._token is not None,
        )
        try:
            return job.run()
        except BaseException:
            if not job.settled:
                self.close()  # replies may still be in flight: the connection is unusable
            raise


def _needs_models(conn: Connection, what: str) -> None:
    if not conn.session.models:
        raise LocalProtocolError(
            f"{what}: the server at {conn.stream.peer} speaks protocol 1.{conn.minor}, which has no {what} "
            "(it needs 1.5: a newer weightlift serve)"
        )


def _free(conn: Connection, names: Sequence[str]) -> int:
    """FREE the names in as few messages as the frame and the tensor count allow."""
    freed = 0
    batch: builtins.list[str] = []
    size = 0
    for n in names:
        cost = len(n.encode()) + 2
        if batch and (len(batch) >= MAX_TENSORS or size + cost > conn.max_frame - 64):
            freed += _free_batch(conn, batch)
            batch, size = [], 0
        batch.append(n)
        size += cost
    return freed + (_free_batch(conn, batch) if batch else 0)


def _free_batch(conn: Connection, names: builtins.list[str]) -> int:
    conn.send(conn.frame(Free(tuple(names))))
    reply: FreeReply = conn.expect(FreeReply)
    return reply.freed


def _check_push_options(
    source: Source | Tensors,
    *,
    to: object,
    base: Tensors | None,
    in_place: bool,
    verify: bool,
    manifest: ManifestSource | None,
) -> None:
    """OptionError for a push's options that do not go together, before any connection."""
    if manifest is not None and not verify:
        raise OptionError("push(manifest=...) is what verify=True checks against: pass verify=True too")
    if isinstance(source, Mapping):
        if to is not None:
            raise OptionError("push(to=...) takes a checkpoint; push tensors from memory to each server's own client")
        if manifest is not None:
            raise OptionError("push(manifest=...) takes a checkpoint; tensors from memory are hashed where they are")
    elif base is not None or in_place:
        raise OptionError("push(base=..., in_place=...) apply to tensors pushed from memory")
