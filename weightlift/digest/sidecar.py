"""Digests remembered across runs: a checkpoint file's sidecar manifest, and hashing a list of tensors.

A server that keeps a tensor cache can fill a tensor from it when the client names the tensor's
BLAKE3 digest, so the client needs digests for the tensors worth asking about, and only then:
without a server cache a digest is pure cost.

:class:`Sidecar` remembers the digests of a checkpoint file in a sidecar JSON, so a second push of
the same file hashes nothing. It is a cache of hashes of the file *as it is now*, never proof
that the file is what was published (that is :mod:`weightlift.digest.published`): a file changed
since is hashed afresh and its new digests recorded. The server trusts a digest blindly (it cannot see the client's
bytes), so a stale digest would put wrong weights in the server's memory without any error; that
is why a manifest's entries count only while the file's size, mtime, ctime, inode and device are
what they were when the digests were taken. ctime is in the identity because tools such as
``rsync -t``, ``tar x`` and ``touch -r`` set mtime back after changing the bytes, while ctime
cannot be set from user space; the price is a rehash after a chmod or rename of the checkpoint.

The identity says whether a sidecar is stale, not who wrote it: anyone can read a file's size,
times, inode and device with ``stat``. A sidecar is therefore trusted only when the user could
not have been handed it by someone else (:func:`trusted_fd`): it is a regular file, not a link,
owned by the effective user (or by root, who can change the checkpoint itself anyway), and not
writable by its group or others. These checks are made on the open descriptor, so what is
checked is what is read. A folder others may write (a sticky shared folder) lets them delete a
sidecar or put their own in its place, but theirs is ignored and the file is hashed instead.
Sidecars are written into weightlift's own cache folder (``$WEIGHTLIFT_CACHE/manifests``, by
default ``~/.cache/weightlift/manifests``), never into the user's model folder, and only when that
folder is the user's and private (0700); one found beside a file (``<file>.wl-manifest.json``,
as older versions wrote them) is still read. Sidecars are written to an exclusive temporary file (never through an existing name or link),
mode 0600, and renamed into place.

:func:`hash_tensors` ties it together for a list of tensors: digests from the manifest where it
has them, the rest hashed on a :class:`~weightlift.digest.blake.DigestPool`, the manifest saved
once they are all done.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import stat
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import blake3

from weightlift import env
from weightlift.digest.blake import DIGEST_SIZE, HASH_THRESHOLD, DigestPool, digest_hex, hash_buffer
from weightlift.errors import NotFoundError

__all__ = ["SIDECAR_SUFFIX", "SIDECAR_VERSION", "Sidecar", "hash_tensors", "read_trusted", "trusted_fd", "write_atomic"]

#: Suffix of the sidecar manifest next to a checkpoint file.
SIDECAR_SUFFIX = ".wl-manifest.json"
SIDECAR_VERSION = 1


def _identity(st: os.stat_result) -> dict[str, int]:
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
        "device": st.st_dev,
    }


#: Largest sidecar read; a real one holds about 150 bytes per tensor.
MAX_SIDECAR = 256 * 1024 * 1024
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _fallback_dir() -> str:
    return os.path.join(env.cache_dir(), "manifests")


def _trusted_owner(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def trusted_fd(st: os.stat_result) -> bool:
    """Whether a file with this (f)stat may be believed: a regular file owned by the effective
    user or root, not writable by its group or others. Always true off POSIX."""
    if os.name != "posix":
        return True
    return stat.S_ISREG(st.st_mode) and _trusted_owner(st.st_uid) and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _private_dir(path: str, *, create: bool) -> bool:
    """Whether ``path`` is a folder of the effective user's that no one else can use (made 0700 if
    ``create`` and absent; narrowed to 0700 if it is ours and wider). False for a link, a folder
    of someone else's, or one that cannot be made. Checked on the open folder, not its name."""
    if os.name != "posix":
        if create:
            os.makedirs(path, exist_ok=True)
        return True
    if create:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError:
            return False
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return False
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o700)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def read_trusted(path: str) -> bytes | None:
    """The bytes of the file at ``path`` if :func:`trusted_fd` holds for it (checked on the open
    descriptor, never following a link and never blocking on a FIFO); None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not trusted_fd(st) or st.st_size > MAX_SIDECAR:
            return None
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


class Sidecar:
    """Digests of the tensors of one checkpoint file, valid while the file is unchanged.

    Stored as ``<blake3 of the real path>.json`` in weightlift's cache folder (see the module
    docstring), read from there or from ``<file>.wl-manifest.json`` beside the file; read only from a file
    another user could not have written (see the module docstring). Safe to call from several
    threads (digests arrive from pool workers).
    """

    def __init__(self, path: str | os.PathLike[str], identity: dict[str, int]):
        self.path = os.path.abspath(os.fspath(path))
        self._identity = identity
        self._entries: dict[str, tuple[int, int, bytes]] = {}
        self._dirty = False
        self._lock = threading.Lock()

    @property
    def sidecar_path(self) -> str:
        return self.path + SIDECAR_SUFFIX

    @property
    def fallback_path(self) -> str:
        key = blake3.blake3(os.path.realpath(self.path).encode("utf-8", "surrogateescape"))
        return os.path.join(_fallback_dir(), key.hexdigest() + ".json")

    def _candidates(self) -> list[str]:
        """The places this file's sidecar may be read from: beside it (written by an older
        version, or by the user), and in the cache folder when that folder is private to the user."""
        out = [self.sidecar_path]
        if _private_dir(_fallback_dir(), create=False):
            out.append(self.fallback_path)
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Sidecar:
        """The manifest of ``path`` as saved, or an empty one if none matches the file as it is now.

        NotFoundError if the checkpoint file itself cannot be stat'ed; a missing, corrupt or stale
        manifest is never an error.
        """
        try:
            st = os.stat(path)
        except OSError as exc:
            raise NotFoundError(f"cannot stat checkpoint: {exc.strerror}", file=os.fspath(path)) from exc
        m = cls(path, _identity(st))
        for candidate in m._candidates():
            entries = _read_manifest(candidate, m._identity)
            if entries is not None:
                m._entries = entries
                break
        return m

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, name: str, offset: int, length: int) -> bytes | None:
        """The digest recorded for ``name`` at exactly (offset, length), or None."""
        with self._lock:
            entry = self._entries.get(name)
        if entry is None or entry[0] != offset or entry[1] != length:
            return None
        return entry[2]

    def put(self, name: str, offset: int, length: int, digest: bytes) -> None:
        """Record a digest taken of the file's bytes [offset, offset+length)."""
        digest_hex(digest)  # validates the size
        with self._lock:
            if self._entries.get(name) != (offset, length, bytes(digest)):
                self._entries[name] = (offset, length, bytes(digest))
                self._dirty = True

    def save(self) -> None:
        """Write the manifest atomically if it changed; a failure is a warning, never an error.

        Nothing is written if the file changed since :meth:`load`: the digests may then describe
        bytes that are no longer there.
        """
        with self._lock:
            if not self._dirty:
                return
            entries = dict(self._entries)
            self._dirty = False
        try:
            now = _identity(os.stat(self.path))
        except OSError:
            now = None
        if now != self._identity:
            warnings.warn(f"{self.path} changed while it was hashed; its digests are not saved", stacklevel=2)
            return
        doc = {
            "version": SIDECAR_VERSION,
            "file": self._identity,
            "tensors": {
                name: {"offset": off, "length": ln, "blake3": d.hex()} for name, (off, ln, d) in entries.items()
            },
        }
        data = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
        # in weightlift's own cache, never into the user's model folder
        target = self.fallback_path
        if not _private_dir(os.path.dirname(target), create=True):
            why = f"{os.path.dirname(target)}: not a private folder of this user"
        else:
            try:
                write_atomic(target, data, mode=0o600)
                return
            except OSError as exc:
                why = f"{target}: {exc.strerror or exc}"
        warnings.warn(f"cannot save digest manifest ({why})", stacklevel=2)


