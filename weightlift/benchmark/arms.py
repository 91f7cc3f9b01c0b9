"""Arm bodies for :mod:`weightlift.benchmark.harness`, each run in a fresh child process.

Theory of operation. The parent starts ``python -c BOOT <this file> <arm> <options JSON>``.
BOOT loads this file by path, not as ``weightlift.benchmark.arms``, so an arm that measures a peer
library never pays for importing weightlift; only weightlift's own arms import it. Every arm
ends the same way, which is what makes the windows comparable: every tensor is in memory and
every page of it has been touched (one byte in each 4096, plus the last), or, for a device
destination, the device has synchronised. Then the child prints one line::

    WL_READY <wall clock ns> <JSON: inner_s, load_s, tensors, bytes, profile, ...>

and leaves with ``os._exit(0)``: tearing down gigabytes of arrays is no part of any window. An
arm that finds at run time that it cannot run prints ``WL_SKIP <reason>`` instead.

``inner_s`` is the child's own time from its first line to ready (imports included);
``load_s`` starts after the arm's imports, right before the load call.

Baselines use the same protocol: they print their measured bandwidths in the ready JSON.
This module imports nothing heavy at the top, so the parent may import it for the arm table.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

READY = "WL_READY"
SKIP = "WL_SKIP"
PAGE = mmap.PAGESIZE
BLOCK = 8 * 1024 * 1024  # baseline read / copy granule
BASELINES = ("base.copy", "base.read", "base.tcp", "base.h2d")  # in-process baselines, reported under each table
READ_LIMIT_THREADS = (1, 2, 4)  # the raw read limit is the fastest of these reader counts


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
    env: dict[str, str] = field(default_factory=dict)


class Skip(Exception):
    """Raised by an arm body that cannot run here; the parent lists it as skipped."""


# -- residency (strict: a failed mincore is an error, never "0 % resident") -------------------
# weightlift's own probe and eviction, loaded by path: this file must not import the package.


def _load_residency() -> Any:
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(os.path.dirname(here), "disk", "residency.py")
    spec = importlib.util.spec_from_file_location("_wl_bench_residency", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_residency = _load_residency()
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


def _touch_any(values: Any) -> tuple[int, int]:
    values = list(values)
    if values and type(values[0]).__module__.startswith("torch"):
        return touch_torch(values)
    return touch_numpy(values)


# -- peer arms --------------------------------------------------------------------------------


def _st_numpy(o: dict[str, Any]) -> dict[str, Any]:
    try:
        import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 with numpy, as a user must)
    except ImportError:
        pass
    from safetensors.numpy import load_file

    t0 = time.perf_counter_ns()
    out: dict[str, Any] = {}
    for f in o["files"]:
        out.update(load_file(f))
    n, b = touch_numpy(out.values())
    return {"load_s": (time.perf_counter_ns() - t0) / 1e9, "tensors": n, "bytes": b}


def _cuda_context() -> None:
    """Create the CUDA context before the clock: load_s compares loaders, not driver start-up
    (the window still includes it, for every CUDA arm alike)."""
    import torch

    torch.empty(1, device="cuda")
    torch.cuda.synchronize()


def _st_torch(o: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    from safetensors.torch import load_file

    if device != "cpu":
        _cuda_context()
    t0 = time.perf_counter_ns()
    out: dict[str, Any] = {}
    for f in o["files"]:
        out.update(load_file(f, device=device))
    n, b = touch_torch(out.values())
    return {"load_s": (time.perf_counter_ns() - t0) / 1e9, "tensors": n, "bytes": b}


def _torch_load(o: dict[str, Any]) -> dict[str, Any]:
    import torch

    t0 = time.perf_counter_ns()
    out = torch.load(o["pt"], mmap=True, weights_only=True)
    n, b = touch_torch(out.values())
    return {"load_s": (time.perf_counter_ns() - t0) / 1e9, "tensors": n, "bytes": b}


def _runai(o: dict[str, Any]) -> dict[str, Any]:
    from runai_model_streamer import SafetensorsStreamer

    t0 = time.perf_counter_ns()
    out: dict[str, Any] = {}
    with SafetensorsStreamer() as s:
        s.stream_files(list(o["files"]), device="cpu")
        for name, t in s.get_tensors():
            out[name] = t  # owned by the caller (the default), so keeping it is safe
    n, b = touch_torch(out.values())
    return {"load_s": (time.perf_counter_ns() - t0) / 1e9, "tensors": n, "bytes": b}


def _fastsafetensors(o: dict[str, Any]) -> dict[str, Any]:
    # its CPU path: no GPUDirect Storage (nogds), files read into host buffers by its own threads
    import torch  # noqa: F401  (fastsafetensors imports its framework when the loader is made: not in load_s)
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    t0 = time.perf_counter_ns()
    loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
    try:
        loader.add_filenames({0: list(o["files"])})
        fb = loader.copy_files_to_device()  # owning mode: the tensors keep their buffers after close()
        out = {name: fb.get_tensor(name) for name in loader.get_keys()}
        fb.close()
    finally:
        loader.close()
    n, b = touch_torch(out.values())
    return {"load_s": (time.perf_counter_ns() - t0) / 1e9, "tensors": n, "bytes": b}


def _tensorizer(o: dict[str, Any]) -> dict[str, Any]:
    from tensorizer import TensorDeserializer

    t0 = time.perf_counter_ns()
    d = TensorDeserializer(o["tz"], device="cpu", lazy_load=False)  # kept open: os._exit ends the child
    out = dict(d.items())
    n, b = touch_torch(out.values())
    return {"load_s": (time.perf_counter_ns() - t0) / 1e9, "tensors": n, "bytes": b}


def _instanttensor(o: dict[str, Any]) -> dict[str, Any]:
    from instanttensor import safe_open

    _cuda_context()
    t0 = time.perf_counter_ns()
    out: dict[str, Any] = {}
    with safe_open(list(o["files"]), framework="pt", device=0) as f:
        for name, t in f.tensors():
            out[name] = t  # owned by default (copy=True)
    n, b = touch_torch(out.values())
    return {"load_s": (time.perf_counter_ns() - t0) / 1e9, "tensors": n, "bytes": b}


# -- weightlift arms --------------------------------------------------------------------------


class _Off:
    enabled = False

    def report(self) -> dict[str, Any]:
        return {}


def _profiler(o: dict[str, Any]) -> Any:
    """A recording profiler for the profiled round; otherwise a stand-in that is off."""
    if not o.get("profile"):
        return _Off()
    from weightlift.profile import Profiler

    return Profiler(enabled=True)


def _prof_arg(prof: Any) -> Any:
    # False, not a disabled Profiler: the load then takes exactly the path a user gets with
    # profiling off
    return prof if prof.enabled else False


def _wl_load(o: dict[str, Any], **kw: Any) -> dict[str, Any]:
    from weightlift.api import load

    if kw.get("framework") == "torch":
        import torch  # noqa: F401  (imported before the clock, as the torch peers do)
    if str(kw.get("device", "cpu")).startswith("cuda"):
        _cuda_context()
    prof = _profiler(o)
    t0 = time.perf_counter_ns()
    out = load(o["path"], profile=_prof_arg(prof), **kw)
    n, b = _touch_any(out.values())
    info: dict[str, Any] = {"load_s": (time.perf_counter_ns() - t0) / 1e9, "tensors": n, "bytes": b}
    if prof.enabled:
        info["profile"] = prof.report()
    return info


def _push_touch(
    server: Any, addr: Any, path: str, prof: Any = None, client: dict[str, Any] | None = None, **push: Any
) -> Any:
    """Push ``path`` to ``server`` (in this process) and touch every tensor it then holds;
    ``client`` and ``push`` are extra arguments of the Client and of its push."""
    from weightlift.remote.client import Client

    with Client(addr, profile=_prof_arg(prof) if prof is not None else None, **(client or {})) as c:
        pushed = c.push(path, **push)
    return pushed, _touch_any(server.tensors().values())


def _timed_push(
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
    t0 = time.perf_counter_ns() if t0 is None else t0
    pushed, (n, b) = _push_touch(server, addr, o["path"], prof, client, **(push or {}))
    info: dict[str, Any] = {
        "load_s": (time.perf_counter_ns() - t0) / 1e9,
        **extra,
        "tensors": n,
        "bytes": b,
        "push": {k: v for k, v in pushed.as_dict().items() if k != "profile"},
    }
    if stats:
        info["server_stats"] = dict(server.stats())
    if prof.enabled:
        info["profile"] = prof.report()
        info["server_profile"] = _server_report(server)
    return info


_BENCH_TOKEN = b"weightlift-bench-token-0123456789"


def _tls_contexts() -> tuple[Any, Any]:
    """(server, client) TLS contexts around a fresh self-signed certificate for 127.0.0.1."""
    import datetime
    import ipaddress
    import ssl
    import tempfile

    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        raise Skip("needs the cryptography package to make a certificate") from None
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .sign(key, hashes.SHA256())
    )
    folder = tempfile.mkdtemp(prefix="wl-bench-tls-")
    cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert_path, key_path)
    return server, ssl.create_default_context(cafile=cert_path)


def _wl_push(
    o: dict[str, Any], *, cache: bool = False, verify: bool = False, mac: bool = False, tls: bool = False
) -> dict[str, Any]:
    """Push the checkpoint to a weightlift Server in this process, over loopback; ``verify``: the
    server reports digests and the client checks them; ``mac``: a token, so every frame carries
    a MAC; ``tls``: over TLS (its certificate made before the clock starts)."""
    from weightlift.remote.server import Server

    prof = _profiler(o)
    server_tls, client_tls = _tls_contexts() if tls else (None, None)
    token = _BENCH_TOKEN if mac else None
    t0 = time.perf_counter_ns()
    server = Server(
        "127.0.0.1",
        0,
        cache_dir=o["cache_dir"] if cache else None,
        profile=prof.enabled,
        token=token,
        tls=server_tls,
    )
    addr = server.start()
    try:
        client = {"token": token, "tls": client_tls} if mac or tls else None
        return _timed_push(server, addr, o, prof, t0, client=client, push={"verify": True} if verify else None)
    finally:
        server.close()


def _wl_push_reserved(o: dict[str, Any]) -> dict[str, Any]:
    """A first push into a Server started with ``reserve=`` the checkpoint's size, once the
    reserve is faulted in (as in a worker that starts its server before its other start-up
    work); the push alone is timed. ``reserve_s`` is how long the reserve took to fault in."""
    from weightlift.checkpoint import open_checkpoint
    from weightlift.memory.pool import POOL_MIN, size_class
    from weightlift.remote.server import Server

    prof = _profiler(o)
    # what the tensors will take: each of 2 MiB or more gets whole 2 MiB pages
    size = sum(size_class(t.length) for t in open_checkpoint(o["path"]).tensors if t.length >= POOL_MIN)
    t0 = time.perf_counter_ns()
    server = Server("127.0.0.1", 0, reserve=size, profile=prof.enabled)
    addr = server.start()
    try:
        while server.reserved[0] < server.reserved[1]:
            time.sleep(0.005)
        reserve_s = (time.perf_counter_ns() - t0) / 1e9
        return _timed_push(server, addr, o, prof, stats=True, reserve_s=reserve_s)
    finally:
        server.close()


def _wl_push_again(o: dict[str, Any], *, cache: bool) -> dict[str, Any]:
    """Pushes of the checkpoint to one running Server in this process; the last one is timed.

    Without a cache it is a weight update in steady state: three pushes, the third timed. Every
    byte crosses the wire again, into memory the server released with an earlier version (the
    second push leaves a spare of each size in the pool: a tensor's new version must land
    before its old one may go). With a cache (a fresh folder per run) it is two pushes: the
    first fills the cache and the second finds every large tensor already held. The first push
    is timed too (``first_s``), so the ratio is first over last in the same process.
    """
    import shutil
    import tempfile

    from weightlift.remote.server import Server

    prof = _profiler(o)
    cache_dir = tempfile.mkdtemp(prefix="wl-second-", dir=o["cache_root"]) if cache else None
    server = Server("127.0.0.1", 0, cache_dir=cache_dir, profile=prof.enabled)
    addr = server.start()
    try:
        t0 = time.perf_counter_ns()
        _push_touch(server, addr, o["path"])
        first_s = (time.perf_counter_ns() - t0) / 1e9
        if not cache:
            _push_touch(server, addr, o["path"])  # the update measured is the third push
        return _timed_push(server, addr, o, prof, stats=True, first_s=first_s)
    finally:
        server.close()
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)


def _server_report(server: Any) -> dict[str, Any] | None:
    # the server files a connection's report when its thread sees the connection close
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        reports = server.profile_reports()
        if reports:
            return reports[-1]
        time.sleep(0.01)
    return None


def _wl_split(o: dict[str, Any]) -> dict[str, Any]:
    """The second half of the tensors pushed to a server in this process while the first half
    loads locally (weightlift.split.split_load); ready when both halves are in memory."""
    from weightlift.remote.server import Server
    from weightlift.split import split_load

    with open(o["split_file"], encoding="utf-8") as f:
        remote_names = frozenset(json.load(f))  # exact names: a set is not read as globs
    prof = _profiler(o)
    t0 = time.perf_counter_ns()
    server = Server("127.0.0.1", 0, profile=prof.enabled)
    host, port = server.start()
    try:
        res = split_load(o["path"], {f"{host}:{port}": remote_names}, profile=_prof_arg(prof))
        n, b = _touch_any(res.local.values())
        rn, rb = _touch_any(server.tensors().values())
        info: dict[str, Any] = {
            "load_s": (time.perf_counter_ns() - t0) / 1e9,
            "tensors": n + rn,
            "bytes": b + rb,
            "local_bytes": b,
            "remote_bytes": rb,
        }
        if prof.enabled:
            info["profile"] = prof.report()
            info["server_profile"] = _server_report(server)
    finally:
        server.close()
    return info


# -- profiler overhead probe --------------------------------------------------------------------


def _profile_loop(o: dict[str, Any]) -> dict[str, Any]:
    """Read every tensor into fresh arrays in loader-sized calls, with the profiler code path
    absent ("plain"), present but off ("off": one ``if prof.enabled:`` per clock read), or on."""
    import numpy as np

    from weightlift.checkpoint import open_checkpoint
    from weightlift.profile import Profiler

    mode = o["mode"]
    prof = Profiler(enabled=(mode == "on"))
    ck = open_checkpoint(o["path"])
    step = 16 * 1024 * 1024
    t_load = time.perf_counter_ns()
    out = []
    calls = 0
    fds = {f: os.open(f, os.O_RDONLY) for f in ck.files}
    for t in ck.tensors:
        dst = np.empty(t.length, dtype=np.uint8)
        view = dst.data
        fd = fds[t.file]
        for pos in range(0, t.length, step):
            n = min(step, t.length - pos)
            if mode == "plain":
                os.preadv(fd, [view[pos : pos + n]], t.offset + pos)
            else:
                if prof.enabled:
                    t0 = time.perf_counter_ns()
                os.preadv(fd, [view[pos : pos + n]], t.offset + pos)
                if prof.enabled:
                    prof.record("read", t0, time.perf_counter_ns(), n)
                    prof.count(calls=1)
            calls += 1
        out.append(dst)
    for fd in fds.values():
        os.close(fd)
    n, b = touch_numpy(out)
    info: dict[str, Any] = {
        "load_s": (time.perf_counter_ns() - t_load) / 1e9,
        "tensors": n,
        "bytes": b,
        "read_calls": calls,
    }
    if prof.enabled:
        info["profile"] = prof.report()
    return info


# -- baselines --------------------------------------------------------------------------------


def _data_size(path: str) -> int:
    return os.stat(path).st_size


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _run_threads(fn: Callable[[int], None], k: int) -> float:
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(k)]
    t0 = time.perf_counter_ns()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter_ns() - t0) / 1e9


def _shares(size: int, k: int) -> list[tuple[int, int]]:
    step = -(-size // k)
    step += -step % PAGE
    return [(i * step, min(size, (i + 1) * step)) for i in range(k) if i * step < size]


def _copy_shares(src: Any, dst: Any, shares: list[tuple[int, int]]) -> float:
    """Copy ``src`` into ``dst`` (uint8 arrays), one share per thread; returns the seconds."""
    import numpy as np

    def work(i: int) -> None:
        a, b = shares[i]
        for x in range(a, b, 8 * BLOCK):
            y = min(b, x + 8 * BLOCK)
            np.copyto(dst[x:y], src[x:y])

    return _run_threads(work, len(shares))


def _read_shares(fd: int, shares: list[tuple[int, int]], bufs: list[bytearray]) -> float:
    """Read each share with ``preadv`` into its thread's reused buffer; returns the seconds."""

    def work(i: int) -> None:
        a, b = shares[i]
        mv = memoryview(bufs[i])
        pos = a
        while pos < b:
            n = os.preadv(fd, [mv[: min(len(mv), b - pos)]], pos)
            if n <= 0:
                raise OSError(f"short read at {pos}")
            pos += n

    return _run_threads(work, len(shares))


