"""The seam to torch.distributed: a process group's collectives on flat byte buffers, and arenas.

Every collective weightlift issues goes through :class:`Comm`, which maps torch's errors (a
peer that died, a timeout, a broken socket) to :class:`~weightlift.errors.TransportError` at
this one boundary, and bounds every wait by ``timeout`` where one is given (gloo also honours
the ``timeout`` given to ``init_process_group``). Buffers are uint8 tensors that weightlift
builds; nothing is pickled.

An :class:`Arena` is one destination buffer for a whole load, on the host (fresh memory,
huge pages where possible) or on a CUDA device; the collectives write into slices of it, and
each tensor handed back is a view of it. A device arena is filled through a reused host
staging buffer of :data:`STAGING` bytes, so a caller fills at most that much at a time.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import numpy as np

from weightlift.distributed.shard import Piece
from weightlift.dtypes import dtype_info
from weightlift.errors import OptionError, TransportError, WeightliftError, install_hint
from weightlift.memory.targets import fresh_host, view_as
from weightlift.options import Placement

__all__ = ["Comm", "Arena", "pack", "ALIGN", "STAGING"]

ALIGN = 64  # every tensor starts 64-byte aligned in an arena, so any dtype can view it
STAGING = 16 * 1024 * 1024


def pack(sizes: list[int], start: int = 0) -> tuple[list[int], int]:
    """Offsets of back-to-back buffers of ``sizes`` bytes, each :data:`ALIGN`-aligned; and the end."""
    offs, at = [], start
    for n in sizes:
        at = -(-at // ALIGN) * ALIGN
        offs.append(at)
        at += n
    return offs, at


class Comm:
    """A process group's rank, size and collectives, with torch's errors mapped to ours."""

    def __init__(self, group: Any = None, *, timeout: float | None = None):
        try:
            import torch.distributed as dist
        except ImportError:
            raise OptionError(f"a process group needs torch: {install_hint('torch')}") from None
        if not dist.is_available():
            raise OptionError("this torch build has no torch.distributed")
        if not dist.is_initialized():
            raise OptionError("torch.distributed is not initialised: call init_process_group first")
        self.dist = dist
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        if self.rank < 0:
            raise OptionError("this process is not a member of the process group it was given")
        self.backend = str(dist.get_backend(self.group)).lower()
        self.timeout = None if timeout is None else datetime.timedelta(seconds=float(timeout))
        self.place = Placement()  # where collective buffers live; check_device sets the load's
        self.device = self.place.device  # the same, as torch takes it

    def check_device(self, place: Placement) -> None:
        """A gloo group moves host memory, an NCCL group device memory: refuse a mismatch now.
        The small tensors weightlift exchanges besides the arena go to the same device."""
        if self.backend == "nccl" and not place.cuda:
            raise OptionError("an NCCL group moves CUDA memory: load with device='cuda:N', or pass a gloo group")
        if self.backend == "gloo" and place.cuda:
            raise OptionError("a gloo group moves host memory here: load with device='cpu', or pass an NCCL group")
        self.place, self.device = place, place.device

    def landed(self) -> None:
        """Return once the collectives queued so far have run. An NCCL ``wait()`` only orders the
        current stream after the collective: a clock read without this times the bytes enqueued,
        not the bytes landed."""
        if self.place.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def global_rank(self, r: int) -> int:
        if self.group is self.dist.group.WORLD:
            return r
        assert self.group is not None  # None is the default group, which WORLD stands for above
        return int(self.dist.get_global_rank(self.group, r))

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except WeightliftError:
            raise
        except Exception as e:  # noqa: BLE001 - torch raises RuntimeError and its subclasses here
            raise self._error(what, e) from None

    def _error(self, what: str, e: BaseException) -> TransportError:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if len(first) > 300:
            first = first[:300] + "..."
        return TransportError(
            f"rank {self.rank} of {self.world}: {what} failed: a peer rank left, or the collective timed out ({first})"
        )

    def wait(self, work: Any, what: str) -> None:
        if work is None:
            return
        if self.timeout is not None:
            self._call(what, lambda: work.wait(timeout=self.timeout))
        else:
            self._call(what, work.wait)

    def broadcast(self, t: Any, src: int, *, async_op: bool = False, what: str = "broadcast") -> Any:
        g = self.global_rank(src)
        work = self._call(what, lambda: self.dist.broadcast(t, src=g, group=self.group, async_op=True))
        if async_op:
            return work
        self.wait(work, what)
        return None

    def all_gather(self, out: Any, mine: Any, *, async_op: bool = False, what: str = "all_gather") -> Any:
        """``out`` (``world`` times the size of ``mine``) gets every rank's ``mine``, in rank order;
        ``mine`` may be this rank's slice of ``out`` (in place)."""
        fn = getattr(self.dist, "all_gather_single", None) or self.dist.all_gather_into_tensor
        work = self._call(what, lambda: fn(out, mine, group=self.group, async_op=True))
        if async_op:
            return work
        self.wait(work, what)
        return None

    def isend(self, t: Any, peer: int, *, what: str = "send") -> Any:
        """Send the contiguous tensor ``t`` to group rank ``peer``; the work to :meth:`wait` for.
        Between two ranks, messages match in the order they are posted."""
        g = self.global_rank(peer)
        return self._call(what, lambda: self.dist.isend(t, dst=g, group=self.group))

    def irecv(self, t: Any, peer: int, *, what: str = "recv") -> Any:
        """Receive into the contiguous tensor ``t`` from group rank ``peer``; the work to wait for."""
        g = self.global_rank(peer)
        return self._call(what, lambda: self.dist.irecv(t, src=g, group=self.group))

    def all_to_all(
        self,
        out: Any,
        inp: Any,
        out_splits: list[int],
        in_splits: list[int],
        *,
        async_op: bool = False,
        what: str = "all_to_all",
    ) -> Any:
        work = self._call(
            what,
            lambda: self.dist.all_to_all_single(
                out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=self.group, async_op=True
            ),
        )
        if async_op:
            return work
        self.wait(work, what)
        return None


