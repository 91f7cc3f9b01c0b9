"""Where loaded bytes land: host arrays (numpy, torch CPU) or CUDA device memory.

Each target says whether a plain memcpy is the correct way to fill it (``memcpy_ok``). Host
arrays in the checkpoint's own dtype are: the loader and the server write bytes straight into
them. A CUDA device is not (its memory is not host-addressable), nor is any target that
transforms the bytes (a dtype cast on load): those go through their own fill step,
:meth:`Target.write`, fed from a reused staging buffer.

Host destinations come from :func:`weightlift.memory.fresh.fresh_host`, mapped the way this machine
fills fresh memory fastest (:mod:`weightlift.memory.fresh`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeAlias

import numpy as np

from weightlift.dtypes import DTYPES, byte_length, dtype_info, numpy_dtype, torch_dtype
from weightlift.errors import DeviceError, OptionError, install_hint
from weightlift.formats import TensorInfo
from weightlift.memory.fresh import before_kernel_copy as populate
from weightlift.memory.fresh import fresh_host
from weightlift.options import Placement

__all__ = [
    "Target",
    "Stager",
    "HostTarget",
    "CastTarget",
    "CudaTarget",
    "PinnedSlots",
    "make_target",
    "target_for",
    "fresh_host",
    "populate",
    "as_bytes",
    "view_as",
    "tensor_view",
    "quantized",
    "STAGING_SLOT",
    "WORKER_SLOT",
    "DEVICE_ALIGN",
    "cuda_device",
    "empty_device_cache",
]

STAGING_SLOT = 64 * 1024 * 1024
#: Where a tensor loaded into device memory starts, in bytes: what cudaMalloc guarantees, so a
#: loaded tensor is as aligned as one torch allocated on its own. cuBLASLt needs 16 for its fast
#: kernels (and fp8 ``_scaled_mm`` refuses less); a tensor at 8 mod 16 gets other kernels, and
#: other logits, than the same weights loaded by another loader.
DEVICE_ALIGN = 256
#: A caller's host buffer for a :class:`Stager`, or a function that makes one when first needed.
Spare: TypeAlias = "np.ndarray | memoryview | Callable[[], np.ndarray | memoryview] | None"
_PLAIN = {d.name for d in DTYPES}


def as_bytes(arr: Any, *, after: Any = None) -> np.ndarray:
    """A contiguous array's or tensor's bytes as a flat uint8 numpy array: the one way weightlift
    reads a tensor's bytes (to hash them, send them, compare them), on any device.

    A numpy array or a CPU tensor gives a view of its own memory. A tensor on a device (whose
    ``.numpy()`` refuses) gives a host copy, made on the calling thread's current stream of the
    tensor's device, which waits only for work queued on that stream: ``after`` (an event recorded
    where the bytes were written, on another thread's or a side stream) is waited for first.
    """
    if isinstance(arr, np.ndarray):
        return arr.reshape(-1).view(np.uint8)
    import torch

    flat = arr.reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        return flat.numpy()
    if after is not None:
        after.synchronize()
    return flat.cpu().numpy()


def view_as(raw: np.ndarray, dtype: str, shape: tuple[int, ...], framework: str) -> Any:
    """``raw`` (uint8, exactly the tensor's bytes) seen as a tensor of ``dtype`` and ``shape``."""
    info = dtype_info(dtype)
    if framework == "numpy":
        if info.bits % 8:
            return raw
        return raw.view(numpy_dtype(dtype)).reshape(shape)
    import torch

    if raw.size == 0:  # torch cannot reinterpret an empty byte view; nothing to share anyway
        return torch.empty(shape if info.bits % 8 == 0 else (0,), dtype=torch_dtype(dtype))
    t = torch.from_numpy(raw) if raw.flags.writeable else _readonly_torch(raw)
    if info.bits % 8:
        return t
    return t.view(torch_dtype(dtype)).reshape(shape)


def quantized(t: TensorInfo) -> bool:
    """A tensor whose bytes are quantized blocks (GGUF), not an array of a plain dtype."""
    return t.dtype not in _PLAIN


def tensor_view(raw: np.ndarray, t: TensorInfo, framework: str) -> Any:
    """``raw`` (host uint8, exactly ``t``'s bytes) as the array a load returns for ``t``: its dtype
    and shape, or for quantized blocks uint8 rows of its ``raw_shape``."""
    if not quantized(t):
        return view_as(raw, t.dtype, t.shape, framework)
    shaped = raw.reshape(t.extra.get("raw_shape", (raw.size,)))
    if framework == "numpy":
        return shaped
    return view_as(shaped, "U8", shaped.shape, "torch")


def _readonly_torch(raw: np.ndarray) -> Any:
    import warnings

    import torch

    with warnings.catch_warnings():
        # torch warns that it cannot protect read-only memory; copy=False documents that the
        # tensors are backed by the read-only mapping and must not be written.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw)


class Target:
    """Where tensors land. Subclasses define the fill step; host targets accept a plain memcpy.

    The loader and the server's receiver see a target only through this interface: whole-load
    destinations (:meth:`arena`, :meth:`view`), a cast variant (:meth:`casting`), and for the
    targets a memcpy cannot fill (``memcpy_ok`` False), the host staging that bytes pass through
    on their way in (:meth:`stager`). Neither ever tests a target's class.
    """

    device: str = "cpu"
    framework: str = "numpy"
    memcpy_ok: bool = True
    dtype: str | None = None
    #: where each tensor of an arena starts (:func:`weightlift.plan.layout`): 0 keeps a host
    #: tensor at its file offset modulo the plan's ALIGN (no copy cut at a tensor boundary)
    align: int = 0

    def empty(self, dtype: str, shape: tuple[int, ...]) -> Any:
        raise NotImplementedError

    def host_view(self, dest: Any) -> memoryview:
        raise DeviceError(f"{type(self).__name__} memory is not host-addressable")

    def write(self, dest: Any, offset: int, data: Any) -> None:
        raise NotImplementedError

    def finish(self, dest: Any) -> Any:
        return dest

    def synchronize(self) -> None:
        pass

    def arena(self, nbytes: int) -> Any:
        """One flat uint8 destination of ``nbytes`` for a whole load; its tensors are :meth:`view` s of it."""
        return fresh_host(nbytes)

    def view(self, arena: Any, offset: int, t: TensorInfo) -> Any:
        """Tensor ``t`` as a view of its bytes at ``offset`` in ``arena`` (from :meth:`arena`)."""
        return tensor_view(arena[offset : offset + t.length], t, self.framework)

    def casting(self, dtype: str) -> Target:
        """A target in the same place that casts floating-point tensors to ``dtype`` on the way in."""
        return CastTarget(self.framework, dtype)

    def stager(self, spare: Spare = None, *, private: bool = False) -> Stager:
        """The host staging bytes pass through on their way into this target (see :class:`Stager`).

        ``spare`` is a host buffer of the caller's (or a function that makes one, called only
        if it is needed), used where the target has no staging of its own. ``private=True`` asks for staging of the caller's own (one worker thread each),
        returned by :meth:`Stager.close`; else the target's own staging, for one thread at a time.
        """
        return Stager(self, spare)

    def pinned_bytes(self) -> int:
        """Host memory this target pins for its own staging once it is used (a server charges it
        to its memory account when it makes the target)."""
        return 0

    @property
    def unified_memory(self) -> bool:
        """Whether this memory is the same RAM as the page cache (an integrated GPU): keeping the
        page cache would then hold a checkpoint twice."""
        return False


class Stager:
    """Host bytes on their way into a target: :meth:`take` a host buffer, fill it, :meth:`land` it.

    This one lands the bytes through :meth:`Target.write` out of a buffer of the caller's (or one
    of its own); a CUDA target's stager hands out its pinned slots instead, so the bytes are
    filled once, in place, and land by an asynchronous device copy. Either way the buffer is
    reused by the next :meth:`take`.
    """

    def __init__(self, target: Target, spare: Spare = None):
        self.target = target
        self._make = spare if callable(spare) else None
        self._spare = None if spare is None or callable(spare) else np.frombuffer(spare, dtype=np.uint8)
        self._buf: np.ndarray | None = None

    def take(self, n: int) -> np.ndarray:
        """A host buffer for up to ``n`` bytes (its length says how many), free to fill now."""
        if self._spare is None and self._make is not None:
            self._spare = np.frombuffer(self._make(), dtype=np.uint8)
        if self._spare is None:
            self._spare = np.empty(min(max(n, 1), STAGING_SLOT), dtype=np.uint8)
        self._buf = self._spare[:n]
        return self._buf

    def land(self, dest: Any, offset: int) -> None:
        """The buffer last taken, filled, becomes the bytes of ``dest`` from byte ``offset``."""
        assert self._buf is not None, "land() before take()"
        self.target.write(dest, offset, self._buf)

    def close(self) -> None:
        pass

    def __enter__(self) -> Stager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HostTarget(Target):
    """numpy arrays or torch CPU tensors in the checkpoint's dtype: filled by plain memcpy."""

    memcpy_ok = True

    def __init__(self, framework: str = "numpy"):
        self.framework = framework

    def empty(self, dtype: str, shape: tuple[int, ...]) -> Any:
        return view_as(fresh_host(byte_length(dtype, shape)), dtype, shape, self.framework)

    def host_view(self, dest: Any) -> memoryview:
        return as_bytes(dest).data

    def write(self, dest: Any, offset: int, data: Any) -> None:
        src = np.frombuffer(data, dtype=np.uint8)
        as_bytes(dest)[offset : offset + src.size] = src


class CastTarget(Target):
    """Host tensors converted to another dtype on the way in: never a plain memcpy.

    ``write`` takes bytes of the source dtype at a source byte offset (whole elements) and
    converts them into the matching elements of the destination, so a stream needs no buffer
    the size of the whole tensor.
    """

    memcpy_ok = False

    def __init__(self, framework: str, dtype: str):
        self.framework = framework
        self.dtype = dtype
        self.cast = dtype
        self._src: dict[int, str] = {}

    def empty(self, dtype: str, shape: tuple[int, ...]) -> Any:
        if dtype_info(dtype).bits % 8 or dtype_info(self.cast).bits % 8:
            raise OptionError(f"cannot cast packed type {dtype} to {self.cast}")
        dest = view_as(fresh_host(byte_length(self.cast, shape)), self.cast, shape, self.framework)
        self._src[id(dest)] = dtype
        return dest

    def convert(self, src: Any, dtype: str, shape: tuple[int, ...]) -> Any:
        """A converted copy of a whole source buffer (the loader's one-pass fill)."""
        dest = self.empty(dtype, shape)
        self._fill(dest, dtype, 0, src)
        self._src.pop(id(dest), None)
        return dest

    def write(self, dest: Any, offset: int, data: Any) -> None:
        self._fill(dest, self._src[id(dest)], offset, data)

    def _fill(self, dest: Any, src_dtype: str, offset: int, data: Any) -> None:
        size = dtype_info(src_dtype).bits // 8
        nbytes = len(memoryview(data).cast("B"))
        if offset % size or nbytes % size:
            raise OptionError(f"a cast write must cover whole {src_dtype} elements")
        if not nbytes:  # an empty tensor: nothing to convert, and torch cannot view no bytes
            return
        flat = dest.reshape(-1)
        i0 = offset // size
        if self.framework == "numpy":
            src = np.frombuffer(data, dtype=numpy_dtype(src_dtype))
            flat[i0 : i0 + src.size] = src.astype(flat.dtype)
        else:
            src = view_as(np.frombuffer(data, dtype=np.uint8), src_dtype, (-1,), "torch")
            flat[i0 : i0 + src.numel()].copy_(src)

    def finish(self, dest: Any) -> Any:
        self._src.pop(id(dest), None)
        return dest


class PinnedSlots:
    """Pinned host slots and a copy stream on one device, double buffered.

    A slot is handed out again only after the event recorded behind its last copy has completed,
    so whoever filled it may fill the next one while the device copies this one. Each copy marks
    its destination as in use by the copy stream (``record_stream``; see :class:`CudaTarget`).
    """

    def __init__(self, torch: Any, stream: Any, buffers: list[Any]):
        self.torch = torch
        self.stream = stream
        self.buffers = buffers
        self.host = [b if isinstance(b, np.ndarray) else b.numpy() for b in buffers]
        self.events: list[Any] = [None] * len(buffers)
        self._next = 0

    def slot(self) -> tuple[int, np.ndarray]:
        """A free slot (index, uint8 numpy view), waiting for its last copy if needed."""
        i = self._next
        self._next = (i + 1) % len(self.buffers)
        ev = self.events[i]
        if ev is not None:
            ev.synchronize()
        return i, self.host[i]

    def upload(self, i: int, dest_bytes: Any, n: int) -> Any:
        """Copy the first ``n`` bytes of slot ``i`` into ``dest_bytes`` (a uint8 device view);
        returns the event behind the copy."""
        torch = self.torch
        with torch.cuda.stream(self.stream):
            dest_bytes.copy_(self.buffers[i][:n], non_blocking=True)
            dest_bytes.record_stream(self.stream)  # freed only after the copy
            return self._recorded(i)

    def cast_upload(self, i: int, dest: Any, src_dtype: str, offset: int, n: int, device: Any) -> Any:
        """Convert the first ``n`` bytes of slot ``i`` (``src_dtype`` elements) into the elements of
        ``dest`` from source byte ``offset`` on."""
        size = dtype_info(src_dtype).bits // 8
        if offset % size or n % size:
            raise OptionError(f"a cast write must cover whole {src_dtype} elements")
        with self.torch.cuda.stream(self.stream):
            src = self.buffers[i][:n].view(torch_dtype(src_dtype)).to(device, non_blocking=True)
            dest.reshape(-1)[offset // size : offset // size + src.numel()].copy_(src)
            dest.record_stream(self.stream)  # src was allocated on this stream; dest was not
            return self._recorded(i)

    def _recorded(self, i: int) -> Any:
        # blocking: a host thread that waits for a slot sleeps instead of spinning a core (a
        # loader has a dozen such threads, a server one per connection)
        ev = self.torch.cuda.Event(blocking=True)
        ev.record(self.stream)
        self.events[i] = ev
        return ev

    def wait(self) -> None:
        """Wait for every copy out of the slots."""
        for ev in self.events:
            if ev is not None:
                ev.synchronize()


class _PinnedStager(Stager):
    """A CUDA target's staging: its pinned slots, filled in place, landed by asynchronous copies."""

    def __init__(self, target: CudaTarget, slots: PinnedSlots, release: Any = None):
        super().__init__(target)
        self.slots = slots
        self._release = release
        self._slot = 0
        self._n = 0
        self._waited = 0  # the target's allocations this stager's stream has been ordered after

    def take(self, n: int) -> np.ndarray:
        self._slot, buf = self.slots.slot()
        self._n = min(n, len(buf))
        return buf[: self._n]

    def land(self, dest: Any, offset: int) -> None:
        target: CudaTarget = self.target  # type: ignore[assignment]
        self._waited = target.order_after_allocs(self.slots.stream, self._waited)
        flat = dest.reshape(-1).view(self.slots.torch.uint8)
        target.copied(dest, self.slots.upload(self._slot, flat[offset : offset + self._n], self._n))

    def close(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release(self.slots)


#: the pinned slot of a loader worker's private staging (two per worker)
WORKER_SLOT = 16 * 1024 * 1024
_worker_slots: dict[str, list[PinnedSlots]] = {}
_worker_lock = threading.Lock()


def _import_torch() -> Any:
    import torch

    return torch


def cuda_device(device: str | Placement, current: Callable[[], int]) -> str:
    """``device`` (``cuda`` or ``cuda:N``, or a CUDA :class:`~weightlift.options.Placement`) as
    the one device it names: ``cuda:N``. A bare ``cuda`` is ``current()``, torch's current device,
    which is per thread: it must be asked once, in the caller's thread, and the answer carried as
    a value (a loader or server thread asking again gets device 0 whatever the caller set)."""
    if isinstance(device, Placement):  # checked when it was made: only the number is left to find
        if not device.cuda:
            raise OptionError(f"not a CUDA device: {device.device!r}")
        index = device.index
        return f"cuda:{index if index is not None else int(current())}"
    name, _, number = str(device).partition(":")
    if name != "cuda":
        raise OptionError(f"not a CUDA device: {device!r}")
    if not number:
        return f"cuda:{int(current())}"
    if not number.isdigit():
        raise OptionError(f"unknown device {device!r}: expected cuda or cuda:N")
    return f"cuda:{int(number)}"


class CudaTarget(Target):
    """torch CUDA tensors, filled through pinned staging slots and asynchronous copies.

    Two pinned slots (double buffering): while the device copies out of one, the host fills the
    other. A slot is reused only after the event recorded behind its copy has completed, so the
    caller may reuse its own buffer as soon as :meth:`write` returns.

    The device is resolved once, when the target is made, in the caller's thread (see
    :func:`cuda_device`): every stream and tensor of the target is on that one device.

    The copies run on the target's own stream (or a loader worker's), and the destination was
    allocated on the caller's current one: memory torch's caching allocator may have freed with
    kernels still queued on that stream. Every copy stream is ordered after an event recorded on
    the allocating stream behind each allocation, before its first copy into it. Each destination
    is also marked as in use by the copy stream (``record_stream``): a tensor
    dropped while its copies are still in flight (a client gone mid-tensor, a digest that did not
    match) goes back to torch's caching allocator, which hands its memory to no other tensor
    until the copies queued on that stream have finished. Without the mark the memory could be
    reused at once, and the late copy would land in someone else's tensor.

    Its dependencies can be handed in: ``torch`` (the module), ``stream`` (the copy stream) and
    ``pinned`` (makes a pinned host buffer of n bytes); by default the real ones.
    """

    memcpy_ok = False
    framework = "torch"
    align = DEVICE_ALIGN

    def __init__(
        self,
        device: str | Placement = "cuda",
        dtype: str | None = None,
        *,
        slot_bytes: int = STAGING_SLOT,
        slots: int = 2,
        torch: Any = None,
        stream: Any = None,
        pinned: Any = None,
    ):
        if torch is None:
            torch = _import_torch()
        if not torch.cuda.is_available():
            named = device.device if isinstance(device, Placement) else device
            raise DeviceError(f"device {named!r} asked for, but torch sees no CUDA device")
        self._torch = torch
        self.device = cuda_device(device, lambda: torch.cuda.current_device())
        self.dtype = dtype
        self._dev = torch.device(self.device)
        self._stream = stream if stream is not None else torch.cuda.Stream(device=self._dev)
        self._pinned = pinned if pinned is not None else self._pin
        self._slot_bytes = slot_bytes
        # pinned slots are made at the first write: pinning costs far more than using memory, and
        # a load that brings its own staging (the loader's private stagers) never needs these
        self._nslots = slots
        self._own: PinnedSlots | None = None
        self._lock = threading.Lock()
        self._src: dict[int, str] = {}
        # per allocating stream, the event behind its latest allocation; and how many allocations
        self._allocated: dict[Any, Any] = {}
        self._allocs = 0
        self._landed: dict[int, Any] = {}  # id(dest) -> the event behind its latest copy

    def _pin(self, n: int) -> Any:
        return self._torch.empty(n, dtype=self._torch.uint8, pin_memory=True)

    def _slots(self) -> PinnedSlots:
        if self._own is None:
            self._own = PinnedSlots(
                self._torch, self._stream, [self._pinned(self._slot_bytes) for _ in range(self._nslots)]
            )
        return self._own

    def empty(self, dtype: str, shape: tuple[int, ...]) -> Any:
        torch = self._torch
        if self.dtype is not None:
            dest = torch.empty(shape, dtype=torch_dtype(self.dtype), device=self._dev)
            self._src[id(dest)] = dtype
        elif dtype_info(dtype).bits % 8:
            dest = torch.empty(byte_length(dtype, shape), dtype=torch.uint8, device=self._dev)
        else:
            dest = torch.empty(shape, dtype=torch_dtype(dtype), device=self._dev)
        self._after_alloc()
        return dest

    def _after_alloc(self) -> None:
        # Memory is allocated on the current stream and may be a block freed with kernels still
        # queued there; the copies into it run on this target's stream, or a worker's, which must
        # not start before that work is done.
        current = self._torch.cuda.current_stream(self._dev)
        ev = self._torch.cuda.Event()
        ev.record(current)
        with self._lock:
            self._allocated[current] = ev
            self._allocs += 1
        self._stream.wait_stream(current)

    def order_after_allocs(self, stream: Any, waited: int) -> int:
        """Order ``stream`` (a copy stream) after every allocation of this target since the
        ``waited`` th; returns the count to pass next time. Cheap when nothing was allocated."""
        with self._lock:
            if self._allocs == waited:
                return waited
            events, n = list(self._allocated.values()), self._allocs
        for ev in events:
            stream.wait_event(ev)
        return n

    def copied(self, dest: Any, event: Any) -> None:
        """``event`` is behind the latest copy into ``dest``: :meth:`finish` waits for it alone."""
        self._landed[id(dest)] = event

    def slot(self) -> tuple[int, np.ndarray]:
        """A free pinned slot (index, uint8 numpy view), waiting for its last copy if needed."""
        return self._slots().slot()

    def upload(self, slot: int, dest_bytes: Any, n: int) -> None:
        """Copy the first ``n`` bytes of pinned ``slot`` into ``dest_bytes`` (a uint8 device view)."""
        self._slots().upload(slot, dest_bytes, n)

    def write(self, dest: Any, offset: int, data: Any) -> None:
        src = np.frombuffer(data, dtype=np.uint8)
        src_dtype = self._src.get(id(dest))
        flat = dest.reshape(-1).view(self._torch.uint8) if src_dtype is None else None
        pos = 0
        with self._lock:
            slots = self._slots()
            while pos < src.size:
                n = min(self._slot_bytes, src.size - pos)
                i, buf = slots.slot()
                buf[:n] = src[pos : pos + n]
                if flat is not None:
                    ev = slots.upload(i, flat[offset + pos : offset + pos + n], n)
                else:
                    ev = slots.cast_upload(i, dest, src_dtype, offset + pos, n, self._dev)  # type: ignore[arg-type]
                self.copied(dest, ev)
                pos += n

    def synchronize(self) -> None:
        self._stream.synchronize()
        self._landed.clear()  # every copy on the stream landed (a tensor dropped unfinished too)

    def finish(self, dest: Any) -> Any:
        """``dest`` once every copy into it has landed: its own last copy waited for, not the
        copies of other tensors queued behind it on the stream."""
        self._src.pop(id(dest), None)
        ev = self._landed.pop(id(dest), None)
        if ev is not None:
            ev.synchronize()  # the stream's copies run in order: this one landed, all before it did
        else:  # copies not seen by copied() (upload() called directly): all of them
            self._stream.synchronize()
        return dest

    def arena(self, nbytes: int) -> Any:
        arena = self._torch.empty(nbytes, dtype=self._torch.uint8, device=self._dev)
        self._after_alloc()
        return arena

    def view(self, arena: Any, offset: int, t: TensorInfo) -> Any:
        raw = arena[offset : offset + t.length]
        if quantized(t):
            return raw.reshape(t.extra.get("raw_shape", (t.length,)))
        if dtype_info(t.dtype).bits % 8:
            return raw
        return raw.view(torch_dtype(t.dtype)).reshape(t.shape)

    def casting(self, dtype: str) -> Target:
        return CudaTarget(self.device, dtype, torch=self._torch, pinned=self._pinned)

    def pinned_bytes(self) -> int:
        return self._nslots * self._slot_bytes

    def stager(self, spare: Spare = None, *, private: bool = False) -> Stager:
        if self.dtype is not None:  # a cast: through write(), which converts on the device
            return Stager(self, spare)
        if not private:
            return _PinnedStager(self, self._slots())
        with _worker_lock:
            pool = _worker_slots.setdefault(self.device, [])
            slots = pool.pop() if pool else None
        if slots is None:
            stream = self._torch.cuda.Stream(device=self._dev)
            slots = PinnedSlots(self._torch, stream, [self._pinned(WORKER_SLOT) for _ in range(2)])
        return _PinnedStager(self, slots, release=self._return_slots)

    def _return_slots(self, slots: PinnedSlots) -> None:
        """Pinning memory costs far more than using it, so a worker's slots outlive a load; its
        stream belongs to this device (its copies and the events behind them must be on one),
        so they are kept per device."""
        slots.wait()
        with _worker_lock:
            _worker_slots.setdefault(self.device, []).append(slots)

    @property
    def unified_memory(self) -> bool:
        try:
            props = self._torch.cuda.get_device_properties(self._dev)
            return bool(getattr(props, "is_integrated", False))
        except Exception:  # noqa: BLE001 - a property query that fails means a discrete device
            return False


def empty_device_cache(device: str, torch: Any = None) -> int:
    """Give the blocks torch's caching allocator holds unused on ``device`` back to the driver;
    returns the bytes given back. A dropped tensor's memory stays cached for torch's next
    allocation otherwise: counted as used by nvidia-smi and out of other processes' reach."""
    torch = torch if torch is not None else _import_torch()
    before = int(torch.cuda.memory_reserved(device))
    with torch.cuda.device(device):  # empty_cache() frees the current device's cache
        torch.cuda.empty_cache()
    return max(0, before - int(torch.cuda.memory_reserved(device)))


def target_for(place: Placement, dtype: str | None = None) -> Target:
    """The target for a checked device/framework pair; ``dtype`` (a dtype name) casts on load."""
    if dtype is not None:
        dtype_info(dtype)
    if place.framework == "torch":
        # here, before any byte is read, rather than as an ImportError from the first tensor's view
        try:
            _import_torch()
        except ImportError:
            raise OptionError(f"framework='torch' needs torch: {install_hint('torch')}") from None
    if place.cuda:
        return CudaTarget(place, dtype)
    return CastTarget(place.framework, dtype) if dtype else HostTarget(place.framework)


def make_target(device: str = "cpu", framework: str = "numpy", dtype: str | None = None) -> Target:
    """:func:`target_for` a device and framework given as strings (checked as a
    :class:`~weightlift.options.Placement` here), for a caller that holds no Placement."""
    return target_for(Placement(device=device, framework=framework), dtype)
