"""One store's client: object identity, small reads, and ranged reads straight into a buffer.

Every request for tensor bytes carries the ETag seen when the object's header was read as
``If-Match`` (for a server that states no ETag, its Last-Modified as ``If-Unmodified-Since``), and
every answer's validators are compared with those: an object replaced while a load reads it
answers 412 or states another version, and the load stops with a FormatError naming it, as a
local file changed under a load does; bytes of two versions are never mixed. An answer that
states no validator proves nothing (a server may ignore ``If-Match`` as well), so once such a
read has landed the object's validators are asked again (a HEAD) and must still be the ones
seen at open. An object that states neither validator at open cannot be re-checked: its bytes
are read only by a caller that checks them itself (a load verified against a published
manifest, a header parser, a calibration's timing), and anyone else gets a FileError naming it.

A body cut short (a reset connection, a server that stops early) is resumed from the byte where
it stopped, with backoff, up to :class:`~weightlift.sources.credentials.Retry`'s limit, and given
up once no byte of it has landed for the retry time; requests that fail before a body (5xx,
throttling, refused connections) are retried by obstore.

The body arrives in chunks of at least :data:`CHUNK` bytes, each copied once into its place in
the destination while the next is received on obstore's own threads (the GIL is not held while
bytes are received); whoever watches the bytes land is told of them :data:`PIECE` bytes at a
time. Chunks are kept small on purpose: obstore gathers network reads smaller than the asked
minimum into a buffer of that size, and a buffer of a mebibyte may come fresh from the
allocator each time (a mapping of its own, faulted in page by page and unmapped after: glibc
does so until a freed block of that size has raised its mapping threshold), which then costs
more system time than the copy out of it. Foreign errors become weightlift's here, naming the object and what to
check, and never a credential.
"""

from __future__ import annotations

import errno
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from weightlift.errors import FileError, FormatError, NotFoundError, OptionError, TransportError, WeightliftError
from weightlift.profile import Profiler
from weightlift.sources.credentials import Retry, describe, make_store, resolve
from weightlift.sources.url import Location

__all__ = ["ObjectInfo", "Store", "store_for", "forget_stores", "PIECE"]

#: the most bytes of a body held per connection inside the client while they are copied out
PIECE = 1024 * 1024
#: the smallest chunk of a body obstore hands over at once (it gathers smaller network reads)
CHUNK = 64 * 1024
_OFF = Profiler(enabled=False)
#: objects asked for per page of a listing (S3's own most)
LIST_PAGE = 1000
#: pages a prefix's listing may take, restarts past sub-prefixes included
MAX_LIST_PAGES = 1000
#: objects directly inside a prefix that a listing keeps at most
MAX_LISTED = 100_000
# after a sub-prefix's name: sorts after every key under it (keys are compared as UTF-8 bytes)
_PAST_ALL = "/\U0010ffff"


@dataclass(frozen=True)
class ObjectInfo:
    """An object as its header was read: a load reads only bytes of this version."""

    url: str
    size: int
    etag: str | None
    version: str | None = None
    #: the Last-Modified it stated: what identifies the version where a server states no ETag
    last_modified: datetime | None = None


