"""Arm bodies for :mod:`weightlift.benchmark.harness`, each run in a fresh child process.

Theory of operation. The parent starts ``python -c BOOT <this file> <arm> <options JSON> [<file>...]``.
BOOT loads this file by path, not as ``weightlift.benchmark.arms``, so an arm that measures a peer
library never pays for importing weightlift; only weightlift's own arms import it. The arm
files named after the options (:mod:`.floors`, a research bench's peers) are loaded by path
the same way, as ``wl_bench_<stem>``, and add their ``BODIES``; they find this module as
``sys.modules["wl_bench_arms"]``. Every arm
ends the same way, which is what makes the windows comparable: every tensor is in memory and
every page of it has been touched (one byte in each 4096, plus the last), or, for a device
destination, the device has synchronised. Then the child prints one line::

    WL_READY <wall clock ns> <JSON: inner_s, load_s, tensors, bytes, profile, ...>

and leaves with ``os._exit(0)``: tearing down gigabytes of arrays is no part of any window. An
arm that finds at run time that it cannot run prints ``WL_SKIP <reason>`` instead.

``inner_s`` is the child's own time from its first line to ready (imports included);
``load_s`` is the arm's clock: :func:`start_clock` right before the load call, :func:`stop_clock`
at ready. No clock may hold a first import: a module imported inside it (weightlift's lazy
``import ml_dtypes`` for a bf16 tensor took about 1 s of a 1.3 s load on a 2-core machine, while
the safetensors arm imported it before its clock) would time the import, not the loader. So
every arm has the same named pre-clock step, :func:`preload`: before its body runs, the child
imports the modules the parent names (those the same arm imported inside its clock in an
earlier run, learned from its warm-up round), and the body imports what it knows it needs
before starting its clock. The clock records what was imported inside it anyway
(``timed_imports`` in the ready line), and the table names any arm that did.

The arms here and in :mod:`.floors` are what ``weightlift bench`` runs on a user's checkpoint:
weightlift's loads and its loopback push, safetensors, fastsafetensors (its CPU path, where it is
installed: the ``bench`` extra brings it), and the floors (copy, raw read, raw loopback TCP)
they are held to.
This module imports nothing heavy at the top, so the parent may import it for the arm table.
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

READY = "WL_READY"
SKIP = "WL_SKIP"
PAGE = mmap.PAGESIZE
BLOCK = 8 * 1024 * 1024  # baseline read / copy granule


@dataclass(frozen=True)
class ArmSpec:
    """What the parent needs to know about an arm before starting it."""

    name: str
    kind: str  # "local", "remote" or "baseline"
    description: str
    requires: tuple[str, ...] = ()  # modules that must be importable
    cuda: bool = False  # needs a CUDA device
    uses_pt: bool = False  # reads the .pt copy of the checkpoint, not the safetensors files
    uses_tensorizer: bool = False  # reads a tensorizer copy of the checkpoint
    weightlift: bool = False  # weightlift's own arm: takes a profiler, feeds the phase chart
    safetensors_only: bool = False  # a peer that reads safetensors files only
    # held to the floor of its kind (the copy or read floor, raw loopback TCP); False for a load
    # that copies nothing (a mapping touched in place), which no copy floor bounds
    floored: bool = True
    env: dict[str, str] = field(default_factory=dict)


class Skip(Exception):
    """Raised by an arm body that cannot run here; the parent lists it as skipped."""


def load_file(name: str, path: str) -> Any:
    """Load the Python file at ``path`` as module ``name`` (registered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# -- the clock: the load call's time, and the imports it must not hold --------------------------

_clock: dict[str, Any] = {"started": False, "before": None, "imported": []}


def preload(modules: Any) -> list[str]:
    """The pre-clock step every arm takes: import ``modules`` (in the order given) so that no
    clock pays for a first import of them. Returns those that did not import (left to the arm)."""
    failed = []
    for name in modules or ():
        if name in sys.modules or name.startswith(("wl_bench_", "_wl_bench_")):
            continue
        try:
            importlib.import_module(name)
        except BaseException:  # a module that cannot be imported by name (an alias, a stub)
            failed.append(name)
    return failed


def start_clock() -> int:
    """Start an arm's clock (``perf_counter_ns``), noting the modules already imported."""
    _clock["started"] = True
    _clock["before"] = frozenset(sys.modules)
    return time.perf_counter_ns()


def stop_clock(t0: int) -> float:
    """Seconds since ``t0`` (from :func:`start_clock`); notes the modules imported in between."""
    seconds = (time.perf_counter_ns() - t0) / 1e9
    before = _clock["before"]
    if before is not None:
        _clock["imported"] += [m for m in sys.modules if m not in before and m not in _clock["imported"]]
    return seconds


def timed_imports() -> list[str] | None:
    """The modules first imported inside the arm's clock; None if the arm never started one."""
    return list(_clock["imported"]) if _clock["started"] else None


# -- residency (strict: a failed mincore is an error, never "0 % resident") -------------------
# weightlift's own probe and eviction, loaded by path: this file must not import the package.

_residency = load_file(
    "_wl_bench_residency",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "disk", "residency.py"),
)
resident_fraction: Callable[[str], float] = _residency.file_fraction
evict: Callable[[str], None] = _residency.drop


