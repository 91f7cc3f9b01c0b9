"""Load profiler: where the time of a load goes, per phase, with an optional Chrome trace.

Theory of operation
-------------------
A call site wraps a step in ``with prof.phase("read", nbytes, name=...):`` (or
``prof.command("HAVE")`` for a protocol round trip); the phases are "read", "hash", "stage",
"wire", "device". When the profiler is off, ``phase`` returns one shared object whose enter and
exit do nothing: no clock read, no lock, no allocation. A step whose byte count is known only at
its end sets it on the span (``with prof.phase("wire") as sp: ...; sp.nbytes = n``). Call sites
that already hold their own stamps hand them to :meth:`Profiler.record`.

Records are *foreground* (on the path that decides when the load is done) or *background*
(cache warmer threads, hash workers: work that overlaps the foreground and only costs when it
competes for a core or the disk). The report is built from the stored records when asked for:

* ``span`` runs from the first foreground start to the last foreground end.
* Each instant of the span belongs either to one or more foreground phases or to nobody. Time
  that nobody covers is the ``gap`` (the caller's own overhead between calls, stalls, waiting).
  Time that several phases cover at once (a reader thread and a device copy on another thread)
  is shared equally among the phases active in it, so the phases plus the gap add up to the
  span exactly, however the caller's intervals overlap. The plain sum of each phase's
  durations is reported as ``work_s`` (it counts parallel work once per thread).
* Background records never stretch the span; their durations are summed per phase.

``reset()`` forgets everything, including the first start and the last end, so a server that
prints one report per client and then resets starts the next client's span at that client's
first transfer, with no idle time between clients counted as a gap.

Report keys (``Profiler.report()``; stable, the README documents them):

===============  ==========================================================================
``tensors``      tensors counted with ``count(tensors=...)``
``calls``        calls counted with ``count(calls=...)`` (protocol messages, read calls)
``bytes``        bytes counted with ``count(nbytes=...)``; when nothing was counted, the
                 largest per-phase foreground byte total (every phase moves the payload once)
``span_s``       first foreground start to last foreground end, seconds
``phases_s``     {"read", "hash", "stage", "wire", "device", "gap"}: exclusive seconds,
                 summing to ``span_s``
``work_s``       {phase: seconds}: plain sum of foreground durations (overlap counted twice)
``phase_bytes``  {phase: bytes}: bytes given to foreground records of each phase
``background_s`` {phase: seconds}: plain sum of background durations
``commands``     {name: {"count", "seconds"}} from ``command()``
``gbps``         ``bytes / span_s / 1e9`` (decimal GB/s; 0.0 for an empty span)
===============  ==========================================================================

With ``trace=True`` every record is kept with its thread, and :meth:`write_trace` writes the
Chrome trace format (a ``traceEvents`` array of complete ``"X"`` events with ``ts``/``dur`` in
microseconds, and ``"M"`` thread_name metadata, one track per thread) that Perfetto and
chrome://tracing open. An event is named ``"<phase> <name>"`` (``"read model.embed"``,
``"read warm chunk"``, ``"wire send"``, ``"device <tensor>"``) or just the phase without a
name; its ``args`` carry the bytes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from types import TracebackType
from typing import Any

from weightlift import env
from weightlift.errors import FileError, OptionError

__all__ = ["PHASES", "ENV_VAR", "Profiler", "Span"]

PHASES: tuple[str, ...] = ("read", "hash", "stage", "wire", "device")
ENV_VAR = "WEIGHTLIFT_LOADPROF"

_INDEX = {p: i for i, p in enumerate(PHASES)}


class Span:
    """One timed step: the clock is read on enter and the record made on exit.

    ``nbytes`` may be set inside the block. The disabled profiler hands out one shared instance
    of the base class, whose enter and exit do nothing.
    """

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int = 0) -> None:
        self.nbytes = nbytes

    def __enter__(self) -> Span:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        return None


class _TimedSpan(Span):
    __slots__ = ("prof", "phase", "name", "background", "command", "t0")

    def __init__(self, prof: Profiler, phase: str, nbytes: int, name: str | None, background: bool, command: bool):
        super().__init__(nbytes)
        self.prof, self.phase, self.name, self.background, self.command = prof, phase, name, background, command
        self.t0 = 0

    def __enter__(self) -> Span:
        self.t0 = time.perf_counter_ns()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        t1 = time.perf_counter_ns()
        if self.command:
            self.prof.command(self.phase, self.t0, t1)
        else:
            self.prof.record(self.phase, self.t0, t1, self.nbytes, name=self.name, background=self.background)


_OFF = Span()


class Profiler:
    """Per-phase timing of a load; off by default, on with ``WEIGHTLIFT_LOADPROF=1``.

    ``enabled=None`` reads the environment variable; ``trace=True`` also keeps every record for
    :meth:`write_trace` and, with ``enabled=None``, turns the profiler on (asking for a trace
    is asking for the records).
    """

    enabled: bool
    trace: bool
    _first_ns: int | None
    _last_end_ns: int | None

    def __init__(self, enabled: bool | None = None, *, trace: bool = False) -> None:
        if enabled is None:
            enabled = True if trace else env.load_profile()
        self.enabled = bool(enabled)
        self.trace = bool(trace)
        self._lock = threading.Lock()
        self.reset()

    # -- recording --

    def phase(self, phase: str, nbytes: int = 0, *, name: str | None = None, background: bool = False) -> Span:
        """A context manager that records one step of ``phase``; free when the profiler is off."""
        if not self.enabled:
            return _OFF
        return _TimedSpan(self, phase, nbytes, name, background, False)

    def timed(self, cmd_name: str) -> Span:
        """A context manager that records one protocol command (see :meth:`command`)."""
        if not self.enabled:
            return _OFF
        return _TimedSpan(self, cmd_name, 0, None, False, True)

    def clock(self) -> int:
        """``time.perf_counter_ns()`` when on, 0 when off: for stamps a step hands to :meth:`record`."""
        return time.perf_counter_ns() if self.enabled else 0

    def record(
        self,
        phase: str,
        t0_ns: int,
        t1_ns: int,
        nbytes: int = 0,
        *,
        name: str | None = None,
        background: bool = False,
    ) -> None:
        """One step of ``phase`` that ran from ``t0_ns`` to ``t1_ns`` (perf_counter_ns) moving ``nbytes``."""
        if not self.enabled:
            return
        i = _INDEX.get(phase)
        if i is None:
            raise OptionError(f"unknown profiler phase {phase!r}; expected one of {', '.join(PHASES)}")
        if t1_ns < t0_ns:  # a clock read in the wrong order must not make negative time
            t1_ns = t0_ns
        dt = t1_ns - t0_ns
        with self._lock:
            if background:
                self._bg_ns[i] += dt
                self._bg_bytes[i] += nbytes
            else:
                self._fg.append((i, t0_ns, t1_ns))
                self._work_ns[i] += dt
                self._fg_bytes[i] += nbytes
                if self._first_ns is None or t0_ns < self._first_ns:
                    self._first_ns = t0_ns
                if self._last_end_ns is None or t1_ns > self._last_end_ns:
                    self._last_end_ns = t1_ns
            if self.trace:
                self._keep(phase if name is None else f"{phase} {name}", phase, t0_ns, t1_ns, nbytes, background)

    def command(self, cmd_name: str, t0_ns: int, t1_ns: int) -> None:
        """One protocol command (or other named call) that took ``t1_ns - t0_ns``."""
        if not self.enabled:
            return
        dt = max(0, t1_ns - t0_ns)
        with self._lock:
            entry = self._commands.get(cmd_name)
            if entry is None:
                self._commands[cmd_name] = [1, dt]
            else:
                entry[0] += 1
                entry[1] += dt
            if self.trace:
                self._keep(cmd_name, "command", t0_ns, t0_ns + dt, 0, False)

    def count(self, tensors: int = 0, calls: int = 0, nbytes: int = 0) -> None:
        """Add to the tensor, call and byte counters."""
        if not self.enabled:
            return
        with self._lock:
            self._tensors += tensors
            self._calls += calls
            self._bytes += nbytes

    def reset(self) -> None:
        """Forget every record, counter and timestamp: the next record starts a new span."""
        with self._lock:
            self._fg: list[tuple[int, int, int]] = []
            self._work_ns = [0] * len(PHASES)
            self._fg_bytes = [0] * len(PHASES)
            self._bg_ns = [0] * len(PHASES)
            self._bg_bytes = [0] * len(PHASES)
            self._first_ns = None
            self._last_end_ns = None
            self._commands: dict[str, list[int]] = {}
            self._tensors = 0
            self._calls = 0
            self._bytes = 0
            # trace: (label, category, t0, t1, nbytes, thread ident, background)
            self._events: list[tuple[str, str, int, int, int, int, bool]] = []
            self._thread_names: dict[int, str] = {}

    def _keep(self, label: str, cat: str, t0: int, t1: int, nbytes: int, background: bool) -> None:
        # called with the lock held
        ident = threading.get_ident()
        if ident not in self._thread_names:
            self._thread_names[ident] = threading.current_thread().name
        self._events.append((label, cat, t0, t1, nbytes, ident, background))

    # -- reporting --

    def report(self) -> dict[str, Any]:
        """The counters and the per-phase split of the span; see the module docstring for the keys."""
        with self._lock:
            fg = list(self._fg)
            first, last = self._first_ns, self._last_end_ns
            work = list(self._work_ns)
            fg_bytes = list(self._fg_bytes)
            bg = list(self._bg_ns)
            commands = {k: (v[0], v[1]) for k, v in self._commands.items()}
            tensors, calls, counted = self._tensors, self._calls, self._bytes
        span_ns = (last - first) if first is not None and last is not None else 0
        exclusive = _exclusive_split(fg)
        span_s = span_ns / 1e9
        phases: dict[str, float] = {p: exclusive[i] / 1e9 for i, p in enumerate(PHASES)}
        phases["gap"] = max(0.0, span_s - sum(phases[p] for p in PHASES))
        nbytes = counted if counted else max(fg_bytes)
        return {
            "tensors": tensors,
            "calls": calls,
            "bytes": nbytes,
            "span_s": span_s,
            "phases_s": phases,
            "work_s": {p: work[i] / 1e9 for i, p in enumerate(PHASES)},
            "phase_bytes": {p: fg_bytes[i] for i, p in enumerate(PHASES)},
            "background_s": {p: bg[i] / 1e9 for i, p in enumerate(PHASES)},
            "commands": {k: {"count": c, "seconds": ns / 1e9} for k, (c, ns) in sorted(commands.items())},
            "gbps": (nbytes / span_s / 1e9) if span_s > 0 else 0.0,
        }

    def format(self) -> str:
        """A small table of the report for a terminal."""
        return format_report(self.report())

    def trace_events(self) -> dict[str, Any]:
        """The Chrome trace object (``{"traceEvents": [...]}``) of the kept records."""
        if not self.trace:
            raise OptionError("this profiler keeps no trace; make it with Profiler(trace=True)")
        with self._lock:
            events = list(self._events)
            names = dict(self._thread_names)
        pid = os.getpid()
        tids: dict[int, int] = {}
        for ev in events:
            tids.setdefault(ev[5], len(tids) + 1)
        base = min((ev[2] for ev in events), default=0)
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "weightlift"}}
        ]
        for ident, tid in tids.items():
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": names[ident]}})
        for label, cat, t0, t1, nbytes, ident, background in events:
            out.append(
                {
                    "name": label,
                    "cat": f"{cat},background" if background else cat,
                    "ph": "X",
                    "ts": (t0 - base) / 1e3,
                    "dur": (t1 - t0) / 1e3,
                    "pid": pid,
                    "tid": tids[ident],
                    "args": {"bytes": nbytes},
                }
            )
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the kept records as a Chrome trace JSON file (Perfetto, chrome://tracing)."""
        obj = self.trace_events()
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(obj, f, separators=(",", ":"))
        except OSError as e:
            raise FileError(f"cannot write trace to {os.fspath(path)!r}: {e.strerror or e}", errno=e.errno) from None


