"""Running arms: each a command in a fresh process, interleaved, timed from spawn to its ready line.

Theory of operation
-------------------
An *arm* is one way of getting a checkpoint into memory, run as a command in a fresh process.
Its window runs from the moment the parent spawns the child to the moment the parent reads the
child's ready line (``WL_READY <ns> <json>``), which every arm prints at the same point: all
tensors loaded and every page of them touched (see :mod:`weightlift.benchmark.arms`). The parent
also keeps the child's own ``inner_s`` (its first line to ready) and ``load_s`` (load call to
ready, imports excluded).

Arms run interleaved, A B C A B C ..., so a slow minute on a shared machine lands on every arm
alike; the first round is a warm-up and is not counted. Per arm :func:`run_arms` reports the
median window and its spread (min, max, IQR) and its speed-up over a baseline arm taken pair
by pair: run *i* of the baseline over run *i* of the arm in the same round (above 1: the arm was
faster), then the median of those ratios. Every arm imports what its load needs before its
clock starts (:func:`~.arms.preload`, learned from the warm-up round), so ``load_s`` never holds
a first import for one arm and not another. An arm that crashes is listed as failed with the tail of its stderr, and the
others go on.

Cold mode evicts every file an arm reads (``posix_fadvise(DONTNEED)`` after writing back
dirty pages) before each of its runs and checks with ``mincore`` that nothing stayed
resident; the result says how much did. The checkpoints the runs read are made here too
(:func:`synthetic_checkpoint`, :func:`describe_checkpoint`); which arms run and against which
floors is :mod:`.suite`'s, the command line :mod:`.command`'s.
"""

from __future__ import annotations

import json
import os
import random
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightlift import env
from weightlift.benchmark import arms as bench_arms
from weightlift.benchmark import floors as bench_floors
from weightlift.benchmark.arms import READY, SKIP
from weightlift.benchmark.stats import paired_ratio, summarize
from weightlift.benchmark.synthetic import GIB, MIB, ensure_demo_checkpoint, llama_for_size, write_checkpoint
from weightlift.disk import residency, source
from weightlift.errors import OptionError, WeightliftError

__all__ = [
    "Arm",
    "ArmFailed",
    "ArmSkipped",
    "Sample",
    "ARM_FILES",
    "SETTLE_S",
    "QUICK_SETTLE_S",
    "run_once",
    "run_arms",
    "round_order",
    "child_argv",
    "with_preload",
    "evict_files",
    "max_resident",
    "ensure_bytecode",
    "bench_dir",
    "make_checkpoint",
    "synthetic_checkpoint",
    "default_checkpoint",
    "describe_checkpoint",
]

SETTLE_S = 20.0  # pause before each run of a full benchmark: long enough that arm order does not change the medians
QUICK_SETTLE_S = 3.0  # --quick: short, and said to be short in its output

# the arm bodies a child may run, loaded by path: the package's arms, then its floors
ARM_FILES = (os.path.abspath(bench_arms.__file__), os.path.abspath(bench_floors.__file__))
# Loads the first arm file by path, so peer arms never import the weightlift package.
BOOT = (
    "import time;_t0=time.perf_counter_ns();import sys,importlib.util as u;"
    "s=u.spec_from_file_location('wl_bench_arms',sys.argv[1]);m=u.module_from_spec(s);"
    "sys.modules[s.name]=m;s.loader.exec_module(m);m.main(_t0,sys.argv[2:])"
)


def child_argv(arm: str, opts: dict[str, Any], files: Sequence[str] = ARM_FILES) -> list[str]:
    """The command line that runs arm body ``arm`` in a child; ``files``: the arm files holding
    the bodies, :mod:`weightlift.benchmark.arms` first."""
    return [sys.executable, "-c", BOOT, files[0], arm, json.dumps(opts), *files[1:]]


