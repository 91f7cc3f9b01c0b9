"""Fresh host memory: how this machine fills it fastest, measured once and remembered.

Theory of operation. Every byte weightlift lands in host memory lands in memory nobody has
touched yet, and on virtual machines whose host backs guest memory lazily the first touch of a
page can cost more than the copy into it. How to pay for it best depends on the machine, so
three choices are a :class:`FillPolicy`:

``huge``
    Advise destinations to use transparent huge pages (2 MiB per fault) or not (4 KiB). Fewer
    faults is not always faster: a huge-page fault zeroes 2 MiB at once and, with THP
    ``defrag`` at ``madvise``, may compact memory synchronously first. Without advice a mapping
    gets whatever the system default is, so the policy always says which it wants.
``ahead``
    Whether a destination about to be filled by a kernel copy (``preadv``, ``recv_into``) is
    faulted in from user space first, or left for the copy to fault. (A user-space copy,
    ``np.copyto`` out of a mapping, is never faulted ahead: that would be the same faults in
    series with the same copy.)
``method``
    How memory is faulted in where something must (ahead of a kernel copy, the server's helper
    threads, a reserve): ``"touch"`` (one write per page) or ``"populate"``
    (``MADV_POPULATE_WRITE``, one system call; Linux 5.14 and later).
``helpers``
    Threads per server connection that fault the next destinations in while the socket fills
    the current one (:mod:`weightlift.memory.faulter`); 0 leaves every fault to the receive itself.

Where the policy comes from, first match wins: the environment (``WEIGHTLIFT_HUGEPAGES=0|1``,
``WEIGHTLIFT_FAULT_AHEAD=0|1``, ``WEIGHTLIFT_FAULT_METHOD=touch|populate``,
``WEIGHTLIFT_FAULT_HELPERS=N``, each on its own);
the calibration recorded for this machine by ``weightlift bench --calibrate-memory`` (in
``memory.json`` in weightlift's cache folder, keyed by what identifies the machine: kernel,
memory size, core count and THP settings); else :data:`DEFAULT`, the choice measured best on
the machines this was developed on (bench/RESULTS.md). Calibration runs each way of filling
fresh memory in fresh processes, with a pause before each long enough for the host to take
back what the previous one freed, and keeps the fastest by median.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from weightlift import env, libc
from weightlift.errors import FileError

__all__ = [
    "FillPolicy",
    "DEFAULT",
    "policy",
    "reset_policy",
    "new_mapping",
    "fresh_host",
    "fault_in",
    "before_kernel_copy",
    "map_in",
    "calibrate",
    "memory_file",
    "machine_key",
]

PAGE = mmap.PAGESIZE
SMALL = 2 * 1024 * 1024  # below this, np.empty: malloc's free lists reuse small blocks


@dataclass(frozen=True)
class FillPolicy:
    """How fresh host memory is mapped and faulted in (see the module docstring)."""

    huge: bool = False
    ahead: bool = False
    method: str = "touch"
    helpers: int = 2
    source: str = "default"  # "default", "calibrated" or "environment": where it came from

    def __post_init__(self) -> None:
        if self.method not in ("touch", "populate"):
            raise ValueError(f"fault method must be 'touch' or 'populate', not {self.method!r}")


# Where a host backs guest memory lazily, 4 KiB pages were faster than huge pages for every way
# of filling fresh memory, and a kernel copy into memory populated first (MADV_POPULATE_WRITE,
# one call per piece) faster than one left to fault its own pages (bench/RESULTS.md, fill
# strategies); a calibration or the environment overrides it. Without MADV_POPULATE_WRITE
# (Linux before 5.14) fault_in falls back to one write per page.
DEFAULT = FillPolicy(huge=False, ahead=True, method="populate")

_lock = threading.Lock()
_policy: FillPolicy | None = None


def memory_file() -> str:
    return os.path.join(env.cache_dir(), "memory.json")


def _read_sys(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return "?"


def machine_key() -> str:
    """What a calibration is valid for: kernel, memory, cores and the THP settings."""
    mem = "?"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            mem = f.readline().split()[1]
    except (OSError, IndexError):
        pass
    thp = "/sys/kernel/mm/transparent_hugepage/"
    return "|".join(
        (platform.release(), mem, str(os.cpu_count()), _read_sys(thp + "enabled"), _read_sys(thp + "defrag"))
    )


def _recorded() -> FillPolicy | None:
    try:
        with open(memory_file(), encoding="utf-8") as f:
            entry = json.load(f).get(machine_key())
        return replace(
            DEFAULT,
            huge=bool(entry["huge"]),
            ahead=bool(entry["ahead"]),
            method=str(entry["method"]),
            source="calibrated",
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def policy() -> FillPolicy:
    """The policy in force: the environment over this machine's calibration over :data:`DEFAULT`."""
    global _policy
    with _lock:
        if _policy is None:
            p = _recorded() or DEFAULT
            huge, ahead = env.hugepages(), env.fault_ahead()
            method, helpers = env.fault_method(), env.fault_helpers()
            if huge is not None or ahead is not None or method is not None or helpers is not None:
                p = replace(
                    p,
                    huge=p.huge if huge is None else huge,
                    ahead=p.ahead if ahead is None else ahead,
                    method=p.method if method is None else method,
                    helpers=p.helpers if helpers is None else helpers,
                    source="environment",
                )
            _policy = p
        return _policy


