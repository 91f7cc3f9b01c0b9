"""Group loads from a store: one read of an s3:// or https:// checkpoint shared over a group.

Theory of operation. ``weightlift.load(url, group=pg)`` runs the group load of local files
(:mod:`.group`: the plan derived from the headers alone, replicated tensors striped over the
ranks and gathered in place, sharded slices read by their own rank or by an owner and sent by
``all_to_all``) with two changes, both here:

* **The header is read once, by rank 0, and broadcast.** Rank 0 opens the checkpoint (a HEAD and
  one or two small ranged reads per object; a GGUF prefix of megabytes) and sends every rank a
  description of its tensors and of each object's version (size, ETag, Last-Modified). The
  others take those versions as their own (:meth:`~weightlift.sources.objects.Objects.adopt`):
  every rank's ranged reads then carry the same ``If-Match``, so the group reads one version of
  each object even when it is replaced while the ranks start, and the header's bytes leave the
  store once, not once per rank (which a checkpoint of a few hundred MB would notice at four
  ranks: up to 2 MB per GGUF object each).
* **The bytes come from :class:`StoreReader`**, the group loader's slice reader over ranged
  GETs: each rank reads only its stripes (and its own slices), on a pool of the endpoint's
  connection count, straight into the arena; so across the group each byte leaves the store
  once, and a rank holds, besides its destination, at most a part per connection (rows read
  from a span: a few rows per connection). The store's checks apply unchanged: every request
  carries the version read at open, and an object replaced mid-load stops the rank that meets it
  with a FormatError naming it; the group loader then stops every other rank at the next round
  (:class:`~weightlift.errors.GroupError`), so no rank returns tensors.

``verify=True`` checks what landed on each rank against the published manifest, by the rules of
:func:`weightlift.digest.published.reference` (the manifest named, else the one beside the
checkpoint in the store, else NotFoundError): every rank hashes the tensors it holds, as a
single-process verified load does, and the group agrees on the outcome before any rank returns.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from typing import Any

import numpy as np

from weightlift.checkpoint import Checkpoint, open_checkpoint
from weightlift.digest.landed import LandedHasher
from weightlift.digest.published import Reference
from weightlift.distributed.comm import Comm
from weightlift.distributed.reader import row_read_min
from weightlift.distributed.shard import Rows
from weightlift.errors import RemoteProtocolError, WeightliftError
from weightlift.formats import TensorInfo
from weightlift.memory.targets import as_bytes
from weightlift.sources.load import plan_budget
from weightlift.sources.objects import IDENTITY, Objects
from weightlift.sources.store import ObjectInfo
from weightlift.sources.url import is_url

__all__ = ["StoreReader", "share_checkpoint", "landed_check", "in_store"]

_FORMAT = "weightlift-group-store/1"


def share_checkpoint(comm: Comm, path: str, *, src: int = 0) -> Checkpoint:
    """The checkpoint at ``path`` (a URL) on every rank, its header read by rank ``src`` only.

    Rank ``src`` opens it and broadcasts its description; a rank ``src`` that fails tells the
    others first (they raise GroupError) and raises its own error."""
    from weightlift.distributed.fanout import share_description  # fanout builds on the group loader

    failure: BaseException | None = None
    desc = b""
    ck: Checkpoint | None = None
    if comm.rank == src:
        try:
            ck = open_checkpoint(path)
            desc = _describe(ck)
        except Exception as e:  # noqa: BLE001 - the others are told, then it is raised here
            failure = e
    desc = share_description(comm, desc, src, failed=failure is not None)
    if failure is not None:
        raise failure
    if ck is not None:
        return ck
    return _parse(desc, path)


def _info_row(i: ObjectInfo) -> dict[str, Any]:
    lm = i.last_modified.isoformat() if i.last_modified is not None else None
    return {"url": i.url, "size": i.size, "etag": i.etag, "version": i.version, "last_modified": lm}


def _describe(ck: Checkpoint) -> bytes:
    assert ck.source is not None  # opened from a URL
    files = list(dict.fromkeys(t.file for t in ck.tensors))
    at = {f: k for k, f in enumerate(files)}
    rows = [
        [
            t.name,
            t.dtype,
            list(t.shape),
            at[t.file],
            t.offset,
            t.length,
            t.ggml_type,
            t.alignment,
            list(t.extra["raw_shape"]) if "raw_shape" in t.extra else None,
        ]
        for t in ck.tensors
    ]
    doc = {
        "format": _FORMAT,
        "path": ck.path,
        "kind": ck.format,
        "objects": [_info_row(ck.source.info(f)) for f in files],
        "tensors": rows,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def _ints(xs: Any) -> bool:
    return isinstance(xs, list) and all(type(x) is int and x >= 0 for x in xs)


def _parse(desc: bytes, url: str) -> Checkpoint:
    """Rank 0's description, checked (every tensor inside its object), as a checkpoint whose
    objects are read at the versions rank 0 saw."""
    try:
        doc = json.loads(desc)
        if doc.get("format") != _FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {_FORMAT!r}")
        objs = Objects(url)
        infos: list[ObjectInfo] = []
        for o in doc["objects"]:
            if not isinstance(o["url"], str) or type(o["size"]) is not int or o["size"] < 0:
                raise ValueError(f"bad object {o!r}")
            lm = datetime.fromisoformat(o["last_modified"]) if o["last_modified"] is not None else None
            info = ObjectInfo(o["url"], o["size"], o["etag"], o["version"], lm)
            objs.adopt(info)
            infos.append(info)
        tensors = []
        for name, dtype, shape, k, offset, length, ggml, align, raw in doc["tensors"]:
            if not (isinstance(name, str) and isinstance(dtype, str) and _ints(shape) and type(k) is int):
                raise ValueError(f"bad entry for {name!r}")
            if not 0 <= k < len(infos) or type(offset) is not int or type(length) is not int:
                raise ValueError(f"bad place for {name!r}")
            if offset < 0 or length < 0 or offset + length > infos[k].size:
                raise ValueError(f"tensor {name!r} at [{offset}, {offset + length}) leaves its object")
            if (ggml is not None and type(ggml) is not int) or (align is not None and type(align) is not int):
                raise ValueError(f"bad GGUF fields for {name!r}")
            if raw is not None and not _ints(raw):
                raise ValueError(f"bad raw shape for {name!r}")
            t = TensorInfo(name, dtype, tuple(shape), infos[k].url, offset, length, ggml_type=ggml, alignment=align)
            if raw is not None:
                t.extra["raw_shape"] = tuple(raw)
            t.extra[IDENTITY] = infos[k]
            tensors.append(t)
        path, kind = doc["path"], doc["kind"]
        if not isinstance(path, str) or kind not in ("safetensors", "gguf"):
            raise ValueError("bad path or format")
    except WeightliftError:  # Objects' own, saying what failed (several are ValueErrors too)
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise RemoteProtocolError(f"rank 0's description of {url} is malformed: {e}") from None
    return Checkpoint(path, kind, [i.url for i in infos], tensors, source=objs)


class StoreReader:
    """Reads :class:`~.shard.Rows` of a checkpoint's objects with ranged GETs, as
    :class:`~.reader.SliceReader` reads files: the group loader takes either.

    Reads run on one pool of the endpoint's connection count (``threads`` where given), shared
    by every caller, each part at most the endpoint's part size. ``bytes_read`` counts the bytes
    asked of the store. ``checked``: the bytes will be verified against a published manifest,
    so an object that states no validator may be read (the store's rule)."""

    def __init__(self, objs: Objects, *, threads: int | None = None, checked: bool = False):
        b = plan_budget(objs, threads=threads, staged=False)
        self.objs = objs
        self.part = b.part
        self.connections = b.connections
        self.checked = checked
        self.row_min = row_read_min()
        self.bytes_read = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.connections, thread_name_prefix="wl-group-store")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get(self, file: str, offset: int, dst: memoryview) -> None:
        if not dst.nbytes:
            return
        self.objs.read_into(file, offset, dst, unvalidated_ok=self.checked)
        with self._lock:
            self.bytes_read += dst.nbytes
            self.requests += 1

    def _run(self, jobs: Sequence[Callable[[], None]]) -> None:
        """Run the jobs on the pool; the first error is raised once all have stopped."""
        futures: list[Future[None]] = [self._pool.submit(j) for j in jobs]
        first: BaseException | None = None
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - the first is raised below
                if first is None:
                    first = e
                    for g in futures:
                        g.cancel()
        if first is not None:
            raise first

    def _ranges(self, file: str, offset: int, dst: memoryview) -> list[Callable[[], None]]:
        """Jobs reading ``dst.nbytes`` bytes from ``offset`` into ``dst``, a part each."""
        n = dst.nbytes
        return [
            functools.partial(self._get, file, offset + a, dst[a : min(n, a + self.part)])
            for a in range(0, n, self.part)
        ]

    def read(self, rows: Rows, dst: np.ndarray) -> None:
        """Fill ``dst`` (uint8, ``rows.nbytes`` long) with the rows, packed one after another."""
        if dst.size != rows.nbytes:
            raise AssertionError(f"destination of {dst.size} bytes for {rows.nbytes} bytes of rows")
        if not rows.nbytes:
            return
        mv = dst.reshape(-1).data.cast("B")
        if rows.contiguous:
            self._run(self._ranges(rows.file, rows.offset, mv))
        elif rows.seg >= self.row_min or rows.stride > self.part:
            # rows far apart (or large): a request per row, never the bytes between them
            jobs: list[Callable[[], None]] = []
            for i in range(rows.count):
                jobs += self._ranges(rows.file, rows.offset + i * rows.stride, mv[i * rows.seg : (i + 1) * rows.seg])
            self._run(jobs)
        else:
            out = dst.reshape(rows.count, rows.seg)
            self._span(rows.file, rows.offset, rows.count, rows.stride, [(0, rows.seg, out)])

    def scatter(self, file: str, offset: int, count: int, segs: Sequence[int], dsts: Sequence[np.ndarray]) -> None:
        """Read ``count`` rows from ``offset``, each made of ``len(segs)`` back-to-back segments, the
        k-th ``segs[k]`` bytes long, into ``dsts[k]`` (``count * segs[k]`` bytes, rows packed):
        an owner rank reading a tensor once for every rank's slice of it."""
        stride = sum(segs)
        if not count or not stride:
            return
        cols, at = [], 0
        for seg, dst in zip(segs, dsts, strict=True):
            if seg:
                cols.append((at, seg, dst.reshape(count, seg)))
            at += seg
        self._span(file, offset, count, stride, cols)

    def _span(self, file: str, offset: int, count: int, stride: int, cols: list[tuple[int, int, np.ndarray]]) -> None:
        """The span of ``count`` rows of ``stride`` bytes read in parts of whole rows, each part's
        columns ``[at, at + seg)`` copied to rows of their destination: a buffer of a part (or of
        one row, where a row is longer) per connection at a time."""
        per = max(1, self.part // stride)
        span = (count - 1) * stride + max(at + seg for at, seg, _ in cols)  # nothing past the last column

        def one(r: int) -> None:
            k = min(per, count - r)
            n = min(k * stride, span - r * stride)
            buf = np.empty(k * stride, dtype=np.uint8)
            self._get(file, offset + r * stride, buf.data[:n])
            rows = buf.reshape(k, stride)
            for at, seg, out in cols:
                out[r : r + k] = rows[:, at : at + seg]

        self._run([functools.partial(one, r) for r in range(0, count, per)])


def landed_check(ref: Reference, infos: list[TensorInfo], out: dict[str, Any]) -> dict[str, Any]:
    """IntegrityError unless every tensor of ``out`` (whole tensors) landed as ``ref`` says; else
    what a single-process verified load reports (``verify``, ``manifest``, ``verified``)."""
    hasher = LandedHasher(infos, ref.expected(infos), against=ref.against)
    for t in infos:
        hasher.landed(t.file, t.offset, as_bytes(out[t.name]))
    hasher.check()
    said: dict[str, Any] = {"verify": ref.summary(len(infos)), "manifest": ref.manifest}
    if ref.published:
        said["verified"] = len(infos)
    return said


def in_store(path: str | os.PathLike[str] | Checkpoint) -> bool:
    """Whether ``path`` is a checkpoint in a store (a URL, or a checkpoint opened from one)."""
    if isinstance(path, Checkpoint):
        return path.source is not None
    return isinstance(path, str) and is_url(path)
