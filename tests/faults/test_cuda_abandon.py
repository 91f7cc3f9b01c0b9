"""A CUDA tensor abandoned while its asynchronous copies are in flight is not reused under them.

The server fills a CUDA tensor with copies on the target's own stream; the tensor was allocated
on the current stream. If it is dropped mid-copy (a client gone mid-tensor, a digest that did not
match), torch's caching allocator may hand its memory to the next tensor at once, and the late
copy lands there. CudaTarget marks each destination as used by its copy stream, so the
allocator waits for those copies before reusing the memory.

The CPU test drives CudaTarget's copy steps against a model of that allocator (blocks freed
while a stream they were recorded on has work queued are not reused until it finishes); the GPU
test does the same on a device.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np

import weightlift.memory.targets as targets_mod
from tests.devices import needs_cuda, needs_torch
from weightlift.memory.targets import CudaTarget


class FakeStream:
    """A stream whose queued copies run only when :meth:`finish` says so (a slow DMA)."""

    def __init__(self, name: str):
        self.name = name
        self.queued: list[Any] = []
        self.waited: list[FakeStream] = []

    def finish(self) -> None:
        for other in self.waited:  # what this stream was ordered after runs first
            other.finish()
        work, self.queued = self.queued, []
        for job in work:
            job()

    def synchronize(self) -> None:
        self.finish()

    def wait_stream(self, other: FakeStream) -> None:
        self.waited.append(other)

    def wait_event(self, ev: Any) -> None:
        self.waited.append(ev.stream)


class Allocator:
    """The caching allocator's rule: a freed block is reusable at once unless it was recorded on
    another stream, in which case it waits for the work queued there when it was freed."""

    def __init__(self) -> None:
        self.free_blocks: list[np.ndarray] = []
        self.waiting: list[tuple[np.ndarray, list[FakeStream]]] = []

    def alloc(self, n: int) -> np.ndarray:
        # blocks whose streams have finished their work become reusable
        done = [w for w in self.waiting if not any(s.queued for s in w[1])]
        self.waiting = [w for w in self.waiting if w not in done]
        self.free_blocks += [block for block, _ in done]
        for i, b in enumerate(self.free_blocks):
            if b.size == n:
                return self.free_blocks.pop(i)
        return np.zeros(n, dtype=np.uint8)

    def release(self, block: np.ndarray, streams: list[FakeStream]) -> None:
        busy = [s for s in streams if s.queued]
        if busy:
            self.waiting.append((block, busy))
        else:
            self.free_blocks.append(block)


class DeviceTensor:
    """A device tensor over one allocator block; a view shares the block and its stream record."""

    def __init__(self, alloc: Allocator, block: np.ndarray, lo: int = 0, hi: int | None = None, owner: Any = None):
        self.alloc, self.block, self.lo, self.hi = alloc, block, lo, block.size if hi is None else hi
        self.owner = owner or self
        if owner is None:
            self.streams: list[FakeStream] = []
            self.released = False

    def __getitem__(self, s: slice) -> DeviceTensor:
        lo, hi, _ = s.indices(self.hi - self.lo)
        return DeviceTensor(self.alloc, self.block, self.lo + lo, self.lo + hi, self.owner)

    def copy_(self, src: Any, non_blocking: bool = False) -> None:
        data = np.array(src, dtype=np.uint8)  # what the host slot holds when the copy is queued
        block, lo = self.block, self.lo
        CURRENT[-1].queued.append(lambda: block.__setitem__(slice(lo, lo + data.size), data))

    def record_stream(self, stream: FakeStream) -> None:
        if stream not in self.owner.streams:
            self.owner.streams.append(stream)

    def drop(self) -> None:
        """The last reference goes: the block returns to the allocator."""
        owner = self.owner
        if not owner.released:
            owner.released = True
            self.alloc.release(owner.block, owner.streams)


DEFAULT = FakeStream("default")
CURRENT = [DEFAULT]
THREAD = threading.local()  # torch's current device is per thread: 0 in a thread that set none


class _MadeStream(FakeStream):
    made: list[_MadeStream] = []

    def __init__(self, device: Any = None):
        super().__init__(f"worker on {device}")
        self.device = device
        _MadeStream.made.append(self)


class _Cuda:
    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def current_stream(device: Any = None) -> FakeStream:
        return CURRENT[-1]

    @staticmethod
    @contextlib.contextmanager
    def stream(s: FakeStream):
        CURRENT.append(s)
        try:
            yield
        finally:
            CURRENT.pop()

    Stream = _MadeStream

    @staticmethod
    def current_device() -> int:
        return getattr(THREAD, "device", 0)

    class Event:
        def __init__(self, blocking: bool = False):
            self.blocking = blocking

        def record(self, stream: FakeStream) -> None:
            self.stream = stream

        def synchronize(self) -> None:
            self.stream.finish()


class FakeTorch:
    cuda = _Cuda
    uint8 = np.uint8

    @staticmethod
    def device(name: str) -> str:
        return name


def _target(slot_bytes: int, dtype: str | None = None, pinned: Any = None, stream: Any = None) -> CudaTarget:
    """A CudaTarget over fakes: no device needed, the copy steps are what is tested."""
    return CudaTarget(
        "cuda",
        dtype,
        slot_bytes=slot_bytes,
        torch=FakeTorch,
        stream=stream or FakeStream("copies"),
        pinned=pinned or (lambda n: np.zeros(n, dtype=np.uint8)),
    )


def test_a_tensor_dropped_mid_copy_is_not_reused_until_its_copies_finish():
    n = 1 << 16
    alloc = Allocator()
    target = _target(n)
    dest = DeviceTensor(alloc, alloc.alloc(n))
    slot, buf = target.slot()
    buf[:] = 7
    target.upload(slot, dest[0:n], n)  # queued on the copy stream, not run yet
    dest.drop()  # abandoned with the copy in flight
    other = DeviceTensor(alloc, alloc.alloc(n))  # the next tensor, on the current stream
    other.block[:] = 0
    target.synchronize()  # the late copy lands now
    assert other.block is not dest.block, "the abandoned tensor's memory was reused under its copy"
    assert not other.block.any()
    assert alloc.alloc(n) is dest.block  # and once the copy finished, the memory is reused


@needs_torch  # the cast step names torch dtypes
def test_a_cast_tensor_dropped_mid_copy_is_not_reused_until_its_copies_finish():
    n = 1 << 12
    alloc = Allocator()

    class Staged(np.ndarray):
        def view(self, *_a: Any) -> Any:  # a torch dtype view of a host slot
            return self

        def to(self, *_a: Any, **_k: Any) -> Any:  # the device copy of the slot, on the copy stream
            return np.asarray(self).copy().view(Staged)

        def numel(self) -> int:
            return self.size

    copies = FakeStream("copies")
    target = _target(n, "U8", pinned=lambda k: np.zeros(k, dtype=np.uint8).view(Staged), stream=copies)

    def empty(shape: tuple[int, ...], **_k: Any) -> DeviceTensor:  # the cast destination, on the device
        t = DeviceTensor(alloc, alloc.alloc(n))
        t.reshape = lambda *_a: t  # type: ignore[attr-defined]
        return t

    FakeTorch.empty = staticmethod(empty)  # type: ignore[attr-defined]
    try:
        dest = target.empty("U8", (n,))
        # the destination came from the current stream: the copy stream waits for what is queued there
        assert copies.waited == [CURRENT[-1]]
        target.write(dest, 0, bytes([9]) * n)  # converted on the copy stream, not run yet
    finally:
        del FakeTorch.empty  # type: ignore[attr-defined]
    dest.drop()
    other = DeviceTensor(alloc, alloc.alloc(n))
    other.block[:] = 0
    target.synchronize()
    assert other.block is not dest.block, "the abandoned tensor's memory was reused under its copy"
    assert not other.block.any()


def test_a_stager_lands_through_the_pinned_slots():
    """The seam the loader and the receiver use: fill the slot handed out, land it; no host copy."""
    n = 1 << 10
    alloc = Allocator()
    target = _target(n)
    dest = DeviceTensor(alloc, alloc.alloc(3 * n))
    dest.reshape = lambda *_a: dest  # type: ignore[attr-defined]
    dest.view = lambda *_a: dest  # type: ignore[attr-defined]
    with target.stager() as st:
        for k in range(3):
            buf = st.take(3 * n - k * n)
            assert len(buf) == n and buf.base is not None  # a slot of the target's, not a copy
            buf[:] = k + 1
            st.land(dest, k * n)
    target.synchronize()
    assert [int(dest.block[k * n]) for k in range(3)] == [1, 2, 3]


def _in_a_thread(fn: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_a_bare_cuda_is_the_callers_device_in_every_worker_thread(monkeypatch):
    """After ``set_device(1)`` a bare "cuda" is cuda:1 for the caller; a loader worker's thread
    has device 0 current. The worker's copy stream must be on the device the arena is on."""
    monkeypatch.setattr(targets_mod, "_worker_slots", {})
    _MadeStream.made.clear()
    THREAD.device = 1
    try:
        target = _target(1 << 10)
    finally:
        del THREAD.device
    assert target.device == "cuda:1"
    stager = _in_a_thread(lambda: target.stager(private=True))
    assert [s.device for s in _MadeStream.made] == ["cuda:1"]
    stager.close()
    assert list(targets_mod._worker_slots) == ["cuda:1"]  # kept for that device, not "cuda"


def test_a_workers_copy_stream_waits_for_the_stream_that_allocated_its_destination(monkeypatch):
    """The arena may be memory freed with a kernel still queued on the allocating (current) stream;
    a loader worker copies on a private stream, which must be ordered after that kernel, or the
    kernel overwrites the loaded bytes when it runs."""
    monkeypatch.setattr(targets_mod, "_worker_slots", {})
    n = 1 << 10
    alloc = Allocator()
    block = alloc.alloc(n)
    DEFAULT.queued.append(lambda: block.__setitem__(slice(None), 7))  # a kernel still queued on it

    def empty(nbytes: int, **_k: Any) -> DeviceTensor:  # the arena: that block, on the current stream
        t = DeviceTensor(alloc, block)
        t.reshape = lambda *_a: t  # type: ignore[attr-defined]
        t.view = lambda *_a: t  # type: ignore[attr-defined]
        return t

    monkeypatch.setattr(FakeTorch, "empty", staticmethod(empty), raising=False)
    target = _target(n)
    arena = target.arena(n)

    def load() -> None:
        with target.stager(private=True) as st:
            st.take(n)[:] = 1
            st.land(arena, 0)
        # close() waited for the copy: it ran, and what it was ordered after ran first

    _in_a_thread(load)
    DEFAULT.finish()  # the device runs whatever is left
    assert (block == 1).all(), "a kernel queued before the allocation ran after the load's copy"