def reset_policy() -> None:
    """Forget the policy read so far (after the environment or the calibration changed)."""
    global _policy
    with _lock:
        _policy = None


def new_mapping(size: int, *, huge: bool | None = None) -> mmap.mmap:
    """A private anonymous mapping of ``size`` bytes, advised for huge pages or against them."""
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    want = policy().huge if huge is None else huge
    try:
        m.madvise(mmap.MADV_HUGEPAGE if want else mmap.MADV_NOHUGEPAGE)
    except (AttributeError, OSError):
        pass  # no THP here: 4 KiB pages hold the same bytes
    return m


def fresh_host(nbytes: int) -> np.ndarray:
    """Uninitialised, writable host memory as a uint8 array, mapped as the policy says."""
    if nbytes < SMALL:
        return np.empty(nbytes, dtype=np.uint8)
    return np.frombuffer(new_mapping(nbytes), dtype=np.uint8)


def _as_uint8(buf: Any) -> np.ndarray:
    return buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)


def fault_in(buf: Any, *, method: str | None = None) -> None:
    """Fault ``buf``'s pages in (writable memory; its contents are not kept)."""
    arr = _as_uint8(buf)
    if not arr.size:
        return
    if (method or policy().method) == "populate" and _populate(arr):
        return
    arr[::PAGE] = 0
    a = arr.ctypes.data
    if (a + arr.size - 1) // PAGE != (a + (arr.size - 1) // PAGE * PAGE) // PAGE:
        arr[-1] = 0  # a buffer that starts inside a page ends in one the stride missed