class Arena:
    """One destination buffer of ``nbytes`` where ``place`` says (host memory by default);
    tensors are views of it."""

    def __init__(self, nbytes: int, place: Placement = Placement()):  # noqa: B008 - a frozen value
        self.nbytes = nbytes
        self.device = place.device
        self.cuda = place.cuda
        self._torch: Any = None
        if self.cuda:
            import torch

            try:
                self.dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                self._stage_t = torch.empty(min(STAGING, max(1, nbytes)), dtype=torch.uint8, pin_memory=True)
            except (RuntimeError, AssertionError) as e:
                from weightlift.errors import DeviceError

                raise DeviceError(f"cannot allocate {nbytes} bytes on {self.device}: {e}") from None
            self._stage = self._stage_t.numpy()
            self.host = None
        else:
            self.host = fresh_host(nbytes)

    @property
    def limit(self) -> int:
        """The most bytes one :meth:`fill` may take."""
        return STAGING if self.cuda else 1 << 62

    def tensor(self) -> Any:
        """The whole arena as a flat uint8 torch tensor (shares memory) for collectives."""
        if self._torch is None:
            if self.cuda:
                self._torch = self.dev
            else:
                import torch

                self._torch = torch.from_numpy(self.host)
        return self._torch

    def fill(self, off: int, n: int, write: Callable[[np.ndarray], None]) -> None:
        """``write`` fills a host buffer of ``n`` bytes that lands at ``off``."""
        if not n:
            return
        if self.host is not None:
            write(self.host[off : off + n])
            return
        if n > len(self._stage):
            raise AssertionError(f"fill of {n} bytes over the staging buffer of {len(self._stage)}")
        write(self._stage[:n])
        self.dev[off : off + n].copy_(self._stage_t[:n])  # synchronous: the staging buffer is reused next

    def view(self, off: int, p: Piece, framework: str) -> Any:
        """Piece ``p``'s bytes at ``off``, as the array a load returns for it."""
        t = p.tensor
        n = p.nbytes
        if self.host is not None:
            raw = self.host[off : off + n]
            if t.quantized:
                shaped = raw.reshape(p.raw_shape)
                return shaped if framework == "numpy" else view_as(shaped, "U8", shaped.shape, "torch")
            return view_as(raw, t.dtype, p.shape, framework)
        from weightlift.dtypes import torch_dtype

        dev = self.dev[off : off + n]
        if t.quantized:
            return dev.reshape(p.raw_shape)
        if dtype_info(t.dtype).bits % 8:
            return dev
        return dev.view(torch_dtype(t.dtype)).reshape(p.shape)
