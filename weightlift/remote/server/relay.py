"""Relayed pushes: a server forwards what it receives to the next server of a chain.

Theory of operation. A client pushing one selection to N servers sends it to the first only,
after a RELAY naming the others in order. Every ALLOC of that push names the tensor's digest (the
origin's BLAKE3, hashed where the bytes come from), and the receiver proves the bytes that
landed against it before the tensor is held (:mod:`~weightlift.remote.server.receive`). A
proven tensor is handed to this connection's :class:`Relay` at once, which pushes it onward to
the next hop with the client's own code (:class:`~weightlift.remote.client.push.Pusher` over a
:class:`~weightlift.remote.client.connection.Connection`): the tensor's memory as the payload,
and in its ALLOC the digest the origin sent, never one the relay computed. That hop proves the
bytes against the origin's digest in turn, holds them, and forwards to the hop after it, named by
the RELAY this relay sent it. So a chain of N moves each tensor over N links, each of them once,
while the next tensor is still arriving upstream: the client's egress is the model once, and the
whole push takes about the time of one plus a tensor's time per hop.

What a relay can and cannot do to the bytes: it can delay them or drop them (the client's
RELAY_END then names it as the hop that failed), withhold the COMMIT, and it can forward other bytes, which the next
hop refuses (they do not hash to the origin's digest) and reports, so nothing it changed becomes
visible downstream. It cannot choose what a later hop accepts: the digests come from the origin
over the authenticated, MACed connection of each hop, and a relay has no digest of its own to
offer (a tensor the origin sent without one is never relayed).

Credentials: each hop authenticates with the server's peer credentials (``peer_token``, by default
the server's own token: a fleet shares one; ``peer_tls``, a client TLS context), configured on the
server. The client's RELAY names addresses only: a token sent along the chain would be a secret
every relay could replay anywhere, and one taken from the wire would let any client make the
server present credentials of the client's choosing.

One unit on every hop, in two phases. RELAY opens an update on its connection (the
connection's :class:`~weightlift.remote.server.updates.switch.Switch`): what it proves is held,
invisible and charged, not published; a relay opens the last hop's with UPDATE. RELAY_END (after
the client's last BARRIER, so every tensor of the push has been handed over) is the prepare: it
waits for the onward push, then for the next hop's own RELAY_END (the last hop's BARRIER_REPLY),
and answers ``ok`` once every hop downstream holds its whole set, or with the first hop that
does not: the hops before it are prepared, it and the hops after it dropped theirs. The relay's
thread then keeps its onward connection open for the decision: the COMMIT that reaches this
connection switches this hop in and is passed on (:meth:`Relays.decide`), each hop answering
once the next has; a drop (ABORT, a failed switch here, the connection ending first) closes the
onward connection without a COMMIT, so each hop after drops its set in turn (the minor 5
rollback of a connection that ends mid-update). A relay can withhold the COMMIT: the hops after
it then keep their old version, never part of the new.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from weightlift.errors import IntegrityError, OptionError, RemoteProtocolError, TransportError
from weightlift.formats import TensorInfo
from weightlift.profile import Profiler
from weightlift.remote.client.client import NOT_SWITCHED, Client, ClientOptions
from weightlift.remote.client.connection import Connection
from weightlift.remote.client.memory import MEMORY
from weightlift.remote.client.push import Hashing, Pusher, Tally, wire_form
from weightlift.remote.protocol import MAX_HOPS, Commit, CommitReply, Message, RelayEnd, RelayReply, Update
from weightlift.remote.protocol import Relay as RelayMessage
from weightlift.remote.server.config import ServerConfig
from weightlift.remote.transport import parse_address

if TYPE_CHECKING:
    from weightlift.remote.server.admission import Context
    from weightlift.remote.server.receive import Receiver

__all__ = ["Relays", "Relay", "RELAY_TIMEOUT", "BATCH_TENSORS"]

#: Seconds a hop may take to answer (its handshake, a BARRIER, its own RELAY_END) before this
#: relay gives up on it and reports it as the hop that failed.
RELAY_TIMEOUT = 120.0
#: Tensors handed to the sender at once: whatever has been proven since it last took some, up to
#: this many; batches follow one another on the wire with no BARRIER between them.
BATCH_TENSORS = 256


class Relays:
    """One connection's relay, from RELAY to RELAY_END: ``rx`` (its receiver) forwards what it
    proves while one is open; ``reply`` answers the client, ``event`` logs a line."""

    def __init__(
        self, ctx: Context, rx: Receiver, reply: Callable[[Message], None], event: Callable[..., None]
    ) -> None:
        self._ctx, self._rx, self._reply, self._event = ctx, rx, reply, event
        self.relay: Relay | None = None  # RELAY to RELAY_END
        self.prepared: Relay | None = None  # RELAY_END to COMMIT: waiting for the decision

    def start(self, msg: RelayMessage) -> None:
        if self.relay is not None or self._rx.pending:
            raise RemoteProtocolError("RELAY after the push began, or twice on one connection")
        if self._rx.publish != self._ctx.store.publish:  # an update's tensors are visible at its COMMIT only
            raise RemoteProtocolError("RELAY inside an update: a relayed push is an update of its own")
        if not self._ctx.pooled:
            self._reply(RelayReply(False, message="this server does not relay: its tensors are not in host memory"))
            return
        try:
            self.relay = Relay(self._ctx.config, msg.hops)
        except OptionError as e:
            self._reply(RelayReply(False, message=str(e)))
            return
        self._rx.forward = self.relay.forward
        self._reply(RelayReply(True))
        self._event(logging.INFO, "relay", hops=len(msg.hops), next=msg.hops[0])

    def end(self, msg: RelayEnd, *, refused: str = "") -> None:
        """RELAY_END: the reply once every hop downstream holds its whole set (prepared) or one
        failed. ``refused``: why this hop's own set is not whole (its update is dropped here, and
        the hops downstream are told to drop theirs)."""
        relay, self.relay = self.relay, None
        if relay is None:
            raise RemoteProtocolError("RELAY_END without a RELAY")
        self._rx.forward = None
        reply = relay.end()
        if refused:
            relay.decide(False)
            reply = RelayReply(False, reply.tensors, reply.nbytes, "", f"not held here: {refused}", reply.skipped)
        else:
            self.prepared = relay
        self._reply(reply)
        level = logging.INFO if reply.ok else logging.WARNING
        self._event(level, "relay_end", ok=reply.ok, tensors=reply.tensors, failed=reply.failed)

    def decide(self, commit: bool, reply: CommitReply | None = None) -> CommitReply | None:
        """This hop's COMMIT (``reply``, switched or not; ``commit``: whether it switched): the
        same decision sent down the chain, and ``reply`` with what downstream did added."""
        relay, self.prepared = self.prepared, None
        if relay is None:
            return reply
        down = relay.decide(commit)
        if (
            reply is None
            or not reply.ok
            or not relay.next_prepared
            or (down is not None and down.ok and not down.message)
        ):
            return reply
        if down is not None and down.ok:  # the next hop switched; one after it did not, as it says
            return replace(reply, message=down.message)
        why = down.message if down is not None else relay.commit_error or "no reply"
        return replace(reply, message=f"{NOT_SWITCHED}{relay.next} did not switch: {why}")

    @property
    def open(self) -> bool:
        """Whether a RELAY is open (until RELAY_END)."""
        return self.relay is not None

    def close(self) -> None:
        """The connection ended before its COMMIT: every hop downstream drops what it holds."""
        for relay in (self.relay, self.prepared):
            if relay is not None:
                relay.close()
        self.relay = self.prepared = None


class Relay:
    """The onward push of one connection's relayed tensors to ``hops[0]`` (which relays them to
    ``hops[1:]``), on a thread of its own, started here.

    :meth:`forward` hands over a proven tensor (never blocks); :meth:`end` waits for every hop and
    returns the RELAY_REPLY; :meth:`close` gives up (the client went away).

    A next hop that cannot be reached, dies or stalls (a transport failure) is skipped: the hop
    after it gets every tensor handed over so far, then the rest, from here (a caching hop fills
    what it already holds), and the reply names the skipped hop. A next hop that refuses what it
    is sent (bytes that do not hash to the origin's digest) is not skipped: the fault may be this
    relay's, so the reply names it as failed and the client serves it and the hops after it.
    """

    def __init__(self, config: ServerConfig, hops: tuple[str, ...], *, timeout: float | None = None):
        if not hops or len(hops) > MAX_HOPS:
            raise OptionError(f"a relay names between 1 and {MAX_HOPS} hops, got {len(hops)}")
        for h in hops:
            parse_address(h)  # OptionError now, not on the relay's thread
        self.next, self.rest = hops[0], hops[1:]
        timeout = RELAY_TIMEOUT if timeout is None else timeout
        self.options = ClientOptions(token=config.peer_token, tls=config.peer_tls, timeout=timeout)
        self.tensors = self.nbytes = 0  # forwarded and proven at the next hop
        self.error: BaseException | None = None
        self.skipped: list[str] = []  # hops routed around, in chain order
        self._why: list[str] = []
        self._queue: queue.SimpleQueue[TensorInfo | None] = queue.SimpleQueue()
        self._handed: list[TensorInfo] = []  # every tensor taken from the queue: sent again past a skipped hop
        self._ended = False  # the queue's end was taken
        self._downstream: RelayReply | None = None
        self._prepared = threading.Event()  # the push and the prepare ended (or failed): end() may answer
        self._decision: queue.SimpleQueue[bool] = queue.SimpleQueue()  # COMMIT (True) or drop (False)
        self.next_prepared = False  # the next hop holds its whole set and waits for the decision
        self.committed: CommitReply | None = None  # the next hop's COMMIT_REPLY
        self.commit_error = ""
        self._thread = threading.Thread(target=self._run, name=f"weightlift-relay {self.next}", daemon=True)
        self._thread.start()

    def forward(self, name: str, dtype: str, shape: tuple[int, ...], data: Any, digest: bytes | None) -> None:
        """Push ``data`` (a tensor's host memory, as published) onward with the origin's ``digest``."""
        if self.error is not None:
            return  # the hop failed: RELAY_END reports it
        flat = np.frombuffer(data, dtype=np.uint8)
        extra: dict[str, Any] = {"data": lambda: flat}
        if digest is not None:
            extra["relayed"] = digest
        self._queue.put(TensorInfo(name, dtype, shape, MEMORY, 0, flat.nbytes, extra=extra))

    def end(self) -> RelayReply:
        """Every tensor has been handed over: wait for the onward push and the hops after it."""
        self._queue.put(None)
        self._prepared.wait()
        why = "; ".join(self._why)
        if self.error is not None:
            message = "; ".join([*self._why, f"{type(self.error).__name__}: {self.error}"])
            return RelayReply(False, self.tensors, self.nbytes, self.next, message, tuple(self.skipped))
        down = self._downstream or RelayReply(True)
        skipped = (*self.skipped, *down.skipped)
        message = "; ".join(m for m in (why, down.message) if m)
        return RelayReply(down.ok, self.tensors, self.nbytes, down.failed, message, skipped)

    def decide(self, commit: bool) -> CommitReply | None:
        """The decision for the next hop (COMMIT, or drop its set); its COMMIT_REPLY, or None
        where it never got as far as holding its set (or did not answer: :attr:`commit_error`)."""
        self._decision.put(commit)
        self._thread.join()
        return self.committed

    def close(self) -> None:
        """The connection ended before its COMMIT: stop after what was handed over, and have the
        next hop drop its set (its connection closes without a COMMIT)."""
        self._queue.put(None)
        self._decision.put(False)

    def _run(self) -> None:
        client: Client | None = None
        try:
            while True:
                try:
                    client = self._deliver()
                    break
                except TransportError as e:  # dead, stalled or unreachable: the hops after it are served from here
                    if not self.rest:
                        self.error = e
                        return
                    self.skipped.append(self.next)
                    self._why.append(f"{self.next} skipped: {e}")
                    self.next, self.rest = self.rest[0], self.rest[1:]
                except BaseException as e:  # noqa: BLE001 - reported by RELAY_END, naming this hop
                    self.error = e
                    return
            self.next_prepared = True
            self._prepared.set()
            self._commit(client)
        finally:
            self._prepared.set()
            if client is not None:
                client.close()

    def _deliver(self) -> Client:
        """Connect to the next hop, open the unit there (RELAY the rest of the chain to it, or
        UPDATE the last hop), push, and prepare it (RELAY_END, or the push's last BARRIER): the
        client, its connection waiting for the decision."""
        client = Client.with_options(self.next, replace(self.options))
        try:
            conn = client.connections[0]
            if self.rest:
                conn.send(conn.frame(RelayMessage(self.rest)))
                reply = conn.expect(RelayReply)
                if not reply.ok:
                    raise OptionError(f"{self.next} refuses to relay: {reply.message}")
            else:  # the last hop holds its set as an update of its own
                conn.send(conn.frame(Update()))
            self._push(conn)
            if self.rest:
                conn.send(conn.frame(RelayEnd()))
                self._downstream = conn.expect(RelayReply)
        except BaseException:
            client.close()
            raise
        return client

    def _commit(self, client: Client) -> None:
        """Wait for this hop's decision and pass it on: a COMMIT (which the next hop passes on in
        turn), or the connection closed without one (the next hop drops its set, and so on)."""
        commit = self._decision.get()
        if not commit:
            return
        conn = client.connections[0]
        try:
            conn.send(conn.frame(Commit(Commit.FLAG_NO_ROOT)))
            self.committed = conn.expect(CommitReply)
        except Exception as e:  # noqa: BLE001 - the hop died between its prepare and the decision
            self.commit_error = f"{type(e).__name__}: {e}"

    def _push(self, conn: Connection) -> None:
        """One push to the next hop: what was handed over before (to a hop after a skipped one),
        then each batch as it is handed over (one BARRIER at the end, and every MAX_DIGESTS / 2
        tensors for their digests)."""
        prof = Profiler(False)
        tally = Tally()
        hashing = Hashing([], threshold=0, prof=prof, enabled=True, verify=True)
        pusher = Pusher(conn, prof=prof, tally=tally, hashing=hashing, threshold=0, verify=True)
        batch = list(self._handed)
        while True:
            plans = [wire_form(t) for t in batch]
            hashing.carry(plans)
            pusher.send(plans)
            if self._ended:
                break
            batch = []
            item = self._queue.get()
            while item is not None:
                batch.append(item)
                if len(batch) >= BATCH_TENSORS or self._queue.empty():
                    break
                item = self._queue.get()
            self._ended = item is None
            self._handed.extend(batch)
        pusher.finish()
        if tally.differ:  # the hop stored other bytes than it proved: it refuses them itself first
            raise IntegrityError(f"{self.next} reports other digests for " + ", ".join(tally.differ))
        self.tensors, self.nbytes = tally.tensors, tally.bytes