def with_preload(argv: list[str], modules: Sequence[str]) -> list[str]:
    """``argv`` (from :func:`child_argv`) with ``modules`` added to what its child imports in the
    pre-clock step (:func:`~.arms.preload`); any other command is returned as it is."""
    if not modules or argv[:3] != [sys.executable, "-c", BOOT]:
        return argv
    opts = json.loads(argv[5])
    opts["preload"] = list(dict.fromkeys([*opts.get("preload", []), *modules]))
    return [*argv[:5], json.dumps(opts), *argv[6:]]


# -- running one arm ---------------------------------------------------------------------------


@dataclass
class Arm:
    """A named command run in a fresh process; ``files`` are evicted before each run when cold."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: tuple[str, ...] = ()
    skip: str | None = None
    description: str = ""
    kind: str = "local"
    profile_argv: list[str] | None = None  # the same arm with the profiler on (weightlift arms)
    floored: bool = True  # held to the floor of its kind (see ArmSpec.floored)


class ArmFailed(WeightliftError):
    """An arm's child exited without a ready line, or timed out."""


class ArmSkipped(WeightliftError):
    """An arm's child found it cannot run here (it printed WL_SKIP)."""


@dataclass
class Sample:
    """One run: the parent's window and what the child said in its ready line."""

    window_s: float
    info: dict[str, Any]
    resident_before: float | None = None


def run_once(argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 600.0) -> Sample:
    """Spawn ``argv`` and time it from spawn to the ready line read here."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter_ns()
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, env=full_env, close_fds=True
        )
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = t0 + int(timeout * 1e9)
        pending = b""
        others: list[bytes] = []
        found: tuple[int, bytes] | None = None
        skipped: str | None = None
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while found is None and skipped is None:
                left = deadline - time.perf_counter_ns()
                if left <= 0:
                    proc.kill()
                    proc.wait()
                    raise ArmFailed(f"no ready line within {timeout:.0f} s")
                if not sel.select(left / 1e9):
                    continue
                chunk = os.read(fd, 65536)
                now = time.perf_counter_ns()
                if not chunk:
                    break
                pending += chunk
                while b"\n" in pending and found is None and skipped is None:
                    line, pending = pending.split(b"\n", 1)
                    if line.startswith(READY.encode() + b" "):
                        found = (now, line)
                    elif line.startswith(SKIP.encode() + b" "):
                        skipped = line[len(SKIP) + 1 :].decode(errors="replace").strip()
                    else:
                        others = (others + [line])[-5:]
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        proc.stdout.close()
        if skipped is not None:
            raise ArmSkipped(skipped)
        if found is None:
            err.seek(0)
            tail = err.read().decode(errors="replace").strip().splitlines()[-6:]
            out = [o.decode(errors="replace") for o in others]
            raise ArmFailed(f"exit status {rc} without a ready line: " + " | ".join(out + tail))
    t_ready, line = found
    parts = line.decode().split(" ", 2)
    try:
        info = json.loads(parts[2]) if len(parts) > 2 else {}
    except ValueError:
        raise ArmFailed(f"ready line carries malformed JSON: {line[:200]!r}") from None
    if not isinstance(info, dict):
        info = {"value": info}
    return Sample((t_ready - t0) / 1e9, info)


# -- cold mode -------------------------------------------------------------------------------


def _expand(paths: Sequence[str]) -> list[str]:
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            for root, _, names in os.walk(p):
                out.extend(os.path.join(root, n) for n in names)
        elif os.path.exists(p):
            out.append(p)
    return out


def evict_files(paths: Sequence[str]) -> None:
    """Drop every file (folders: every file under them) from the page cache, dirty pages written back first."""
    for p in _expand(paths):
        source.evict(p)


def max_resident(paths: Sequence[str]) -> float:
    """The largest resident fraction among the files, by a fresh mincore each call."""
    return max((residency.file_fraction(p) for p in _expand(paths)), default=0.0)


# -- the loop --------------------------------------------------------------------------------


def round_order(items: Sequence[Any], rnd: int, order: str = "shuffle") -> list[Any]:
    """The order of round ``rnd``: ``"shuffle"``: as given for round 0, then a seeded shuffle
    per round in which, where the number of arms allows, no arm runs right after an arm it
    already followed in an earlier round (nor right after itself across two rounds);
    ``"forward"`` / ``"reverse"``: as given / reversed in every round.

    Why predecessors and not only a shuffle: with a short pause an arm started right after one
    that freed a checkpoint's worth of memory gets that memory still backed by the host, and
    loads faster. Seeded shuffles alone put ``safetensors.numpy`` right after the copy floor
    (which frees the most) in two of the three counted rounds of ``--quick`` and right after
    itself in the third: its load call took 0.26 s there against 0.39 s with 20 s pauses,
    while weightlift's took 0.26 s and 0.27 s."""
    if order not in ("shuffle", "forward", "reverse"):
        raise OptionError(f"order must be 'shuffle', 'forward' or 'reverse', not {order!r}")
    out = list(items)
    if order == "reverse":
        out.reverse()
    elif order == "shuffle" and rnd:
        out = [out[i] for i in _shuffled_rounds(len(out), rnd)[rnd]]
    return out