def write_atomic(target: str, data: bytes, *, mode: int = 0o644) -> None:
    """Write ``data`` to ``target`` through a temporary file and a rename: all or nothing.

    The temporary file has an unpredictable name and is created exclusively, without following a
    link, with ``mode`` (less the umask); the rename replaces whatever ``target`` was (a file or a
    link), never writing through it."""
    tmp = f"{target}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.close(fd)
        fd = -1
        os.replace(tmp, target)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _read_manifest(path: str, identity: dict[str, int]) -> dict[str, tuple[int, int, bytes]] | None:
    """The entries in ``path`` if it is a well-formed manifest for ``identity``; None otherwise."""
    raw = read_trusted(path)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("version") != SIDECAR_VERSION or doc.get("file") != identity:
            return None
        tensors = doc["tensors"]
        if not isinstance(tensors, dict):
            return None
        out: dict[str, tuple[int, int, bytes]] = {}
        for name, e in tensors.items():
            off, ln, hx = e["offset"], e["length"], e["blake3"]
            if type(off) is not int or type(ln) is not int or off < 0 or ln < 0:
                return None
            if not isinstance(hx, str) or len(hx) != 2 * DIGEST_SIZE:
                return None
            out[name] = (off, ln, bytes.fromhex(hx))
        return out
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


