"""The research bench's arm table: weightlift's package arms plus the peer loaders and variants.

``weightlift bench`` runs the package's table (weightlift, safetensors and the floors, see
:mod:`weightlift.benchmark.suite`); the scripts here run this one, which adds the peers
(``torch.load``, runai-model-streamer, fastsafetensors, tensorizer, InstantTensor), weightlift's
variants (the legacy push, a caching server, weight updates, split loads, verification, the
MAC and TLS) and the research floors (fault-in, raw read and TCP into fresh memory), whose
bodies live in :mod:`peer_arms`. The functions below are the package's, bound to this table.

    from suite import run_benchmark, command, add_arguments   # with bench/ on sys.path
"""

from __future__ import annotations

import compileall
import functools
import json
import os
import shutil
from typing import Any

import peer_arms

from weightlift.benchmark import suite as package
from weightlift.benchmark.command import add_arguments
from weightlift.benchmark.command import command as _command
from weightlift.benchmark.harness import ARM_FILES, bench_dir, child_argv, run_once
from weightlift.errors import WeightliftError

__all__ = [
    "TABLE",
    "LOCAL_ARMS",
    "REMOTE_ARMS",
    "QUICK_ARMS",
    "add_arguments",
    "command",
    "run_benchmark",
    "build_arms",
    "expand_arm_names",
    "arm_reason",
    "run_baselines",
    "ensure_pt",
    "ensure_tensorizer",
]

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
QUICK_ARMS = package.QUICK_ARMS
FILES = (*ARM_FILES, os.path.abspath(peer_arms.__file__))


def _server_cache() -> str:
    return os.path.join(bench_dir(), "server-cache")


def _copy_path(ck: dict[str, Any], suffix: str) -> str:
    stem = os.path.splitext(os.path.basename(ck["files"][0]))[0]
    st = os.stat(ck["files"][0])
    return os.path.join(bench_dir(), f"{stem}-{ck['file_bytes']}-{st.st_mtime_ns}{suffix}")


def ensure_pt(ck: dict[str, Any], *, timeout: float = 1800.0) -> str:
    """A torch zip-file copy of the checkpoint for the torch.load arm, made once in a child."""
    pt = _copy_path(ck, ".pt")
    if not os.path.exists(pt):
        run_once(child_argv("make-pt", {"files": ck["files"], "pt": pt}, FILES), timeout=timeout)
    return pt


def ensure_tensorizer(ck: dict[str, Any], *, timeout: float = 1800.0) -> str:
    """A tensorizer copy of the checkpoint for the tensorizer arm, made once in a child."""
    tz = _copy_path(ck, ".tensors")
    if not os.path.exists(tz):
        run_once(child_argv("make-tensorizer", {"files": ck["files"], "tz": tz}, FILES), timeout=timeout)
    return tz


def _prepare(name: str, ck: dict[str, Any], opts: dict[str, Any]) -> tuple[tuple[str, ...] | None, str | None]:
    """What the research arms need beyond the checkpoint: a converted copy, a cache, a name list."""
    spec = TABLE.specs[name]
    files: tuple[str, ...] | None = None
    try:
        if spec.uses_pt:
            opts["pt"] = ensure_pt(ck)
            files = (opts["pt"],)
        if spec.uses_tensorizer:
            opts["tz"] = ensure_tensorizer(ck)
            files = (opts["tz"],)
    except WeightliftError as e:
        return None, f"could not write the {'.pt' if spec.uses_pt else 'tensorizer'} copy: {e}"
    if name == "wl.push.cached":
        opts["cache_dir"] = _server_cache()
        files = (*ck["files"], opts["cache_dir"])
    if name == "wl.push.second":
        opts["cache_root"] = bench_dir()  # a fresh cache folder per run is made under it
    if name == "wl.split":
        # through a file: a long name list would not fit in one command-line argument
        split = os.path.join(bench_dir(), "split-names.json")
        with open(split, "w", encoding="utf-8") as f:
            json.dump(ck["names"][len(ck["names"]) // 2 :], f)
        opts["split_file"] = split
    return files, None


def _before() -> None:
    shutil.rmtree(_server_cache(), ignore_errors=True)  # the warm-up push fills it; counted pushes hit it
    # every child loads this arm file too: compiled once here, as the package's are, not in each window
    compileall.compile_file(peer_arms.__file__, quiet=2)


TABLE = package.ArmTable(
    specs={**package.PACKAGE.specs, **peer_arms.SPECS},
    files=FILES,
    local=LOCAL_ARMS,
    remote=REMOTE_ARMS,
    quick=QUICK_ARMS,
    prepare=_prepare,
    before=_before,
)

run_benchmark = functools.partial(package.run_benchmark, table=TABLE)
build_arms = functools.partial(package.build_arms, table=TABLE)
expand_arm_names = functools.partial(package.expand_arm_names, table=TABLE)
arm_reason = functools.partial(package.arm_reason, table=TABLE)
run_baselines = functools.partial(package.run_baselines, table=TABLE)
command = functools.partial(_command, table=TABLE)
