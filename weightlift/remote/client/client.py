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
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypedDict, overload

from weightlift.checkpoint import Checkpoint, Select, open_checkpoint
from weightlift.errors import LocalProtocolError, OptionError, PushError, RemoteProtocolError, StateError
from weightlift.options import check_keywords, keyword_signature
from weightlift.profile import Profiler
from weightlift.remote.client.connection import MAX_TIMEOUT, Connection
from weightlift.remote.client.job import PIPELINE, ProgressCallback, Push, PushResult, strategy
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
from weightlift.remote.protocol import (
    MAX_HOPS,
    MAX_TENSORS,
    PROTOCOL_MINOR,
    Commit,
    CommitReply,
    Free,
    FreeReply,
    Hello,
    Relay,
    RelayEnd,
    RelayReply,
    Remove,
    Update,
    relay_usable,
)
from weightlift.remote.token import token_bytes
from weightlift.remote.transport import TCP, Backend, TlsBackend

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11; only a checker reads it

    from weightlift.digest.published import ManifestSource, Reference
    from weightlift.formats import TensorInfo

__all__ = [
    "Client",
    "ClientKw",
    "ClientOptions",
    "PushKw",
    "MemoryPushKw",
    "PushOptions",
    "PushResult",
    "RemoteTensor",
    "ServerReport",
    "MAX_LIST_ENTRIES",
    "MAX_LIST_BYTES",
]

Source = str | os.PathLike[str] | Checkpoint
#: How a COMMIT_REPLY of a relayed push begins where a hop after the answering one did not switch
#: in ("switched here; HOST:PORT did not switch: why", :mod:`weightlift.remote.server.relay`).
NOT_SWITCHED = "switched here; "

#: How ``push(to=[...])`` reaches the servers: "auto" and "chain" relay (the client sends each
#: byte once, to its own server, which forwards to the next: :mod:`weightlift.remote.server.relay`;
#: "auto" falls back to "direct" where a server cannot relay), "direct" pushes to each server.
RELAYS = ("auto", "chain", "direct")
#: What a push takes from memory: ``{name: numpy array or torch tensor}``.
Tensors = Mapping[str, Any]


class ClientKw(TypedDict, total=False):
    """The types of :class:`Client`'s keywords besides the address. The keywords themselves,
    their defaults and checks are :class:`ClientOptions`'s fields; what each means is said once,
    in :class:`Client`'s docstring."""

    token: str | bytes | None
    streams: int
    profile: Profiler | bool | None
    timeout: float | None
    protocol_minor: int
    backend: Backend
    tls: ssl.SSLContext | None
    keep_base: bool


@dataclass(frozen=True, kw_only=True)
class ClientOptions:
    """Everything :class:`Client` takes besides the address (see there), checked once.

    ``secret`` and ``transport`` are derived: the token as bytes, whitespace around it dropped,
    as :func:`~weightlift.remote.token.read_token` reads a token file; the backend connections
    are made with (``tls`` made into one). Build a variant with :func:`dataclasses.replace`.
    """

    token: str | bytes | None = field(default=None, repr=False)  # a secret: never in a log line
    streams: int = 1
    profile: Profiler | bool | None = None
    timeout: float | None = 30.0
    protocol_minor: int = PROTOCOL_MINOR
    backend: Backend = TCP
    tls: ssl.SSLContext | None = None
    keep_base: bool = False

    secret: bytes | None = field(init=False, repr=False, compare=False)
    transport: Backend = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tls is not None and self.backend is not TCP:
            raise OptionError("pass tls= or backend=, not both")
        object.__setattr__(self, "transport", TlsBackend(self.tls) if self.tls is not None else self.backend)
        streams, timeout = self.streams, self.timeout
        if not isinstance(streams, int) or streams < 1:
            raise OptionError(f"streams must be a positive integer, got {streams!r}")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= MAX_TIMEOUT
        ):  # NaN and infinity too: the socket would raise ValueError or OverflowError at connect
            raise OptionError(
                f"timeout must be None or a number of seconds over 0, up to {MAX_TIMEOUT:.0f}; got {timeout!r}"
            )
        if not 0 <= self.protocol_minor <= PROTOCOL_MINOR:
            raise OptionError(f"protocol_minor must be between 0 and {PROTOCOL_MINOR}")
        object.__setattr__(self, "secret", token_bytes(self.token))