# -- touching: the common definition of "ready" -------------------------------------------------


def touch_numpy(arrays: Any) -> tuple[int, int]:
    """Read one byte per page of every array; returns (tensors, bytes)."""
    import numpy as np

    n = nbytes = 0
    for a in arrays:
        n += 1
        nbytes += a.nbytes
        if a.nbytes:
            b = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            int(b[::PAGE].sum()) + int(b[-1])
    return n, nbytes


def touch_torch(tensors: Any) -> tuple[int, int]:
    """Read one byte per page of every CPU tensor, synchronise CUDA; returns (tensors, bytes)."""
    import torch

    n = nbytes = 0
    cuda = False
    for t in tensors:
        n += 1
        size = t.numel() * t.element_size()
        nbytes += size
        if t.is_cuda:
            cuda = True
        elif size:
            b = t.contiguous().reshape(-1).view(torch.uint8)
            int(b[::PAGE].sum()) + int(b[-1])
    if cuda:
        torch.cuda.synchronize()
    return n, nbytes


def touch_any(values: Any) -> tuple[int, int]:
    values = list(values)
    if values and type(values[0]).__module__.startswith("torch"):
        return touch_torch(values)
    return touch_numpy(values)


# -- safetensors, the reference every table is read against ----------------------------------


def _st_numpy(o: dict[str, Any]) -> dict[str, Any]:
    try:
        import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 with numpy, as a user must)
    except ImportError:
        pass
    from safetensors.numpy import load_file

    t0 = start_clock()
    out: dict[str, Any] = {}
    for f in o["files"]:
        out.update(load_file(f))
    n, b = touch_numpy(out.values())
    return {"load_s": stop_clock(t0), "tensors": n, "bytes": b}


def cuda_context() -> None:
    """Create the CUDA context before the clock: load_s compares loaders, not driver start-up
    (the window still includes it, for every CUDA arm alike)."""
    import torch

    torch.empty(1, device="cuda")
    torch.cuda.synchronize()


