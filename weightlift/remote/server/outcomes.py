"""What one connection's next BARRIER reports: tensors and bytes completed, errors, the tensors
a FILL could not fill, and the digests of verified tensors.

A client does not wait for a reply per tensor: everything that happens to its requests between
two barriers is kept here, within fixed bounds (MAX_ERRORS messages, MAX_DIGESTS digests,
MAX_TENSORS remembered failed ids), and handed over, then forgotten, at the barrier.
"""

from __future__ import annotations

from weightlift.remote.protocol import MAX_DIGESTS, MAX_ERRORS, MAX_MESSAGE, MAX_TENSORS, Barrier, BarrierReply
from weightlift.remote.server.store import Store

__all__ = ["Outcomes"]


class Outcomes:
    """One connection's results since its last barrier; ``failed`` remembers (oldest first) the
    ids whose ALLOC failed, so that their WRITEs are drained without a second error."""

    def __init__(self, store: Store, *, max_digests: int = MAX_DIGESTS):
        self._store = store
        self._max_digests = max_digests
        self.failed: dict[int, None] = {}
        self.errors: list[str] = []
        self.dropped_errors = 0
        self.need: dict[int, None] = {}  # pending ids a FILL_FROM_CACHE could not fill, in order
        self.done_tensors = 0
        self.done_bytes = 0
        # (id, digest) of verified tensors completed since the last barrier, at most MAX_DIGESTS
        self.verified: list[tuple[int, bytes]] = []
        self.verified_dropped = 0

    def error(self, text: str) -> None:
        """Keep an error for the next barrier; past MAX_ERRORS only count it."""
        self._store.count("errors")
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(text[:MAX_MESSAGE])  # the wire cuts it there anyway
        else:
            self.dropped_errors += 1

    def mark_failed(self, tid: int) -> None:
        self.failed.pop(tid, None)
        self.failed[tid] = None
        if len(self.failed) > MAX_TENSORS:  # forget the oldest: at worst one more "not allocated" error
            del self.failed[next(iter(self.failed))]

    def add_verified(self, tid: int, digest: bytes) -> None:
        if len(self.verified) < self._max_digests:
            self.verified.append((tid, digest))
        else:
            self.verified_dropped += 1

    def barrier(self, flags: int = 0) -> BarrierReply:
        """The reply to BARRIER: what completed and failed since the last one, what to resend, and
        (``flags`` asking for them) the digests of the verified tensors that completed."""
        if self.verified_dropped:
            self.error(
                f"{self.verified_dropped} verified tensors completed past the {self._max_digests} one barrier"
                " reports: their digests are lost (send BARRIER more often)"
            )
        errors = self.errors
        if self.dropped_errors:
            errors = errors[: MAX_ERRORS - 1] + [f"... and {self.dropped_errors + 1} more errors"]
        digests = tuple(self.verified) if flags & Barrier.FLAG_DIGESTS else ()
        reply = BarrierReply(self.done_tensors, self.done_bytes, tuple(errors), tuple(self.need), digests)
        self.errors, self.need, self.verified = [], {}, []
        self.dropped_errors = self.done_tensors = self.done_bytes = self.verified_dropped = 0
        return reply