def _populate(arr: np.ndarray) -> bool:
    """``MADV_POPULATE_WRITE`` over the pages inside ``arr``, the partial pages at either end
    written by hand; False where the kernel refuses it (before 5.14), and nothing was done."""
    a = arr.ctypes.data
    lo, hi = -(-a // PAGE) * PAGE, (a + arr.size) // PAGE * PAGE
    if hi <= lo:
        return False
    try:
        libc.madvise(lo, hi - lo, libc.MADV_POPULATE_WRITE)
    except OSError:
        return False
    arr[: lo - a] = 0
    if a + arr.size > hi:
        arr[hi - a] = 0
    return True


def before_kernel_copy(buf: Any) -> None:
    """Ready fresh memory that ``preadv`` or ``recv_into`` is about to fill: faulted in first
    where the policy says that pays, else left for the copy to fault."""
    if policy().ahead:
        fault_in(buf)


# -- mapped files, made ready to read ------------------------------------------------------

MAP_IN_PIECE = 64 << 20


def map_in(regions: list[tuple[int, int, str]], *, threads: int) -> int:
    """Make mapped file bytes ready to read: in the page cache, in this process's page tables,
    and touched once, on ``threads`` threads; returns the bytes covered.

    ``regions`` are ``(address, length, file)``: parts of mappings of files (shared or
    private), which the caller keeps mapped until this returns. Each 64 MiB piece is populated
    with one ``madvise(MADV_POPULATE_READ)``, which reads a cold piece from storage (the
    threads' pieces are separate streams) and maps it without copying a byte, then one byte of
    each page is read. Where memory is virtual (a VM) the first access to a page the
    hypervisor just filled is a fault of its own, about as dear as the read (768 MiB just read
    in: 0.45-0.55 s the first time, 0.07 s the second): without the touch the model's first
    forward pass pays it, on one thread. Measured in isolation, evicted (bench/RESULTS.md,
    2026-11-30 night): 0.61-0.64 s on two threads this way, 1.09-1.17 s on one, 1.0-1.1 s for
    parallel ``sendfile`` readers followed by the first read.

    A read error, or a file shorter than its mapping, fails ``MADV_POPULATE_READ`` with EFAULT
    before any touch: a :class:`FileError` naming the file. A kernel without the advice (before
    5.14: EINVAL) has each piece read through ``/proc/self/mem`` instead, a slice at a time into
    a scratch buffer (:func:`_kernel_read`): the kernel faults the pages into this process's
    page tables as a touch would, and a page it cannot fill (past the end of a file cut short)
    is an I/O error, the same FileError, where a touch would raise SIGBUS and end the process.
    Only where that file cannot be read are the pages touched. The read copies every byte once
    (0.76 GB in the page cache, two threads: 0.18-0.20 s against 0.03 s for the touch here); on
    a cold file, what map_in is for, the read from storage outweighs it.
    """
    step = MAP_IN_PIECE
    pieces = [(a + o, min(step, n - o), f) for a, n, f in regions if n > 0 for o in range(0, n, step)]
    if not pieces:
        return 0
    ready = _PieceReader(step)
    lock = threading.Lock()
    errors: list[BaseException] = []
    state = {"next": 0}

    def run() -> None:
        while not errors:
            with lock:
                i = state["next"]
                if i >= len(pieces):
                    return
                state["next"] = i + 1
            try:
                ready.piece(*pieces[i])
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                errors.append(e)

    k = max(1, min(threads, len(pieces)))
    workers = [threading.Thread(target=run, name=f"wl-map-in-{i}", daemon=True) for i in range(k - 1)]
    for w in workers:
        w.start()
    try:
        run()
    except BaseException as e:  # interrupted between pieces: the workers stop after theirs
        errors.append(e)
        raise
    finally:
        for w in workers:
            w.join()
        ready.close()
    if errors:
        raise errors[0]
    return sum(n for _, n, _ in pieces)


class _PieceReader:
    """How :func:`map_in` makes one piece ready, shared by its threads: advised, then touched;
    where the kernel has no such advice, read through ``/proc/self/mem`` (touched only where
    that cannot be opened)."""

    def __init__(self, step: int) -> None:
        # one ctypes type for every piece (ctypes keeps a type per length for good); a piece
        # reads only its own bytes of it
        self.piece_type = ctypes.c_uint8 * step
        self.advice = getattr(mmap, "MADV_POPULATE_READ", libc.MADV_POPULATE_READ)
        self.advise = True
        self.mem: int | None = None
        self.lock = threading.Lock()
        self.local = threading.local()

    def piece(self, addr: int, n: int, f: str) -> None:
        lo, hi = addr - addr % PAGE, -(-(addr + n) // PAGE) * PAGE
        if self.advise:
            try:
                libc.madvise(lo, hi - lo, self.advice)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.ENOSYS):
                    raise _unreadable(e.errno or 0, f) from None
                with self.lock:  # a kernel before 5.14, or a C library without madvise
                    if self.advise:
                        self.mem = _open_own_memory()
                        self.advise = False
        if not self.advise and self.mem is not None:
            if not hasattr(self.local, "scratch"):
                self.local.scratch = memoryview(bytearray(KERNEL_READ))
            err = _kernel_read(self.mem, lo, hi - lo, self.local.scratch)
            if err:
                raise _unreadable(err, f)
            return
        first = -addr % PAGE  # the first page boundary inside the piece
        arr = np.ctypeslib.as_array(self.piece_type.from_address(addr))[:n]
        int(arr[first::PAGE].sum())  # a read of one byte per page; numpy lets go of the GIL
        if first:
            int(arr[0])

    def close(self) -> None:
        if self.mem is not None:
            os.close(self.mem)
            self.mem = None


def _unreadable(err: int, file: str) -> FileError:
    why = "a read error, or the file is shorter than it was" if err in (errno.EFAULT, errno.EIO) else None
    return FileError(f"cannot read its mapped bytes ({why or os.strerror(err)})", file=file, errno=err)


#: bytes of this process's memory :func:`_kernel_read` reads per call, into a scratch buffer of this size
KERNEL_READ = 1 << 20


def _open_own_memory() -> int | None:
    """A descriptor of ``/proc/self/mem`` for reading, or None where it cannot be opened."""
    try:
        return os.open("/proc/self/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _kernel_read(mem: int, addr: int, n: int, scratch: memoryview) -> int:
    """Read ``n`` bytes of this process's memory at ``addr`` through ``mem`` (``/proc/self/mem``)
    into ``scratch``, a slice at a time: the kernel faults every page in as a read of it would.
    Returns 0, or the errno where a page cannot be read (EIO past the end of a file cut short)."""
    done = 0
    while done < n:
        k = min(len(scratch), n - done)
        try:
            got = os.preadv(mem, [scratch[:k]], addr + done)
        except OSError as e:
            return e.errno or errno.EIO
        if got <= 0:
            return errno.EIO
        done += got
    return 0


# -- calibration ---------------------------------------------------------------------------------

# Each trial lands ``size`` bytes in fresh memory of one kind, on every core, in a fresh process.
# "copy": np.copyto out of a mapping (the loader's warm path); "pread", "touch+pread",
# "populate+pread": a kernel copy into memory left alone or faulted in first (the cold loader
# and the server's socket).
TRIALS = tuple((huge, kind) for huge in (False, True) for kind in ("copy", "pread", "touch+pread", "populate+pread"))


def _trial(fd: int, size: int, huge: bool, kind: str, k: int) -> float:
    src = np.frombuffer(mmap.mmap(fd, size, prot=mmap.PROT_READ), dtype=np.uint8)
    t0 = time.perf_counter()
    dst = np.frombuffer(new_mapping(size, huge=huge), dtype=np.uint8)
    step = -(-size // k)
    step = -(-step // SMALL) * SMALL

    def work(i: int) -> None:
        a, b = i * step, min(size, (i + 1) * step)
        if kind == "copy":
            for x in range(a, b, 32 << 20):
                np.copyto(dst[x : min(b, x + (32 << 20))], src[x : min(b, x + (32 << 20))])
            return
        if kind != "pread":
            fault_in(dst[a:b], method=kind.split("+")[0])
        mv = dst.data
        while a < b:
            a += os.preadv(fd, [mv[a : min(b, a + (8 << 20))]], a)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(k) if i * step < size]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def calibrate(
    size: int = 512 << 20,
    *,
    rounds: int = 3,
    pause: float = 15.0,
    remember: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time every way of filling fresh memory (:data:`TRIALS`), each in a fresh process after
    ``pause`` seconds, ``rounds`` times in alternating order; choose and (by default) remember
    the fastest for this machine. Returns the medians and the chosen policy."""
    say = log or (lambda s: None)
    fd = os.memfd_create("wl-calibrate") if hasattr(os, "memfd_create") else None
    tmp = None
    if fd is None:
        tmp = tempfile.NamedTemporaryFile(prefix="wl-calibrate-")
        fd = tmp.fileno()
    try:
        chunk = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
        for off in range(0, size, len(chunk)):
            os.pwrite(fd, chunk[: min(len(chunk), size - off)], off)
        times: dict[tuple[bool, str], list[float]] = {t: [] for t in TRIALS}
        for r in range(rounds):
            for huge, kind in TRIALS if r % 2 == 0 else TRIALS[::-1]:
                time.sleep(pause)
                out = subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        "import sys,weightlift.memory.fresh as f;f._child(sys.argv[1:])",
                        str(fd),
                        str(size),
                        str(int(huge)),
                        kind,
                        str(os.cpu_count() or 1),
                    ],
                    pass_fds=(fd,),
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                if out.returncode != 0:
                    raise RuntimeError(f"calibration trial failed: {out.stderr.strip()[-500:]}")
                s = float(out.stdout.split()[-1])
                times[(huge, kind)].append(s)
                say(f"  {'huge' if huge else '4k'} {kind}: {s:.3f} s")
    finally:
        if tmp is not None:
            tmp.close()
        else:
            os.close(fd)
    med = {t: statistics.median(v) for t, v in times.items()}
    huge = med[(True, "copy")] < med[(False, "copy")]
    kernel = {k: med[(huge, k)] for k in ("pread", "touch+pread", "populate+pread")}
    best = min(kernel, key=kernel.__getitem__)
    method = "populate" if med[(huge, "populate+pread")] < med[(huge, "touch+pread")] else "touch"
    chosen = replace(DEFAULT, huge=huge, ahead=best != "pread", method=method, source="calibrated")
    result = {
        "size": size,
        "rounds": rounds,
        "pause_s": pause,
        "machine": machine_key(),
        "medians_s": {f"{'huge' if h else '4k'} {k}": v for (h, k), v in med.items()},
        "policy": {k: v for k, v in asdict(chosen).items() if k in ("huge", "ahead", "method")},
    }
    if remember:
        _remember(result)
        reset_policy()
    return result


def _remember(result: dict[str, Any]) -> None:
    path = memory_file()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with open(path, encoding="utf-8") as f:
                obj = json.load(f)
            obj = obj if isinstance(obj, dict) else {}
        except (OSError, ValueError):
            obj = {}
        obj[result["machine"]] = {**result["policy"], "medians_s": result["medians_s"], "at": int(time.time())}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".memory.")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache folder: the policy is then used for this process only


def _child(argv: list[str]) -> None:
    fd, size, huge, kind, k = int(argv[0]), int(argv[1]), argv[2] == "1", argv[3], int(argv[4])
    print(f"{_trial(fd, size, huge, kind, k):.6f}", flush=True)
    os._exit(0)
