"""How many connections and how large a part a store likes, learned once and remembered.

A store's throughput comes from parallel requests: one S3 connection carries tens of MB/s, so a
fast load needs many, and each request costs a round trip, so parts must be large enough to
hide it. :func:`calibrate` times ranged reads of an object at a few connection counts and part
sizes and records the best pair in ``sources.json`` in weightlift's cache folder, keyed by the
endpoint (as :mod:`weightlift.disk.storage` records what a local disk likes); loads from that
endpoint then use it. Without a record a load uses :data:`CONNECTIONS` and :data:`PART`.
A missing or unwritable file is never an error.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from weightlift import env

__all__ = [
    "forget",
    "Tuning",
    "CONNECTIONS",
    "PART",
    "BUDGET_PARTS",
    "tuning_for",
    "remember",
    "calibrate",
    "tuning_file",
    "TRIAL_PARTS",
]

CONNECTIONS = 16
PART = 8 * 1024 * 1024
#: the default host-memory budget, in parts per connection (one being received, one landing)
BUDGET_PARTS = 2
#: the fewest parts per connection a calibration trial reads
TRIAL_PARTS = 3

_lock = threading.Lock()
_memo: dict[str, Tuning] = {}


@dataclass(frozen=True)
class Tuning:
    connections: int = CONNECTIONS
    part: int = PART

    @property
    def budget(self) -> int:
        """The default host-memory budget: :data:`BUDGET_PARTS` parts per connection."""
        return BUDGET_PARTS * self.part * self.connections


def forget() -> None:
    """Drop what this process remembers (the file is read again at the next load)."""
    with _lock:
        _memo.clear()


def tuning_file() -> str:
    return os.path.join(env.cache_dir(), "sources.json")


def _read() -> dict[str, Any]:
    try:
        with open(tuning_file(), encoding="utf-8") as f:
            obj = json.load(f)
        return obj if isinstance(obj, dict) else {}
    except (OSError, ValueError):
        return {}


def tuning_for(endpoint: str) -> Tuning:
    """The tuning recorded for ``endpoint``, else the defaults."""
    with _lock:
        if endpoint in _memo:
            return _memo[endpoint]
    e = _read().get(endpoint)
    t = Tuning()
    if isinstance(e, dict) and isinstance(e.get("connections"), int) and isinstance(e.get("part"), int):
        if e["connections"] > 0 and e["part"] >= 64 * 1024:
            t = Tuning(e["connections"], e["part"])
    with _lock:
        _memo[endpoint] = t
    return t


def remember(endpoint: str, tuning: Tuning, **measured: float) -> None:
    """Record a measured tuning (best effort)."""
    with _lock:
        _memo[endpoint] = tuning
    path = tuning_file()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        obj = _read()
        obj[endpoint] = {
            "connections": tuning.connections,
            "part": tuning.part,
            "measured": measured,
            "at": int(time.time()),
        }
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".sources.")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass


def calibrate(
    url: str,
    *,
    connections: tuple[int, ...] = (2, 4, 8, 16, 32, 64),
    parts: tuple[int, ...] = (4 << 20, 16 << 20),
    nbytes: int = 256 << 20,
    rounds: int = 2,
    save: bool = True,
) -> tuple[Tuning, dict[str, float]]:
    """Time ranged reads of the object at ``url``: each connection count at :data:`PART` (the
    fewest within a tenth of the fastest wins), then the other part sizes at that count, then
    more connections at the chosen part size where they gain a tenth. Remember (``save``) and
    return the fastest, and every rate measured (GB/s, keyed ``"<connections>x<MiB>"``).

    A trial reads ``nbytes`` of the object (its first bytes, again from its start where it is
    shorter), and at least :data:`TRIAL_PARTS` parts per connection, so that a count is timed
    with all its connections busy rather than by one round of requests. Each setting is timed
    ``rounds`` times, the settings interleaved, and its best rate kept: on a shared machine
    noise only ever slows a trial down."""
    from weightlift.sources.objects import objects_for

    objs = objects_for(url)
    info = objs.info(url)
    loc = objs.location(url)
    store = objs.store(url)
    span = min(nbytes, info.size)
    rates: dict[str, float] = {}

    def trial(c: int, part: int) -> float:
        key = f"{c}x{part >> 20}MiB"
        for _ in range(max(1, rounds)):
            rates[key] = max(rates.get(key, 0.0), _rate(store, info, loc, span, c, part))
        return rates[key]

    by_c: dict[int, float] = {}
    for _ in range(max(1, rounds)):  # interleaved: a slow moment costs one trial of each, not one count
        for c in connections:
            key = f"{c}x{PART >> 20}MiB"
            rates[key] = by_c[c] = max(by_c.get(c, 0.0), _rate(store, info, loc, span, c, PART))
    # the fewest connections within a tenth of the fastest: fewer hold less memory, and a short
    # trial's noise should not buy connections that do not pay
    best_c = min(c for c, r in by_c.items() if r >= 0.9 * max(by_c.values()))
    best = max([PART, *parts], key=lambda p: rates.get(f"{best_c}x{p >> 20}MiB") or trial(best_c, p))
    # another part size moves the best count: more connections at it, kept only where they pay
    for c in (x for x in connections if best_c < x <= 4 * best_c):
        if trial(c, best) > 1.1 * rates[f"{best_c}x{best >> 20}MiB"]:
            best_c = c
    tuned = Tuning(best_c, best)
    if save:
        remember(store.config.endpoint_key, tuned, gbps=rates[f"{best_c}x{best >> 20}MiB"])
    return tuned, rates


def _rate(store: Any, info: Any, loc: Any, span: int, connections: int, part: int) -> float:
    """GB/s of ranged reads of ``span`` bytes (at least :data:`TRIAL_PARTS` parts per connection,
    the span read again from its start as needed), ``part`` at a time on ``connections`` threads."""
    part = max(1, min(part, span))
    whole = max(part, span - span % part)  # parts that fit the span whole, so every read is a full part
    count = max(-(-span // part), TRIAL_PARTS * connections)
    mine = threading.local()

    def one(i: int) -> int:
        buf = getattr(mine, "buf", None)
        if buf is None:
            buf = mine.buf = memoryview(bytearray(part))
        off = (i * part) % whole
        n = min(part, info.size - off)
        store.read_into(info, loc, off, buf[:n], unvalidated_ok=True)  # timed, not kept
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(connections) as ex:
        moved = sum(ex.map(one, range(count)))
    return moved / (time.perf_counter() - t0) / 1e9
