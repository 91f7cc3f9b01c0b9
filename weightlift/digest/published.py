"""The published manifest: a checkpoint's tensors and their BLAKE3, checking files against it.

A *published manifest* is JSON a user can put next to a model: per tensor its name, dtype,
shape, byte length and BLAKE3 digest, in file order, plus one BLAKE3 digest over the canonical
encoding of that list, so the whole model is named by one digest. It is built from the per-file
sidecars the push client keeps (:class:`~weightlift.digest.sidecar.Sidecar`, valid while the
file is unchanged): a second manifest of an unchanged checkpoint hashes nothing, and a manifest
taken first makes the next push hash nothing either.

A verified load hashes what landed against these digests: :mod:`weightlift.digest.landed`.

Which digests a verify checks against is decided here, once, for every caller (a load, a push,
``weightlift check``, vLLM's loader): :func:`reference`. In order: the manifest the caller names;
else the published manifest found beside the checkpoint (:func:`find_published`, the names
``weightlift manifest`` writes: ``<file>.manifest.json`` beside a file, ``weightlift.manifest.json``
in its folder or store prefix); else none, and the check says so: it can then only show that what
landed equals the files as they are now. The per-file sidecars are a cache of those hashes, never
proof: a file changed since it was published hashes afresh and "matches" itself.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import blake3

from weightlift.checkpoint import Checkpoint, Select, open_checkpoint
from weightlift.digest.blake import DIGEST_SIZE, DigestPool
from weightlift.digest.sidecar import hash_tensors
from weightlift.digest.sketch import SKETCH_FIELD, sketch_bytes
from weightlift.dtypes import DTYPES, dtype_info
from weightlift.errors import FileError, IntegrityError, NotFoundError, OptionError, WeightliftError
from weightlift.formats import TensorInfo
from weightlift.sources.digests import digests as store_digests
from weightlift.sources.url import is_url

__all__ = [
    "FORMAT",
    "ManifestEntry",
    "Manifest",
    "default_manifest_path",
    "make_manifest",
    "read_manifest",
    "file_digests",
    "verify_checkpoint",
    "expected_digests",
    "find_published",
    "Reference",
    "reference",
    "announce",
    "ManifestSource",
]

FORMAT = "weightlift-manifest"
VERSION = 1
#: Suffix of a published manifest (distinct from the sidecar's ``.wl-manifest.json``).
PUBLISHED_SUFFIX = ".manifest.json"
FOLDER_MANIFEST = "weightlift.manifest.json"
DTYPE_NAMES = frozenset(d.name for d in DTYPES)
#: the largest published manifest read from a store
MAX_MANIFEST_SIZE = 256 * 1024 * 1024


@dataclass(frozen=True)
class ManifestEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    length: int
    blake3: str  # hex
    #: the tensor's linear sketch (:mod:`weightlift.digest.sketch`, empty seed), 16 hex digits, or
    #: None: written on request only, and absent from older manifests, whose digests it leaves alone
    sketch64: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "length": self.length,
             "blake3": self.blake3}  # fmt: skip
        if self.sketch64 is not None:
            d[SKETCH_FIELD] = self.sketch64
        return d


@dataclass(frozen=True)
class Manifest:
    entries: tuple[ManifestEntry, ...]

    @property
    def digest(self) -> str:
        """BLAKE3 over the canonical JSON of the entries: one name for the whole model."""
        return blake3.blake3(_canonical(self.entries)).hexdigest()

    def by_name(self) -> dict[str, ManifestEntry]:
        return {e.name: e for e in self.entries}

    def sketches(self) -> dict[str, int]:
        """Each tensor's sketch (seed ``b""``), for the tensors that have one: what a sharded copy
        is checked against without a gather (:func:`weightlift.distributed.reshard_transfer`)."""
        return {e.name: int(e.sketch64, 16) for e in self.entries if e.sketch64 is not None}

    def to_json(self) -> str:
        doc = {"format": FORMAT, "version": VERSION, "algorithm": "blake3", "digest": self.digest,
               "tensors": [e.as_dict() for e in self.entries]}  # fmt: skip
        return json.dumps(doc, indent=1) + "\n"


def _canonical(entries: Iterable[ManifestEntry]) -> bytes:
    return json.dumps([e.as_dict() for e in entries], separators=(",", ":"), sort_keys=True).encode()


def default_manifest_path(path: str | os.PathLike[str]) -> str:
    """Where ``weightlift manifest`` writes and ``weightlift verify`` looks by default."""
    p = os.fspath(path)
    if is_url(p):  # beside the object, or inside the prefix, in the store
        return p + FOLDER_MANIFEST if p.endswith("/") else p + PUBLISHED_SUFFIX
    if os.path.isdir(p):
        return os.path.join(p, FOLDER_MANIFEST)
    return p + PUBLISHED_SUFFIX


def file_digests(tensors: Sequence[TensorInfo], *, threads: int | None = None) -> dict[str, bytes]:
    """BLAKE3 of each tensor's bytes in its file: from the sidecars where valid, else hashed on
    all cores (one tensor per core); the sidecars are updated, so this is paid once per file."""
    n = threads or os.cpu_count() or 1
    with DigestPool(max(1, n)) as pool:
        futures = hash_tensors(tensors, pool=pool, threshold=0)
        out = {name: f.result() for name, f in futures.items()}
    return out


def make_manifest(
    source: str | os.PathLike[str] | Checkpoint, *, select: Select = None, sketch: bool = False
) -> Manifest:
    """The published manifest of a checkpoint's (selected) tensors, in file order; ``sketch``:
    with each tensor's linear sketch as well (local files; tensors of 1, 2, 4 or 8-byte elements),
    which reads every byte once more on one core (about 2 GB/s)."""
    ck = source if isinstance(source, Checkpoint) else open_checkpoint(source)
    infos = ck.select(select)
    digests = file_digests(infos) if ck.source is None else store_digests(ck.source, infos)
    sketches = _sketches(ck, infos) if sketch else {}
    return Manifest(
        tuple(
            ManifestEntry(t.name, t.dtype, tuple(t.shape), t.length, digests[t.name].hex(), sketches.get(t.name))
            for t in infos
        )
    )


def _sketches(ck: Checkpoint, infos: Sequence[TensorInfo]) -> dict[str, str]:
    """The sketch of each tensor a sketch can describe, as 16 hex digits, read from the mapping."""
    if ck.source is not None:
        raise OptionError(f"{ck.path}: sketches are computed from local files; download the checkpoint first")
    out = {}
    for t in infos:
        info = dtype_info(t.dtype) if t.dtype in DTYPE_NAMES else None
        if info is None or info.bits not in (8, 16, 32, 64):
            continue  # quantized or sub-byte: such tensors are never resharded, so never sketched
        view = ck.mapped(t.file).view(t.offset, t.length)
        out[t.name] = f"{sketch_bytes(view, info.bits // 8, t.shape, t.name):016x}"
    return out


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """A published manifest from ``path``: NotFoundError if absent, IntegrityError if malformed or
    if its own digest does not match its entries."""
    p = os.fspath(path)
    try:
        if is_url(p):
            from weightlift.sources.objects import Objects

            raw = Objects(p).read_all(p, MAX_MANIFEST_SIZE)
        else:
            with open(p, "rb") as f:
                raw = f.read()
    except WeightliftError:  # the store's, already saying what failed (some are OSErrors too)
        raise
    except FileNotFoundError:
        raise NotFoundError("no manifest here (write one with `weightlift manifest`)", file=p) from None
    except OSError as e:
        raise FileError(f"cannot read manifest: {e.strerror}", file=p, errno=e.errno) from None
    except ValueError as e:  # a NUL byte in the path (a config value): no file is named so
        raise OptionError(f"manifest {p!r} is not a path: {e}") from None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # nested past the parser's depth: not a manifest either
        raise IntegrityError(f"{p}: manifest is not JSON: {type(e).__name__}: {e}") from None
    try:
        if doc["format"] != FORMAT or doc["version"] != VERSION:
            raise IntegrityError(f"{p}: not a {FORMAT} version {VERSION}")
        entries = [_entry(item) for item in doc["tensors"]]
        if len({e.name for e in entries}) != len(entries):
            raise IntegrityError(f"{p}: the manifest names a tensor more than once")
        m = Manifest(tuple(entries))
        if not isinstance(doc["digest"], str) or doc["digest"].lower() != m.digest:
            raise IntegrityError(f"{p}: the manifest's own digest does not match its tensors (edited or damaged)")
    except IntegrityError:  # the checks above (a ValueError too), already saying what is wrong
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise IntegrityError(f"{p}: malformed manifest ({type(e).__name__}: {e})") from None
    return m


def _entry(item: Any) -> ManifestEntry:
    """One manifest entry from its JSON object; KeyError, TypeError or ValueError if malformed."""
    name, dtype, shape, length, hx = (item[k] for k in ("name", "dtype", "shape", "length", "blake3"))
    if not isinstance(name, str) or not isinstance(dtype, str) or type(length) is not int or length < 0:
        raise TypeError(name)
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise TypeError(name)
    if not isinstance(hx, str) or len(bytes.fromhex(hx)) != DIGEST_SIZE:
        raise TypeError(name)
    sk = item.get(SKETCH_FIELD)
    if sk is not None and (not isinstance(sk, str) or len(bytes.fromhex(sk)) != 8):
        raise TypeError(name)
    return ManifestEntry(name, dtype, tuple(shape), length, hx.lower(), sk and sk.lower())


def _differences(
    expected: dict[str, ManifestEntry], infos: Sequence[TensorInfo], digests: dict[str, bytes]
) -> list[str]:
    """Names of tensors that differ from the manifest, each with why."""
    out = []
    for t in infos:
        e = expected.get(t.name)
        if e is None:
            out.append(f"{t.name} (not in the manifest)")
        elif e.length != t.length or e.dtype != t.dtype or e.shape != tuple(t.shape):
            out.append(
                f"{t.name} (manifest: {e.dtype}{list(e.shape)} {e.length} bytes; here: {t.dtype}{list(t.shape)} {t.length} bytes)"
            )
        elif digests[t.name].hex() != e.blake3:
            out.append(f"{t.name} (BLAKE3 differs)")
    return out


def verify_checkpoint(
    source: str | os.PathLike[str] | Checkpoint, manifest: Manifest, *, select: Select = None
) -> list[str]:
    """Hash the checkpoint's tensors afresh and compare with ``manifest``: the tensors that differ
    (or are missing from either side), each with why; empty when all match."""
    ck = source if isinstance(source, Checkpoint) else open_checkpoint(source)
    infos = ck.select(select)
    if ck.source is not None:
        digests = store_digests(ck.source, infos)
    else:
        with DigestPool(max(1, os.cpu_count() or 1)) as pool:
            # never from a sidecar: verify is the question whether the bytes are still these
            futures = hash_tensors(infos, pool=pool, threshold=0, manifests=False)
            digests = {n: f.result() for n, f in futures.items()}
    differ = _differences(manifest.by_name(), infos, digests)
    if select is None:
        here = {t.name for t in infos}
        differ += [f"{e.name} (in the manifest, not in the checkpoint)" for e in manifest.entries if e.name not in here]
    return differ


def expected_digests(
    tensors: Sequence[TensorInfo], manifest: str | os.PathLike[str] | Manifest | None
) -> dict[str, bytes]:
    """Digests to check a load against: the published manifest's, else the files' own (from the
    sidecars, hashed once when they lack them)."""
    if manifest is None:
        return file_digests(tensors)
    m = manifest if isinstance(manifest, Manifest) else read_manifest(manifest)
    by_name = m.by_name()
    out: dict[str, bytes] = {}
    bad = []
    for t in tensors:
        e = by_name.get(t.name)
        if e is None or e.length != t.length or e.dtype != t.dtype or e.shape != tuple(t.shape):
            bad.append(t.name)
        else:
            out[t.name] = bytes.fromhex(e.blake3)
    if bad:  # named: a manifest found beside the checkpoint is one the caller may not know of
        where = f"{os.fspath(manifest)}: " if not isinstance(manifest, Manifest) else ""
        raise IntegrityError(
            f"{where}{len(bad)} tensor(s) not in the manifest or of another dtype, shape or size: {', '.join(bad[:8])}"
        )
    return out


#: A published manifest: its path or URL, or one read.
ManifestSource: TypeAlias = "str | os.PathLike[str] | Manifest"


def _published_names(path: str) -> list[str]:
    """Where a checkpoint file's published manifest may be, in order: beside the file, then in
    its folder (as ``weightlift manifest`` writes them for a file and for a folder)."""
    return [path + PUBLISHED_SUFFIX, os.path.join(os.path.dirname(os.path.abspath(path)), FOLDER_MANIFEST)]


def find_published(ck: Checkpoint) -> str | None:
    """The published manifest beside the checkpoint ``ck`` (see the module docstring), or None.

    In a store the object's ``<object>.manifest.json``, else the prefix's
    ``weightlift.manifest.json`` (:meth:`~weightlift.sources.objects.Objects.find_manifest`)."""
    if ck.source is not None:
        try:
            return ck.source.find_manifest(ck.path)
        except NotFoundError:
            return None
    return next((p for p in _published_names(ck.path) if os.path.isfile(p)), None)


@dataclass(frozen=True)
class Reference:
    """What a verify compares landed bytes with (:func:`reference`), and the honest words for it.

    ``manifest``: the published manifest's path or URL (or a description of a ``Manifest`` passed
    as a value), None when there is none; ``named``: the caller named it (else it was found beside
    the checkpoint); ``digests``: the published digest of each tensor, None without a manifest:
    then the only reference is the files' own bytes as they are now (:meth:`expected`).
    """

    manifest: str | None
    named: bool
    digests: dict[str, bytes] | None
    #: where a published manifest was looked for, when none was found
    tried: tuple[str, ...] = ()

    @property
    def published(self) -> bool:
        """Whether the check is against a published digest: only then is anything *verified*."""
        return self.digests is not None

    @property
    def against(self) -> str:
        """What the landed bytes are compared with, for a message."""
        if self.manifest is None:
            return "the files as they are now (no published manifest)"
        return f"the manifest {self.manifest}" if self.named else f"the published manifest {self.manifest}"

    def expected(self, tensors: Sequence[TensorInfo]) -> dict[str, bytes]:
        """The digest each of ``tensors`` must land with: the published one, else the file's own
        (from the cache of hashes where it is valid, else hashed now)."""
        return self.digests if self.digests is not None else file_digests(tensors)

    def summary(self, count: int) -> str:
        """One line saying what was checked against what; "verified" only against a published digest."""
        if self.published:
            return f"verified {count} tensors against {self.against}: every landed byte matches its published BLAKE3"
        where = f" at {' or '.join(self.tried)}" if self.tried else ""
        return (
            f"no published manifest{where}: checked only that the {count} tensors landed equal to the files "
            "as they are now, not that they are what was published (write one with `weightlift manifest`)"
        )


def reference(ck: Checkpoint, tensors: Sequence[TensorInfo], manifest: ManifestSource | None) -> Reference:
    """The digests a verify of ``tensors`` (of ``ck``) checks against: ``manifest`` if given, else
    the published manifest beside the checkpoint, else none (the files' own bytes, said so).

    IntegrityError if the manifest is malformed or lacks one of the tensors; NotFoundError for a
    checkpoint in a store with no manifest beside it (a store keeps no cache of hashes, and
    hashing the object to compare it with itself would read it twice)."""
    if manifest is not None:
        where = f"given (digest {manifest.digest[:16]})" if isinstance(manifest, Manifest) else os.fspath(manifest)
        return Reference(where, True, expected_digests(tensors, manifest))
    # in a store: NotFoundError naming both places looked at
    found = ck.source.find_manifest(ck.path) if ck.source is not None else find_published(ck)
    if found is not None:
        return Reference(found, False, expected_digests(tensors, found))
    return Reference(None, False, None, tuple(_published_names(ck.path)))


def announce(report: Mapping[str, Any], logger: logging.Logger, prefix: str = "") -> None:
    """Log the line a verified load left in ``report`` (``report["verify"]``, see
    :meth:`Reference.summary`): at INFO when it was checked against a published manifest, as a
    warning when there was none to check against; nothing for a load that did not verify."""
    said = report.get("verify")
    if said is not None:
        level = logging.INFO if report.get("manifest") is not None else logging.WARNING
        logger.log(level, "%s%s", prefix, said)