def _shuffled_rounds(n: int, last: int) -> list[list[int]]:
    """Rounds 0..``last`` of ``n`` arms as indices: round 0 as given; each later one the first
    of a few seeded shuffles (seed: the round, then derived ones) that repeats no (predecessor,
    arm) pair of the rounds after round 0 before it, or the one that repeats fewest."""
    rounds = [list(range(n))]
    seen: set[tuple[int, int]] = set()  # round 0 is the uncounted warm-up (by default): its pairs may recur
    for rnd in range(1, last + 1):
        best: tuple[int, list[int]] | None = None
        for attempt in range(200):
            cand = list(range(n))
            random.Random(rnd if attempt == 0 else rnd * 1000 + attempt).shuffle(cand)
            pairs = [(rounds[-1][-1], cand[0]), *zip(cand, cand[1:], strict=False)]
            repeats = sum(a == b or (a, b) in seen for a, b in pairs)
            if best is None or repeats < best[0]:
                best = (repeats, cand)
            if repeats == 0:
                break
        assert best is not None
        chosen = best[1]
        seen.update([(rounds[-1][-1], chosen[0]), *zip(chosen, chosen[1:], strict=False)])
        rounds.append(chosen)
    return rounds


@dataclass
class _Runner:
    """What every run of one :func:`run_arms` call shares, and the order the runs took."""

    cold: bool
    timeout: float
    settle: float
    say: Callable[[str], None]
    order_log: list[dict[str, Any]] = field(default_factory=list)
    # per arm, the modules its earlier runs imported inside their clocks: later runs import them
    # before the clock, so no counted run (and no profiled one) times a first import
    preload: dict[str, list[str]] = field(default_factory=dict)

    def run(self, a: Arm, r: dict[str, Any], rnd: int, warmup: int) -> None:
        """Run arm ``a`` once in round ``rnd`` and record it in ``r``, its entry of the result."""
        counted = rnd >= warmup
        if r["status"] != "ok":  # failed in an earlier round: not started again
            if counted:
                for k in ("times_s", "inner_s", "load_s"):
                    r[k].append(None)
            return
        self.order_log.append({"round": rnd, "arm": a.name, "counted": counted})
        s = self.one(a, with_preload(a.argv, self.preload.get(a.name, [])), r)
        if s is not None:
            self.say(f"  {'run ' + str(rnd - warmup + 1) if counted else 'warm-up'} {a.name}: {s.window_s:.3f} s")
            r["bytes"], r["tensors"] = s.info.get("bytes"), s.info.get("tensors")
        if counted:
            _record(r, s)

    def one(self, a: Arm, argv: list[str], r: dict[str, Any] | None) -> Sample | None:
        """One run after the pause (and, cold, the eviction); a skip or failure is noted in ``r``."""
        if self.settle > 0:
            time.sleep(self.settle)
        resident = None
        if self.cold and a.files:
            evict_files(a.files)
            resident = max_resident(a.files)
        try:
            s = run_once(argv, env=a.env, timeout=self.timeout)
        except (ArmSkipped, ArmFailed) as e:
            if r is not None:
                r["status"], r["reason"] = "skipped" if isinstance(e, ArmSkipped) else "failed", str(e)
            return None
        s.resident_before = resident
        learned = self.preload.setdefault(a.name, [])
        learned += [m for m in s.info.get("timed_imports") or () if m not in learned]
        return s


