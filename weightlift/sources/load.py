"""Loading tensors out of a store into a target, through the ranged-read engine.

The engine's theory of operation (:mod:`weightlift.sources.engine`) says how bytes move; this
module picks the target, the connections and the part size (the endpoint's tuning, or
``threads=`` as the connection count), runs the parts, and returns the tensors as views of the
arena, as a local load does. ``copy=False`` has no mapping to borrow from here: tensors are
loaded as with ``copy=True``.

A cast on load (``dtype=``) converts the floating-point tensors of another dtype as the local
loader does, through the target's cast variant: each part is received into its worker's buffer
and converted from there into its elements of the tensor (parts are cut per tensor, whole
elements each), so no tensor is held twice in the source dtype; the other tensors load as above.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from weightlift import env
from weightlift.dtypes import DTYPES, dtype_info
from weightlift.formats import TensorInfo
from weightlift.memory.faulter import REGION, Faulter
from weightlift.memory.targets import Stager, Target, as_bytes, target_for
from weightlift.options import LoadOptions
from weightlift.profile import Profiler
from weightlift.sources.engine import Budget, Part, layout, make_parts, make_runs, run_parts
from weightlift.sources.objects import Objects

__all__ = ["load_objects", "plan_budget"]

_OFF = Profiler(enabled=False)
#: how far the arena's fault-in helpers may run ahead of the parts landing in it
FAULT_WINDOW = 256 * 1024 * 1024
Landed = Callable[..., None]
_PLAIN = {d.name for d in DTYPES}


def casts(t: TensorInfo, cast: str | None) -> bool:
    """Whether a load with ``dtype=cast`` converts ``t``: floating point of another plain dtype,
    the tensors the local loader converts."""
    return (
        cast is not None
        and t.dtype in _PLAIN
        and dtype_info(t.dtype).numpy.startswith(("float", "bfloat"))
        and t.dtype != cast
    )


def plan_budget(objs: Objects, *, threads: int | None, staged: bool, budget: int | None = None) -> Budget:
    """Connections, part size and memory budget for reading ``objs``: the endpoint's tuning, with
    ``threads`` (else ``WEIGHTLIFT_SOURCE_CONNECTIONS``) as the connection count, and ``budget``
    (else ``WEIGHTLIFT_SOURCE_BUDGET``) bytes of host memory."""
    t = objs.tuning()
    conns = threads or env.source_connections() or t.connections
    part = env.source_part() or t.part
    return Budget.fit(
        budget if budget is not None else env.source_budget(), part=part, connections=conns, staged=staged
    )


def load_objects(
    objs: Objects,
    infos: list[TensorInfo],
    opts: LoadOptions,
    *,
    prof: Profiler = _OFF,
    progress: Callable[[int], None] | None = None,
    on_landed: Landed | None = None,
    target: Target | None = None,
    budget: int | None = None,
) -> dict[str, Any]:
    """``infos`` (tensors of ``objs``) loaded into ``target`` (default: ``opts``' device and
    framework); ``{name: tensor}`` in the order of ``infos``. ``on_landed`` is told the bytes as
    they land (see :func:`weightlift.local.loader.load_local`; for a cast, the source bytes);
    ``budget`` bounds the host memory held besides the destination (default:
    ``WEIGHTLIFT_SOURCE_BUDGET``, else two parts per connection for a staged target)."""
    t0 = time.perf_counter()
    target = target if target is not None else target_for(opts.placement)
    casted = [t for t in infos if casts(t, opts.cast)]
    direct = [t for t in infos if not casts(t, opts.cast)] if casted else infos
    nbytes = sum(t.length for t in infos)
    prof.count(tensors=len(infos), nbytes=nbytes)
    # a verified load compares every byte with the published manifest: a mix of two versions
    # of an object that states no validator is caught there
    mover = _Mover(objs, prof, progress, on_landed, checked=opts.verify and on_landed is not None)
    out: dict[str, Any] = {}
    used: list[tuple[Budget, int]] = []  # (budget, requests) of each pass
    if direct and on_landed is not None and not target.memcpy_ok:
        # device memory: what is proven is read back from the device after the load, as a local
        # load does (the staging the bytes passed through would prove a copy that landed wrong)
        out.update(_Mover(objs, prof, progress, None).direct(direct, target, opts.threads, budget, used))
        for t in direct:
            on_landed(t.file, t.offset, as_bytes(out[t.name]))
    elif direct:
        out.update(mover.direct(direct, target, opts.threads, budget, used))
    if casted:
        assert opts.cast is not None
        out.update(mover.converted(casted, target.casting(opts.cast), opts.threads, budget, used))
    if opts.report is not None:
        seconds = time.perf_counter() - t0
        b = used[0][0] if used else plan_budget(objs, threads=opts.threads, staged=False, budget=budget)
        requests = sum(n for _, n in used)
        opts.report.update(
            tensors=len(infos),
            bytes=nbytes,
            seconds=seconds,
            gbps=nbytes / seconds / 1e9 if seconds > 0 else 0.0,
            files=len({t.file for t in infos}),
            copy=True,
            device=opts.device,
            framework=opts.framework,
            source={
                "connections": min(b.connections, max(1, requests)),
                "part": b.part,
                "budget": b.nbytes,
                "requests": requests,
            },
        )
        if prof.enabled:
            opts.report["profile"] = prof.report()
    return {t.name: out[t.name] for t in infos}


class _Mover:
    """How the parts of one load land: in place in a host arena, through a worker's staging, or
    converted by a cast target."""

    def __init__(
        self,
        objs: Objects,
        prof: Profiler,
        progress: Callable[[int], None] | None,
        on_landed: Landed | None,
        *,
        checked: bool = False,
    ):
        self.objs, self.prof, self.progress, self.on_landed = objs, prof, progress, on_landed
        self.checked = checked

    def direct(
        self, infos: list[TensorInfo], target: Target, threads: int | None, budget: int | None, used: list[Any]
    ) -> dict[str, Any]:
        """Tensors in their own dtype: runs laid out in one arena, each tensor a view of it."""
        staged = not target.memcpy_ok
        b = plan_budget(self.objs, threads=threads, staged=staged, budget=budget)
        runs = make_runs(infos, align=target.align)  # a device's tensors start on its alignment
        starts, total = layout(runs, align=target.align)
        parts = make_parts(runs, starts, b.part)
        used.append((b, len(parts)))
        arena = target.arena(total)
        # only a verified staged load holds bytes while it waits for a late part (its hasher keeps
        # copies of the staging pieces that came early); elsewhere no worker waits for another's
        # part, so one slow request must stall nobody
        window = b.window if staged and self.on_landed is not None else len(parts)
        if staged:
            run_parts(
                parts,
                lambda stager, p: self.staged(stager, arena, p),
                connections=b.connections,
                window=window,
                worker_state=lambda: target.stager(private=True),
                close_state=lambda s: s.close(),
            )
        else:
            self.host(arena, parts, b.connections, window)
        target.synchronize()
        return {
            t.name: target.view(arena, s + (t.offset - r.offset), t)
            for r, s in zip(runs, starts, strict=True)
            for t in r.tensors
        }

    def converted(
        self, infos: list[TensorInfo], ct: Target, threads: int | None, budget: int | None, used: list[Any]
    ) -> dict[str, Any]:
        """Tensors cast on load: parts cut per tensor (whole elements), each received into the
        worker's buffer and converted from there into its elements of the tensor."""
        b = plan_budget(self.objs, threads=threads, staged=True, budget=budget)
        dests = [ct.empty(t.dtype, t.shape) for t in infos]
        parts: list[Part] = []
        owner: list[int] = []  # the tensor of each part
        for i, t in enumerate(infos):
            size = dtype_info(t.dtype).bits // 8
            step = max(size, b.part - b.part % size)
            for a in range(0, t.length, step):
                parts.append(Part(len(parts), t.file, t.offset + a, min(step, t.length - a), a))
                owner.append(i)
        used.append((b, len(parts)))
        landed, prof = self.on_landed, self.prof

        def work(buf: memoryview, p: Part) -> None:
            view = buf[: p.length]
            self.objs.read_into(p.file, p.offset, view, prof=prof, unvalidated_ok=self.checked)
            if landed is not None:
                landed(p.file, p.offset, view, stable=False)
            with prof.phase("stage", p.length):
                ct.write(dests[owner[p.index]], p.dst, view)
            self._done(p)

        window = b.window if landed is not None else len(parts)
        run_parts(
            parts,
            work,
            connections=b.connections,
            window=window,
            worker_state=lambda: memoryview(bytearray(b.part)),
        )
        return {t.name: ct.finish(d) for t, d in zip(infos, dests, strict=True)}

    def _done(self, p: Part) -> None:
        self.prof.count(calls=1)
        if self.progress is not None:
            self.progress(p.length)

    def staged(self, stager: Stager, arena: Any, p: Part) -> None:
        prof, a = self.prof, 0
        while a < p.length:
            with prof.phase("device"):
                buf = stager.take(p.length - a)  # waits for the copy out of this slot
            n = len(buf)
            self.objs.read_into(
                p.file, p.offset + a, memoryview(buf.data).cast("B"), prof=prof, unvalidated_ok=self.checked
            )
            if self.on_landed is not None:
                self.on_landed(p.file, p.offset + a, buf, stable=False)
            with prof.phase("device", n):
                stager.land(arena, p.dst + a)
            a += n
        self._done(p)

    def host(self, arena: Any, parts: list[Part], connections: int, window: int) -> None:
        flat = np.frombuffer(arena, dtype=np.uint8) if not isinstance(arena, np.ndarray) else arena
        mv = memoryview(flat.data).cast("B") if flat.size else memoryview(b"")
        # the network is the wait here, as the disk is for a cold local load: helpers fault the
        # arena's fresh pages in ahead of the parts on otherwise idle cores
        faulter = Faulter.ahead(flat, window=FAULT_WINDOW, name="wl-source-fault") if flat.size else None
        landed = self.on_landed

        def work(_: Any, p: Part) -> None:
            if faulter is not None:
                faulter.ready(REGION, p.dst, p.dst + p.length)
            piece = None
            if landed is not None:

                def piece(a: int, z: int, p: Part = p) -> None:
                    landed(p.file, p.offset + a, flat[p.dst + a : p.dst + z])

            self.objs.read_into(
                p.file,
                p.offset,
                mv[p.dst : p.dst + p.length],
                prof=self.prof,
                on_piece=piece,
                unvalidated_ok=self.checked,
            )
            self._done(p)

        try:
            run_parts(parts, work, connections=connections, window=window)
        finally:
            if faulter is not None:
                faulter.close()
