"""The public verb: ``weightlift.load`` picks the kind of load from a table and runs it.

``load`` turns its keywords into one :class:`~weightlift.options.LoadOptions` (every value
checked once) and asks :data:`KINDS`, in order, which kind of load the call is: a distributed
load (``shard=`` or ``group=``), a split load (``remote=``), a verified load (``verify=True``) or
a plain local one. Each kind declares the options it supports and those it accepts without using
(tuning it does without); any other option that is set is refused, naming the option and what it
is for, by one check (:func:`kind_for`). Each kind lives in its own layer
(:mod:`weightlift.local`, :mod:`weightlift.split`, :mod:`weightlift.distributed`), so the local
loader never learns about the remote options.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict, cast, overload

from weightlift.checkpoint import Checkpoint, open_checkpoint
from weightlift.errors import OptionError
from weightlift.local.loader import Prefetch, load_local, prefetch
from weightlift.options import (
    Array,
    DTypeLike,
    Group,
    LoadOptions,
    ProfileLike,
    Select,
    check_keywords,
    keyword_signature,
)
from weightlift.split import split_load

if TYPE_CHECKING:
    import numpy as np
    import torch
    from numpy.typing import NDArray
    from typing_extensions import Unpack  # typing's own from Python 3.11; only a checker reads it

    from weightlift.digest.published import Manifest
    from weightlift.distributed.shard import Shard

_log = logging.getLogger("weightlift")

__all__ = ["load", "LoadKw", "prefetch", "Prefetch", "LoadKind", "KINDS", "kind_for", "run_load"]

Path = str | os.PathLike[str] | Checkpoint


@dataclass(frozen=True)
class LoadKind:
    """One kind of load: how a call asks for it, what it supports, and the function that runs it."""

    name: str
    #: the options that ask for this kind, as an error message names them ("" for the plain load)
    chosen_by: str
    #: whether a call is of this kind (the first kind in :data:`KINDS` that says so runs it)
    wants: Callable[[LoadOptions], bool]
    #: the options that take effect in this kind
    supports: frozenset[str]
    #: options accepted and not used: tuning this kind does without, or a split load's link
    #: settings; accepted as they always were, so that callers passing them everywhere keep working
    ignores: frozenset[str]
    run: Callable[[Path, LoadOptions], dict[str, Any]]

    def refused(self, opts: LoadOptions) -> list[str]:
        """The options set in ``opts`` that this kind neither supports nor ignores."""
        return [n for n in opts.given() if n not in self.supports and n not in self.ignores]


def _local(path: Path, opts: LoadOptions) -> dict[str, Any]:
    return load_local(path, opts)


def _verified(path: Path, opts: LoadOptions) -> dict[str, Any]:
    from weightlift.digest.landed import LandedHasher
    from weightlift.digest.published import announce, reference

    ck = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    infos = ck.select(opts.select)
    # LoadOptions cannot name the manifest's type (it sits in a lower layer); load's signature does
    manifest = cast("str | os.PathLike[str] | Manifest | None", opts.manifest)
    ref = reference(ck, infos, manifest)
    hasher = LandedHasher(infos, ref.expected(infos), against=ref.against)
    out = load_local(ck, opts, on_landed=hasher.landed)
    try:
        hasher.check()
    except BaseException:
        out.clear()
        raise
    said: dict[str, Any] = {"verify": ref.summary(len(infos)), "manifest": ref.manifest}
    if ref.published:
        said["verified"] = len(infos)
    if opts.report is not None:  # the caller shows the line (the CLI, vLLM's log, from_pretrained's)
        opts.report.update(said)
    else:
        announce(said, _log)
    return out


def _split(path: Path, opts: LoadOptions) -> dict[str, Any]:
    res = split_load(path, opts)
    if opts.report is not None:
        opts.report["remote"] = res.remote
        opts.report["seconds"] = res.seconds
    return res.local


def _distributed(path: Path, opts: LoadOptions) -> dict[str, Any]:
    from weightlift.distributed import distributed_load  # process groups: torch.distributed, on demand

    return distributed_load(path, opts)


_LOCAL = frozenset(
    {"device", "framework", "select", "dtype", "copy", "page_cache", "warm", "threads", "engine"}
    | {"dequantize", "profile", "progress", "report"}
)
_LINK = frozenset({"token", "streams"})  # how a split load reaches its servers

#: The kinds of load, in the order they are asked whether a call is theirs.
KINDS: tuple[LoadKind, ...] = (
    LoadKind(
        "distributed",
        "shard= or group=",
        lambda o: o.shard is not None or o.group is not None,
        frozenset(
            {"device", "framework", "select", "copy", "engine", "report", "shard", "group", "verify", "manifest"}
        ),
        frozenset({"page_cache", "warm", "threads", "progress"}) | _LINK,
        _distributed,
    ),
    LoadKind("split", "remote=", lambda o: bool(o.remote), _LOCAL | {"remote"} | _LINK, frozenset(), _split),
    LoadKind("verified", "verify=True", lambda o: o.verify, _LOCAL | {"verify", "manifest"}, _LINK, _verified),
    LoadKind("local", "", lambda o: True, _LOCAL, _LINK, _local),
)


def kind_for(opts: LoadOptions) -> LoadKind:
    """The kind of load ``opts`` asks for; OptionError naming an option set that it does not support."""
    kind = next(k for k in KINDS if k.wants(opts))
    refused = kind.refused(opts)
    if refused:
        name = refused[0]
        value = getattr(opts, name)
        shown = f"{name}={value!r}" if isinstance(value, bool) else f"{name}="
        if kind.chosen_by:
            raise OptionError(f"{shown} is not supported together with {kind.chosen_by} (a {kind.name} load)")
        users = [k.chosen_by for k in KINDS if name in k.supports and k.chosen_by]
        raise OptionError(f"{shown} is only used with {' or '.join(users)}")
    return kind


class LoadKw(TypedDict, total=False):
    """The types of :func:`load`'s keywords besides ``framework`` (which picks the result's type).

    The keywords themselves, their defaults and checks are :class:`~weightlift.options.LoadOptions`'s
    fields; what each means is said once, in :func:`load`'s docstring. This only types them for a
    checker, with the types a lower layer cannot name (``Shard``, ``Manifest``).
    """

    device: str
    select: Select
    dtype: DTypeLike | None
    copy: bool
    page_cache: str | None
    warm: bool | None
    threads: int | None
    engine: str
    dequantize: bool
    profile: ProfileLike
    progress: bool | None
    report: dict[str, object] | None
    remote: Mapping[str, Select] | None
    token: str | bytes | None
    streams: int
    shard: Shard | None
    group: Group | None
    verify: bool
    manifest: str | os.PathLike[str] | Manifest | None


@overload
def load(
    path: Path, *, framework: Literal["numpy"] = ..., **options: Unpack[LoadKw]
) -> dict[str, NDArray[np.generic]]: ...
@overload
def load(path: Path, *, framework: Literal["torch"], **options: Unpack[LoadKw]) -> dict[str, torch.Tensor]: ...
@overload
def load(path: Path, *, framework: str = ..., **options: Unpack[LoadKw]) -> dict[str, Array]: ...


def load(
    path: str | os.PathLike[str] | Checkpoint, *, framework: str = "numpy", **options: Unpack[LoadKw]
) -> dict[str, Array]:
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

    ``shard`` (a :class:`weightlift.Shard`) loads this rank's slices; ``group`` (a
    torch.distributed process group) shares one read of the checkpoint among its ranks (see
    :mod:`weightlift.distributed`).

    ``verify=True`` hashes (BLAKE3) the bytes that landed in the destination, as they land, on
    the threads that copied them, and compares each tensor with ``manifest`` (a published
    manifest's path, URL or value, see :mod:`weightlift.digest.published`), else with the
    published manifest found beside the checkpoint (``weightlift manifest``'s output), else only
    with the files' own bytes as they are now, which proves the copy and not that the files are
    what was published. One line says which (``report["verify"]``, else logged on the
    ``weightlift`` logger: a warning when no published manifest was found). A CUDA load hashes
    the host-side staging bytes it copies to the device; a dtype cast, the bytes it read. A
    mismatch raises IntegrityError naming the tensors and what they were compared with, and
    nothing is returned.

    An option the kind of load does not support (``dtype`` with ``shard``, ``verify`` with
    ``remote``, ``manifest`` without ``verify``...) is an OptionError naming it (see :data:`KINDS`).
    """
    check_keywords("load", options, LoadOptions)
    opts = LoadOptions(framework=framework, **options)
    return run_load(path, opts)


def run_load(path: str | os.PathLike[str] | Checkpoint, opts: LoadOptions) -> dict[str, Any]:
    """:func:`load` for options already built: the kind ``opts`` asks for, run."""
    return kind_for(opts).run(path, opts)


# help() and inspect show every keyword with its default, as when load wrote each one out
load.__signature__ = keyword_signature(load, LoadOptions, LoadKw)  # type: ignore[attr-defined]