def _st_torch(o: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    from safetensors.torch import load_file

    if device != "cpu":
        cuda_context()
    t0 = start_clock()
    out: dict[str, Any] = {}
    for f in o["files"]:
        out.update(load_file(f, device=device))
    n, b = touch_torch(out.values())
    return {"load_s": stop_clock(t0), "tensors": n, "bytes": b}


def _fastsafetensors(o: dict[str, Any]) -> dict[str, Any]:
    # its CPU path: no GPUDirect Storage (nogds), files read into host buffers by its own threads
    import torch  # noqa: F401  (fastsafetensors imports its framework when the loader is made: not in load_s)
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    t0 = start_clock()
    loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
    try:
        loader.add_filenames({0: list(o["files"])})
        fb = loader.copy_files_to_device()  # owning mode: the tensors keep their buffers after close()
        out = {name: fb.get_tensor(name) for name in loader.get_keys()}
        fb.close()
    finally:
        loader.close()
    n, b = touch_torch(out.values())
    return {"load_s": stop_clock(t0), "tensors": n, "bytes": b}


# -- weightlift arms --------------------------------------------------------------------------


class _Off:
    enabled = False

    def report(self) -> dict[str, Any]:
        return {}


def profiler(o: dict[str, Any]) -> Any:
    """A recording profiler for the profiled round; otherwise a stand-in that is off."""
    if not o.get("profile"):
        return _Off()
    from weightlift.profile import Profiler

    return Profiler(enabled=True)


def prof_arg(prof: Any) -> Any:
    # False, not a disabled Profiler: the load then takes exactly the path a user gets with
    # profiling off
    return prof if prof.enabled else False


def wl_load(o: dict[str, Any], **kw: Any) -> dict[str, Any]:
    from weightlift.api import load

    try:
        import ml_dtypes  # noqa: F401  (bfloat16 and float8 for numpy: imported before the clock, as
    except ImportError:  # the safetensors arm does; weightlift's load imports it lazily)
        pass
    if kw.get("framework") == "torch":
        import torch  # noqa: F401  (imported before the clock, as the torch peers do)
    if str(kw.get("device", "cpu")).startswith("cuda"):
        cuda_context()
    prof = profiler(o)
    t0 = start_clock()
    out = load(o["path"], profile=prof_arg(prof), **kw)
    n, b = touch_any(out.values())
    info: dict[str, Any] = {"load_s": stop_clock(t0), "tensors": n, "bytes": b}
    if prof.enabled:
        info["profile"] = prof.report()
    return info


def push_touch(
    server: Any, addr: Any, path: str, prof: Any = None, client: dict[str, Any] | None = None, **push: Any
) -> Any:
    """Push ``path`` to ``server`` (in this process) and touch every tensor it then holds;
    ``client`` and ``push`` are extra arguments of the Client and of its push."""
    from weightlift.remote.client import Client

    with Client(addr, profile=prof_arg(prof) if prof is not None else None, **(client or {})) as c:
        pushed = c.push(path, **push)
    return pushed, touch_any(server.tensors().values())


def timed_push(
    server: Any,
    addr: Any,
    o: dict[str, Any],
    prof: Any,
    t0: int | None = None,
    *,
    stats: bool = False,
    client: dict[str, Any] | None = None,
    push: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The timed push of a push arm: ``load_s`` from ``t0`` (default: now) to every tensor in the
    server's memory and touched, the push's figures, ``extra``, the profiles when profiling."""
    t0 = start_clock() if t0 is None else t0
    pushed, (n, b) = push_touch(server, addr, o["path"], prof, client, **(push or {}))
    info: dict[str, Any] = {
        "load_s": stop_clock(t0),
        **extra,
        "tensors": n,
        "bytes": b,
        "push": {k: v for k, v in pushed.as_dict().items() if k != "profile"},
    }
    if stats:
        info["server_stats"] = dict(server.stats())
    if prof.enabled:
        info["profile"] = prof.report()
        info["server_profile"] = server_report(server)
    return info


def wl_push(
    o: dict[str, Any],
    *,
    server: dict[str, Any] | None = None,
    client: dict[str, Any] | None = None,
    push: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Push the checkpoint to a weightlift Server in this process, over loopback; ``server``,
    ``client`` and ``push`` are extra arguments of the Server, the Client and its push."""
    from weightlift.remote.client import Client  # noqa: F401  (imported before the clock)
    from weightlift.remote.server import Server

    prof = profiler(o)
    t0 = start_clock()  # a freshly started server: its start is in the clock, as a user's is
    srv = Server("127.0.0.1", 0, profile=prof.enabled, **(server or {}))
    addr = srv.start()
    try:
        return timed_push(srv, addr, o, prof, t0, client=client, push=push)
    finally:
        srv.close()


def server_report(server: Any) -> dict[str, Any] | None:
    # the server files a connection's report when its thread sees the connection close
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        reports = server.profile_reports()
        if reports:
            return reports[-1]
        time.sleep(0.01)
    return None


# -- the arm table ------------------------------------------------------------------------------

_WL_PUSH_REQ = ("weightlift.remote.server", "weightlift.remote.client")

SPECS: dict[str, ArmSpec] = {
    s.name: s
    for s in (
        ArmSpec(
            "safetensors.numpy", "local", "safetensors.numpy.load_file", ("safetensors", "numpy"), safetensors_only=True
        ),
        ArmSpec(
            "safetensors.torch",
            "local",
            "safetensors.torch.load_file (on the CPU, views of a private mapping of the file: nothing copied)",
            ("safetensors", "torch"),
            safetensors_only=True,
            floored=False,
        ),
        ArmSpec(
            "safetensors.cuda",
            "local",
            "safetensors.torch.load_file(device='cuda:0')",
            ("safetensors", "torch"),
            cuda=True,
            safetensors_only=True,
        ),
        ArmSpec(
            "fastsafetensors",
            "local",
            "fastsafetensors SafeTensorsFileLoader, CPU path (nogds=True)",
            ("fastsafetensors", "torch"),
            safetensors_only=True,
        ),
        ArmSpec(
            "wl.numpy", "local", "weightlift.load(framework='numpy', copy=True)", ("weightlift.api",), weightlift=True
        ),
        ArmSpec(
            "wl.numpy.nocopy",
            "local",
            "weightlift.load(framework='numpy', copy=False) + touch",
            ("weightlift.api",),
            weightlift=True,
            floored=False,
        ),
        ArmSpec(
            "wl.torch", "local", "weightlift.load(framework='torch')", ("weightlift.api", "torch"), weightlift=True
        ),
        ArmSpec(
            "wl.cuda",
            "local",
            "weightlift.load(device='cuda', framework='torch')",
            ("weightlift.api", "torch"),
            cuda=True,
            weightlift=True,
        ),
        ArmSpec("wl.push", "remote", "weightlift.Client push to a Server over loopback", _WL_PUSH_REQ, weightlift=True),
    )
}

BODIES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "safetensors.numpy": _st_numpy,
    "safetensors.torch": _st_torch,
    "safetensors.cuda": lambda o: _st_torch(o, device="cuda:0"),
    "fastsafetensors": _fastsafetensors,
    "wl.numpy": lambda o: wl_load(o, framework="numpy", copy=True),
    "wl.numpy.nocopy": lambda o: wl_load(o, framework="numpy", copy=False),
    "wl.torch": lambda o: wl_load(o, framework="torch"),
    "wl.cuda": lambda o: wl_load(o, framework="torch", device="cuda"),
    "wl.push": wl_push,
}


def main(t0_ns: int, argv: list[str]) -> None:
    """Child entry point: run one arm, print the marker, leave without teardown.

    ``argv``: the arm, its options as JSON, then any further arm files, whose ``BODIES`` add to
    this module's."""
    name, opts = argv[0], json.loads(argv[1])
    try:
        bodies = dict(BODIES)
        for path in argv[2:]:
            stem = os.path.splitext(os.path.basename(path))[0]
            bodies.update(load_file(f"wl_bench_{stem}", path).BODIES)
        preload(opts.get("preload"))  # the named pre-clock step, the same for every arm
        info = bodies[name](opts)
        info["timed_imports"] = timed_imports()
    except Skip as e:
        print(f"{SKIP} {e}", flush=True)
        os._exit(0)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    info["inner_s"] = (time.perf_counter_ns() - t0_ns) / 1e9
    print(f"{READY} {time.time_ns()} {json.dumps(info)}", flush=True)
    os._exit(0)