# ---------------------------------------------------------------------------------------------
# Background hashing


class _TensorLike(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def file(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...


def _mapped_view(t: _TensorLike) -> memoryview:
    from weightlift.disk.source import mapped

    return mapped(t.file).view(t.offset, t.length)


def hash_tensors(
    tensors: Iterable[_TensorLike],
    *,
    view: Callable[[Any], Any] | None = None,
    pool: DigestPool | None = None,
    threshold: int = HASH_THRESHOLD,
    manifests: bool = True,
) -> dict[str, Future[bytes]]:
    """Digest futures for every tensor of at least ``threshold`` bytes, by name.

    Digests come from each file's :class:`Sidecar` where it has them; the rest are hashed on
    ``pool`` (or inline, already done, when there is none) from ``view(tensor)``, by default the
    read-only mmap slice of the tensor. When the last digest of a file arrives its manifest is
    saved, so the next push of the same file hashes nothing.
    """
    view = view or _mapped_view
    chosen = [t for t in tensors if t.length >= threshold]
    by_file: dict[str, list[_TensorLike]] = {}
    for t in chosen:
        by_file.setdefault(t.file, []).append(t)
    out: dict[str, Future[bytes]] = {}
    for file, group in by_file.items():
        manifest = Sidecar.load(file) if manifests else None
        pending: list[tuple[_TensorLike, Future[bytes]]] = []
        for t in group:
            known = manifest.get(t.name, t.offset, t.length) if manifest is not None else None
            fut: Future[bytes]
            if known is not None:
                fut = Future()
                fut.set_result(known)
            elif pool is not None:
                fut = pool.submit(t.name, view(t))
                pending.append((t, fut))
            else:
                fut = Future()
                fut.set_result(hash_buffer(view(t)))
                pending.append((t, fut))
            out[t.name] = fut
        if manifest is not None and pending:
            _save_when_done(manifest, pending)
    return out


def _save_when_done(manifest: Sidecar, pending: Sequence[tuple[_TensorLike, Future[bytes]]]) -> None:
    remaining = [len(pending)]
    lock = threading.Lock()

    def done(t: _TensorLike, fut: Future[bytes]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            manifest.put(t.name, t.offset, t.length, fut.result())
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            manifest.save()

    for t, fut in pending:
        fut.add_done_callback(functools.partial(_then, done, t))


def _then(done: Callable[[Any, Future[bytes]], None], t: Any, fut: Future[bytes]) -> None:
    done(t, fut)
