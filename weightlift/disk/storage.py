"""What a storage device is good at, learned once and remembered.

Whether parallel readers speed up a cold read depends on the device (a striped array or an SSD
likes several, a single disk may like one). ``weightlift bench --cold`` measures it with
seconds-long raw reads by 1, 2 and 4 threads and records the best count here, in
``storage.json`` in weightlift's cache folder, keyed by the device number; cold loads from that
device then use it. ``WEIGHTLIFT_COLD_READERS=N`` pins the count; deleting the file forgets
everything. A missing, unreadable or unwritable file is never an error: the loader then uses
all its readers.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from typing import Any

from weightlift import env

__all__ = ["readers_for", "remember_readers", "storage_file"]

_lock = threading.Lock()
_memo: dict[int, int] = {}


def storage_file() -> str:
    return os.path.join(env.cache_dir(), "storage.json")


def _read() -> dict[str, Any]:
    try:
        with open(storage_file(), encoding="utf-8") as f:
            obj = json.load(f)
        return obj if isinstance(obj, dict) else {}
    except (OSError, ValueError):
        return {}


def readers_for(device: int) -> int | None:
    """The reader count recorded for this device (or pinned by the environment), else None."""
    pinned = env.cold_readers()
    if pinned is not None:
        return pinned
    with _lock:
        if device in _memo:
            return _memo[device]
    entry = _read().get(str(device))
    if isinstance(entry, dict) and isinstance(entry.get("readers"), int) and entry["readers"] > 0:
        with _lock:
            _memo[device] = entry["readers"]
        return entry["readers"]
    return None


def remember_readers(device: int, readers: int, **measured: float) -> None:
    """Record a measured reader count (best effort: a read-only cache folder is not an error)."""
    with _lock:
        _memo[device] = readers
    path = storage_file()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        obj = _read()
        obj[str(device)] = {"readers": readers, "measured": measured, "at": int(time.time())}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".storage.")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass
