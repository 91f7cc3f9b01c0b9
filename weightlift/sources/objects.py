"""The objects of one checkpoint in a store: their identities, their headers, their bytes.

:class:`Objects` is what a :class:`~weightlift.checkpoint.Checkpoint` opened from a URL keeps as
its ``source``: the store clients, and each object's size and ETag as they were when its header
was read. Opening reads at most two small ranges per safetensors object (a speculative
:data:`HEAD_GUESS` bytes that usually hold the whole header, then the rest if it is longer) and a
growing prefix for GGUF, whose header length is known only once parsed. Loading, hashing and
pushing read tensor bytes through :mod:`weightlift.sources.engine`.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from weightlift.errors import FormatError, NotFoundError
from weightlift.formats import TensorInfo
from weightlift.formats import safetensors as st
from weightlift.sources.store import ObjectInfo, Store, store_for
from weightlift.sources.tuning import Tuning, tuning_for
from weightlift.sources.url import Location, parse

__all__ = ["Objects", "objects_for", "opened", "HEAD_GUESS", "GGUF_FIRST", "MAX_GGUF_HEADER", "IDENTITY"]

#: bytes read first from a safetensors object: its header in one request, most of the time
HEAD_GUESS = 256 * 1024
#: bytes of a GGUF object read first, growing fourfold while the header runs past them
GGUF_FIRST = 2 * 1024 * 1024
#: the most of a GGUF object read for its header (less where the store's memory budget is less)
MAX_GGUF_HEADER = 512 * 1024 * 1024
#: the key of a tensor's ``extra`` that holds the :class:`ObjectInfo` its header was read from
IDENTITY = "identity"


class Objects:
    """The objects behind one opened URL (all in one bucket or on one host)."""

    def __init__(self, url: str):
        self.root = parse(url)
        self._infos: dict[str, ObjectInfo] = {}
        self._first: dict[str, bytes] = {}  # each object's first HEAD_GUESS bytes, read once
        self._lock = threading.Lock()

    # -- names -------------------------------------------------------------------------------

    def location(self, url: str) -> Location:
        return parse(url)

    def store(self, url: str) -> Store:
        return store_for(self.location(url))

    def sibling(self, url: str, name: str) -> str:
        return self.location(url).sibling(name).url

    def child(self, url: str, name: str) -> str:
        return self.location(url).child(name).url

    def tuning(self) -> Tuning:
        return tuning_for(self.store(self.root.url).config.endpoint_key)

    # -- identities ----------------------------------------------------------------------------

    def info(self, url: str) -> ObjectInfo:
        """The object's size and ETag, asked once: every later read is of this version."""
        with self._lock:
            got = self._infos.get(url)
        if got is None:
            got = self.store(url).head(self.location(url))
            with self._lock:
                got = self._infos.setdefault(url, got)
            with _opened_lock:
                _opened[url] = self
        return got

    def adopt(self, info: ObjectInfo) -> None:
        """Take ``info``, read elsewhere (by another rank of a group), as the version of its
        object: every later read here is of that version, as if this process had asked."""
        with self._lock:
            self._infos[info.url] = info
        with _opened_lock:
            _opened[info.url] = self

    def exists(self, url: str) -> bool:
        try:
            self.info(url)
        except NotFoundError:
            return False
        return True

    def listing(self, url: str) -> list[str] | None:
        """Names inside prefix ``url``; None where the store cannot list (HTTP)."""
        return self.store(url).listing(self.location(url))

    @property
    def identity(self) -> dict[str, ObjectInfo]:
        with self._lock:
            return dict(self._infos)

    # -- bytes -----------------------------------------------------------------------------------

    def read(self, url: str, offset: int, n: int) -> bytes:
        """``n`` bytes of the object at ``offset`` (clipped to its end)."""
        info = self.info(url)
        n = max(0, min(n, info.size - offset))
        return self.store(url).read(info, self.location(url), offset, n) if n else b""

    def read_into(
        self, url: str, offset: int, dst: memoryview, *, identity: ObjectInfo | None = None, **kw: Any
    ) -> None:
        """Bytes of the object at ``offset`` into ``dst``, of the version ``identity`` names
        (default: the one these objects read)."""
        info = identity if identity is not None else self.info(url)
        self.store(url).read_into(info, self.location(url), offset, dst, **kw)

    def read_all(self, url: str, limit: int) -> bytes:
        """The whole object (an index, a manifest), FormatError if over ``limit`` bytes."""
        info = self.info(url)
        if info.size > limit:
            raise FormatError(f"is {info.size} bytes, over the limit of {limit}", file=url)
        return self.read(url, 0, info.size)

    # -- headers ---------------------------------------------------------------------------------

    def safetensors_header(self, url: str) -> tuple[list[TensorInfo], dict[str, str]]:
        """The tensors and metadata of a safetensors object: one ranged read, two if its header
        is longer than :data:`HEAD_GUESS`."""
        size = self.info(url).size
        first = self.first(url)
        n = st.header_length(first[: st.PREFIX_SIZE], file=url, file_size=size)
        end = st.PREFIX_SIZE + n
        header = first[st.PREFIX_SIZE : end]
        if len(first) < end:
            header += self.read(url, len(first), end - len(first))
        if len(header) != n:
            raise FormatError("object ended inside its header", file=url)
        tensors, metadata = st.parse_header(header, file=url, file_size=size)
        return self._stamped(url, tensors), metadata

    def gguf_header(self, url: str) -> tuple[list[TensorInfo], dict[str, Any]]:
        """The tensors and metadata of a GGUF object, from a prefix read until the header parses.

        The prefix grows (fourfold, or to what the parser says it needs) only while the parse
        stops at its end (:class:`~weightlift.formats.gguf.Truncated`), and never past the
        store's memory budget or :data:`MAX_GGUF_HEADER`: any other error is the file's, raised
        at once."""
        from weightlift.formats import gguf

        size = self.info(url).size
        limit = min(size, MAX_GGUF_HEADER, self.tuning().budget)
        buf = self.first(url)
        if len(buf) < min(size, GGUF_FIRST):
            buf += self.read(url, len(buf), min(size, GGUF_FIRST) - len(buf))
        while True:
            try:
                head = gguf.parse_gguf(buf, file=url, file_size=size)
                return self._stamped(url, list(head.tensors)), dict(head.metadata)
            except gguf.Truncated as e:
                if e.needed > limit:
                    raise FormatError(
                        f"GGUF header needs more than {limit} bytes, the most read for a header here "
                        f"(the store's memory budget): {e.reason}",
                        file=url,
                    ) from None
                want = min(limit, max(e.needed, len(buf) * 4))
            more = self.read(url, len(buf), want - len(buf))
            if not more:
                raise FormatError("object ended inside its header", file=url)
            buf += more

    def _stamped(self, url: str, tensors: list[TensorInfo]) -> list[TensorInfo]:
        """``tensors``, each marked with the version of the object its header was read from:
        code handed only a tensor (a push's reads, :func:`opened`) reads that version, even
        where the URL was opened again since as another one."""
        info = self.info(url)
        for t in tensors:
            t.extra[IDENTITY] = info
        return tensors

    def first(self, url: str) -> bytes:
        """The object's first :data:`HEAD_GUESS` bytes (its magic and, usually, its header)."""
        got = self._first.get(url)
        if got is None:
            got = self._first[url] = self.read(url, 0, HEAD_GUESS)
        return got

    def magic(self, url: str) -> bytes:
        return self.first(url)[:4]

    def find_manifest(self, path: str) -> str:
        """The published manifest of the checkpoint at ``path``: beside it
        (``<object>.manifest.json``), else in its prefix (``weightlift.manifest.json``), as
        ``weightlift manifest`` writes them; NotFoundError naming both places."""
        tried = [path + ".manifest.json", self.sibling(path, "weightlift.manifest.json")]
        for url in tried:
            if self.exists(url):
                return url
        raise NotFoundError(
            f"no published manifest at {' or '.join(tried)} (write one with `weightlift manifest`, or pass manifest=)",
            file=path,
        )

    def put(self, url: str, data: bytes) -> None:
        """Write ``data`` as the object ``url`` (a published manifest)."""
        self.store(url).put(self.location(url), data)


_opened: weakref.WeakValueDictionary[str, Objects] = weakref.WeakValueDictionary()
_opened_lock = threading.Lock()


def opened(url: str) -> Objects:
    """The :class:`Objects` that last read ``url``'s identity in this process (a checkpoint
    opened from it and still alive), else fresh ones: for code handed a tensor's URL only."""
    with _opened_lock:
        got = _opened.get(url)
    return got if got is not None else Objects(url)


def objects_for(url: str) -> Objects:
    """Fresh :class:`Objects` for ``url`` (identities are read again)."""
    return Objects(url)
