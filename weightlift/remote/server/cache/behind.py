"""Writing cache entries behind the push: from a published tensor's memory, on one thread.

Theory of operation. A tensor named by digest is hashed as its bytes arrive (the receive path
proves it before publishing it); its cache entry need not be written on that path too. Writing
it there made a first push into a caching server wait for the disk: every piece was written to
a file before the next was received. Instead the receiver hands the published tensor to
:class:`WriteBehind`, whose one thread writes the entry later, from the tensor's memory, to a
temporary file renamed into place once whole (:class:`~.cache.CacheWriter`): an entry is still
never visible before it is complete.

What the writer holds, and why it is safe:

* **A reference, charged.** A job keeps the published array alive, so its memory is never
  reused under the write: the store's account charges an array until its last reference goes,
  so what the writer holds counts against ``max_memory`` like any reader's. A tensor replaced
  before its turn is dropped from the queue (:meth:`WriteBehind.drop`): an old version is worth
  nothing to the cache and its memory goes back at once. At most the one tensor being written is
  held past its replacement.
* **Not changed under it.** An in-place switch of a tensor's memory drops its queued jobs and
  waits for the one being written from it before it changes a byte (:class:`~weightlift.remote.server.updates.switch.Switch`),
  and the receiver holds the tensor's read gate from its publish until its job is queued, so no
  switch falls between the two: the bytes written are those the digest was proven for.
* **Bytes still proven.** The bytes were proven to hash to the digest when they arrived. They
  still do unless someone wrote into the tensor since, which only a holder of a writable handle
  can do; the store marks an entry ``exposed`` before it hands one out. A job asks ``sealed()``
  when it starts: a sealed tensor is written without hashing it again; an exposed one is hashed
  as it is written and committed only if it still matches. ``sealed()`` is asked again before the
  rename, so a handle given out during the write aborts the entry.
* **Behind, also for the CPU.** Copying an entry into the page cache takes a core as long as
  receiving it did. While any connection has tensors in flight, and until none has had any for
  :data:`QUIET_S` (a push leaves gaps between one tensor and the next ALLOC), the writer waits
  (each entry at most :data:`MAX_DEFER_S`, so a server that never stops receiving still
  caches), and it runs at the lowest priority, so that on a machine whose cores are busy with
  the push the entries are written with the time left over.
* **Bounded.** At most :data:`MAX_JOBS` jobs wait; past that a tensor is not cached (a counter
  says how many), so a disk slower than the network never holds the push up or grows a queue
  without end. :meth:`WriteBehind.flush` waits for the queue to empty (a server closing, a test).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightlift.digest.blake import byte_view
from weightlift.errors import CacheError

__all__ = ["WriteBehind", "sealed_since", "MAX_JOBS", "WRITE_PIECE"]

BEHIND_NICE = 19  # the writer thread's nice value: it runs on what the receive leaves
MAX_DEFER_S = 5.0  # an entry waits for the receives in flight to end at most this long
QUIET_S = 0.25  # ... and after the last one ended, this long without another beginning
IDLE_EXIT_S = 1.0  # the writer thread ends after this long with nothing to write
MAX_JOBS = 4096  # entries waiting to be written; past this a tensor is not cached
WRITE_PIECE = 8 * 1024 * 1024  # bytes per write(): large, and each piece hashed while still in cache


def sealed_since(store: Any, name: str, tensor: Any, *, staged: bool = False) -> Callable[[], bool] | None:
    """For ``tensor``, just published as ``name`` in ``store``: whether nobody was handed a
    writable handle on it since (not on that entry, nor on a later one that published the same
    memory again); None if ``name`` holds another tensor already. ``staged``: the tensor is held
    for an update's switch, not in the store yet, and nobody can hold a handle on it until then."""
    entry = store.get(name)
    if staged and (entry is None or entry.tensor is not tensor):

        def published_sealed() -> bool:
            cur = store.get(name)
            return not (cur is not None and cur.tensor is tensor and cur.exposed)

        return published_sealed
    if entry is None or entry.tensor is not tensor:
        return None

    def sealed() -> bool:
        if entry.exposed:
            return False
        cur = store.get(name)
        return not (cur is not None and cur.tensor is tensor and cur.exposed)

    return sealed


