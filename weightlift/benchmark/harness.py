"""Benchmark harness: time to ready per arm, in fresh processes, interleaved, with baselines.

Theory of operation
-------------------
An *arm* is one way of getting a checkpoint into memory, run as a command in a fresh process.
Its window runs from the moment the parent spawns the child to the moment the parent reads the
child's ready line (``WL_READY <ns> <json>``), which every arm prints at the same point: all
tensors loaded and every page of them touched (see :mod:`weightlift.benchmark.arms`). The parent
also keeps the child's own ``inner_s`` (its first line to ready) and ``load_s`` (load call to
ready, imports excluded).

Arms run interleaved, A B C A B C ..., so a slow minute on a shared machine lands on every arm
alike; the first round is a warm-up and is not counted. Per arm the harness reports the median
window and its spread (min, max, IQR), the GB/s that median means, and the ratio to a
baseline arm taken pair by pair: run *i* of an arm over run *i* of the baseline in the same
round, then the median of those ratios.

Cold mode evicts every file an arm reads (``posix_fadvise(DONTNEED)`` after writing back
dirty pages) before each of its runs and checks with ``mincore`` that nothing stayed
resident; the output says how much did. Baselines measured in the same run bound what an arm
could reach: the copy limit (mapped file to memory on every core), the best raw read
(preadv, 1/2/4 threads), raw loopback TCP (sendfile to recv_into) and pinned host-to-device
bandwidth where a CUDA device is present. An arm whose module is missing or that needs a
device that is not here is listed as skipped with the reason; one that crashes is listed as
failed with the tail of its stderr, and the others go on.

The result is one JSON-able dict (``SCHEMA``): ``checkpoint``, ``mode``, ``cold_check``,
``runs``, ``order``, ``baseline``, ``arms`` ({name: status, reason, times_s, inner_s,
load_s, summary, gbps, load_gbps, ratio, bytes, tensors, profile}), ``baselines``, ``notes``
and ``machine``; :mod:`.report` renders it (table, plot), :mod:`.stats` holds the medians and
paired ratios, :mod:`.synthetic` writes the checkpoints, and :func:`add_arguments` /
:func:`command` are the argparse front end that ``weightlift bench`` and ``bench/*.py`` share.
"""

from __future__ import annotations

import json
import os
import platform
import random
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightlift import env
from weightlift.benchmark import arms as bench_arms
from weightlift.benchmark.arms import BASELINES, READY, SKIP, SPECS
from weightlift.benchmark.report import format_table, plot
from weightlift.benchmark.stats import paired_ratio, summarize
from weightlift.benchmark.synthetic import GIB, MIB, ensure_demo_checkpoint, llama_for_size, write_checkpoint
from weightlift.disk import residency, source
from weightlift.errors import OptionError, WeightliftError

__all__ = [
    "SCHEMA",
    "Arm",
    "ArmFailed",
    "ArmSkipped",
    "Sample",
    "run_once",
    "run_arms",
    "child_argv",
    "evict_files",
    "max_resident",
    "bench_dir",
    "make_checkpoint",
    "synthetic_checkpoint",
    "describe_checkpoint",
    "build_arms",
    "run_benchmark",
    "LOCAL_ARMS",
    "REMOTE_ARMS",
    "QUICK_ARMS",
]

SCHEMA = "weightlift-bench/1"

LOCAL_ARMS = (
    "safetensors.numpy",
    "safetensors.torch",
    "safetensors.cuda",
    "torch.load",
    "runai",
    "fastsafetensors",
    "tensorizer",
    "instanttensor",
    "wl.numpy",
    "wl.numpy.nocopy",
    "wl.torch",
    "wl.cuda",
    "limit.copy",
    "limit.copy.huge",
)
REMOTE_ARMS = (
    "wl.push",
    "wl.push.legacy",
    "wl.push.cached",
    "wl.push.update",
    "wl.push.reserved",
    "wl.push.second",
    "wl.split",
    "limit.tcp",
    "limit.tcp.fresh",
    "limit.fault",
)
QUICK_ARMS = ("safetensors.numpy", "wl.numpy", "wl.numpy.nocopy", "wl.push", "limit.copy")
ARM_KINDS = ("local", "remote", "probe", "limit")  # what runs as an interleaved arm
SETTLE_S = 20.0  # pause before each run of a full benchmark: long enough that arm order does not change the medians
QUICK_SETTLE_S = 3.0  # --quick: short, and said to be short in its output