class Store:
    """The client of one bucket (or one HTTP host), shared by every object read from it."""

    def __init__(self, loc: Location, *, retry: Retry | None = None, connections: int = 16):
        self.config, provider = resolve(loc)
        self.retry = retry or Retry()
        self._scheme = loc.scheme
        self._store = make_store(self.config, provider, self.retry, connections=connections)

    def _key(self, loc: Location) -> str:
        return loc.key

    def head(self, loc: Location) -> ObjectInfo:
        """The object's size and identity; NotFoundError if it does not exist."""
        import obstore

        try:
            meta = obstore.head(self._store, self._key(loc))
        except Exception as e:  # noqa: BLE001 - mapped to weightlift's errors here
            raise self.error(e, loc.url, "read its metadata") from None
        return ObjectInfo(loc.url, int(meta["size"]), meta.get("e_tag"), meta.get("version"), _modified(meta))

    def exists(self, loc: Location) -> bool:
        try:
            self.head(loc)
        except NotFoundError:
            return False
        return True

    def listing(self, loc: Location) -> list[str] | None:
        """The names directly inside prefix ``loc`` (objects, not sub-prefixes); None where the
        store cannot list (plain HTTP).

        Read a page at a time, and at most :data:`MAX_LIST_PAGES` pages: a store whose listing
        is always truncated (a new continuation token each page) would otherwise be asked for
        pages forever, each one kept. A page that ends inside a sub-prefix is followed by one that
        starts past all it holds: a sub-prefix of many objects costs one request, not a page each
        thousand, and small ones (a folder per saved step) are read through in the page they
        came in, not a request each. FormatError naming the prefix past the bound."""
        if self._scheme != "s3":
            return None
        import obstore

        prefix = loc.key if not loc.key or loc.key.endswith("/") else loc.key + "/"
        names: list[str] = []
        pages, offset = 0, None
        try:
            while True:
                resume = None
                for chunk in obstore.list(self._store, prefix or None, offset=offset, chunk_size=LIST_PAGE):
                    pages += 1
                    if pages > MAX_LIST_PAGES:
                        raise FormatError(
                            f"the prefix lists more than {MAX_LIST_PAGES} pages of objects; name the checkpoint's "
                            f"file or index",
                            file=loc.url,
                        )
                    resume = _page(chunk, prefix, offset, names, loc.url)
                    if resume is not None:
                        break
                if resume is None:
                    return sorted(names)
                offset = resume
        except WeightliftError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self.error(e, loc.url, "list the prefix") from None

    def put(self, loc: Location, data: bytes) -> None:
        import obstore

        try:
            obstore.put(self._store, self._key(loc), data)
        except Exception as e:  # noqa: BLE001
            raise self.error(e, loc.url, "write it") from None

    def read(self, obj: ObjectInfo, loc: Location, offset: int, n: int) -> bytes:
        """``n`` bytes of the object at ``offset`` (a header: small), as bytes."""
        buf = bytearray(n)
        # a header is parsed, and the tensors it places are read under the rules above
        self.read_into(obj, loc, offset, memoryview(buf), unvalidated_ok=True)
        return bytes(buf)

    def read_into(
        self,
        obj: ObjectInfo,
        loc: Location,
        offset: int,
        dst: memoryview,
        *,
        prof: Profiler = _OFF,
        on_piece: Callable[[int, int], None] | None = None,
        unvalidated_ok: bool = False,
    ) -> None:
        """Bytes [offset, offset + len(dst)) of ``obj`` into ``dst``, resumed where a body stops.

        ``on_piece(start, end)`` is told each range of ``dst`` as it is filled. An object without
        a validator (no ETag, no Last-Modified) is read only with ``unvalidated_ok``: the caller
        checks the bytes itself (a verified load), since nothing here could tell two versions
        apart."""
        if not (obj.etag or obj.last_modified or obj.version or unvalidated_ok):
            raise FileError(
                "the store states neither an ETag nor a Last-Modified for it, so a replacement during "
                "a load could not be detected; load it with verify=True (against its published "
                "manifest), or serve it from a store that states either",
                file=obj.url,
            )
        n = dst.nbytes
        done, attempt = 0, 0
        unproven: list[bool] = []  # one entry per answer that did not state the version read
        moved = time.monotonic()  # when a byte last landed (or the read began)
        while done < n:
            try:
                done = self._body(obj, loc, offset, dst, done, prof, on_piece, unproven)
            except _Interrupted as cut:
                if cut.done > done:
                    moved = time.monotonic()
                done = cut.done
                attempt += 1
                # a body that brings nothing (stalled, or trickling under a chunk per request) is
                # given the retry time once: the client already retried it that long inside
                if time.monotonic() - moved > self.retry.retry_timeout_s:
                    raise TransportError(
                        f"{obj.url}: no byte of the body arrived at byte {offset + done} for "
                        f"{self.retry.retry_timeout_s:g} s ({cut.reason}); check the connection to "
                        f"{describe(self.config)}"
                    ) from None
                if attempt > self.retry.max_retries:
                    raise TransportError(
                        f"{obj.url}: the body stopped at byte {offset + done} {attempt} times "
                        f"({cut.reason}); check the connection to {describe(self.config)}"
                    ) from None
                time.sleep(self.retry.backoff(attempt))
        if unproven and (obj.etag or obj.last_modified):
            self._recheck(obj, loc)

    def _recheck(self, obj: ObjectInfo, loc: Location) -> None:
        """After bytes came in answers that stated no validator: the object must still be the
        version seen at open (if it was replaced since, what landed may be of either)."""
        now = self.head(loc)
        if now.size != obj.size or (now.etag != obj.etag if obj.etag else now.last_modified != obj.last_modified):
            raise _changed(obj)

    def _body(
        self,
        obj: ObjectInfo,
        loc: Location,
        offset: int,
        dst: memoryview,
        done: int,
        prof: Profiler,
        on_piece: Callable[[int, int], None] | None,
        unproven: list[bool],
    ) -> int:
        """One request for what is left; returns how much of ``dst`` is filled when its body ends."""
        import obstore

        n = dst.nbytes
        opts: Any = {"range": (offset + done, offset + n)}
        if obj.etag:
            opts["if_match"] = obj.etag
        elif obj.last_modified is not None:
            opts["if_unmodified_since"] = obj.last_modified
        if obj.version:
            opts["version"] = obj.version
        try:
            t0 = prof.clock()
            with prof.phase("wire", name="request"):  # until the response's headers: the store's latency
                res = obstore.get(self._store, self._key(loc), options=opts)
            prof.command("GET headers", t0, prof.clock())
            if not self._same(obj, res.meta):
                unproven.append(True)
            first = prof.enabled
            told = done  # on_piece has been told of dst[:told]
            with prof.phase("read", n - done, name="body"):
                try:
                    for piece in res.stream(min_chunk_size=CHUNK):
                        if first:  # request to first body byte (its first chunk): the commands table's mean
                            prof.command("GET first byte", t0, prof.clock())
                            first = False
                        k = len(piece)
                        if done + k > n:
                            raise FileError(
                                f"the store sent more bytes than the range asked for at {offset + done}", file=obj.url
                            )
                        dst[done : done + k] = piece
                        done += k
                        if on_piece is not None and done - told >= PIECE:
                            a, told = told, done
                            on_piece(a, done)
                finally:  # what landed before the body ended (or was cut: it resumes after it)
                    if on_piece is not None and done > told:
                        a, told = told, done
                        on_piece(a, done)
        except WeightliftError:
            raise
        except Exception as e:  # noqa: BLE001 - an interrupted body, or an error to map
            if _interrupted(e):
                raise _Interrupted(done, type(e).__name__) from None
            raise self.error(e, obj.url, f"read bytes [{offset + done}, {offset + n})") from None
        if done < n:  # the body ended early but cleanly: a server's truncated answer
            raise _Interrupted(done, f"the body ended {n - done} bytes short")
        return done

    def _same(self, obj: ObjectInfo, meta: Any) -> bool:
        """Raise if an answer states another version than ``obj``; whether it stated ``obj``'s
        (an answer without its validator proves nothing: the server may ignore ``If-Match``)."""
        tag, modified = meta.get("e_tag"), _modified(meta)
        if obj.etag and tag and tag != obj.etag or int(meta.get("size", obj.size)) != obj.size:
            raise _changed(obj)
        if obj.version:  # a read of one version of a versioned object: that version or nothing
            return True
        if obj.etag:
            return tag == obj.etag
        # without an ETag, the date is the version (a server that ignores If-Unmodified-Since
        # still states it)
        if obj.last_modified is not None and modified is not None and modified != obj.last_modified:
            raise _changed(obj)
        return obj.last_modified is not None and modified == obj.last_modified

    def error(self, e: BaseException, url: str, what: str) -> WeightliftError:
        """``e`` (obstore's) as weightlift's error, naming the object and what to check."""
        import obstore.exceptions as ox

        cfg = describe(self.config)
        status = _status(e)
        if isinstance(e, (ox.NotFoundError, FileNotFoundError)) or status in (404, 410):
            if "NoSuchBucket" in str(e):  # S3's code for it, in the answer's body
                return NotFoundError(
                    f"no such bucket {self.config.root!r} (check its name and the endpoint: {cfg})", file=url
                )
            if self._scheme != "s3":
                return NotFoundError("no such file (the server answered 404; name a folder with its '/')", file=url)
            return NotFoundError(f"no such object (check the bucket, the key and the endpoint: {cfg})", file=url)
        if isinstance(e, ox.PreconditionError) or status == 412:
            return _changed_url(url)
        if status == 416:  # a range inside the size seen at open, refused: the object is shorter now
            return FormatError(
                f"the store refused to {what} as past the object's end (416 Range Not Satisfiable): it is "
                "shorter than when its header was read; open it again",
                file=url,
            )
        if isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError, PermissionError)) or status in (401, 403):
            check = (
                "the credentials, AWS_PROFILE, the bucket policy"
                if self._scheme == "s3"
                else "the server's permissions"
            )
            return FileError(f"access denied: cannot {what} (check {check}; {cfg})", file=url, errno=errno.EACCES)
        if _not_partial(e):  # obstore gives no body of a 200 to a ranged GET
            return TransportError(
                f"{url}: cannot {what}: the server answered the ranged GET with 200 OK instead of "
                "206 Partial Content (some S3 gateways do so even with a Content-Range of exactly the "
                "range asked: rclone's serve s3, lakeFS); weightlift reads objects only by ranges "
                f"answered 206 ({cfg})"
            )
        if isinstance(e, ox.UnknownConfigurationKeyError):
            return OptionError(f"{url}: store configuration: {_first_line(e)}")
        return TransportError(f"{url}: cannot {what}: {_first_line(e)} ({cfg})")


