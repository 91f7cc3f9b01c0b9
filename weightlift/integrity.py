"""Integrity: a checkpoint's published manifest, checking a file against it, and checking a load's
landed bytes as they land.

A *published manifest* is JSON a user can put next to a model: per tensor its name, dtype,
shape, byte length and BLAKE3 digest, in file order, plus one BLAKE3 digest over the canonical
encoding of that list, so the whole model is named by one digest. It is built from the per-file
sidecars the push client keeps (:class:`~weightlift.remote.manifest.Manifest`, valid while the
file is unchanged): a second manifest of an unchanged checkpoint hashes nothing, and a manifest
taken first makes the next push hash nothing either.

A verified load (:class:`LandedHasher`) hashes what landed in the destination, not what was
read: the loader's workers call :meth:`LandedHasher.landed` with each chunk right after copying
it, while it is still in the cache. A chunk is cut at tensor boundaries into pieces; each tensor
has one incremental BLAKE3 hasher fed in byte order. A piece that arrives before the one ahead
of it (another worker still copying that chunk) is parked and hashed by whichever worker fills
the gap, so hashing follows the copy on the same threads without a second pass over memory.
"""

from __future__ import annotations

import bisect
import json
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import blake3

from weightlift.checkpoint import Checkpoint, Select, open_checkpoint
from weightlift.errors import FileError, IntegrityError, NotFoundError
from weightlift.formats import TensorInfo
from weightlift.remote.digest import DIGEST_SIZE, DigestPool, byte_view
from weightlift.remote.manifest import hash_tensors

__all__ = [
    "FORMAT",
    "ManifestEntry",
    "PublishedManifest",
    "default_manifest_path",
    "make_manifest",
    "read_manifest",
    "file_digests",
    "verify_checkpoint",
    "LandedHasher",
]

FORMAT = "weightlift-manifest"
VERSION = 1
#: Suffix of a published manifest (distinct from the sidecar's ``.wl-manifest.json``).
PUBLISHED_SUFFIX = ".manifest.json"
FOLDER_MANIFEST = "weightlift.manifest.json"


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
class PublishedManifest:
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


def make_manifest(source: str | os.PathLike[str] | Checkpoint, *, select: Select = None) -> PublishedManifest:
    """The published manifest of a checkpoint's (selected) tensors, in file order."""
    ck = source if isinstance(source, Checkpoint) else open_checkpoint(source)
    infos = ck.select(select)
    digests = file_digests(infos)
    return PublishedManifest(
        tuple(ManifestEntry(t.name, t.dtype, tuple(t.shape), t.length, digests[t.name].hex()) for t in infos)
    )


def read_manifest(path: str | os.PathLike[str]) -> PublishedManifest:
    """A published manifest from ``path``: NotFoundError if absent, IntegrityError if malformed or
    if its own digest does not match its entries."""
    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            doc = json.loads(f.read())
    except FileNotFoundError:
        raise NotFoundError("no manifest here (write one with `weightlift manifest`)", file=p) from None
    except OSError as e:
        raise FileError(f"cannot read manifest: {e.strerror}", file=p, errno=e.errno) from None
    except ValueError as e:
        raise IntegrityError(f"{p}: manifest is not JSON: {e}") from None
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
        m = PublishedManifest(tuple(entries))
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
    source: str | os.PathLike[str] | Checkpoint, manifest: PublishedManifest, *, select: Select = None
) -> list[str]:
    """Hash the checkpoint's tensors afresh and compare with ``manifest``: the tensors that differ
    (or are missing from either side), each with why; empty when all match."""
    ck = source if isinstance(source, Checkpoint) else open_checkpoint(source)
    infos = ck.select(select)
    with DigestPool(max(1, os.cpu_count() or 1)) as pool:
        # never from a sidecar: verify is the question whether the bytes are still these
        futures = hash_tensors(infos, pool=pool, threshold=0, manifests=False)
        digests = {n: f.result() for n, f in futures.items()}
    differ = _differences(manifest.by_name(), infos, digests)
    if select is None:
        here = {t.name for t in infos}
        differ += [f"{e.name} (in the manifest, not in the checkpoint)" for e in manifest.entries if e.name not in here]
    return differ


# -- a verified load -------------------------------------------------------------------------------


