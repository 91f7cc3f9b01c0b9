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
from typing import Any

import numpy as np

from weightlift.dtypes import byte_length, dtype_info, numpy_dtype, torch_dtype
from weightlift.errors import DeviceError, OptionError
from weightlift.memory.fresh import before_kernel_copy as populate
from weightlift.memory.fresh import fresh_host
from weightlift.options import Placement

__all__ = ["Target", "HostTarget", "CastTarget", "CudaTarget", "make_target", "fresh_host", "populate", "STAGING_SLOT"]

STAGING_SLOT = 64 * 1024 * 1024


def as_bytes(arr: Any) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous numpy array or CPU torch tensor."""
    if isinstance(arr, np.ndarray):
        return arr.reshape(-1).view(np.uint8)
    import torch

    return arr.reshape(-1).view(torch.uint8).numpy()


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


def _readonly_torch(raw: np.ndarray) -> Any:
    import warnings

    import torch

    with warnings.catch_warnings():
        # torch warns that it cannot protect read-only memory; copy=False documents that the
        # tensors are backed by the read-only mapping and must not be written.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw)


class Target:
    """Where tensors land. Subclasses define the fill step; host targets accept a plain memcpy."""

    device: str = "cpu"
    framework: str = "numpy"
    memcpy_ok: bool = True
    dtype: str | None = None

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


class CudaTarget(Target):
    """torch CUDA tensors, filled through pinned staging slots and asynchronous copies.

    Two pinned slots (double buffering): while the device copies out of one, the host fills the
    other. A slot is reused only after the event recorded behind its copy has completed, so the
    caller may reuse its own buffer as soon as :meth:`write` returns.

    The copies run on the target's own stream, and the destination was allocated on the current
    one, so each destination is marked as in use by the copy stream (``record_stream``): a tensor
    dropped while its copies are still in flight (a client gone mid-tensor, a digest that did not
    match) goes back to torch's caching allocator, which hands its memory to no other tensor
    until the copies queued on that stream have finished. Without the mark the memory could be
    reused at once, and the late copy would land in someone else's tensor.
    """

    memcpy_ok = False
    framework = "torch"

    def __init__(
        self, device: str = "cuda", dtype: str | None = None, *, slot_bytes: int = STAGING_SLOT, slots: int = 2
    ):
        import torch

        if not torch.cuda.is_available():
            raise DeviceError(f"device {device!r} asked for, but torch sees no CUDA device")
        self._torch = torch
        self.device = str(torch.device(device))
        self.dtype = dtype
        self._dev = torch.device(device)
        self._stream = torch.cuda.Stream(device=self._dev)
        self._slot_bytes = slot_bytes
        # pinned slots are made at the first write: pinning costs far more than using memory, and
        # a load that brings its own staging (the loader's per-worker slots) never needs these
        self._nslots = slots
        self._slots: list[Any] = []
        self._slot_np: list[np.ndarray] = []
        self._events: list[Any] = [None] * slots
        self._next = 0
        self._lock = threading.Lock()
        self._src: dict[int, str] = {}

    def empty(self, dtype: str, shape: tuple[int, ...]) -> Any:
        torch = self._torch
        if self.dtype is not None:
            dest = torch.empty(shape, dtype=torch_dtype(self.dtype), device=self._dev)
            self._src[id(dest)] = dtype
            return dest
        if dtype_info(dtype).bits % 8:
            return torch.empty(byte_length(dtype, shape), dtype=torch.uint8, device=self._dev)
        return torch.empty(shape, dtype=torch_dtype(dtype), device=self._dev)

    def slot(self) -> tuple[int, np.ndarray]:
        """A free pinned slot (index, uint8 numpy view), waiting for its last copy if needed."""
        if not self._slots:
            torch = self._torch
            self._slots = [
                torch.empty(self._slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(self._nslots)
            ]
            self._slot_np = [s.numpy() for s in self._slots]
        i = self._next
        self._next = (i + 1) % self._nslots
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()
        return i, self._slot_np[i]

    def upload(self, slot: int, dest_bytes: Any, n: int) -> None:
        """Copy the first ``n`` bytes of pinned ``slot`` into ``dest_bytes`` (a uint8 device view)."""
        torch = self._torch
        with torch.cuda.stream(self._stream):
            dest_bytes.copy_(self._slots[slot][:n], non_blocking=True)
            dest_bytes.record_stream(self._stream)  # see the class docstring: freed only after the copy
            ev = torch.cuda.Event()
            ev.record(self._stream)
        self._events[slot] = ev

    def write(self, dest: Any, offset: int, data: Any) -> None:
        src = np.frombuffer(data, dtype=np.uint8)
        src_dtype = self._src.get(id(dest))
        flat = dest.reshape(-1).view(self._torch.uint8) if src_dtype is None else None
        pos = 0
        with self._lock:
            while pos < src.size:
                n = min(self._slot_bytes, src.size - pos)
                i, buf = self.slot()
                buf[:n] = src[pos : pos + n]
                if flat is not None:
                    self.upload(i, flat[offset + pos : offset + pos + n], n)
                else:
                    self._cast_upload(dest, src_dtype, offset + pos, i, n)  # type: ignore[arg-type]
                pos += n

    def _cast_upload(self, dest: Any, src_dtype: str, offset: int, slot: int, n: int) -> None:
        torch = self._torch
        size = dtype_info(src_dtype).bits // 8
        if offset % size or n % size:
            raise OptionError(f"a cast write must cover whole {src_dtype} elements")
        with torch.cuda.stream(self._stream):
            src = self._slots[slot][:n].view(torch_dtype(src_dtype)).to(self._dev, non_blocking=True)
            dest.reshape(-1)[offset // size : offset // size + src.numel()].copy_(src)
            dest.record_stream(self._stream)  # src was allocated on this stream; dest was not
            ev = torch.cuda.Event()
            ev.record(self._stream)
        self._events[slot] = ev

    def synchronize(self) -> None:
        self._stream.synchronize()

    def finish(self, dest: Any) -> Any:
        self._src.pop(id(dest), None)
        self.synchronize()
        return dest


def make_target(device: str = "cpu", framework: str = "numpy", dtype: str | None = None) -> Target:
    """The target for ``device``/``framework`` (checked as a :class:`~weightlift.options.Placement`);
    ``dtype`` (a dtype name) casts on load."""
    place = Placement(device=device, framework=framework)
    if dtype is not None:
        dtype_info(dtype)
    if place.cuda:
        return CudaTarget(place.device, dtype)
    return CastTarget(place.framework, dtype) if dtype else HostTarget(place.framework)