def _entry(a: Arm) -> dict[str, Any]:
    return {
        "status": "skipped" if a.skip else "ok",
        "reason": a.skip,
        "kind": a.kind,
        "floored": a.floored,
        "description": a.description,
        "times_s": [],
        "inner_s": [],
        "load_s": [],
        "resident_before": [],
        "bytes": None,
        "tensors": None,
        "profile": None,
        "server_profile": None,
        "timed_imports": [],  # modules a counted run first imported inside its clock (should be none)
    }


def _record(r: dict[str, Any], s: Sample | None) -> None:
    """A counted run's figures, None where it did not finish."""
    r["times_s"].append(s.window_s if s else None)
    r["inner_s"].append(s.info.get("inner_s") if s else None)
    r["load_s"].append(s.info.get("load_s") if s else None)
    if s is None:
        return
    if "first_s" in s.info:  # arms that time a first and a second push
        r.setdefault("first_s", []).append(s.info["first_s"])
    if "push" in s.info:  # what each push sent and found cached
        r.setdefault("push", []).append(s.info["push"])
    if s.resident_before is not None:
        r["resident_before"].append(s.resident_before)
    r["timed_imports"] += [m for m in s.info.get("timed_imports") or () if m not in r["timed_imports"]]


def _summarize(res: dict[str, dict[str, Any]], baseline: str | None) -> str | None:
    """Medians and paired ratios per arm, against ``baseline`` (else the first arm that ran); returns it."""
    base = baseline if baseline in res and res[baseline]["status"] == "ok" else None
    if base is None:
        base = next((n for n, r in res.items() if r["status"] == "ok"), None)
    for r in res.values():
        r["summary"] = summarize(r["times_s"])
        r["inner"] = summarize(r["inner_s"])
        r["load"] = summarize(r["load_s"])
        ref = res[base] if base is not None and r["status"] == "ok" else None
        # speed-up over the baseline, one way everywhere: its time over this arm's (above 1: faster)
        r["speedup"] = paired_ratio(ref["times_s"], r["times_s"]) if ref is not None else None
        r["load_speedup"] = paired_ratio(ref["load_s"], r["load_s"]) if ref is not None else None
        if r.get("first_s") and len(r["first_s"]) == len(r["load_s"]):
            r["first"] = summarize(r["first_s"])
            r["second_speedup"] = paired_ratio(r["first_s"], r["load_s"])  # first over second, per run
    return base