_ARMS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arms.py")
# Loads bench_arms.py by path, so peer arms never import the weightlift package.
BOOT = (
    "import time;_t0=time.perf_counter_ns();import sys,importlib.util as u;"
    "s=u.spec_from_file_location('wl_bench_arms',sys.argv[1]);m=u.module_from_spec(s);"
    "sys.modules[s.name]=m;s.loader.exec_module(m);m.main(_t0,sys.argv[2:])"
)


def child_argv(arm: str, opts: dict[str, Any]) -> list[str]:
    """The command line that runs arm body ``arm`` of :mod:`weightlift.benchmark.arms` in a child."""
    return [sys.executable, "-c", BOOT, _ARMS_FILE, arm, json.dumps(opts)]


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
    """The order of round ``rnd``: ``"shuffle"``: as given for round 0, a shuffle seeded by
    ``rnd`` after; ``"forward"`` / ``"reverse"``: as given / reversed in every round."""
    if order not in ("shuffle", "forward", "reverse"):
        raise OptionError(f"order must be 'shuffle', 'forward' or 'reverse', not {order!r}")
    out = list(items)
    if order == "reverse":
        out.reverse()
    elif order == "shuffle" and rnd:
        random.Random(rnd).shuffle(out)
    return out


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
    say = log or (lambda s: None)
    res: dict[str, dict[str, Any]] = {}
    for a in arms:
        res[a.name] = {
            "status": "skipped" if a.skip else "ok",
            "reason": a.skip,
            "kind": a.kind,
            "description": a.description,
            "times_s": [],
            "inner_s": [],
            "load_s": [],
            "resident_before": [],
            "bytes": None,
            "tensors": None,
            "profile": None,
            "server_profile": None,
        }
    order_log: list[dict[str, Any]] = []
    live = [a for a in arms if not a.skip]
    for rnd in range(warmup + runs):
        counted = rnd >= warmup
        for a in round_order(live, rnd, order):
            r = res[a.name]
            if r["status"] != "ok":
                if counted:
                    for k in ("times_s", "inner_s", "load_s"):
                        r[k].append(None)
                continue
            order_log.append({"round": rnd, "arm": a.name, "counted": counted})
            if settle > 0:
                time.sleep(settle)
            s = _one(a, a.argv, cold=cold, timeout=timeout, r=r)
            if s is not None:
                say(f"  {'run ' + str(rnd - warmup + 1) if counted else 'warm-up'} {a.name}: {s.window_s:.3f} s")
                r["bytes"], r["tensors"] = s.info.get("bytes"), s.info.get("tensors")
            if counted:
                r["times_s"].append(s.window_s if s else None)
                r["inner_s"].append(s.info.get("inner_s") if s else None)
                r["load_s"].append(s.info.get("load_s") if s else None)
                if s is not None and "first_s" in s.info:  # arms that time a first and a second push
                    r.setdefault("first_s", []).append(s.info["first_s"])
                if s is not None and "push" in s.info:  # what each push sent and found cached
                    r.setdefault("push", []).append(s.info["push"])
                if s is not None and s.resident_before is not None:
                    r["resident_before"].append(s.resident_before)
    if profile_round:
        for a in live:
            if a.profile_argv and res[a.name]["status"] == "ok":
                if settle > 0:
                    time.sleep(settle)
                s = _one(a, a.profile_argv, cold=cold, timeout=timeout, r=None)
                if s is not None:
                    res[a.name]["profile"] = s.info.get("profile")
                    res[a.name]["server_profile"] = s.info.get("server_profile")
    base = baseline if baseline in res and res[baseline]["status"] == "ok" else None
    if base is None:
        base = next((n for n, r in res.items() if r["status"] == "ok"), None)
    for r in res.values():
        r["summary"] = summarize(r["times_s"])
        r["inner"] = summarize(r["inner_s"])
        r["load"] = summarize(r["load_s"])
        ref = res[base] if base is not None and r["status"] == "ok" else None
        r["ratio"] = paired_ratio(r["times_s"], ref["times_s"]) if ref is not None else None
        r["load_ratio"] = paired_ratio(r["load_s"], ref["load_s"]) if ref is not None else None
        if r.get("first_s") and len(r["first_s"]) == len(r["load_s"]):
            r["first"] = summarize(r["first_s"])
            r["second_speedup"] = paired_ratio(r["first_s"], r["load_s"])  # first over second, per run
    residents = [x for r in res.values() for x in r["resident_before"]]
    return {
        "arms": res,
        "order": order_log,
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


def _one(a: Arm, argv: list[str], *, cold: bool, timeout: float, r: dict[str, Any] | None) -> Sample | None:
    resident = None
    if cold and a.files:
        evict_files(a.files)
        resident = max_resident(a.files)
    try:
        s = run_once(argv, env=a.env, timeout=timeout)
    except ArmSkipped as e:
        if r is not None:
            r["status"], r["reason"] = "skipped", str(e)
        return None
    except ArmFailed as e:
        if r is not None:
            r["status"], r["reason"] = "failed", str(e)
        return None
    s.resident_before = resident
    return s


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


def ensure_pt(ck: dict[str, Any], *, timeout: float = 1800.0) -> str:
    """A torch zip-file copy of the checkpoint for the torch.load arm, made once in a child."""
    stem = os.path.splitext(os.path.basename(ck["files"][0]))[0]
    st = os.stat(ck["files"][0])
    pt = os.path.join(bench_dir(), f"{stem}-{ck['file_bytes']}-{st.st_mtime_ns}.pt")
    if not os.path.exists(pt):
        run_once(child_argv("make-pt", {"files": ck["files"], "pt": pt}), timeout=timeout)
    return pt


def ensure_tensorizer(ck: dict[str, Any], *, timeout: float = 1800.0) -> str:
    """A tensorizer copy of the checkpoint for the tensorizer arm, made once in a child."""
    stem = os.path.splitext(os.path.basename(ck["files"][0]))[0]
    st = os.stat(ck["files"][0])
    tz = os.path.join(bench_dir(), f"{stem}-{ck['file_bytes']}-{st.st_mtime_ns}.tensors")
    if not os.path.exists(tz):
        run_once(child_argv("make-tensorizer", {"files": ck["files"], "tz": tz}), timeout=timeout)
    return tz


# -- which arms can run here -------------------------------------------------------------------

_cuda_memo: list[str | None] = []


def cuda_reason() -> str | None:
    """None when a CUDA device is usable from torch; otherwise why not."""
    if _cuda_memo:
        return _cuda_memo[0]
    reason: str | None
    import glob

    # a cheap negative first: no driver node, no driver proc entry, no nvidia-smi (ROCm: /dev/kfd)
    if not (
        glob.glob("/dev/nvidia*")
        or os.path.exists("/proc/driver/nvidia")
        or os.path.exists("/dev/kfd")
        or shutil.which("nvidia-smi")
    ):
        reason = "no CUDA device (no NVIDIA driver on this machine)"
    elif _missing("torch"):
        reason = "torch is not installed"
    else:
        probe = "import torch,sys;sys.exit(0 if torch.cuda.is_available() else 3)"
        rc = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=300).returncode
        reason = None if rc == 0 else "torch sees no CUDA device (CPU build of torch, or no GPU)"
    _cuda_memo.append(reason)
    return reason


