"""The built-in default: a synthetic checkpoint shaped like a small LLM, loaded and checked.

``weightlift demo`` makes the checkpoint once (about 1 GiB, in the cache folder), then loads it
with weightlift and with ``safetensors`` in the same run, interleaved, checks every byte of
weightlift's result against digests recorded when the file was written, prints both times to
ready and weightlift's own phase breakdown, and, where the remote half is available, pushes the
checkpoint to a tensor server on loopback and checks what arrived. Where transformers is
installed it ends with ``weightlift check`` on a tiny random Llama (written once beside the
checkpoint by transformers' ``save_pretrained``): weightlift's model against transformers' own,
from disk and through the loopback server.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weightlift.benchmark.synthetic import demo_dir, demo_tensors, ensure_demo_checkpoint
from weightlift.errors import IntegrityError, install_hint
from weightlift.progress import terminal

__all__ = ["demo_dir", "ensure_demo_checkpoint", "ensure_tiny_model", "demo_tensors", "run_demo"]

TINY_NAME = "demo-tiny-llama"


def verify(tensors: dict[str, Any], digests: dict[str, str]) -> int:
    """BLAKE3 of every loaded tensor against the recorded digest; returns bytes checked."""
    from weightlift.digest.blake import hash_buffer
    from weightlift.memory.targets import as_bytes

    checked = 0
    missing = set(digests) - set(tensors)
    if missing:
        raise IntegrityError(f"demo: tensors missing from the load: {sorted(missing)[:3]}")
    for name, arr in tensors.items():
        raw = as_bytes(arr.cpu() if hasattr(arr, "cpu") else arr)
        if hash_buffer(raw).hex() != digests[name]:
            raise IntegrityError(f"demo: tensor {name!r} differs from what was written")
        checked += raw.size
    return checked


def run_demo(*, rounds: int = 3, push: bool = True, layers: int = 8, progress: bool = False) -> dict[str, Any]:
    """Load the demo checkpoint with weightlift and safetensors, interleaved; print and return
    figures. ``progress``: a line on the terminal (only where stderr is one) while the checkpoint
    is first written."""
    from weightlift.api import load
    from weightlift.profile import Profiler

    path = ensure_demo_checkpoint(layers=layers, progress=terminal("writing the demo checkpoint", enabled=progress))
    digests = json.loads((path.parent / "digests.json").read_text())
    size = path.stat().st_size
    st_load: Callable[..., dict[str, Any]] | None
    try:
        from safetensors.numpy import load_file as st_load
    except ImportError:
        st_load = None
    times: dict[str, list[float]] = {"weightlift": [], "safetensors": []}
    out: dict[str, Any] = {"checkpoint": str(path), "bytes": size}
    report: dict[str, Any] = {}
    for r in range(rounds):
        t0 = time.perf_counter()
        got = load(path, progress=False)
        times["weightlift"].append(time.perf_counter() - t0)
        if r == 0:
            out["bytes_verified"] = verify(got, digests)
        del got
        if st_load is not None:
            t0 = time.perf_counter()
            st_load(str(path))  # the dict is dropped at once, as weightlift's is after timing
            times["safetensors"].append(time.perf_counter() - t0)
    prof = Profiler(enabled=True)
    got = load(path, progress=False, profile=prof, report=report)
    del got
    med = {k: statistics.median(v) for k, v in times.items() if v}
    out["median_s"] = med
    out["profile"] = prof.report()
    print(f"checkpoint  {path}  ({size / 2**30:.2f} GiB, {len(digests)} tensors)")
    print(f"verified    {out['bytes_verified']:,} bytes: every tensor's BLAKE3 matches what was written")
    print(
        f"page cache  {report.get('resident_before', 0) * 100:.0f} % resident when this process first probed it"
        " (the probe runs once per file per process)"
    )
    print(f"time to ready, median of {rounds} interleaved runs (host memory, owned copies):")
    for k, v in med.items():
        print(f"  {k:<12} {v:7.3f} s   {size / v / 1e9:6.2f} GB/s")
    if "safetensors" in med and med["weightlift"] > 0:
        print(f"  speed-up over safetensors: {med['safetensors'] / med['weightlift']:.2f}x")
    elif st_load is None:
        print(f"  safetensors: not installed ({install_hint('bench')}, or pip install safetensors), skipped")
    print("weightlift's load, by phase (profiler):")
    print(prof.format())
    if push:
        out["push"] = _demo_push(path, digests)
    out["check"] = _demo_check(push=push)
    return out


def _demo_push(path: Path, digests: dict[str, str]) -> dict[str, Any] | None:
    try:
        from weightlift.remote.client.client import Client
        from weightlift.remote.server.server import Server
    except ImportError as e:
        print(f"remote push: not available ({e})")
        return None
    with Server(port=0) as srv:
        host, port = srv.start()
        with Client(f"{host}:{port}") as c:
            res = c.push(path)
        got = srv.tensors()
        checked = verify(got, digests)
    secs = getattr(res, "seconds", 0.0) or 0.0
    nbytes = getattr(res, "bytes", checked)
    print(
        f"remote push to a server on {host}:{port}: {nbytes / 2**30:.2f} GiB in {secs:.3f} s"
        f" ({nbytes / secs / 1e9 if secs else 0:.2f} GB/s), {checked:,} bytes verified on the server"
    )
    return {"seconds": secs, "bytes": nbytes, "verified": checked}


def ensure_tiny_model() -> Path:
    """A tiny random Llama folder as transformers' ``save_pretrained`` writes it, made once."""
    import torch
    import transformers

    d = demo_dir().parent / TINY_NAME
    if (d / "config.json").exists():
        return d
    print(f"writing the tiny model for the check (once): {d}")
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.3,
    )
    tmp = d.with_name(f"{TINY_NAME}.{os.getpid()}.tmp")
    with torch.random.fork_rng(devices=[]):  # a fixed model without touching the caller's RNG
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(tmp, max_shard_size="200KB")
    os.replace(tmp, d)
    # its manifest published while the files are as written, so the check has something
    # independent of the files to compare with
    from weightlift.digest.published import default_manifest_path, make_manifest
    from weightlift.digest.sidecar import write_atomic

    write_atomic(default_manifest_path(d), make_manifest(d).to_json().encode())
    return d


def _demo_check(*, push: bool) -> dict[str, Any] | None:
    """``weightlift check`` on the tiny model, from disk and, with ``push``, through a loopback server."""
    from weightlift.errors import WeightliftError

    try:
        from weightlift.hf import require_transformers

        require_transformers()
    except WeightliftError as e:
        print(f"model check: skipped ({e})")
        return None
    from weightlift.check import format_result, run_check

    folder = ensure_tiny_model()
    results = {"disk": run_check(str(folder))}
    print(format_result(results["disk"]))
    if push:
        from weightlift.remote.client.client import Client
        from weightlift.remote.server.server import Server

        with Server(port=0) as srv:
            host, port = srv.start()
            with Client(f"{host}:{port}") as c:
                c.push(folder)
            results["server"] = run_check(str(folder), source=f"{host}:{port}")
        print(format_result(results["server"]))
    failed = [k for k, r in results.items() if not r["ok"]]
    if failed:
        raise IntegrityError(f"demo: the model check failed ({', '.join(failed)})")
    return results