def run_arms(
    arms: Sequence[Arm],
    *,
    runs: int = 5,
    warmup: int = 1,
    cold: bool = False,
    baseline: str | None = None,
    timeout: float = 600.0,
    profile_round: bool = True,
    settle: float = 0.0,
    order: str = "shuffle",
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the arms interleaved, ``warmup`` uncounted rounds then ``runs`` counted ones.

    ``settle`` seconds pass before every run. On a VM whose host takes freed guest memory back
    after a delay, an arm started right after another one exited gets the memory that one
    freed, still backed, at several times the speed of memory the host must back afresh:
    without a long enough pause, the order of the arms decides part of what they measure. How
    long is long enough is measured, not assumed: run the same arms with ``order="forward"``
    and ``order="reverse"`` (``bench/order_check.py``) and the medians must agree within
    noise; :data:`SETTLE_S` is the pause that passed that check. By default each round after
    the first runs the arms in its own shuffled order (seeded by the round number: the same
    every time), so no arm always follows the same one.
    """
    if runs < 1 or warmup < 0:
        raise OptionError("runs must be at least 1 and warmup at least 0")
    runner = _Runner(cold=cold, timeout=timeout, settle=settle, say=log or (lambda s: None))
    res = {a.name: _entry(a) for a in arms}
    live = [a for a in arms if not a.skip]
    for rnd in range(warmup + runs):
        for a in round_order(live, rnd, order):
            runner.run(a, res[a.name], rnd, warmup)
    for a in live if profile_round else ():
        if a.profile_argv and res[a.name]["status"] == "ok":
            s = runner.one(a, with_preload(a.profile_argv, runner.preload.get(a.name, [])), None)
            if s is not None:
                res[a.name]["profile"] = s.info.get("profile")
                res[a.name]["server_profile"] = s.info.get("server_profile")
    base = _summarize(res, baseline)
    residents = [x for r in res.values() for x in r["resident_before"]]
    return {
        "arms": res,
        "order": runner.order_log,
        "order_mode": order,
        "baseline": base,
        "runs": runs,
        "warmup": warmup,
        "settle_s": settle,
        "mode": "cold" if cold else "warm",
        "cold_check": {"runs_checked": len(residents), "max_resident_before": max(residents) if residents else None}
        if cold
        else None,
    }


# -- checkpoints -----------------------------------------------------------------------------


def ensure_bytecode() -> None:
    """Compile weightlift's modules to bytecode, as installing a wheel does, before the arms run.

    Every arm imports something in its window, and torch's, transformers' and safetensors'
    modules come compiled from their wheels. weightlift's, in an editable install under
    ``PYTHONDONTWRITEBYTECODE`` (set on this project's machines), would be compiled from
    source in every child: 0.03-0.06 s of each weightlift window that a user's install does
    not pay. Best effort: a read-only tree is left as it is."""
    import compileall

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # weightlift/
    try:
        compileall.compile_dir(package, quiet=2)
    except OSError:
        pass


def bench_dir() -> str:
    """Where synthetic checkpoints and .pt copies are cached (WEIGHTLIFT_BENCH_DIR overrides)."""
    d = env.bench_dir()
    os.makedirs(d, exist_ok=True)
    return d


def make_checkpoint(path: str, size: int, *, seed: int = 0) -> str:
    """Write a synthetic safetensors file of about ``size`` bytes of random tensor data."""
    # hidden 2048 from 1 GiB up, so the MLP matrices pass the client's hash threshold as real ones do
    write_checkpoint(path, llama_for_size(size), seed=seed, metadata={"format": "pt", "source": "weightlift bench"})
    return path


def synthetic_checkpoint(size: int) -> str:
    """The cached synthetic checkpoint of about ``size`` bytes, made on first use."""
    path = os.path.join(bench_dir(), f"synthetic-{size // MIB}m.safetensors")
    return path if os.path.exists(path) else make_checkpoint(path, size)


def default_checkpoint(*, quick: bool, size: int | None = None) -> str:
    """The demo checkpoint, or for ``quick`` or a given ``size`` a synthetic one of that size."""
    if size is None and not quick:
        return str(ensure_demo_checkpoint())
    return synthetic_checkpoint(size if size else (256 * MIB if quick else 2 * GIB))


def describe_checkpoint(path: str) -> dict[str, Any]:
    """Files, tensor names, payload bytes and format of a checkpoint."""
    try:
        from weightlift.checkpoint import open_checkpoint
    except ImportError:
        open_checkpoint = None  # type: ignore[assignment]
    if open_checkpoint is not None:
        ck = open_checkpoint(path)
        files, fmt, tensors = list(ck.files), ck.format, list(ck.tensors)
    else:
        from weightlift.formats.safetensors import PREFIX_SIZE, header_length, parse_header

        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = header_length(f.read(PREFIX_SIZE), file=path, file_size=size)
            tensors, _ = parse_header(f.read(n), file=path, file_size=size)
        files, fmt = [path], "safetensors"
    return {
        "path": os.path.abspath(path),
        "format": fmt,
        "files": [os.path.abspath(f) for f in files],
        "tensors": len(tensors),
        "bytes": sum(t.length for t in tensors),
        "names": [t.name for t in tensors],
        "file_bytes": sum(os.path.getsize(f) for f in files),
    }
