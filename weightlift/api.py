"""The public verb: ``weightlift.load`` picks the local loader, a split load or a distributed load.

Each kind of load lives in its own layer (:mod:`weightlift.local`, :mod:`weightlift.split`,
:mod:`weightlift.distributed`); this module only reads the options that say which one a call is
and hands the rest over, so the local loader never learns about the remote options.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from weightlift.checkpoint import Checkpoint, Select, open_checkpoint
from weightlift.errors import OptionError
from weightlift.local.loader import Prefetch, load_local, prefetch
from weightlift.split import split_load

__all__ = ["load", "prefetch", "Prefetch"]


def load(
    path: str | os.PathLike[str] | Checkpoint,
    *,
    device: str = "cpu",
    framework: str = "numpy",
    select: Select = None,
    dtype: Any = None,
    copy: bool = True,
    page_cache: str | None = None,
    warm: bool | None = None,
    threads: int | None = None,
    engine: str = "auto",
    dequantize: bool = False,
    profile: Any = None,
    progress: bool | None = None,
    report: dict[str, Any] | None = None,
    remote: Mapping[str, Select] | None = None,
    token: str | bytes | None = None,
    streams: int = 1,
    shard: Any = None,
    group: Any = None,
    verify: bool = False,
    manifest: Any = None,
) -> dict[str, Any]:
    """Load tensors from a checkpoint into memory; returns ``{name: array}`` in file order.

    ``path`` is a .safetensors file, a shard index, a .gguf file, or a folder holding one.
    ``device`` is "cpu" or "cuda[:N]" (CUDA needs ``framework="torch"``). ``select`` is a glob,
    a list of globs, ``"re:<regex>"`` or a compiled regex. ``dtype`` (a name like "F16", a numpy
    or a torch dtype) casts floating-point tensors on load. ``copy=False`` (host only) returns
    read-only arrays backed by the file's mapping; the selected bytes of a cold file are first
    read into the page cache by parallel readers, so the views are ready without further I/O
    (``warm=False``: bare lazy views). ``page_cache`` is "keep" or "evict" (default:
    keep, evict on unified-memory devices; WEIGHTLIFT_PAGE_EVICTION overrides the default).
    ``warm`` forces the read-ahead warmer on or off (default: on when under 90 % of a file is
    resident). ``engine`` is "auto" (``preadv`` straight into the destination, with as many
    readers for a cold file as its device is known to like; a file truncated under the load is
    a FileError), or "mmap" (a copy out of the mapping) or "pread" to force one path. GGUF quantized tensors come
    back as their raw blocks (uint8) unless ``dequantize=True``. ``profile`` is True, False,
    None (env WEIGHTLIFT_LOADPROF) or a :class:`~weightlift.profile.Profiler`. ``report``, if
    given, is filled with the load's figures (bytes, seconds, residency, profile).

    ``remote`` makes it a split load: ``{"host:port": select}`` pushes those tensors to each
    tensor server (with ``token`` and ``streams``) while the rest load here, at the same time;
    the result holds the local tensors and ``report["remote"]`` what each push did.

    ``verify=True`` hashes (BLAKE3) the bytes that landed in the destination, as they land, on
    the threads that copied them, and compares each tensor with ``manifest`` (a published
    manifest's path, see :mod:`weightlift.digest.published`) or, without one, with the digests of the
    file's own bytes (from the sidecar beside it, hashed once when it has none). A CUDA load
    hashes the host-side staging bytes it copies to the device; a dtype cast, the bytes it read.
    A mismatch raises IntegrityError naming the tensors, and nothing is returned.
    """
    local: dict[str, Any] = dict(
        device=device, framework=framework, dtype=dtype, copy=copy, page_cache=page_cache, warm=warm,
        threads=threads, engine=engine, dequantize=dequantize, profile=profile, progress=progress, report=report,
    )  # fmt: skip
    if manifest is not None and not verify:
        raise OptionError("manifest= is only used with verify=True")
    if verify and (shard is not None or group is not None or remote):
        raise OptionError("verify=True is for local loads (not with remote, shard or group)")
    if verify:
        return _verified_load(path, select, manifest, local)
    if shard is not None or group is not None:  # a rank's slices, or one read shared by a process group
        from weightlift.distributed import distributed_load

        return distributed_load(
            path,
            shard=shard,
            group=group,
            device=device,
            framework=framework,
            select=select,
            copy=copy,
            engine=engine,
            report=report,
            unsupported={"dtype": dtype, "dequantize": dequantize, "remote": remote, "profile": profile},
        )
    if remote:
        res = split_load(path, remote, select=select, token=token, streams=streams, **local)
        if report is not None:
            report["remote"] = res.remote
            report["seconds"] = res.seconds
        return res.local
    return load_local(path, select=select, **local)


def _verified_load(path: Any, select: Select, manifest: Any, local: dict[str, Any]) -> dict[str, Any]:
    from weightlift.digest.landed import LandedHasher
    from weightlift.digest.published import expected_digests

    ck = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    infos = ck.select(select)
    hasher = LandedHasher(infos, expected_digests(infos, manifest))
    out = load_local(ck, select=select, on_landed=hasher.landed, **local)
    try:
        hasher.check()
    except BaseException:
        out.clear()
        raise
    if local.get("report") is not None:
        local["report"]["verified"] = len(infos)
    return out