class _Interrupted(Exception):
    def __init__(self, done: int, reason: str):
        self.done = done
        self.reason = reason


def _interrupted(e: BaseException) -> bool:
    """Whether ``e`` is a body cut short (worth resuming), not a refusal. An answer with a
    status is never one, whatever its body says (a 400 whose message mentions a connection is
    still a 400): obstore has already retried the statuses worth retrying (5xx, 429)."""
    import obstore.exceptions as ox

    if isinstance(
        e,
        (
            ox.NotFoundError,
            ox.PreconditionError,
            ox.PermissionDeniedError,
            ox.UnauthenticatedError,
            ox.NotSupportedError,
        ),
    ):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    if _status(e) is not None or _not_partial(e):
        return False
    text = str(e)
    return any(
        s in text for s in ("body", "Body", "connection", "Connection", "reset", "closed", "timed out", "Decode")
    )


def _not_partial(e: BaseException) -> bool:
    """Whether ``e`` is obstore's refusal of a ranged GET answered 200 (its HTTP and its S3
    client word it differently)."""
    text = str(e)
    return "Range request not supported" in text or "non-partial response when range requested" in text


# obstore's message of an answer with an error status: "... status code: 416 Range Not Satisfiable: <body>"
_STATUS = re.compile(r"(?:status code: |\bstatus: )([45]\d\d)\b")