def test_finish_waits_for_its_tensors_last_copy_not_the_whole_stream():
    """A connection may have the next tensor's copies queued behind this one's: finishing this
    one waits for the event behind its own last copy, never for the whole stream."""
    n = 1 << 10
    alloc = Allocator()

    class Counting(FakeStream):
        syncs = 0

        def synchronize(self) -> None:
            Counting.syncs += 1
            super().synchronize()

    target = _target(n, stream=Counting("copies"))
    dest = DeviceTensor(alloc, alloc.alloc(2 * n))
    dest.reshape = lambda *_a: dest  # type: ignore[attr-defined]
    dest.view = lambda *_a: dest  # type: ignore[attr-defined]
    target.write(dest, 0, bytes([5]) * (2 * n))
    assert target.finish(dest) is dest
    assert Counting.syncs == 0
    assert (dest.block == 5).all()  # its copies landed


def test_a_slots_event_is_waited_for_by_sleeping_not_spinning():
    """torch.cuda.Event() busy-spins a core in synchronize(); a loader has a dozen threads
    waiting for slots, so the slot events are made blocking."""
    from weightlift.memory.targets import PinnedSlots

    alloc = Allocator()
    slots = PinnedSlots(FakeTorch, FakeStream("copies"), [np.zeros(64, dtype=np.uint8)])
    i, _ = slots.slot()
    slots.upload(i, DeviceTensor(alloc, alloc.alloc(64)), 64)
    assert slots.events[i].blocking


@needs_cuda
def test_on_a_device_a_tensor_dropped_mid_copy_does_not_write_into_the_next_one():
    import torch

    n = 256 << 20  # a copy long enough to be in flight while the next tensor is made and zeroed
    target = CudaTarget("cuda", slot_bytes=n)
    for _ in range(3):
        dest = target.empty("U8", (n,))
        slot, buf = target.slot()
        buf[:] = 0xA5
        target.upload(slot, dest.view(torch.uint8), n)
        del dest  # abandoned while the copy may still run
        other = torch.zeros(n, dtype=torch.uint8, device="cuda")
        target.synchronize()
        torch.cuda.synchronize()
        assert int(other.count_nonzero()) == 0, "a late copy landed in another tensor"
        del other
