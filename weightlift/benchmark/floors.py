"""The floors and baselines of a benchmark: the copy, the raw read, raw loopback TCP, host to device.

An arm file loaded by path beside :mod:`.arms` (whose docstring says how every arm runs and ends);
in a child it finds that module as ``sys.modules["wl_bench_arms"]``; imported in the parent, it imports it from
the package. The floors run as arms (a fresh process, timed like the loaders), so medians compare
with medians under the same pauses; the baselines measure in one process and report the best of a
few repeats. Baselines print their measured bandwidths in the ready JSON.
"""

from __future__ import annotations

import functools
import importlib
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

core: Any = sys.modules.get("wl_bench_arms") or importlib.import_module("weightlift.benchmark.arms")
BASELINES = ("base.copy", "base.read", "base.tcp", "base.h2d")  # in-process baselines, reported under each table
READ_LIMIT_THREADS = (1, 2, 4)  # the raw read limit is the fastest of these reader counts


def data_size(path: str) -> int:
    return os.stat(path).st_size


def rate_gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def run_threads(fn: Callable[[int], None], k: int) -> float:
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(k)]
    t0 = time.perf_counter_ns()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter_ns() - t0) / 1e9


def split_shares(size: int, k: int) -> list[tuple[int, int]]:
    step = -(-size // k)
    step += -step % core.PAGE
    return [(i * step, min(size, (i + 1) * step)) for i in range(k) if i * step < size]


def _copy_shares(src: Any, dst: Any, shares: list[tuple[int, int]]) -> float:
    """Copy ``src`` into ``dst`` (uint8 arrays), one share per thread; returns the seconds."""
    import numpy as np

    def work(i: int) -> None:
        a, b = shares[i]
        for x in range(a, b, 8 * core.BLOCK):
            y = min(b, x + 8 * core.BLOCK)
            np.copyto(dst[x:y], src[x:y])

    return run_threads(work, len(shares))


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

    return run_threads(work, len(shares))


def _baseline_copy(o: dict[str, Any]) -> dict[str, Any]:
    """The copy limit: the file's bytes out of a fresh mapping into memory, on every core."""
    import numpy as np

    path = o["files"][0] if len(o["files"]) == 1 else None
    if path is None:
        raise core.Skip("copy baseline measures a single file")
    size = data_size(path)
    k = os.cpu_count() or 1
    shares = split_shares(size, k)
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
        out[mode] = {"seconds": sorted(times), "gbps": rate_gbps(size, min(times))}
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
        raise core.Skip("copy limit measures a single file")
    t0 = core.start_clock()
    size = data_size(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    src = np.frombuffer(mm, dtype=np.uint8, count=size)
    dst = np.frombuffer(fresh_mapping(size, huge), dtype=np.uint8)
    shares = split_shares(size, os.cpu_count() or 1)
    _copy_shares(src, dst, shares)
    n, b = core.touch_any([dst])
    return {
        "load_s": core.stop_clock(t0),
        "tensors": 0,
        "bytes": b,
        "threads": len(shares),
        "huge": huge,
    }


def fresh_mapping(size: int, huge: bool) -> mmap.mmap:
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    except (AttributeError, OSError):
        pass
    return m


def _limit_read(o: dict[str, Any], k: int) -> dict[str, Any]:
    """The raw read as an arm: ``k`` threads of preadv, one contiguous share each, into buffers
    already touched, in a fresh process after the same eviction and pause as the loader arms.

    The in-process baseline (base.read) evicts and reads again three times in a row, so its
    later repeats fill the page cache with pages the previous repeat freed moments before,
    which this VM's host still backs; a loader arm's page cache is made of memory as fresh as
    its own."""
    path = o["files"][0] if len(o["files"]) == 1 else None
    if path is None:
        raise core.Skip("the read limit measures a single file")
    size = data_size(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        shares = split_shares(size, k)
        bufs = [bytearray(core.BLOCK) for _ in shares]  # zero-filled: touched
        t0 = core.start_clock()  # the imports check; the read's own time is load_s
        seconds = _read_shares(fd, shares, bufs)
        core.stop_clock(t0)
    finally:
        os.close(fd)
    return {"load_s": seconds, "tensors": 0, "bytes": size, "threads": k}


def _baseline_read(o: dict[str, Any]) -> dict[str, Any]:
    """Best raw read: 1, 2 and 4 threads of preadv into buffers already touched."""
    path = o["files"][0] if len(o["files"]) == 1 else None
    if path is None:
        raise core.Skip("read baseline measures a single file")
    size = data_size(path)
    fd = os.open(path, os.O_RDONLY)
    out: dict[str, Any] = {"bytes": size, "cold": bool(o.get("cold")), "by_threads": {}}
    resident: list[float] = []
    try:
        for k in READ_LIMIT_THREADS:
            bufs = [bytearray(core.BLOCK) for _ in range(k)]  # zero-filled: touched
            shares = split_shares(size, k)
            times = []
            for _ in range(o.get("repeats", 3)):
                if o.get("cold"):
                    core.evict(path)
                    resident.append(core.resident_fraction(path))
                times.append(_read_shares(fd, shares, bufs))
            out["by_threads"][str(k)] = {"seconds": sorted(times), "gbps": rate_gbps(size, min(times))}
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


def baseline_tcp(o: dict[str, Any], fresh: bool = False) -> dict[str, Any]:
    """Raw loopback TCP: sendfile from the file into a socket, recv_into a reused buffer (or,
    with ``fresh``, into fresh memory the size of the data, the kernel faulting it in)."""
    import socket

    path = o["files"][0]
    size = data_size(path)
    times = []
    for _ in range(o.get("repeats", 3)):
        lsock = socket.create_server(("127.0.0.1", 0))
        port = lsock.getsockname()[1]
        errors: list[BaseException] = []

        def send(port: int = port, errors: list[BaseException] = errors) -> None:
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
            dest = memoryview(fresh_mapping(size, False))
        else:
            dest = memoryview(bytearray(core.BLOCK))
        got = 0
        with conn:
            while got < size:
                n = conn.recv_into(dest[got : got + core.BLOCK] if fresh else dest)
                if n == 0:
                    break
                got += n
        dt = (time.perf_counter_ns() - t0) / 1e9
        th.join()
        lsock.close()
        if errors or got != size:
            raise RuntimeError(f"loopback transfer failed after {got} of {size} bytes: {errors}")
        times.append(dt)
    return {"bytes": size, "seconds": sorted(times), "gbps": rate_gbps(size, min(times))}


def limit_tcp(o: dict[str, Any], fresh: bool = False) -> dict[str, Any]:
    """Raw loopback TCP as an arm: one sendfile -> recv_into transfer of the file in a fresh
    process, timed like the push arms, so medians compare with medians under the same pauses."""
    import socket  # noqa: F401  (before the clock)

    t0 = core.start_clock()  # the imports check; the transfer's own time is load_s
    out = baseline_tcp({**o, "repeats": 1}, fresh=fresh)
    core.stop_clock(t0)
    return {"load_s": out["seconds"][0], "tensors": 0, "bytes": out["bytes"]}


def _baseline_h2d(o: dict[str, Any]) -> dict[str, Any]:
    """Pinned host to device bandwidth, timed with CUDA events."""
    import torch

    if not torch.cuda.is_available():
        raise core.Skip("no CUDA device")
    size = min(data_size(o["files"][0]), 1 << 30)
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
        "gbps": rate_gbps(size, min(times)),
        "device": torch.cuda.get_device_name(0),
    }


# -- the arm table ------------------------------------------------------------------------------

SPECS: dict[str, Any] = {
    s.name: s
    for s in (
        core.ArmSpec(
            "limit.copy",
            "limit",
            "copy floor: mmap -> fresh memory (4 KiB pages) on every core, fresh process",
            ("numpy",),
        ),
        core.ArmSpec(
            "limit.copy.huge",
            "limit",
            "copy floor: mmap -> fresh memory (huge pages advised) on every core, fresh process",
            ("numpy",),
        ),
        *(
            core.ArmSpec(
                f"limit.read.{k}",
                "limit",
                f"raw read as an arm: {k} preadv thread(s) into touched buffers, fresh process",
            )
            for k in READ_LIMIT_THREADS
        ),
        core.ArmSpec("limit.tcp", "limit", "raw loopback TCP as an arm: sendfile -> recv_into, fresh process"),
        core.ArmSpec(
            "limit.tcp.fresh",
            "limit",
            "raw loopback TCP into fresh memory: sendfile -> recv_into "
            "untouched memory the size of the data, fresh process (a push's floor)",
        ),
        core.ArmSpec("base.copy", "baseline", "copy limit: mmap -> memory on every core (fresh / touched)", ("numpy",)),
        core.ArmSpec("base.read", "baseline", "best raw read: preadv, 1/2/4 threads, touched buffers"),
        core.ArmSpec("base.tcp", "baseline", "raw loopback TCP: sendfile -> recv_into"),
        core.ArmSpec("base.h2d", "baseline", "pinned host -> device copy", ("torch",), cuda=True),
    )
}

BODIES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "limit.copy": _limit_copy,
    "limit.copy.huge": lambda o: _limit_copy(o, huge=True),
    "limit.tcp": limit_tcp,
    "limit.tcp.fresh": lambda o: limit_tcp(o, fresh=True),
    **{f"limit.read.{k}": functools.partial(_limit_read, k=k) for k in READ_LIMIT_THREADS},
    "base.copy": _baseline_copy,
    "base.read": _baseline_read,
    "base.tcp": baseline_tcp,
    "base.h2d": _baseline_h2d,
}