def _status(e: BaseException) -> int | None:
    """The HTTP status of the answer ``e`` reports, from obstore's message (its only carrier);
    None for an error without one (a cut body, a refused connection)."""
    m = _STATUS.search(str(e))
    return int(m[1]) if m else None


def _modified(meta: Any) -> datetime | None:
    """The Last-Modified an answer stated; None where it stated none (obstore then says 1970)."""
    got: datetime | None = meta.get("last_modified")
    return got if got is not None and got.timestamp() > 0 else None


def _first_line(e: BaseException) -> str:
    # obstore's message starts with the status line; its debug dump after that may be long
    text = str(e).split("\n", 1)[0]
    return text[:300]


def _page(chunk: Any, prefix: str, offset: str | None, names: list[str], url: str) -> str | None:
    """Take the names of a listing page's objects directly inside ``prefix`` into ``names``;
    returns where the next page should start when the page ended inside a sub-prefix (past every
    key under it), else None (the listing goes on as it is). Only the page's end matters: the
    page is already here, and a sub-prefix of a few keys costs nothing more to read through than
    it would to step over, while one that runs past the page is stepped over in one request."""
    resume = None
    for o in chunk:
        rest = o["path"][len(prefix) :]
        if "/" not in rest:
            names.append(rest)
            if len(names) > MAX_LISTED:
                raise FormatError(
                    f"the prefix holds more than {MAX_LISTED} objects; name the checkpoint's file or index", file=url
                )
            resume = None
            continue
        after = prefix + rest.split("/", 1)[0] + _PAST_ALL
        resume = after if offset is None or after > offset else None  # past every key under it
    return resume


def _changed(obj: ObjectInfo) -> FormatError:
    return _changed_url(obj.url)


def _changed_url(url: str) -> FormatError:
    return FormatError(
        "changed in the store since its header was read (its ETag or Last-Modified differs); open it again", file=url
    )


_stores: dict[tuple[str, str], Store] = {}
_stores_lock = threading.Lock()
_retry = Retry()


def store_for(loc: Location) -> Store:
    """The process's one client for ``loc``'s bucket or host (connections are pooled per client)."""
    key = (loc.scheme, loc.root)
    with _stores_lock:
        s = _stores.get(key)
        if s is None:
            s = _stores[key] = Store(loc, retry=_retry)
        return s


def forget_stores(*, retry: Retry | None = None) -> None:
    """Drop every client (the next read resolves credentials and endpoints afresh); ``retry``
    replaces the retry policy of the clients made from now on."""
    global _retry
    with _stores_lock:
        _stores.clear()
        if retry is not None:
            _retry = retry