def _missing(module: str) -> str | None:
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    if module.startswith("weightlift."):
        return f"{module} is not in this build of weightlift"
    return f"module {module} is not installed"


def _weightlift_reason(name: str) -> str | None:
    """Why one of weightlift's own arms cannot run with the installed weightlift, if it cannot."""
    import inspect

    try:
        from weightlift.api import load
    except ImportError as e:
        return f"weightlift.api does not import: {e}"
    params = inspect.signature(load).parameters
    if name == "wl.split" and "remote" not in params:
        return "weightlift.load has no remote= option in this build"
    if name.startswith("wl.push") or name == "wl.split":
        try:
            from weightlift.remote.client import Client  # noqa: F401
            from weightlift.remote.server import Server  # noqa: F401
        except ImportError as e:
            return f"weightlift's server/client do not import: {e}"
    return None


def arm_reason(name: str, ck: dict[str, Any]) -> str | None:
    """None if arm ``name`` can run on checkpoint ``ck`` here; otherwise the reason it cannot."""
    spec = SPECS[name]
    if spec.safetensors_only and ck["format"] != "safetensors":
        return f"reads safetensors files only; this checkpoint is {ck['format']}"
    for mod in spec.requires:
        r = _missing(mod)
        if r:
            return r
    if spec.cuda:
        r = cuda_reason()
        if r:
            return r
    if spec.weightlift:
        return _weightlift_reason(name)
    return None


