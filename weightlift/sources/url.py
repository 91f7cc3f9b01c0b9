"""Where an object lives: ``s3://bucket/key`` or ``http(s)://host/path``, parsed without I/O.

A *location* names one object or one prefix (a folder) of objects. Names beside it (the shards
of an index, the published manifest) are joined with ``/`` as in the store, never with the local
path separator. An http(s) URL with a query string or a fragment is refused: a signed query
belongs to one object and one moment, and would not survive being joined with a shard's name.

An ``s3://`` URL is not an http URL: everything after ``s3://bucket/`` is the key, as it is,
as the AWS CLI reads it (a key may hold ``#``, ``?``, ``%`` or a space; nothing is decoded).
An http(s) URL is percent-encoded: its key is the decoded path (``a%20b`` is the file ``a b``),
which the client encodes once again on the wire, and :attr:`Location.url` encodes it back.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

from weightlift.errors import OptionError

__all__ = ["SCHEMES", "Location", "is_url", "parse"]

SCHEMES = ("s3", "http", "https")
# what stays as it is in an http(s) URL's path when a key is encoded back (RFC 3986's pchar)
_PATH_SAFE = "/!$&'()*+,;=:@~"


def is_url(path: object) -> bool:
    """Whether ``path`` names an object in a store (``s3://``, ``http://``, ``https://``)."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    return isinstance(path, str) and path.split("://", 1)[0].lower() in SCHEMES and "://" in path


@dataclass(frozen=True)
class Location:
    """One object (or prefix): its scheme, the store's root (bucket or ``scheme://host``), its key."""

    scheme: str
    #: the bucket for s3, ``scheme://host[:port]`` for http(s)
    root: str
    #: the object's key (no leading ``/``); a prefix ends in ``/`` or is empty
    key: str

    @property
    def url(self) -> str:
        if self.scheme == "s3":
            return f"s3://{self.root}/{self.key}"
        return f"{self.root}/{quote(self.key, safe=_PATH_SAFE)}"

    @property
    def name(self) -> str:
        return posixpath.basename(self.key.rstrip("/"))

    def sibling(self, name: str) -> Location:
        """The object ``name`` beside this one (in its prefix)."""
        return Location(self.scheme, self.root, posixpath.join(posixpath.dirname(self.key), name))

    def child(self, name: str) -> Location:
        """The object ``name`` inside this prefix."""
        base = self.key if not self.key or self.key.endswith("/") else self.key + "/"
        return Location(self.scheme, self.root, base + name)


def parse(url: str) -> Location:
    """The location ``url`` names; OptionError for what is not a store URL weightlift reads."""
    if url[:5].lower() == "s3://":
        return _parse_s3(url)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise OptionError(f"not a store URL (expected s3://, http:// or https://): {url!r}")
    if parts.query or parts.fragment:
        raise OptionError(f"{scheme}:// URLs with a query or fragment are not supported: {_shown(url)}")
    if not parts.netloc:
        raise OptionError(f"{url!r} names no {'bucket' if scheme == 's3' else 'host'}")
    if parts.username or parts.password:
        raise OptionError(f"credentials in a URL are not supported (use the AWS configuration): {_shown(url)}")
    key = unquote(parts.path.lstrip("/"))  # the client encodes the key on the wire: decoded once here
    if ".." in key.split("/"):
        raise OptionError(f"a key with '..' is not supported: {_shown(url)}")
    return Location(scheme, f"{scheme}://{parts.netloc}", key)


def _parse_s3(url: str) -> Location:
    """``s3://bucket/key``: the key is everything after the bucket's ``/``, as it is."""
    bucket, _, key = url[5:].partition("/")
    if not bucket:
        raise OptionError(f"{url!r} names no bucket")
    if "@" in bucket or ":" in bucket:  # no bucket name holds either: credentials, or a port
        raise OptionError(f"not a bucket name (credentials in a URL are not supported): {bucket.rsplit('@', 1)[-1]!r}")
    key = key.lstrip("/")
    if ".." in key.split("/"):
        raise OptionError(f"a key with '..' is not supported: s3://{bucket}/...")
    return Location("s3", bucket, key)


def _shown(url: str) -> str:
    # never echo a query string (it may hold a signature) or a password
    p = urlsplit(url)
    host = p.hostname or ""
    return f"{p.scheme}://{host}{':' + str(p.port) if p.port else ''}{p.path}"