def _lowest_priority() -> None:
    """Run the calling thread at the lowest CPU priority (Linux: a nice value per thread), so
    that on a machine whose cores are busy receiving, the entries are written with what is left."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BEHIND_NICE)


@dataclass
class _WriteJob:
    digest: bytes
    nbytes: int
    tensor: Any  # the published array: holding it keeps its memory from being reused
    view: Any  # its bytes (a host view of the array)
    sealed: Callable[[], bool]  # whether nobody could have written into it since it was proven
    queued: float  # time.monotonic() when it was queued


class WriteBehind:
    """One background writer of cache entries for a :class:`~.cache.TensorCache`.

    ``make_writer(digest, length, hashed)`` opens an entry's writer (CacheError when it cannot);
    ``on_error`` hears of a write that failed (the server may switch the cache off).
    """

    def __init__(
        self,
        make_writer: Callable[[bytes, int, bool], Any],
        on_error: Callable[[CacheError], None] = lambda e: None,
    ):
        self._make_writer = make_writer
        self.on_error = on_error
        self._cond = threading.Condition()
        self._jobs: deque[_WriteJob] = deque()
        self._busy = False
        self._current: Any = None  # the tensor being written now
        self._queued: dict[bytes, int] = {}  # digest -> jobs of it queued or being written
        self._receiving: set[int] = set()  # receivers with tensors in flight (see receiving())
        self._quiet_since = 0.0  # time.monotonic() when the last receiver in flight stopped
        self._thread: threading.Thread | None = None
        self._closed = False
        self.counts = {"written": 0, "skipped": 0, "dropped": 0, "aborted": 0}

    def submit(self, digest: bytes, tensor: Any, view: Any, sealed: Callable[[], bool]) -> bool:
        """Queue the entry of ``digest`` to be written from ``view`` (the bytes of ``tensor``);
        False (not cached) when the queue is full or closed."""
        nbytes = byte_view(view).nbytes
        with self._cond:
            if self._closed or len(self._jobs) >= MAX_JOBS:
                self.counts["skipped"] += 1
                return False
            job = _WriteJob(bytes(digest), nbytes, tensor, view, sealed, time.monotonic())
            self._jobs.append(job)
            self._queued[job.digest] = self._queued.get(job.digest, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="weightlift-cache-behind", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    def receiving(self, who: int, active: bool) -> None:
        """Receiver ``who`` has tensors in flight (``active``) or none any more: while any has,
        the writer waits (at most :data:`MAX_DEFER_S` per entry), so that its copies to the
        page cache do not take the CPU from the receive."""
        with self._cond:
            if active:
                self._receiving.add(who)
            elif who in self._receiving:
                self._receiving.discard(who)
                if not self._receiving:
                    self._quiet_since = time.monotonic()
                    self._cond.notify_all()

    def pending(self, digest: bytes) -> bool:
        """Whether an entry of ``digest`` is queued or being written."""
        with self._cond:
            return digest in self._queued

    def wait_for(self, digest: bytes, timeout: float | None = None) -> bool:
        """Wait until no entry of ``digest`` is queued or being written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: digest not in self._queued, timeout)

    def _done(self, digest: bytes) -> None:
        # the lock is held
        left = self._queued.pop(digest, 1) - 1
        if left:
            self._queued[digest] = left

    def drop(self, tensor: Any, *, wait: bool = False) -> None:
        """Forget the queued jobs of ``tensor`` (replaced: its memory may go back now). ``wait``:
        also wait until an entry being written from it now is done (its memory is about to be
        written into, which would make the entry's bytes another version's)."""
        with self._cond:
            if wait:
                self._cond.wait_for(lambda: self._current is not tensor)
            gone = [j for j in self._jobs if j.tensor is tensor]
            if gone:
                self.counts["dropped"] += len(gone)
                self._jobs = deque(j for j in self._jobs if j.tensor is not tensor)
                for j in gone:
                    self._done(j.digest)
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued entry is written (or given up); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued, then stop taking jobs."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            for j in self._jobs:
                self._done(j.digest)
            self._jobs.clear()
            self._cond.notify_all()

    def _run(self) -> None:
        _lowest_priority()
        done: bytes | None = None  # the digest of the job just finished
        while True:
            with self._cond:
                if done is not None:
                    self._done(done)
                    done = None
                self._busy = False
                self._current = None
                self._cond.notify_all()
                while not self._jobs:
                    if self._closed or not self._cond.wait(IDLE_EXIT_S) and not self._jobs:
                        self._thread = None  # idle: the next submit starts a new one
                        return
                # behind the receive, for a while at most; the job stays queued meanwhile, so a
                # replacement (or an in-place change of its memory) can still drop it
                while not self._closed and self._jobs:
                    now = time.monotonic()
                    left = self._jobs[0].queued + MAX_DEFER_S - now
                    quiet = 0.0 if self._receiving else self._quiet_since + QUIET_S - now
                    if left <= 0 or (not self._receiving and quiet <= 0):
                        break
                    self._cond.wait(min(left, quiet) if quiet > 0 else left)
                if not self._jobs:
                    continue
                job = self._jobs.popleft()
                self._busy = True
                self._current = job.tensor
            done = job.digest
            try:
                self._write(job)
            except CacheError as e:
                self.on_error(e)
            except Exception as e:  # never let the thread die with jobs queued
                self.on_error(CacheError(f"cache write behind failed: {type(e).__name__}: {e}"))
            del job  # the memory may go back before the next job arrives

    def _write(self, job: _WriteJob) -> None:
        hashed = not job.sealed()  # written into since it was proven: prove it again as it is written
        w = self._make_writer(job.digest, job.nbytes, hashed)
        with w:
            src = byte_view(job.view)
            for pos in range(0, job.nbytes, WRITE_PIECE):
                w.write(src[pos : pos + WRITE_PIECE])
            if not hashed and not job.sealed():  # a writable handle went out during the write
                self.counts["aborted"] += 1
                return  # the context manager removes the temporary file
            w.commit()
        self.counts["written"] += 1