def _baseline_copy(o: dict[str, Any]) -> dict[str, Any]:
    """The copy limit: the file's bytes out of a fresh mapping into memory, on every core."""
    import numpy as np

    path = o["files"][0] if len(o["files"]) == 1 else None
    if path is None:
        raise Skip("copy baseline measures a single file")
    size = _data_size(path)
    k = os.cpu_count() or 1
    shares = _shares(size, k)
    touched = np.ones(size, dtype=np.uint8)
    out: dict[str, Any] = {"bytes": size, "threads": len(shares)}
    for mode in ("fresh", "touched"):
        times = []
        for _ in range(o.get("repeats", 3)):
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            src = np.frombuffer(mm, dtype=np.uint8)
            dst = np.empty(size, dtype=np.uint8) if mode == "fresh" else touched
            times.append(_copy_shares(src, dst, shares))
            del src, dst
            mm.close()
        out[mode] = {"seconds": sorted(times), "gbps": _gbps(size, min(times))}
    out["gbps"] = max(out["fresh"]["gbps"], out["touched"]["gbps"])
    return out


def _limit_copy(o: dict[str, Any], huge: bool = False) -> dict[str, Any]:
    """The copy floor as an arm: in a fresh process, like the loaders, the file's bytes out of a
    fresh mapping into fresh memory on every core, then every page touched. ``huge`` advises the
    destination to use transparent huge pages, else against them (4 KiB pages): the floor is the
    faster of the two, whichever this machine prefers.

    The in-process baseline (base.copy) repeats its copy and keeps the fastest, so its "fresh"
    memory was freed by the repeat before it; on a VM whose host backs guest memory lazily (and
    takes freed memory back after a delay) that is several times cheaper than memory a new
    process gets. This arm pays what every loader arm pays.
    """
    import numpy as np

    path = o["files"][0] if len(o["files"]) == 1 else None
    if path is None:
        raise Skip("copy limit measures a single file")
    t0 = time.perf_counter_ns()
    size = _data_size(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    src = np.frombuffer(mm, dtype=np.uint8, count=size)
    dst = np.frombuffer(_fresh_mapping(size, huge), dtype=np.uint8)
    shares = _shares(size, os.cpu_count() or 1)
    _copy_shares(src, dst, shares)
    n, b = _touch_any([dst])
    return {
        "load_s": (time.perf_counter_ns() - t0) / 1e9,
        "tensors": 0,
        "bytes": b,
        "threads": len(shares),
        "huge": huge,
    }


def _fresh_mapping(size: int, huge: bool) -> mmap.mmap:
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    except (AttributeError, OSError):
        pass
    return m


def _limit_fault(o: dict[str, Any], huge: bool = False) -> dict[str, Any]:
    """The floor for landing the checkpoint in memory a fresh process has never touched: a
    private anonymous mapping of its size (huge pages advised or not) faulted in, one write
    per page, one share per core; nothing is copied and nothing read. A receiver that keeps
    every byte in fresh memory (a freshly started server, a split load) pays at least the
    faster of the two, unless its copy faults pages more cheaply than a write per page does."""
    import numpy as np

    size = _data_size(o["files"][0]) if len(o["files"]) == 1 else sum(os.path.getsize(f) for f in o["files"])
    t0 = time.perf_counter_ns()
    dst = np.frombuffer(_fresh_mapping(size, huge), dtype=np.uint8)
    shares = _shares(size, os.cpu_count() or 1)

    def work(i: int) -> None:
        a, b = shares[i]
        dst[a:b:PAGE] = 1

    _run_threads(work, len(shares))
    return {
        "load_s": (time.perf_counter_ns() - t0) / 1e9,
        "tensors": 0,
        "bytes": size,
        "threads": len(shares),
        "huge": huge,
    }


def _limit_read(o: dict[str, Any], k: int) -> dict[str, Any]:
    """The raw read as an arm: ``k`` threads of preadv, one contiguous share each, into buffers
    already touched, in a fresh process after the same eviction and pause as the loader arms.

    The in-process baseline (base.read) evicts and reads again three times in a row, so its
    later repeats fill the page cache with pages the previous repeat freed moments before,
    which this VM's host still backs; a loader arm's page cache is made of memory as fresh as
    its own."""
    path = o["files"][0] if len(o["files"]) == 1 else None
    if path is None:
        raise Skip("the read limit measures a single file")
    size = _data_size(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        shares = _shares(size, k)
        seconds = _read_shares(fd, shares, [bytearray(BLOCK) for _ in shares])  # zero-filled: touched
    finally:
        os.close(fd)
    return {"load_s": seconds, "tensors": 0, "bytes": size, "threads": k}


def _limit_read_fresh(o: dict[str, Any], k: int) -> dict[str, Any]:
    """The raw read into fresh memory: ``k`` threads of preadv, one contiguous share each,
    straight into one fresh anonymous mapping of the file's size (4 KiB pages, each 8 MiB piece
    populated just before it is read, the fastest fill measured here), then every page touched.

    An owned copy of a cold file has to land in memory the process never touched; the plain raw
    read (limit.read.k) reads into buffers it reuses, so it pays no page faults. This arm is the
    like-for-like floor for a cold owned-copy load."""
    import numpy as np

    path = o["files"][0] if len(o["files"]) == 1 else None
    if path is None:
        raise Skip("the read limit measures a single file")
    t0 = time.perf_counter_ns()
    size = _data_size(path)
    m = _fresh_mapping(size, huge=False)
    mv = memoryview(m)
    populate = getattr(mmap, "MADV_POPULATE_WRITE", 23)
    fd = os.open(path, os.O_RDONLY)
    try:
        shares = _shares(size, k)

        def work(i: int) -> None:
            a, b = shares[i]
            for x in range(a, b, BLOCK):
                y = min(b, x + BLOCK)
                try:
                    m.madvise(populate, x, y - x)
                except OSError:
                    pass
                pos = x
                while pos < y:
                    n = os.preadv(fd, [mv[pos:y]], pos)
                    if n <= 0:
                        raise OSError(f"short read at {pos}")
                    pos += n

        _run_threads(work, len(shares))
    finally:
        os.close(fd)
    mv.release()
    n, b = _touch_any([np.frombuffer(m, dtype=np.uint8)])
    return {"load_s": (time.perf_counter_ns() - t0) / 1e9, "tensors": 0, "bytes": b, "threads": k}


def _baseline_read(o: dict[str, Any]) -> dict[str, Any]:
    """Best raw read: 1, 2 and 4 threads of preadv into buffers already touched."""
    path = o["files"][0] if len(o["files"]) == 1 else None
    if path is None:
        raise Skip("read baseline measures a single file")
    size = _data_size(path)
    fd = os.open(path, os.O_RDONLY)
    out: dict[str, Any] = {"bytes": size, "cold": bool(o.get("cold")), "by_threads": {}}
    resident: list[float] = []
    try:
        for k in READ_LIMIT_THREADS:
            bufs = [bytearray(BLOCK) for _ in range(k)]  # zero-filled: touched
            shares = _shares(size, k)
            times = []
            for _ in range(o.get("repeats", 3)):
                if o.get("cold"):
                    evict(path)
                    resident.append(resident_fraction(path))
                times.append(_read_shares(fd, shares, bufs))
            out["by_threads"][str(k)] = {"seconds": sorted(times), "gbps": _gbps(size, min(times))}
    finally:
        os.close(fd)
    best = max(out["by_threads"].items(), key=lambda kv: kv[1]["gbps"])
    out["best_threads"] = int(best[0])
    out["gbps"] = best[1]["gbps"]
    if o.get("cold"):
        # what this device is good at, for weightlift's own cold loads (weightlift.disk.storage)
        from weightlift.disk.storage import remember_readers

        remember_readers(
            os.stat(path).st_dev, out["best_threads"], **{f"gbps_{k}": v["gbps"] for k, v in out["by_threads"].items()}
        )
    if resident:
        out["max_resident_before"] = max(resident)
    return out


def _baseline_tcp(o: dict[str, Any], fresh: bool = False) -> dict[str, Any]:
    """Raw loopback TCP: sendfile from the file into a socket, recv_into a reused buffer (or,
    with ``fresh``, into fresh memory the size of the data, the kernel faulting it in)."""
    import socket

    path = o["files"][0]
    size = _data_size(path)
    times = []
    for _ in range(o.get("repeats", 3)):
        lsock = socket.create_server(("127.0.0.1", 0))
        port = lsock.getsockname()[1]
        errors: list[BaseException] = []

        def send(port: int = port) -> None:
            try:
                with socket.create_connection(("127.0.0.1", port)) as s, open(path, "rb") as f:
                    off = 0
                    while off < size:
                        n = os.sendfile(s.fileno(), f.fileno(), off, size - off)
                        if n <= 0:
                            raise OSError("sendfile returned 0")
                        off += n
            except BaseException as e:  # reported by the receiving side
                errors.append(e)

        t0 = time.perf_counter_ns()
        th = threading.Thread(target=send)
        th.start()
        conn, _ = lsock.accept()
        if fresh:  # every byte lands in memory never touched before, as on a freshly started server
            dest = memoryview(_fresh_mapping(size, False))
        else:
            dest = memoryview(bytearray(BLOCK))
        got = 0
        with conn:
            while got < size:
                n = conn.recv_into(dest[got : got + BLOCK] if fresh else dest)
                if n == 0:
                    break
                got += n
        dt = (time.perf_counter_ns() - t0) / 1e9
        th.join()
        lsock.close()
        if errors or got != size:
            raise RuntimeError(f"loopback transfer failed after {got} of {size} bytes: {errors}")
        times.append(dt)
    return {"bytes": size, "seconds": sorted(times), "gbps": _gbps(size, min(times))}


def _limit_tcp(o: dict[str, Any], fresh: bool = False) -> dict[str, Any]:
    """Raw loopback TCP as an arm: one sendfile -> recv_into transfer of the file in a fresh
    process, timed like the push arms, so medians compare with medians under the same pauses."""
    out = _baseline_tcp({**o, "repeats": 1}, fresh=fresh)
    return {"load_s": out["seconds"][0], "tensors": 0, "bytes": out["bytes"]}


def _baseline_h2d(o: dict[str, Any]) -> dict[str, Any]:
    """Pinned host to device bandwidth, timed with CUDA events."""
    import torch

    if not torch.cuda.is_available():
        raise Skip("no CUDA device")
    size = min(_data_size(o["files"][0]), 1 << 30)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(max(3, o.get("repeats", 3))):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dev.copy_(host, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return {
        "bytes": size,
        "seconds": sorted(times),
        "gbps": _gbps(size, min(times)),
        "device": torch.cuda.get_device_name(0),
    }


def _make_tensorizer(o: dict[str, Any]) -> dict[str, Any]:
    """Write the checkpoint's tensors in tensorizer's format (for the tensorizer arm)."""
    from safetensors.torch import load_file
    from tensorizer import TensorSerializer

    tensors: dict[str, Any] = {}
    for f in o["files"]:
        tensors.update(load_file(f))
    tmp = o["tz"] + ".tmp"
    s = TensorSerializer(tmp)
    s.write_state_dict(tensors)
    s.close()
    os.replace(tmp, o["tz"])
    return {"tensors": len(tensors)}


def _make_pt(o: dict[str, Any]) -> dict[str, Any]:
    """Write the checkpoint's tensors as a torch zip file (for the torch.load arm)."""
    import torch
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for f in o["files"]:
        tensors.update(load_file(f))
    tmp = o["pt"] + ".tmp"
    torch.save(tensors, tmp)
    os.replace(tmp, o["pt"])
    return {"tensors": len(tensors)}


# -- the arm table ------------------------------------------------------------------------------

_WL_PUSH_REQ = ("weightlift.remote.server", "weightlift.remote.client")

SPECS: dict[str, ArmSpec] = {
    s.name: s
    for s in (
        ArmSpec(
            "safetensors.numpy", "local", "safetensors.numpy.load_file", ("safetensors", "numpy"), safetensors_only=True
        ),
        ArmSpec(
            "safetensors.torch", "local", "safetensors.torch.load_file", ("safetensors", "torch"), safetensors_only=True
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
            "torch.load",
            "local",
            "torch.load(mmap=True) of a .pt copy",
            ("torch", "safetensors"),
            uses_pt=True,
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
            "tensorizer",
            "local",
            "tensorizer TensorDeserializer(device='cpu') of a tensorizer copy",
            ("tensorizer", "safetensors", "torch"),
            uses_tensorizer=True,
            safetensors_only=True,
        ),
        ArmSpec(
            "instanttensor",
            "local",
            "instanttensor safe_open(device=0): it loads into CUDA devices only",
            ("instanttensor", "torch"),
            cuda=True,
            safetensors_only=True,
        ),
        ArmSpec(
            "runai",
            "local",
            "runai_model_streamer SafetensorsStreamer to cpu",
            ("runai_model_streamer", "torch"),
            safetensors_only=True,
        ),
        ArmSpec(
            "wl.numpy", "local", "weightlift.load(framework='numpy', copy=True)", ("weightlift.api",), weightlift=True
        ),
        ArmSpec(
            "wl.numpy.mmap",
            "local",
            "weightlift.load(framework='numpy', engine='mmap'): a copy out of the mapping (the default reads with preadv)",
            ("weightlift.api",),
            weightlift=True,
        ),
        ArmSpec(
            "wl.numpy.nohelpers",
            "local",
            "wl.numpy with no fault-ahead helpers (cold readers fault their own chunks)",
            ("weightlift.api",),
            weightlift=True,
            env={"WEIGHTLIFT_FAULT_HELPERS": "0"},
        ),
        ArmSpec(
            "wl.numpy.verify",
            "local",
            "weightlift.load(framework='numpy', verify=True): every tensor hashed as it lands and "
            "compared with the checkpoint's sidecar manifest (made by the warm-up)",
            ("weightlift.api",),
            weightlift=True,
        ),
        ArmSpec(
            "wl.numpy.profiled", "probe", "weightlift.load(framework='numpy') with the profiler on", ("weightlift.api",)
        ),
        ArmSpec(
            "wl.numpy.nocopy",
            "local",
            "weightlift.load(framework='numpy', copy=False) + touch",
            ("weightlift.api",),
            weightlift=True,
        ),
        ArmSpec(
            "wl.numpy.hugeahead",
            "local",
            "wl.numpy with huge pages and every kernel copy faulted ahead by touch (the fill before the policy)",
            ("weightlift.api",),
            weightlift=True,
            env={"WEIGHTLIFT_HUGEPAGES": "1", "WEIGHTLIFT_FAULT_AHEAD": "1", "WEIGHTLIFT_FAULT_METHOD": "touch"},
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
        ArmSpec(
            "wl.push.hugeahead",
            "remote",
            "wl.push with huge pages and every kernel copy faulted ahead by touch (the fill before the policy)",
            _WL_PUSH_REQ,
            weightlift=True,
            env={"WEIGHTLIFT_HUGEPAGES": "1", "WEIGHTLIFT_FAULT_AHEAD": "1", "WEIGHTLIFT_FAULT_METHOD": "touch"},
        ),
        ArmSpec(
            "wl.push.nohelpers",
            "remote",
            "wl.push with no fault-ahead helper threads in the server",
            _WL_PUSH_REQ,
            weightlift=True,
            env={"WEIGHTLIFT_FAULT_HELPERS": "0"},
        ),
        ArmSpec(
            "wl.push.verify",
            "remote",
            "wl.push with verify=True: the server hashes every tensor as it lands, the client checks "
            "the digests against the sidecar manifest (made by the warm-up)",
            _WL_PUSH_REQ,
            weightlift=True,
        ),
        ArmSpec(
            "wl.push.mac",
            "remote",
            "wl.push with a token: every frame, payloads included, carries a keyed-BLAKE3 MAC",
            _WL_PUSH_REQ,
            weightlift=True,
        ),
        ArmSpec(
            "wl.push.tls",
            "remote",
            "wl.push over TLS (no token): sends without sendfile or scatter-gather",
            (*_WL_PUSH_REQ, "ssl", "cryptography"),
            weightlift=True,
        ),
        ArmSpec(
            "wl.push.legacy",
            "remote",
            "the same push with WEIGHTLIFT_LOAD_OPT=0",
            _WL_PUSH_REQ,
            weightlift=True,
            env={"WEIGHTLIFT_LOAD_OPT": "0"},
        ),
        ArmSpec(
            "wl.push.cached",
            "remote",
            "a second push to a caching server (cache filled by the warm-up)",
            (*_WL_PUSH_REQ, "weightlift.remote.server.cache"),
            weightlift=True,
        ),
        ArmSpec(
            "wl.push.update",
            "remote",
            "a weight update (third push, same shapes) into a running server, timed alone",
            _WL_PUSH_REQ,
            weightlift=True,
        ),
        ArmSpec(
            "wl.push.reserved",
            "remote",
            "a first push into a server started with reserve= (faulted), timed alone",
            _WL_PUSH_REQ,
            weightlift=True,
        ),
        ArmSpec(
            "wl.push.second",
            "remote",
            "two pushes to one caching server (fresh cache): the second, timed alone",
            (*_WL_PUSH_REQ, "weightlift.remote.server.cache"),
            weightlift=True,
        ),
        ArmSpec(
            "wl.split",
            "remote",
            "weightlift.load with half the tensors remote",
            ("weightlift.api", "weightlift.remote.server"),
            weightlift=True,
        ),
        ArmSpec(
            "limit.copy",
            "limit",
            "copy floor: mmap -> fresh memory (4 KiB pages) on every core, fresh process",
            ("numpy",),
        ),
        ArmSpec(
            "limit.copy.huge",
            "limit",
            "copy floor: mmap -> fresh memory (huge pages advised) on every core, fresh process",
            ("numpy",),
        ),
        *(
            ArmSpec(
                f"limit.read.{k}",
                "limit",
                f"raw read as an arm: {k} preadv thread(s) into touched buffers, fresh process",
            )
            for k in READ_LIMIT_THREADS
        ),
        *(
            ArmSpec(
                f"limit.read.fresh.{k}",
                "limit",
                f"raw read into fresh memory: {k} preadv thread(s) into one fresh mapping "
                "(4 KiB pages, populated ahead), every page touched, fresh process",
                ("numpy",),
            )
            for k in READ_LIMIT_THREADS
        ),
        ArmSpec("limit.tcp", "limit", "raw loopback TCP as an arm: sendfile -> recv_into, fresh process"),
        ArmSpec(
            "limit.fault",
            "limit",
            "fault-in floor: fresh memory of the checkpoint's size faulted in on every "
            "core (one write per 4 KiB page), nothing copied, fresh process",
            ("numpy",),
        ),
        ArmSpec("limit.fault.huge", "limit", "the fault-in floor with huge pages advised", ("numpy",)),
        ArmSpec(
            "limit.tcp.fresh",
            "limit",
            "raw loopback TCP into fresh memory: sendfile -> recv_into "
            "untouched memory the size of the data, fresh process",
        ),
        ArmSpec("loop.plain", "probe", "read loop with no profiler code", ("weightlift.checkpoint",)),
        ArmSpec(
            "loop.off", "probe", "the same loop with the profiler checks, profiler off", ("weightlift.checkpoint",)
        ),
        ArmSpec("loop.on", "probe", "the same loop with the profiler on", ("weightlift.checkpoint",)),
        ArmSpec("base.copy", "baseline", "copy limit: mmap -> memory on every core (fresh / touched)", ("numpy",)),
        ArmSpec("base.read", "baseline", "best raw read: preadv, 1/2/4 threads, touched buffers"),
        ArmSpec("base.tcp", "baseline", "raw loopback TCP: sendfile -> recv_into"),
        ArmSpec("base.h2d", "baseline", "pinned host -> device copy", ("torch",), cuda=True),
    )
}

BODIES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "safetensors.numpy": _st_numpy,
    "safetensors.torch": _st_torch,
    "safetensors.cuda": lambda o: _st_torch(o, device="cuda:0"),
    "torch.load": _torch_load,
    "runai": _runai,
    "fastsafetensors": _fastsafetensors,
    "tensorizer": _tensorizer,
    "instanttensor": _instanttensor,
    "wl.numpy": lambda o: _wl_load(o, framework="numpy", copy=True),
    "wl.numpy.profiled": lambda o: _wl_load({**o, "profile": True}, framework="numpy", copy=True),
    "wl.numpy.nocopy": lambda o: _wl_load(o, framework="numpy", copy=False),
    "wl.numpy.mmap": lambda o: _wl_load(o, framework="numpy", copy=True, engine="mmap"),
    "wl.numpy.nohelpers": lambda o: _wl_load(o, framework="numpy", copy=True),
    "wl.numpy.verify": lambda o: _wl_load(o, framework="numpy", copy=True, verify=True),
    "wl.numpy.hugeahead": lambda o: _wl_load(o, framework="numpy", copy=True),
    "wl.torch": lambda o: _wl_load(o, framework="torch"),
    "wl.cuda": lambda o: _wl_load(o, framework="torch", device="cuda"),
    "wl.push": _wl_push,
    "wl.push.legacy": _wl_push,
    "wl.push.hugeahead": _wl_push,
    "wl.push.nohelpers": _wl_push,
    "wl.push.cached": lambda o: _wl_push(o, cache=True),
    "wl.push.verify": lambda o: _wl_push(o, verify=True),
    "wl.push.mac": lambda o: _wl_push(o, mac=True),
    "wl.push.tls": lambda o: _wl_push(o, tls=True),
    "wl.push.update": lambda o: _wl_push_again(o, cache=False),
    "wl.push.second": lambda o: _wl_push_again(o, cache=True),
    "wl.push.reserved": _wl_push_reserved,
    "wl.split": _wl_split,
    "limit.copy": _limit_copy,
    "limit.copy.huge": lambda o: _limit_copy(o, huge=True),
    "limit.tcp": _limit_tcp,
    "limit.tcp.fresh": lambda o: _limit_tcp(o, fresh=True),
    "limit.fault": _limit_fault,
    "limit.fault.huge": lambda o: _limit_fault(o, huge=True),
    **{f"limit.read.{k}": functools.partial(_limit_read, k=k) for k in READ_LIMIT_THREADS},
    **{f"limit.read.fresh.{k}": functools.partial(_limit_read_fresh, k=k) for k in READ_LIMIT_THREADS},
    "loop.plain": lambda o: _profile_loop({**o, "mode": "plain"}),
    "loop.off": lambda o: _profile_loop({**o, "mode": "off"}),
    "loop.on": lambda o: _profile_loop({**o, "mode": "on"}),
    "base.copy": _baseline_copy,
    "base.read": _baseline_read,
    "base.tcp": _baseline_tcp,
    "base.h2d": _baseline_h2d,
    "make-pt": _make_pt,
    "make-tensorizer": _make_tensorizer,
}


def main(t0_ns: int, argv: list[str]) -> None:
    """Child entry point: run one arm, print the marker, leave without teardown."""
    name, opts = argv[0], json.loads(argv[1])
    try:
        info = BODIES[name](opts)
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
