"""Every ``WEIGHTLIFT_*`` switch, the cache folder and the cores this process may use, read in
one place.

Each switch is read when it is used (not at import), so a test or a long-lived worker that
changes the environment sees the change; callers that want a value to stay put memoize it
themselves (the fill policy does). Unset or empty means "the default".

=============================  ==============================================================
``WEIGHTLIFT_CACHE``           the cache folder (calibrations, the demo checkpoint)
``WEIGHTLIFT_BENCH_DIR``       where the benchmark keeps its synthetic checkpoints
``WEIGHTLIFT_LOADPROF``        1: profile every load and push (see :mod:`weightlift.profile`)
``WEIGHTLIFT_PAGE_EVICTION``   1 / 0 / auto: evict the page cache behind a load, or never
``WEIGHTLIFT_COLD_READERS``    pin the number of ``preadv`` readers of a cold file
``WEIGHTLIFT_ROW_READ_MIN``    bytes: smallest row read of a distributed slice load
``WEIGHTLIFT_HUGEPAGES``       1 / 0: fresh host memory in 2 MiB pages or not
``WEIGHTLIFT_FAULT_AHEAD``     1 / 0: fault fresh memory in before a kernel copy fills it
``WEIGHTLIFT_FAULT_METHOD``    touch / populate: how fresh memory is faulted in
``WEIGHTLIFT_FAULT_HELPERS``   helper threads per server connection that fault memory in
``WEIGHTLIFT_LOAD_OPT``        0: the naive remote paths on both sides, for A/B runs
``WEIGHTLIFT_SOURCE_CONNECTIONS``  connections per load from a store URL (default: calibrated)
``WEIGHTLIFT_SOURCE_PART``     bytes per ranged read from a store URL (default: calibrated)
``WEIGHTLIFT_SOURCE_BUDGET``   bytes of host memory a load from a store URL may hold
=============================  ==============================================================
"""

from __future__ import annotations

import os

from weightlift.errors import OptionError

__all__ = [
    "cpus",
    "available_memory",
    "ON",
    "OFF",
    "flag",
    "cache_home",
    "cache_dir",
    "bench_dir",
    "load_profile",
    "page_eviction",
    "cold_readers",
    "row_read_min",
    "hugepages",
    "fault_ahead",
    "fault_method",
    "fault_helpers",
    "load_opt",
    "source_connections",
    "source_part",
    "source_budget",
]

ON = frozenset({"1", "true", "yes", "on"})
OFF = frozenset({"0", "false", "no", "off"})


def cpus() -> int:
    """The cores this process may run on: fewer than the machine's where it is pinned
    (``taskset``, a container's cpuset); the machine's where the affinity cannot be read (not
    Linux, or a sandbox that refuses the call)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_memory(field: str = "MemAvailable") -> int | None:
    """``MemAvailable`` (or another ``field``, such as ``MemTotal``) from ``/proc/meminfo``, in
    bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _get(name: str) -> str:
    return os.environ.get(name, "").strip()


def _digits(v: str) -> bool:
    """Whether ``v`` is a whole number in ASCII digits (``str.isdigit`` takes '³', which ``int`` refuses)."""
    return v.isascii() and v.isdigit()


def flag(name: str) -> bool | None:
    """True or False where ``name`` says so (1/true/yes/on, 0/false/no/off); None otherwise."""
    v = _get(name).lower()
    if v in ON:
        return True
    if v in OFF:
        return False
    return None


def cache_home() -> str:
    """``$XDG_CACHE_HOME``, or ``~/.cache``."""
    return os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")


def cache_dir() -> str:
    """weightlift's cache folder: ``$WEIGHTLIFT_CACHE``, or ``weightlift`` under :func:`cache_home`."""
    return os.environ.get("WEIGHTLIFT_CACHE") or os.path.join(cache_home(), "weightlift")