class _TensorHash:
    __slots__ = ("hasher", "pos", "parked", "busy")

    def __init__(self) -> None:
        self.hasher = blake3.blake3()
        self.pos = 0
        self.parked: dict[int, Any] = {}
        self.busy = False


class LandedHasher:
    """Hashes the bytes a load landed, per tensor, on the threads that landed them.

    ``expected`` maps tensor names to digests; :meth:`check` raises IntegrityError naming every
    tensor whose landed bytes differ (or that did not land completely).
    """

    def __init__(self, tensors: Sequence[TensorInfo], expected: dict[str, bytes]):
        missing = [t.name for t in tensors if t.name not in expected]
        if missing:
            raise IntegrityError(f"no digest to verify {len(missing)} tensor(s) against: {', '.join(missing[:3])}")
        self.expected = expected
        self._all = list(tensors)
        self._tensors: dict[str, list[TensorInfo]] = {}
        for t in sorted(tensors, key=lambda t: (t.file, t.offset)):
            if t.length:  # an empty tensor lands no bytes, and would break the order of ends
                self._tensors.setdefault(t.file, []).append(t)
        # tensors do not overlap, so their ends rise with their offsets
        self._ends = {f: [t.end for t in ts] for f, ts in self._tensors.items()}
        self._state = {t.name: _TensorHash() for t in tensors}
        self._lock = threading.Lock()

    def landed(self, file: str, offset: int, data: Any, *, stable: bool = True) -> None:
        """The bytes of ``file`` at [offset, offset + len(data)) have landed as ``data``.

        ``stable`` False means ``data`` is a staging buffer that is reused once this returns
        (a CUDA load's pinned slot): a piece that cannot be hashed now is copied before parking.
        """
        view = byte_view(data)
        end = offset + view.nbytes
        ts, ends = self._tensors.get(file), self._ends.get(file)
        if not ts or not ends:
            return
        i = bisect.bisect_right(ends, offset)  # the first tensor ending after offset
        while i < len(ts) and ts[i].offset < end:
            t = ts[i]
            a, b = max(offset, t.offset), min(end, t.end)
            if a < b:
                self._feed(self._state[t.name], a - t.offset, view[a - offset : b - offset], stable)
            i += 1

    def _feed(self, st: _TensorHash, pos: int, piece: Any, stable: bool) -> None:
        with self._lock:
            if st.busy or pos != st.pos:  # not next, or another thread is hashing this tensor
                st.parked[pos] = piece if stable else bytes(piece)
                return
            st.busy = True
        while True:  # whoever hashes the piece at st.pos also drains what was parked after it
            st.hasher.update(piece)
            with self._lock:
                st.pos += len(piece)
                nxt = st.parked.pop(st.pos, None)
                if nxt is None:
                    st.busy = False
                    return
            piece = nxt

    def check(self) -> None:
        """IntegrityError naming each tensor whose landed bytes differ from the expected digest."""
        differ = []
        for t in self._all:
            st = self._state[t.name]
            if st.pos != t.length or st.hasher.digest() != self.expected[t.name]:
                differ.append(t.name)
        if differ:
            shown = ", ".join(differ[:8]) + (f" and {len(differ) - 8} more" if len(differ) > 8 else "")
            raise IntegrityError(f"{len(differ)} tensor(s) landed with bytes that differ from their BLAKE3: {shown}")


def expected_digests(
    tensors: Sequence[TensorInfo], manifest: str | os.PathLike[str] | PublishedManifest | None
) -> dict[str, bytes]:
    """Digests to check a load against: the published manifest's, else the files' own (from the
    sidecars, hashed once when they lack them)."""
    if manifest is None:
        return file_digests(tensors)
    m = manifest if isinstance(manifest, PublishedManifest) else read_manifest(manifest)
    by_name = m.by_name()
    out: dict[str, bytes] = {}
    bad = []
    for t in tensors:
        e = by_name.get(t.name)
        if e is None or e.length != t.length:
            bad.append(t.name)
        else:
            out[t.name] = bytes.fromhex(e.blake3)
    if bad:
        raise IntegrityError(f"{len(bad)} tensor(s) not in the manifest or of another size: {', '.join(bad[:8])}")
    return out
