"""The naive receive path, kept apart for A/B runs (``WEIGHTLIFT_LOAD_OPT=0``).

Before the optimized paths a WRITE was received whole into a fresh, zero-filled buffer and then
copied into its destination. The benchmark's ``wl.push.legacy`` arm compares against it, so it
stays as it was; nothing else takes this path.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from weightlift.remote.protocol import WriteHeader

if TYPE_CHECKING:
    from weightlift.remote.server.receive import Pending, Receiver

__all__ = ["receive_naive"]


def receive_naive(rx: Receiver, p: Pending, h: WriteHeader) -> None:
    """Receive one WRITE's payload into a fresh buffer, hash it, then write it into ``p``'s destination."""
    prof = rx.prof
    t0 = time.perf_counter_ns() if prof.enabled else 0
    buf = bytearray(h.length)  # a fresh, zero-filled buffer per message, as the naive path did
    rx.payload(memoryview(buf))
    t1 = time.perf_counter_ns() if prof.enabled else 0
    rx.hash(p, memoryview(buf))
    t2 = time.perf_counter_ns() if prof.enabled else 0
    rx.target.write(p.dest, h.offset, buf)
    if prof.enabled:
        prof.record("wire", t0, t1, h.length, name=p.name)
        prof.record("stage", t2, time.perf_counter_ns(), h.length, name=p.name)