def bench_dir() -> str:
    """The benchmark's checkpoint folder: ``$WEIGHTLIFT_BENCH_DIR``, or ``weightlift/bench`` under :func:`cache_home`."""
    return os.environ.get("WEIGHTLIFT_BENCH_DIR") or os.path.join(cache_home(), "weightlift", "bench")


def load_profile() -> bool:
    """``WEIGHTLIFT_LOADPROF``: profile loads and pushes that do not say otherwise."""
    return _get("WEIGHTLIFT_LOADPROF").lower() in ON


def page_eviction() -> bool | None:
    """``WEIGHTLIFT_PAGE_EVICTION``: "1" forces eviction, "0" forbids it, unset or "auto" leaves the default."""
    v = _get("WEIGHTLIFT_PAGE_EVICTION").lower()
    if v in ("", "auto"):
        return None
    if v in ON:
        return True
    if v in OFF:
        return False
    raise OptionError(f"WEIGHTLIFT_PAGE_EVICTION={v!r}: expected 1, 0 or auto")


def cold_readers() -> int | None:
    """``WEIGHTLIFT_COLD_READERS``: a pinned reader count (a positive integer), else None."""
    v = _get("WEIGHTLIFT_COLD_READERS")
    return int(v) if _digits(v) and int(v) > 0 else None


def row_read_min(default: int) -> int:
    """``WEIGHTLIFT_ROW_READ_MIN`` in bytes, or ``default`` where unset."""
    v = _get("WEIGHTLIFT_ROW_READ_MIN")
    if not v:
        return default
    try:
        n = int(v)
    except ValueError:
        raise OptionError(f"WEIGHTLIFT_ROW_READ_MIN={v!r}: expected a number of bytes") from None
    if n < 1:
        raise OptionError(f"WEIGHTLIFT_ROW_READ_MIN={v!r}: must be at least 1")
    return n


def hugepages() -> bool | None:
    """``WEIGHTLIFT_HUGEPAGES``: fresh host memory in 2 MiB pages (True) or not (False); None: not set."""
    return flag("WEIGHTLIFT_HUGEPAGES")


def fault_ahead() -> bool | None:
    """``WEIGHTLIFT_FAULT_AHEAD``: fault fresh memory in before a kernel copy fills it; None: not set."""
    return flag("WEIGHTLIFT_FAULT_AHEAD")


def fault_method() -> str | None:
    """``WEIGHTLIFT_FAULT_METHOD``: "touch" or "populate"; None for anything else."""
    v = _get("WEIGHTLIFT_FAULT_METHOD").lower()
    return v if v in ("touch", "populate") else None


def fault_helpers() -> int | None:
    """``WEIGHTLIFT_FAULT_HELPERS``: helper threads per server connection; None: not set."""
    v = _get("WEIGHTLIFT_FAULT_HELPERS")
    return int(v) if _digits(v) else None


def load_opt() -> bool:
    """False when ``WEIGHTLIFT_LOAD_OPT=0`` asks for the naive remote behaviour (A/B runs)."""
    return os.environ.get("WEIGHTLIFT_LOAD_OPT", "1").strip() != "0"


def _size(name: str) -> int | None:
    v = _get(name)
    if not v:
        return None
    try:
        n = int(v)
    except ValueError:
        raise OptionError(f"{name}={v!r}: expected a positive integer") from None
    if n < 1:
        raise OptionError(f"{name}={v!r}: must be at least 1")
    return n


def source_connections() -> int | None:
    """``WEIGHTLIFT_SOURCE_CONNECTIONS``: connections per load from a store URL; None: not set."""
    return _size("WEIGHTLIFT_SOURCE_CONNECTIONS")


def source_part() -> int | None:
    """``WEIGHTLIFT_SOURCE_PART``: bytes per ranged read from a store URL; None: not set."""
    return _size("WEIGHTLIFT_SOURCE_PART")


def source_budget() -> int | None:
    """``WEIGHTLIFT_SOURCE_BUDGET``: bytes of host memory a load from a store URL may hold
    besides its destination; None: not set (connections x parts)."""
    return _size("WEIGHTLIFT_SOURCE_BUDGET")