class PushKw(TypedDict, total=False):
    """The types of :meth:`Client.push`'s keywords besides ``to`` (which picks the result's type),
    for a checkpoint; :class:`MemoryPushKw` adds those of a push from memory. Their defaults and
    checks are :class:`PushOptions`'s fields; what each means is said in :meth:`Client.push`."""

    select: Select
    hash_threshold: int | None
    verify: bool
    manifest: ManifestSource | None
    progress: ProgressCallback | None
    model: str | None
    relay: str


class MemoryPushKw(PushKw, total=False):
    """:class:`PushKw` and what only a push of tensors from memory takes."""

    base: Tensors | None
    in_place: bool


@dataclass(frozen=True, kw_only=True)
class PushOptions:
    """Everything :meth:`Client.push` takes besides the source (see there)."""

    select: Select = None
    hash_threshold: int | None = None
    verify: bool = False
    to: Mapping[Address, Select] | Sequence[Address] | None = None
    base: Tensors | None = None
    in_place: bool = False
    manifest: ManifestSource | None = None
    progress: ProgressCallback | None = None
    model: str | None = None
    relay: str = "auto"

    @property
    def relayed(self) -> bool:
        """Whether ``to`` goes through a relay: one selection for every server, not "direct"."""
        return self.to is not None and not isinstance(self.to, Mapping) and self.relay != "direct"

    def check(self, source: Source | Tensors) -> None:
        """OptionError for options that do not go together with each other or with ``source``,
        before any connection."""
        if self.manifest is not None and not self.verify:
            raise OptionError("push(manifest=...) is what verify=True checks against: pass verify=True too")
        if self.relay not in RELAYS:
            raise OptionError(f"push(relay=...) is one of {', '.join(map(repr, RELAYS))}, got {self.relay!r}")
        if self.relay == "chain" and (self.to is None or isinstance(self.to, Mapping)):
            raise OptionError('push(relay="chain") relays one selection: pass to= a list of addresses')
        if self.to is not None and not isinstance(self.to, Mapping) and len(self.to) >= MAX_HOPS:
            raise OptionError(f"push(to=...) relays to fewer than {MAX_HOPS} servers; got {len(self.to)}")
        if isinstance(source, Mapping):
            if self.to is not None and (self.base is not None or self.in_place):
                raise OptionError(
                    "push(to=..., base=..., in_place=...): a relayed push sends whole tensors; deltas go to one server"
                )
            if self.to is not None and not self.relayed:
                raise OptionError(
                    'push(to=...) of tensors from memory relays them: a list of addresses, not relay="direct"'
                )
            if self.manifest is not None:
                raise OptionError(
                    "push(manifest=...) takes a checkpoint; tensors from memory are hashed where they are"
                )
        elif self.base is not None or self.in_place:
            raise OptionError("push(base=..., in_place=...) apply to tensors pushed from memory")
        if self.model is not None and not isinstance(self.model, str):
            raise OptionError(f"push(model=...) takes a model's name (str), not {type(self.model).__name__}")
        if self.to is not None and self.model is not None:
            raise OptionError("push(to=..., model=...): push each server's model with its own client")


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

    def __init__(self, address: Address, **options: Unpack[ClientKw]) -> None:
        check_keywords("Client.__init__", options, ClientOptions)
        self._open(address, ClientOptions(**options))

    @classmethod
    def with_options(cls, address: Address, options: ClientOptions) -> Client:
        """A client of ``address`` with options already built and checked."""
        client = cls.__new__(cls)
        client._open(address, options)
        return client

    def _open(self, address: Address, options: ClientOptions) -> None:
        self.address = address
        self.options = options
        self.streams = options.streams
        self._strategy = strategy()  # how this client's pushes move their tensors, chosen once
        profile = options.profile
        self.profiler = profile if isinstance(profile, Profiler) else Profiler(profile)
        # A profiler of our own reports one push at a time; one passed in accumulates as its owner wishes.
        self._own_profiler = not isinstance(profile, Profiler)
        # what this client last pushed from memory
        self.bases: Bases | None = Bases() if options.keep_base else None
        self._conns: list[Connection] = [self._connect()]

    def _connect(self) -> Connection:
        o = self.options
        return Connection(
            o.transport.connect(self.address, timeout=o.timeout),
            token=o.secret,
            minor=o.protocol_minor,
            timeout=o.timeout,
        )

    def _sibling(self, address: Address) -> Client:
        """A client of another server with this one's token, streams, timeout, minor and backend."""
        return Client.with_options(address, replace(self.options, profile=None, keep_base=False))

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
    def push(self, source: Source | Tensors, *, to: None = None, **options: Unpack[MemoryPushKw]) -> PushResult: ...
    @overload
    def push(
        self, source: Source, *, to: Mapping[Address, Select] | Sequence[Address], **options: Unpack[PushKw]
    ) -> dict[str, PushResult]: ...

    def push(
        self,
        source: Source | Tensors,
        *,
        to: Mapping[Address, Select] | Sequence[Address] | None = None,
        **options: Unpack[MemoryPushKw],
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

        ``relay``: how a list of addresses (one selection; a checkpoint or tensors from memory)
        is reached. "auto" (the default) and "chain": the client pushes to its own server only,
        every tensor with its digest; each server proves each tensor against that digest, then
        forwards it to the next address of the list (:mod:`weightlift.remote.server.relay`), so
        the client sends each byte once (``PushResult.bytes_sent`` is 0 for the servers reached
        through a relay). The push is one unit on every hop: no server shows any of it until
        every server holds all of it, then one COMMIT switches them in down the chain (one that
        fails or goes away first leaves every server on its old version). A hop that dies, stalls or forwards wrong bytes is routed around from
        this client; one that fails from here too is named in PushError, whose results say who
        holds everything. "auto" pushes directly where the first server cannot relay (protocol
        minor 7, host memory); "chain" raises OptionError there. "direct": one push per server.

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

        ``progress``: called as ``progress(bytes done, bytes in all)`` after each tensor lands (or
        is filled from the server's cache), from the sending thread; nothing is drawn otherwise.
        Not with ``to``.

        ``model`` (a server of protocol minor 5): push into that model, a namespace of its own on
        the server (None: the default model, where a client that names none pushes); see
        :meth:`list`, :meth:`pull`, :meth:`remove`. Not with ``to``. To such a server a
        checkpoint arrives as one unit: none of its tensors is visible (LIST, READ, HAVE) until
        every one has landed, and none ever is if the push fails or the client goes away (their
        memory goes back).
        """
        check_keywords("Client.push", options, PushOptions)
        o = PushOptions(to=to, **options)
        o.check(source)
        if o.to is not None and o.progress is not None:
            raise OptionError("push(progress=...) reports one push: not with to=...")
        if o.to is not None:
            return self._push_to(source, o.to, o)
        if isinstance(source, Mapping):
            self._conn().use(o.model or "")
            return self._push_memory(source, o)
        return self._push_checkpoint(source, o)

    def _prepare(self, source: Source, o: PushOptions) -> tuple[builtins.list[TensorInfo], Reference | None]:
        """The selected tensors and, with ``verify``, their reference digests: every check of a
        push before its first byte."""
        from weightlift.digest.published import reference  # a store's manifest: the store clients, on demand

        ck = source if isinstance(source, Checkpoint) else open_checkpoint(source)
        tensors = ck.select(o.select)
        return tensors, reference(ck, tensors, o.manifest) if o.verify else None

    def _push_checkpoint(
        self,
        source: Source,
        o: PushOptions,
        *,
        digests: bool = False,
        prepared: tuple[builtins.list[TensorInfo], Reference | None] | None = None,
    ) -> PushResult:
        """One push of a checkpoint to this client's server; ``digests``: every ALLOC names its
        tensor's digest (a relayed push); ``prepared``: what :meth:`_prepare` returned."""
        tensors, ref = prepared if prepared is not None else self._prepare(source, o)
        self._conn()
        # a relayed push goes over the one connection its RELAY was sent on: a tensor sent over
        # another would land on this server and be relayed to no one
        streams = 1 if digests else self.streams
        while len(self._conns) < streams:
            self._conns.append(self._connect())
        conns = self._conns[:streams]
        for c in conns:
            c.use(o.model or "")
        if self._own_profiler:
            self.profiler.reset()
        job = Push(
            tensors,
            conns,
            where=address_key(self.address),
            how=self._strategy,
            profiler=self.profiler,
            hash_threshold=o.hash_threshold,
            verify=o.verify,
            expected=ref.digests if ref is not None else None,
            manifest=ref.manifest if ref is not None else None,
            progress=o.progress,
            unit=conns[0].session.models and not digests,  # a relayed push's unit is opened by RELAY or UPDATE
            digests=digests,
        )
        try:
            return job.run()
        except BaseException:
            # Unless every connection ended at a BARRIER reply (the server's errors), one may be
            # mid-message or hold tensors allocated ahead and never written: it is unusable.
            if not job.settled:
                self.close()
            raise

    def _push_memory(self, tensors: Tensors, o: PushOptions, *, digests: bool = False) -> PushResult:
        infos = memory_tensors(tensors, o.select)
        conn = self._conn()
        spec = None
        if conn.session.update and not digests:  # a relayed push's unit is opened by RELAY or UPDATE
            bases = given_bases(o.base) if o.base is not None else (self.bases if self.bases is not None else {})
            spec = UpdateSpec(bases, in_place=o.in_place, delta=conn.session.delta)
        if self._own_profiler:
            self.profiler.reset()
        job = Push(
            infos,
            [conn],
            where=address_key(self.address),
            how=PIPELINE,  # the naive arm reads files only
            profiler=self.profiler,
            hash_threshold=o.hash_threshold,
            verify=o.verify,
            update=spec,
            progress=o.progress,
            digests=digests,
        )
        try:
            result = job.run()
        except BaseException:
            if not job.settled:
                self.close()
            if self.bases is not None:
                self.bases.forget()  # the server holds some version of each: none is a sure base
            raise
        if self.bases is not None and spec is None and digests:
            self.bases.forget()  # a relayed push replaced the server's versions: none is a sure base
        if self.bases is not None and spec is not None:
            for t in infos:
                self.bases.record(t.name, t.dtype, t.shape, spec.digests[t.name], host_bytes(t))
        return result

    def _push_to(
        self, source: Source | Tensors, to: Mapping[Address, Select] | Sequence[Address], o: PushOptions
    ) -> dict[str, PushResult]:
        others = dict(to) if isinstance(to, Mapping) else {a: o.select for a in to}
        me = address_key(self.address)
        targets: dict[Address, Select] = {me: o.select, **{address_key(a): s for a, s in others.items()}}
        if len(targets) != len(others) + 1:
            raise OptionError("push(to=...): every server once, this client's own not again")
        if o.relayed:
            relayed = self._push_relayed(source, [address_key(a) for a in others], o)
            if relayed is not None:
                return relayed
        if isinstance(source, Mapping):
            raise OptionError("push(to=...) of tensors from memory needs servers that relay (protocol minor 7)")
        return push_each(
            source,
            targets,
            connect=self._sibling,
            own={me: self},
            hash_threshold=o.hash_threshold,
            verify=o.verify,
            manifest=o.manifest,
        )

    def _push_relayed(
        self, source: Source | Tensors, hops: builtins.list[str], o: PushOptions
    ) -> dict[str, PushResult] | None:
        """Push to this client's server, which relays every tensor along ``hops`` once it has
        proven it against the digest this push names; None where the server cannot relay and
        ``relay="auto"`` lets the caller push directly instead.

        A hop that fails (dead, stalled past the timeout, or refusing what its parent forwards:
        bytes that do not hash to this push's digests) is named by the reply to RELAY_END; the
        hops from it on then get the push again from this client, relayed among themselves, so
        no relay upstream of them is trusted twice. A hop named twice, or that cannot be
        reached, is dropped and the chain goes on after it. A server that keeps a cache fills
        what it already holds (HAVE), so only what it lacks crosses the wire again.
        """
        conn = self._conn()
        me = address_key(self.address)
        if not relay_usable(conn.minor):
            if o.relay == "chain":
                raise OptionError(f'push(relay="chain"): {me} speaks protocol 1.{conn.minor}; relays need 1.7')
            return None
        mine = replace(o, to=None, verify=True)  # each hop proves each tensor; so does this one
        # every check a push makes before its first byte, made before the RELAY
        prepared = None if isinstance(source, Mapping) else self._prepare(source, mine)
        if isinstance(source, Mapping):
            memory_tensors(source, o.select)
        if not self._relay_start(hops):
            if o.relay == "chain":
                raise OptionError(f'push(relay="chain"): {me} does not relay')
            return None
        try:
            result, end = self._relay_rest(source, mine, prepared, hops)
        except BaseException as e:
            not_reached = RemoteProtocolError(f"not reached: the push to {me}, the first hop of the relay, failed")
            raise PushError({me: e, **dict.fromkeys(hops, not_reached)}, {}) from e
        return self._reroute(source, mine, prepared, hops, {me: result}, end)

    def _reroute(
        self,
        source: Source | Tensors,
        o: PushOptions,
        prepared: tuple[builtins.list[TensorInfo], Reference | None] | None,
        hops: builtins.list[str],
        results: dict[str, PushResult],
        end: RelayReply,
    ) -> dict[str, PushResult]:
        """Each hop's result from RELAY_END's ``end``; the hops from a failed one on pushed again
        from this client (see :meth:`_push_relayed`); PushError naming every hop dropped."""
        result = next(iter(results.values()))
        errors: dict[str, BaseException] = {}
        named: dict[str, int] = {}
        skipped: dict[str, str] = {}  # hops a relay routed around: served from this client below
        chain = hops
        while True:
            failed = chain.index(end.failed) if not end.ok and end.failed in chain else len(chain)
            skipped.update(dict.fromkeys((h for h in end.skipped if h in chain[:failed]), end.message))
            for h in chain[:failed]:  # a relay's hop holds what its chain's first hop holds, each proven there
                if h not in skipped:
                    results[h] = PushResult(
                        result.tensors, result.bytes, 0, 0, 0, result.seconds, verified=result.tensors
                    )
            if end.ok or failed == len(chain):
                if not end.ok:  # a reply that names no hop of this chain
                    errors[chain[-1]] = RemoteProtocolError(f"relay failed: {end.message}")
                break
            chain = chain[failed:]
            named[chain[0]] = named.get(chain[0], 0) + 1
            if named[chain[0]] > 1:  # failed again, from this client too: dropped
                errors[chain[0]] = RemoteProtocolError(f"relay to {chain[0]} failed: {end.message}")
                chain = chain[1:]
            if not chain:
                break
            head, chain = chain[0], chain[1:]
            try:
                with self._sibling(head) as again:
                    if not again._relay_start(chain):
                        raise OptionError(f"{head} does not relay")
                    result, end = again._relay_rest(source, o, prepared, chain)
                results[head] = result
            except Exception as e:  # noqa: BLE001 - this hop failed from this client too: dropped next round
                end = RelayReply(False, failed=head, message=f"{type(e).__name__}: {e}")
                named[head] = 1
                chain = [head, *chain]
        self._serve_skipped(source, o, prepared, skipped, results, errors)
        if errors:
            raise PushError(errors, results)
        return results

    def _serve_skipped(
        self,
        source: Source | Tensors,
        o: PushOptions,
        prepared: tuple[builtins.list[TensorInfo], Reference | None] | None,
        skipped: dict[str, str],
        results: dict[str, PushResult],
        errors: dict[str, BaseException],
    ) -> None:
        """Each hop a relay routed around (it died or stalled; the hops after it were served by
        the relay) tried once more from this client, alone: its result, or its error."""
        for h, why in skipped.items():
            if h in results or h in errors:
                continue
            try:
                with self._sibling(h) as one:
                    results[h] = one._relay_rest(source, o, prepared, [])[0]
            except Exception as e:  # noqa: BLE001 - named in PushError
                errors[h] = RemoteProtocolError(
                    f"relay to {h} failed ({why}), and from this client: {type(e).__name__}: {e}; "
                    "it holds the tensors that reached it before"
                )

    def _relay_start(self, hops: builtins.list[str]) -> bool:
        """RELAY ``hops`` (none: a plain push); whether this client's server relays."""
        if not hops:
            return True
        conn = self._conn()
        conn.send(conn.frame(Relay(tuple(hops))))
        return conn.expect(RelayReply).ok

    def _relay_rest(
        self,
        source: Source | Tensors,
        o: PushOptions,
        prepared: tuple[builtins.list[TensorInfo], Reference | None] | None,
        hops: builtins.list[str],
    ) -> tuple[PushResult, RelayReply]:
        """The push after RELAY, every ALLOC naming its digest, as one unit on every hop: RELAY
        (or, with no ``hops``, UPDATE) opens it, RELAY_END's reply says every hop holds its
        whole set (or names the first that does not), and COMMIT switches the hops that do in,
        passed down the chain by each once it has switched (:mod:`weightlift.remote.server.relay`)."""
        if not hops:
            conn = self._conn()
            conn.send(conn.frame(Update()))
        try:
            if isinstance(source, Mapping):
                result = self._push_memory(source, o, digests=True)
            else:
                result = self._push_checkpoint(source, o, digests=True, prepared=prepared)
        except BaseException:
            if self._conns:  # ended at a BARRIER: the unit is dropped on every hop, not left open
                self._drop_relayed(hops)
            raise
        conn = self._conn()
        if hops:
            conn.send(conn.frame(RelayEnd()))
            end = conn.expect(RelayReply)
            if not end.ok and end.failed not in hops:  # this hop's own set is not whole: dropped on every hop
                raise StateError(f"relayed push to {address_key(self.address)} not held there: {end.message}")
        else:
            end = RelayReply(True, result.tensors, result.bytes)
        conn.send(conn.frame(Commit(Commit.FLAG_NO_ROOT)))
        done = conn.expect(CommitReply)
        if not done.ok:
            raise StateError(f"relayed push to {address_key(self.address)} not switched in: {done.message}")
        if done.message:  # a hop after this one died, or failed to switch, after it held its set
            hop = done.message.removeprefix(NOT_SWITCHED).partition(" did not switch: ")[0]
            if not done.message.startswith(NOT_SWITCHED) or hop not in hops:
                raise StateError(
                    f"relayed push switched in at {address_key(self.address)}, not at every hop: {done.message}"
                )
            # the hops before it switched; it and the hops after it hold their old version: as a failed hop
            return result, RelayReply(False, end.tensors, end.nbytes, hop, done.message, end.skipped)
        return result, end

    def _drop_relayed(self, hops: builtins.list[str]) -> None:
        """A relayed push that failed at a BARRIER: its unit dropped on every hop (RELAY_END, then
        COMMIT with ABORT where it is still held), or the connection closed, which drops it too."""
        conn = self._conn()
        try:
            if hops:
                conn.send(conn.frame(RelayEnd()))
                end = conn.expect(RelayReply)
                if not end.ok and end.failed not in hops:  # not whole here: dropped already
                    return
            conn.send(conn.frame(Commit(Commit.FLAG_ABORT)))
            conn.expect(CommitReply)
        except Exception:  # noqa: BLE001 - the push's own error is raised; closing drops the unit
            self.close()

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
        self,
        path: str | os.PathLike[str],
        *,
        verify: bool = False,
        progress: ProgressCallback | None = None,
        model: str | None = None,
    ) -> builtins.list[RemoteTensor]:
        """Write every tensor the server holds to ``path`` as a .safetensors file; returns them.

        The file appears whole or not at all, with the mode the umask allows a new file (0600
        when the server wanted a token). ``verify``: the server states the digest of each tensor
        as it sends it, the client hashes the bytes as they land, and the file is kept only if
        every tensor matches (else :class:`~weightlift.errors.IntegrityError` naming each one
        that differs, and no file). Needs a server of protocol minor 2 (LocalProtocolError
        otherwise). FormatError, before anything is written, if the file's header would pass
        the limit safetensors readers accept. ``progress``: called as ``progress(bytes done, bytes
        in all)`` as the tensors arrive. ``model``: pull that model (None: the default model).
        """
        job = Pull(
            self._model_conn(model),
            path,
            where=address_key(self.address),
            verify=verify,
            protected=self.options.secret is not None,
            progress=progress,
        )
        try:
            return job.run()
        except BaseException:
            if not job.settled:
                self.close()  # replies may still be in flight: the connection is unusable
            raise


# help() and inspect show every keyword with its default, as when each method wrote each one out
Client.__init__.__signature__ = keyword_signature(Client.__init__, ClientOptions, ClientKw)  # type: ignore[attr-defined]
Client.push.__signature__ = keyword_signature(Client.push, PushOptions, MemoryPushKw)  # type: ignore[attr-defined]


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