def _exclusive_split(fg: list[tuple[int, int, int]]) -> list[float]:
    """Nanoseconds per phase with concurrent time shared equally among the phases active in it.

    A sweep over the interval endpoints: between two consecutive endpoints the set of active
    phases is constant, and that stretch is divided among them. Several intervals of one phase
    at once (reader threads) count once, so the result sums to the union of all intervals.
    """
    points: list[tuple[int, int, int]] = []
    for i, t0, t1 in fg:
        if t1 > t0:
            points.append((t0, 1, i))
            points.append((t1, -1, i))
    points.sort()
    out = [0.0] * len(PHASES)
    active = [0] * len(PHASES)
    prev = points[0][0] if points else 0
    for t, delta, i in points:
        if t > prev:
            live = [j for j in range(len(PHASES)) if active[j]]
            if live:
                share = (t - prev) / len(live)
                for j in live:
                    out[j] += share
            prev = t
        active[i] += delta
    return out


def format_report(rep: dict[str, Any]) -> str:
    """Render a :meth:`Profiler.report` dict as a small table."""
    span = rep["span_s"]
    lines = [
        f"load profile: {rep['tensors']} tensors, {rep['calls']} calls, "
        f"{rep['bytes'] / 2**20:.1f} MiB in {span:.3f} s ({rep['gbps']:.2f} GB/s)",
        f"  {'phase':<8} {'seconds':>9} {'share':>7} {'work s':>9} {'background s':>13}",
    ]
    for p in (*PHASES, "gap"):
        sec = rep["phases_s"][p]
        share = f"{100 * sec / span:6.1f}%" if span > 0 else "      -"
        work = f"{rep['work_s'][p]:9.3f}" if p in rep["work_s"] else " " * 9
        bg = f"{rep['background_s'][p]:13.3f}" if p in rep["background_s"] else ""
        lines.append(f"  {p:<8} {sec:9.3f} {share} {work} {bg}".rstrip())
    if rep["commands"]:
        lines.append(f"  {'command':<20} {'count':>7} {'seconds':>9}")
        for name, c in rep["commands"].items():
            lines.append(f"  {name:<20} {c['count']:>7} {c['seconds']:9.3f}")
    return "\n".join(lines)
