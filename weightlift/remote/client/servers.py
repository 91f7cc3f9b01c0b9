"""Different selections of one checkpoint pushed to several tensor servers at once.

The one way to push to several servers directly: ``Client.push(to=...)`` (a list of addresses
with ``relay="direct"``, or where a server cannot relay: see
:mod:`weightlift.remote.server.relay`), :func:`weightlift.distributed.push_many` and the split
load all come here. Each server gets its
own push on its own thread; the checkpoint is opened once and shared, and the page cache serves
every reader after the first, so time to ready is the slowest push, not the sum. Every push runs
to its end even when another fails; then :class:`~weightlift.errors.PushError` holds each error
and each result.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from weightlift.checkpoint import Checkpoint, Select, open_checkpoint
from weightlift.errors import OptionError, PushError
from weightlift.formats import TensorInfo
from weightlift.remote.client.job import PushResult

if TYPE_CHECKING:
    from weightlift.digest.published import Manifest, ManifestSource

__all__ = ["Address", "Target", "address_key", "Pushes", "push_each"]

Address = str | tuple[str, int]


def address_key(addr: Address) -> str:
    """``"host:port"``: how results and errors are keyed, whichever form the address came in."""
    return addr if isinstance(addr, str) else f"{addr[0]}:{addr[1]}"


class Target(Protocol):
    """What a push goes through: a :class:`~weightlift.remote.client.Client`, structurally."""

    def push(
        self,
        source: Checkpoint,
        *,
        select: Select = None,
        hash_threshold: int | None = None,
        verify: bool = False,
        manifest: Manifest | None = None,
    ) -> PushResult: ...

    def close(self) -> None: ...


class Pushes:
    """``targets`` (``{address: select}``) pushed at once, one thread each, started here.

    ``connect`` makes the client of an address (closed after its push); ``own`` names clients
    the caller keeps open, used for their addresses instead. Every selection is checked against
    the checkpoint, and with ``manifest`` (read once, for every push's ``verify``) against the
    manifest, before any connection is made. :meth:`join` waits; :meth:`wait` also raises
    PushError if any push failed, else returns ``{"host:port": PushResult}``.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Checkpoint,
        targets: Mapping[Address, Select],
        *,
        connect: Callable[[Address], Target],
        own: Mapping[str, Target] | None = None,
        hash_threshold: int | None = None,
        verify: bool = False,
        manifest: ManifestSource | None = None,
    ):
        if len({address_key(a) for a in targets}) != len(targets):
            raise OptionError("a push to several servers names every server once")
        if manifest is not None and not verify:
            raise OptionError("a push's manifest is what verify=True checks against: pass verify=True too")
        ck = source if isinstance(source, Checkpoint) else open_checkpoint(source)
        published = _read(manifest)
        for sel in targets.values():
            tensors = ck.select(sel)  # a selection that matches nothing fails here, before any byte is sent
            if published is not None:
                _check_against(tensors, published)
        self._ck, self._connect, self._own = ck, connect, dict(own or {})
        self._hash_threshold, self._verify, self._manifest = hash_threshold, verify, published
        self.results: dict[str, PushResult] = {}
        self.errors: dict[str, BaseException] = {}
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(addr, sel), name=f"weightlift-push {i}", daemon=True)
            for i, (addr, sel) in enumerate(targets.items())
        ]
        for t in self._threads:
            t.start()

    def _run(self, addr: Address, select: Select) -> None:
        key = address_key(addr)
        try:
            target = self._own.get(key)
            if target is not None:
                result = self._push(target, select)
            else:
                target = self._connect(addr)
                try:
                    result = self._push(target, select)
                finally:
                    target.close()
            with self._lock:
                self.results[key] = result
        except BaseException as e:  # noqa: BLE001 - gathered and raised in the caller's thread
            with self._lock:
                self.errors[key] = e

    def _push(self, target: Target, select: Select) -> PushResult:
        if self._manifest is None:  # a target that knows no manifest still takes the push
            return target.push(self._ck, select=select, hash_threshold=self._hash_threshold, verify=self._verify)
        return target.push(
            self._ck, select=select, hash_threshold=self._hash_threshold, verify=self._verify, manifest=self._manifest
        )

    def join(self) -> None:
        """Wait for every push to end, however it ended."""
        for t in self._threads:
            t.join()

    def wait(self) -> dict[str, PushResult]:
        """Wait for every push; PushError if any failed, else every result."""
        self.join()
        if self.errors:
            raise PushError(self.errors, self.results)
        return self.results


def push_each(
    source: str | os.PathLike[str] | Checkpoint,
    targets: Mapping[Address, Select],
    *,
    connect: Callable[[Address], Target],
    own: Mapping[str, Target] | None = None,
    hash_threshold: int | None = None,
    verify: bool = False,
    manifest: ManifestSource | None = None,
) -> dict[str, PushResult]:
    """:class:`Pushes` started and waited for: ``{"host:port": PushResult}``, or PushError."""
    return Pushes(
        source, targets, connect=connect, own=own, hash_threshold=hash_threshold, verify=verify, manifest=manifest
    ).wait()


def _read(manifest: ManifestSource | None) -> Manifest | None:
    if manifest is None:
        return None
    from weightlift.digest.published import Manifest, read_manifest

    return manifest if isinstance(manifest, Manifest) else read_manifest(manifest)


def _check_against(tensors: list[TensorInfo], manifest: Manifest) -> None:
    """IntegrityError if ``manifest`` lacks one of ``tensors`` or gives it another size."""
    from weightlift.digest.published import expected_digests

    expected_digests(tensors, manifest)
