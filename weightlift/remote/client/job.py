"""One push: a checkpoint's selected tensors sent to one server over one or more connections.

Theory of operation: a push is a pipeline, not a conversation. For each tensor the client sends
ALLOC and WRITE headers and the payload in one scatter-gather send, straight from the file's
mapping (or with sendfile for large payloads): no staging copy, no zero-fill, and no reply to
wait for. One BARRIER at the end collects what the server completed and any errors.

Hashing happens only where it can pay: when the server's HELLO says it keeps a cache, and only
for tensors of at least ``hash_threshold`` bytes (1 MiB by default, so the experts of a
mixture-of-experts checkpoint are covered). Their digests come from the file's sidecar when it
has them (so a second push of the same file hashes nothing) and are otherwise computed on
worker threads while the sender moves the small tensors. Each batch of large tensors whose
digests are ready is asked about in one HAVE; the server fills the ones it has from its cache,
and the rest are sent with their digest so the server can cache them. If a cache entry turns
out to be bad, the BARRIER reply lists the tensor and the client sends it.

``streams=N`` spreads the tensors over N connections, balanced by bytes, one sender each.

A checkpoint is pushed as one unit (``unit``, a server of protocol minor 5): UPDATE opens an
update on the first connection (a BARRIER's reply says it is open) and the others JOIN it by its
push id, so every tensor they complete is held back; once every sender's BARRIER came back
clean, one COMMIT (NO_ROOT: nothing is hashed for a set digest) shows them all at once. A push
that fails is aborted (or its connections closed, which aborts it on the server): none of its
tensors ever becomes visible, and their memory goes back.

How the tensors move is a :class:`Strategy`, chosen once per client (:func:`strategy`): the
pipeline above, or with ``WEIGHTLIFT_LOAD_OPT=0`` the naive arm kept for A/B runs
(:mod:`~weightlift.remote.client.naive`). A :class:`Push` holds everything of one push: its
plans, the hashing beside it, the senders and their tally.
"""

from __future__ import annotations

import builtins
import secrets
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from weightlift import env
from weightlift.digest.blake import HASH_THRESHOLD, NAIVE_HASH_THRESHOLD
from weightlift.errors import IntegrityError, LocalProtocolError, RemoteProtocolError, StateError, WeightliftError
from weightlift.formats import TensorInfo
from weightlift.profile import Profiler
from weightlift.remote.client.connection import Connection, printable
from weightlift.remote.client.naive import NaivePusher
from weightlift.remote.client.push import Hashing, Plan, ProgressCallback, Pusher, Tally, balance, wire_form
from weightlift.remote.client.update import UpdatePusher, UpdateSpec
from weightlift.remote.protocol import Barrier, BarrierReply, Commit, CommitReply, Update

__all__ = ["PushResult", "Strategy", "PIPELINE", "NAIVE", "strategy", "Push", "ProgressCallback"]


@dataclass(frozen=True)
class PushResult:
    """What a push did. ``bytes``: tensor bytes now on the server; ``bytes_sent``: payload that
    crossed the wire; ``bytes_hashed``: bytes hashed by this push; ``cached``: tensors the server
    filled from its cache; ``profile``: the profiler report when profiling was on; ``verified``:
    tensors whose digest the server reported and the client matched (``verify=True``): with
    ``manifest`` (the published manifest they were checked against) they are verified, without
    one they are only the files' bytes as they are now; ``deltas``:
    tensors of an update sent as what changed; ``set_digest``: the digest over the whole set an
    update switched in (:func:`weightlift.digest.setdigest.set_digest`), the server's and the
    client's alike."""

    tensors: int
    bytes: int
    bytes_sent: int
    bytes_hashed: int
    cached: int
    seconds: float
    profile: dict[str, Any] | None = None
    verified: int = 0  # tensors whose digest the server reported and the client matched (verify=True)
    deltas: int = 0  # tensors sent as a DELTA against the version the server held (an update)
    set_digest: builtins.bytes | None = None  # an update's set digest, stated by the server and matched by the client
    manifest: str | None = None  # the published manifest the server's digests were checked against (verify=True)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Strategy:
    """How a push moves its tensors. ``sender``: the class that pushes one connection's share;
    ``hash_threshold``: the default size from which tensors are hashed; ``hash_ahead``: digests
    of the tensors worth asking a caching server about are computed on a pool beside the sends
    (else the sender hashes what it needs itself)."""

    name: str
    sender: type[Pusher]
    hash_threshold: int
    hash_ahead: bool


PIPELINE = Strategy("pipeline", Pusher, HASH_THRESHOLD, hash_ahead=True)
NAIVE = Strategy("naive", NaivePusher, NAIVE_HASH_THRESHOLD, hash_ahead=False)


def strategy() -> Strategy:
    """The strategy the environment asks for: :data:`NAIVE` under ``WEIGHTLIFT_LOAD_OPT=0``."""
    return PIPELINE if env.load_opt() else NAIVE


