"""The published manifest: a checkpoint's tensors and their BLAKE3, checking files against it.

A *published manifest* is JSON a user can put next to a model: per tensor its name, dtype,
shape, byte length and BLAKE3 digest, in file order, plus one BLAKE3 digest over the canonical
encoding of that list, so the whole model is named by one digest. It is built from the per-file
sidecars the push client keeps (:class:`~weightlift.digest.sidecar.Sidecar`, valid while the
file is unchanged): a second manifest of an unchanged checkpoint hashes nothing, and a manifest
taken first makes the next push hash nothing either.

A verified load hashes what landed against these digests: :mod:`weightlift.digest.landed`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import blake3

from weightlift.checkpoint import Checkpoint, Select, open_checkpoint
from weightlift.digest.blake import DIGEST_SIZE, DigestPool
from weightlift.digest.sidecar import hash_tensors
from weightlift.errors import FileError, IntegrityError, NotFoundError
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
]

FORMAT = "weightlift-manifest"
VERSION = 1
#: Suffix of a published manifest (distinct from the sidecar's ``.wl-manifest.json``).
PUBLISHED_SUFFIX = ".manifest.json"
FOLDER_MANIFEST = "weightlift.manifest.json"
#: the largest published manifest read from a store
MAX_MANIFEST_SIZE = 256 * 1024 * 1024


@dataclass(frozen=True)
class ManifestEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    length: int
    blake3: str  # hex

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "length": self.length,
                "blake3": self.blake3}  # fmt: skip


@dataclass(frozen=True)
class Manifest:
    entries: tuple[ManifestEntry, ...]

    @property
    def digest(self) -> str:
        """BLAKE3 over the canonical JSON of the entries: one name for the whole model."""
        return blake3.blake3(_canonical(self.entries)).hexdigest()

    def by_name(self) -> dict[str, ManifestEntry]:
        return {e.name: e for e in self.entries}

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


def make_manifest(source: str | os.PathLike[str] | Checkpoint, *, select: Select = None) -> Manifest:
    """The published manifest of a checkpoint's (selected) tensors, in file order."""
    ck = source if isinstance(source, Checkpoint) else open_checkpoint(source)
    infos = ck.select(select)
    digests = file_digests(infos) if ck.source is None else store_digests(ck.source, infos)
    return Manifest(
        tuple(ManifestEntry(t.name, t.dtype, tuple(t.shape), t.length, digests[t.name].hex()) for t in infos)
    )


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """A published manifest from ``path``: NotFoundError if absent, IntegrityError if malformed or
    if its own digest does not match its entries."""
    p = os.fspath(path)
    try:
        if is_url(p):
            from weightlift.sources.objects import Objects

            doc = json.loads(Objects(p).read_all(p, MAX_MANIFEST_SIZE))
        else:
            with open(p, "rb") as f:
                doc = json.loads(f.read())
    except FileNotFoundError:
        raise NotFoundError("no manifest here (write one with `weightlift manifest`)", file=p) from None
    except OSError as e:
        raise FileError(f"cannot read manifest: {e.strerror}", file=p, errno=e.errno) from None
    except (ValueError, RecursionError) as e:  # nested past the parser's depth: not a manifest either
        raise IntegrityError(f"{p}: manifest is not JSON: {type(e).__name__}: {e}") from None
    try:
        if doc["format"] != FORMAT or doc["version"] != VERSION:
            raise IntegrityError(f"{p}: not a {FORMAT} version {VERSION}")
        entries = []
        for item in doc["tensors"]:
            name, dtype, shape, length, hx = (item[k] for k in ("name", "dtype", "shape", "length", "blake3"))
            if not isinstance(name, str) or not isinstance(dtype, str) or type(length) is not int or length < 0:
                raise TypeError(name)
            if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                raise TypeError(name)
            if not isinstance(hx, str) or len(bytes.fromhex(hx)) != DIGEST_SIZE:
                raise TypeError(name)
            entries.append(ManifestEntry(name, dtype, tuple(shape), length, hx.lower()))
        if len({e.name for e in entries}) != len(entries):
            raise IntegrityError(f"{p}: the manifest names a tensor more than once")
        m = Manifest(tuple(entries))
        if not isinstance(doc["digest"], str) or doc["digest"].lower() != m.digest:
            raise IntegrityError(f"{p}: the manifest's own digest does not match its tensors (edited or damaged)")
    except (KeyError, TypeError, ValueError) as e:
        raise IntegrityError(f"{p}: malformed manifest ({type(e).__name__}: {e})") from None
    return m


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
    if bad:
        raise IntegrityError(
            f"{len(bad)} tensor(s) not in the manifest or of another dtype, shape or size: {', '.join(bad[:8])}"
        )
    return out