def expand_arm_names(text: str | Sequence[str] | None, *, quick: bool = False) -> list[str]:
    """Arm names from a comma list; "local", "remote" and "all" name groups."""
    if text is None:
        return list(QUICK_ARMS if quick else LOCAL_ARMS + REMOTE_ARMS)
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[str] = []
    groups = {"local": LOCAL_ARMS, "remote": REMOTE_ARMS, "all": LOCAL_ARMS + REMOTE_ARMS}
    for item in (i.strip() for i in items):
        if not item:
            continue
        names = groups.get(item, (item,))
        for n in names:
            if n not in SPECS or SPECS[n].kind not in ARM_KINDS:
                known = ", ".join(n for n, s in SPECS.items() if s.kind in ARM_KINDS)
                raise OptionError(f"unknown arm {n!r}; known arms: {known} (groups: local, remote, all)")
            if n not in out:
                out.append(n)
    return out


def build_arms(ck: dict[str, Any], names: Sequence[str], *, cache_dir: str | None = None) -> list[Arm]:
    """Arms for ``names`` on checkpoint ``ck`` (from :func:`describe_checkpoint`), skips decided."""
    arms = []
    for name in names:
        spec = SPECS[name]
        reason = arm_reason(name, ck)
        opts: dict[str, Any] = {"path": ck["path"], "files": ck["files"]}
        files: tuple[str, ...] = tuple(ck["files"])
        if spec.uses_pt and reason is None:
            try:
                opts["pt"] = ensure_pt(ck)
                files = (opts["pt"],)
            except WeightliftError as e:
                reason = f"could not write the .pt copy: {e}"
        if spec.uses_tensorizer and reason is None:
            try:
                opts["tz"] = ensure_tensorizer(ck)
                files = (opts["tz"],)
            except WeightliftError as e:
                reason = f"could not write the tensorizer copy: {e}"
        if name == "wl.push.cached":
            opts["cache_dir"] = cache_dir or os.path.join(bench_dir(), "server-cache")
            files += (opts["cache_dir"],)
        if name == "wl.push.second":
            opts["cache_root"] = bench_dir()  # a fresh cache folder per run is made under it
        if name == "wl.split":
            # through a file: a long name list would not fit in one command-line argument
            split = os.path.join(bench_dir(), "split-names.json")
            with open(split, "w", encoding="utf-8") as f:
                json.dump(ck["names"][len(ck["names"]) // 2 :], f)
            opts["split_file"] = split
        arms.append(
            Arm(
                name,
                child_argv(name, opts),
                env=dict(spec.env),
                files=files,
                skip=reason,
                description=spec.description,
                kind=spec.kind,
                profile_argv=child_argv(name, {**opts, "profile": True}) if spec.weightlift else None,
            )
        )
    return arms


# -- baselines ---------------------------------------------------------------------------------


def _warm(path: str) -> None:
    buf = bytearray(bench_arms.BLOCK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def run_baselines(
    ck: dict[str, Any],
    names: Sequence[str],
    *,
    cold: bool = False,
    repeats: int = 3,
    timeout: float = 600.0,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure each baseline in its own child, on the checkpoint's largest file."""
    say = log or (lambda s: None)
    target = max(ck["files"], key=os.path.getsize)
    out: dict[str, Any] = {"file": target}
    for name in names:
        spec = SPECS[name]
        reason = next((r for r in (_missing(m) for m in spec.requires) if r), None)
        if reason is None and spec.cuda:
            reason = cuda_reason()
        if reason:
            out[name] = {"status": "skipped", "reason": reason}
            continue
        if name != "base.read" or not cold:
            _warm(target)  # memory and socket limits, measured without the disk
        try:
            s = run_once(child_argv(name, {"files": [target], "repeats": repeats, "cold": cold}), timeout=timeout)
            out[name] = {"status": "ok", "description": spec.description, **s.info}
            say(f"  baseline {name}: {s.info.get('gbps', 0):.2f} GB/s")
        except ArmSkipped as e:
            out[name] = {"status": "skipped", "reason": str(e)}
        except ArmFailed as e:
            out[name] = {"status": "failed", "reason": str(e)}
    return out


# -- the whole benchmark -----------------------------------------------------------------------


def run_benchmark(
    path: str | None = None,
    *,
    arms: str | Sequence[str] | None = None,
    quick: bool = False,
    cold: bool = False,
    runs: int | None = None,
    warmup: int = 1,
    baseline: str | None = None,
    size: int | None = None,
    baselines: Sequence[str] | None = None,
    timeout: float = 600.0,
    profile_round: bool = True,
    settle: float | None = None,
    json_path: str | None = None,
    png_path: str | None = None,
    order: str = "shuffle",
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Baselines, then the arms interleaved; returns the result dict and writes JSON / PNG if asked."""
    say = log or (lambda s: None)
    started = time.time()
    ensure_bytecode()
    names = expand_arm_names(arms, quick=quick)
    if cold and arms is None:
        # a copy limit of a cold file measures the disk; the read limits are the cold ceiling
        names = [n for n in names if not n.startswith("limit.copy")] + [
            f"limit.read.{k}" for k in bench_arms.READ_LIMIT_THREADS
        ]
    if path is None:
        path = default_checkpoint(quick=quick, size=size)
    ck = describe_checkpoint(path)
    runs = runs or (3 if quick else 5)
    cache_dir = os.path.join(bench_dir(), "server-cache")
    shutil.rmtree(cache_dir, ignore_errors=True)  # the warm-up push fills it; counted pushes hit it
    say(f"checkpoint {ck['path']}: {ck['tensors']} tensors, {ck['bytes'] / GIB:.2f} GiB ({ck['format']})")
    arm_list = build_arms(ck, names, cache_dir=cache_dir)
    base_names = list(BASELINES if baselines is None else baselines)
    bl = run_baselines(ck, base_names, cold=cold, repeats=2 if quick else 3, timeout=timeout, log=say)
    if baseline is None:
        baseline = "safetensors.numpy" if "safetensors.numpy" in names else None
    say(f"arms ({'cold' if cold else 'warm'}, 1 warm-up + {runs} runs, interleaved): {', '.join(names)}")
    if settle is None:
        settle = QUICK_SETTLE_S if quick else SETTLE_S
    result = run_arms(
        arm_list,
        runs=runs,
        warmup=warmup,
        cold=cold,
        baseline=baseline,
        timeout=timeout,
        profile_round=profile_round,
        settle=settle,
        order=order,
        log=say,
    )
    _derive(result, ck, bl)
    result.update(
        {
            "schema": SCHEMA,
            "checkpoint": {k: v for k, v in ck.items() if k != "names"},
            "baselines": bl,
            "quick": quick,
            # every other arm, with the reason it could not run here (None: it could)
            "not_selected": {
                n: arm_reason(n, ck) for n, s in SPECS.items() if s.kind in ("local", "remote") and n not in names
            },
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
                "cuda": cuda_reason() or "available",
            },
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "elapsed_s": time.time() - started,
        }
    )
    result["notes"] = _notes(result)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    if png_path:
        result["png"] = plot(result, png_path)
    return result


def _derive(result: dict[str, Any], ck: dict[str, Any], bl: dict[str, Any]) -> None:
    """GB/s per arm from the checkpoint bytes, and the share of the matching limit."""
    limits = {
        "local": bl.get("base.copy", {}).get("fresh", {}).get("gbps"),
        "remote": bl.get("base.tcp", {}).get("gbps"),
    }
    # a limit measured as an arm (fresh process, same pauses, median of the same rounds) is the
    # one the arms are held to; the in-process baselines (best of three repeats) otherwise
    # the raw read into reused buffers; limit.read.fresh.* (into fresh memory) is reported beside it
    reads = [n for n in result["arms"] if n.startswith("limit.read.") and not n.startswith("limit.read.fresh.")]
    copies = ["limit.copy", "limit.copy.huge"]  # the copy floor: the faster page size
    for kind, cands, fallback in (("local", reads or copies, "base.copy"), ("remote", ["limit.tcp"], "base.tcp")):
        ok = [
            (result["arms"][n]["load"]["median"], n)
            for n in cands
            if n in result["arms"] and result["arms"][n]["status"] == "ok" and result["arms"][n]["load"]["median"]
        ]
        if ok:
            best, name = min(ok)  # the fastest reader count or page size
            limits[kind] = ck["bytes"] / best / 1e9
            result[f"{kind}_limit"] = name
        else:
            result[f"{kind}_limit"] = fallback
    for r in result["arms"].values():
        med, load = r["summary"]["median"], r["load"]["median"]
        r["gbps"] = ck["bytes"] / med / 1e9 if med else None
        r["load_gbps"] = ck["bytes"] / load / 1e9 if load else None
        lim = limits.get(r["kind"])
        r["limit_share"] = r["load_gbps"] / lim if r["load_gbps"] and lim else None
        r["bytes_match"] = None if r["bytes"] is None else r["bytes"] == ck["bytes"]


def _notes(result: dict[str, Any]) -> list[str]:
    notes = []
    cc = result.get("cold_check")
    if cc is not None:
        worst = cc["max_resident_before"]
        if worst is None:
            notes.append("cold: no run was checked")
        elif worst <= 0.001:
            notes.append(
                f"cold: evicted, {100 * worst:.1f} % resident before each run "
                f"({cc['runs_checked']} counted runs checked with mincore)"
            )
        else:
            notes.append(
                f"cold: eviction incomplete, up to {100 * worst:.1f} % resident before a run "
                "(this filesystem may keep pages, e.g. tmpfs)"
            )
    else:
        notes.append("warm: the page cache is left as it is (the warm-up round fills it)")
    for name, r in result["arms"].items():
        if r["status"] == "ok" and r["bytes_match"] is False and r["kind"] != "limit":  # a limit copies the file
            notes.append(f"{name} reported {r['bytes']} bytes; the checkpoint holds {result['checkpoint']['bytes']}")
    return notes


# -- command line ------------------------------------------------------------------------------


def add_arguments(
    p: Any,
    *,
    default_arms: str | None = None,
    quick_arms: str | None = None,
    default_baseline: str | None = None,
    default_size_gib: float | None = None,
) -> None:
    """The options shared by ``weightlift bench`` and the bench/ scripts.

    ``quick_arms`` replaces ``default_arms`` under ``--quick`` unless ``--arms`` was given.
    """
    p.set_defaults(arms_default=default_arms, quick_arms=quick_arms)
    p.add_argument("path", nargs="?", help="checkpoint (default: the demo checkpoint, or a synthetic one)")
    p.add_argument("--quick", action="store_true", help="256 MiB synthetic checkpoint, 3 runs, fewer arms")
    p.add_argument("--cold", action="store_true", help="evict the files before every run and check with mincore")
    p.add_argument("--runs", type=int, help="counted runs per arm (default 5; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted rounds first (default 1)")
    p.add_argument(
        "--arms", default=default_arms, help="comma list of arms, or the groups local, remote, all (see --list)"
    )
    p.add_argument("--baseline", default=default_baseline, help="arm the ratios are taken against")
    p.add_argument(
        "--size-gib",
        type=float,
        help="size of the synthetic checkpoint when no PATH is given"
        + (f" (default {default_size_gib:g}; 0.25 with --quick)" if default_size_gib else ""),
    )
    p.set_defaults(size_gib_default=default_size_gib)
    p.add_argument("--no-baselines", action="store_true", help="skip the copy/read/TCP/H2D baselines")
    p.add_argument("--no-profile", action="store_true", help="skip the extra profiled round of weightlift arms")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    p.add_argument(
        "--settle",
        type=float,
        metavar="SECONDS",
        help=f"pause before every run, so no arm inherits memory the one before it freed "
        f"(default {SETTLE_S:g}; {QUICK_SETTLE_S:g} with --quick)",
    )
    p.add_argument(
        "--order",
        choices=("shuffle", "forward", "reverse"),
        default="shuffle",
        help="arm order per round: a seeded shuffle (default), or as given / reversed in every "
        "round (run both to check that the pause is long enough: same medians either way)",
    )
    p.add_argument(
        "--calibrate-memory",
        action="store_true",
        help="time the ways of filling fresh memory on this machine, in fresh processes, and "
        "remember the fastest for weightlift's loads and servers (weightlift.memory.fresh)",
    )
    p.add_argument("--json", metavar="FILE", help="write the full result as JSON")
    p.add_argument("--png", metavar="FILE", help="draw time to ready and weightlift's phases (matplotlib)")
    p.add_argument("--list", action="store_true", help="list the arms and baselines, then exit")


def command(args: Any) -> int:
    """Run the benchmark for parsed arguments; prints the table. 0 if any arm ran."""
    if args.list:
        for name, spec in SPECS.items():
            print(f"{name:<18} {spec.kind:<9} {spec.description}")
        return 0
    if getattr(args, "calibrate_memory", False):
        return _calibrate_command(args)
    gib = args.size_gib or (None if args.quick else getattr(args, "size_gib_default", None))
    size = int(gib * GIB) if gib else None
    arms = args.arms
    if args.quick and arms == getattr(args, "arms_default", None) and getattr(args, "quick_arms", None):
        arms = args.quick_arms
    result = run_benchmark(
        args.path,
        arms=arms,
        quick=args.quick,
        cold=args.cold,
        runs=args.runs,
        warmup=args.warmup,
        baseline=args.baseline,
        size=size,
        baselines=() if args.no_baselines else None,
        timeout=args.timeout,
        profile_round=not args.no_profile,
        settle=args.settle,
        json_path=args.json,
        png_path=args.png,
        order=args.order,
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    print(format_table(result))
    if args.json:
        print(f"wrote {args.json}")
    if args.png:
        print(f"wrote {args.png}" if result.get("png") else "no PNG: matplotlib is not installed")
    return 0 if any(r["status"] == "ok" for r in result["arms"].values()) else 1


def _calibrate_command(args: Any) -> int:
    from weightlift.memory import fresh

    size = int(args.size_gib * GIB) if args.size_gib else 512 * MIB
    pause = QUICK_SETTLE_S if args.quick and args.settle is None else (SETTLE_S if args.settle is None else args.settle)
    rounds = args.runs or (1 if args.quick else 3)
    print(
        f"filling {size / MIB:.0f} MiB of fresh memory {len(fresh.TRIALS)} ways, {rounds} round(s), "
        f"{pause:g} s pause before each, fresh process each",
        file=sys.stderr,
        flush=True,
    )
    res = fresh.calibrate(size, rounds=rounds, pause=pause, log=lambda s: print(s, file=sys.stderr, flush=True))
    for name, v in sorted(res["medians_s"].items(), key=lambda kv: kv[1]):
        print(f"{name:<20} {v:.3f} s  {size / v / 1e9:.2f} GB/s")
    pol = res["policy"]
    print(
        f"chosen: {'huge' if pol['huge'] else '4 KiB'} pages, kernel copies "
        f"{'faulted ahead (' + pol['method'] + ')' if pol['ahead'] else 'fault their own pages'}, "
        f"fault method {pol['method']}; remembered in {fresh.memory_file()}"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0