class Push:
    """One push of ``tensors`` over ``conns`` (all to one server, ``where``), run by :meth:`run`.

    ``settled`` says afterwards whether every connection ended in step with the server (at a
    BARRIER reply, nothing left allocated): if not, the connections are unusable.
    ``progress(done, total)`` is told the tensor bytes on the server after each tensor.
    """

    def __init__(
        self,
        tensors: Iterable[TensorInfo],
        conns: list[Connection],
        *,
        where: str,
        how: Strategy,
        profiler: Profiler,
        hash_threshold: int | None = None,
        verify: bool = False,
        update: UpdateSpec | None = None,
        expected: Mapping[str, bytes] | None = None,
        manifest: str | None = None,
        progress: ProgressCallback | None = None,
        unit: bool = False,
        digests: bool = False,
    ):
        if verify and not all(c.verify for c in conns):
            raise LocalProtocolError(
                f"push(verify=True): the server speaks protocol 1.{conns[0].minor}, which cannot report "
                "digests (it needs minor 2)"
            )
        self.plans = [wire_form(t) for t in tensors]
        self.conns = conns
        self.where = where
        self.how = how
        self.prof = profiler
        self.threshold = how.hash_threshold if hash_threshold is None else hash_threshold
        if digests:  # a relayed push: every tensor is hashed where its bytes come from, to be proven at each hop
            self.threshold = 0
        self.verify = verify or update is not None  # an update proves every tensor (see update)
        self.update = update  # an update (tensors from memory, minor 3): one connection, UPDATE to COMMIT
        if update is not None:
            self.conns = conns[:1]
        self.tally = Tally(sum(p.info.length for p in self.plans), progress)
        self.senders: list[Pusher] = []
        self.expected = expected  # with verify: digests published for the tensors
        self.manifest = manifest  # where ``expected`` was published
        self.unit = unit and update is None  # a checkpoint as one update over every connection (minor 5)
        self._open = False  # the unit's update is open on the server
        self.digests = digests  # every ALLOC names its tensor's digest (a relayed push: each hop proves it)

    @property
    def settled(self) -> bool:
        return all(p.settled for p in self.senders) and not self._open

    def _begin(self) -> None:
        """Open the unit's update on the first connection and join the others to it."""
        first, rest = self.conns[0], self.conns[1:]
        push = secrets.randbits(63) | 1 if rest else 0
        first.send(first.frame(Update(0, push)))
        self._open = True
        if rest:  # open on the server before another connection asks to join it
            first.send(first.frame(Barrier()))
            reply = first.expect(BarrierReply)
            if reply.errors:
                raise RemoteProtocolError("server: " + "; ".join(printable(e) for e in reply.errors))
            for c in rest:
                c.send(c.frame(Update(Update.FLAG_JOIN, push)))

    def _end(self, *, commit: bool) -> None:
        """COMMIT the unit (or abort it); StateError where the server switched nothing in."""
        first = self.conns[0]
        first.send(first.frame(Commit(Commit.FLAG_NO_ROOT if commit else Commit.FLAG_ABORT)))
        reply = first.expect(CommitReply)
        self._open = False
        if commit and not reply.ok:
            raise StateError(f"push to {self.where}: nothing was made visible: server: {printable(reply.message)}")

    def run(self) -> PushResult:
        """Send every tensor and wait for the server to have them; IntegrityError (with
        ``verify``) naming every tensor the server holds other than the file."""
        t0 = time.perf_counter()
        # an update hashes the tensors it scans against a base itself, in the same pass
        scanned = self.update.scanned(self.plans) if self.update is not None else set()
        hashing = Hashing(
            [p for p in self.plans if p.info.name not in scanned],
            threshold=self.threshold,
            prof=self.prof,
            enabled=self.digests or (self.how.hash_ahead and self.conns[0].cache),
            verify=self.verify,
            expected=self.expected,
        )
        sender = self.how.sender if self.update is None else UpdatePusher
        self.senders = [
            sender(c, prof=self.prof, tally=self.tally, hashing=hashing, threshold=self.threshold, verify=self.verify)
            for c in self.conns
        ]
        if self.update is not None:
            self.senders[0].spec = self.update  # type: ignore[attr-defined]
        ok = False
        try:
            if self.unit:
                self._begin()
            self._send(balance(self.plans, len(self.conns)))
            self._check(self.tally)  # with a unit, before anything wrong is made visible
            if self.unit:
                self._end(commit=True)
            ok = True
        finally:
            hashing.close(ok=ok)
            if self._open and all(p.settled for p in self.senders):
                try:  # every connection in step (a refusal at a BARRIER): abort and keep them
                    self._end(commit=False)
                except WeightliftError:
                    pass  # the connection is left unsettled: the client closes it, which aborts too
        seconds = time.perf_counter() - t0
        tally = self.tally
        return PushResult(
            tally.tensors,
            tally.bytes,
            tally.sent,
            tally.hashed + hashing.hashed_bytes,
            tally.cached,
            seconds,
            self.prof.report() if self.prof.enabled else None,
            tally.verified,
            tally.deltas,
            self.update.root if self.update is not None else None,
            self.manifest if self.verify else None,
        )

    def _check(self, tally: Tally) -> None:
        if tally.differ:
            raise IntegrityError(
                f"push to {self.where}: {len(tally.differ)} of {len(self.plans)} tensors are not on the server "
                + (f"as published in {self.manifest}: " if self.manifest else "as they are in the file: ")
                + ", ".join(tally.differ)
            )

    def _send(self, groups: list[list[Plan]]) -> None:
        """Each sender its group, on threads of their own when there are several."""
        if len(self.senders) == 1:
            self.senders[0].run(groups[0])
            return
        errors: list[BaseException] = []

        def run(sender: Pusher, group: list[Plan]) -> None:
            try:
                sender.run(group)
            except BaseException as e:  # re-raised in the caller's thread
                errors.append(e)

        threads = [
            threading.Thread(target=run, args=(p, g), name=f"weightlift-push {i}", daemon=True)
            for i, (p, g) in enumerate(zip(self.senders, groups, strict=True))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
