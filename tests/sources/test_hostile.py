"""A hostile or broken web server in front of a load: each lie ends in an error naming the
object (or in the exact bytes), never in bytes of two versions mixed or of the wrong range.

The server here is a few lines of ``http.server`` serving one object from memory, so that each
test says exactly what its headers and bodies claim."""

from __future__ import annotations

import contextlib
import gzip
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import weightlift as wl
from tests.checkpoints import raw_bytes, write
from weightlift.errors import FileError, FormatError, TransportError
from weightlift.sources.credentials import Retry
from weightlift.sources.store import forget_stores

pytest.importorskip("obstore", reason="store URLs need obstore (the s3 extra)")

LAST_MODIFIED = "Tue, 01 Dec 2026 00:00:00 GMT"


class Served:
    """One object at ``/m.safetensors``. ``etag``/``last_modified``: the validators every
    response states; ``replace``: (the ranged GET after which ``data`` becomes these bytes and
    ``last_modified`` this date); ``lie``: what the ranged answers do wrong."""

    def __init__(self, data: bytes):
        self.data = data
        self.etag: str | None = '"v0"'
        self.last_modified: str | None = LAST_MODIFIED
        self.replace: tuple[int, bytes, str] | None = None
        self.lie: str | None = None
        #: whether ranged answers state the validators (False: only HEAD and whole GETs do)
        self.ranged_validators = True
        self.gets = 0
        self.heads = 0
        self.lock = threading.Lock()

    def headers(self) -> dict[str, str]:
        out = {}
        if self.etag:
            out["ETag"] = self.etag
        if self.last_modified:
            out["Last-Modified"] = self.last_modified
        return out

    def answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        with self.lock:
            data, validators = self.data, self.headers()
            m = re.fullmatch(r"bytes=(\d+)-(\d+)", h.headers.get("Range", ""))
            self.heads += head
            if m and not head:
                self.gets += 1
                if not self.ranged_validators:
                    validators = {}
                if self.replace is not None and self.gets == self.replace[0]:
                    _, self.data, self.last_modified = self.replace
                    self.etag = self.etag and '"v1"'
        if h.path != "/m.safetensors":
            h.send_response(404)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        if head or not m:
            h.send_response(200)
            for k, v in validators.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            if not head:
                h.wfile.write(data)
            return
        a, z = int(m[1]), int(m[2])
        body, start, encoding = data[a : z + 1], a, None
        if self.lie in ("whole", "400", "416", "200-range"):
            return self._not_partial(h, validators, data, a, z)
        if self.lie == "range":  # states and sends bytes from the object's start
            body, start = data[: len(body)], 0
        elif self.lie == "longer":  # more body than the range asked for
            body = data[a : z + 1 + 4096]
        elif self.lie == "gzip":  # an encoding nobody asked for
            body, encoding = gzip.compress(body), "gzip"
        elif self.lie == "trickle":
            return self._trickle(h, f"bytes {a}-{z}/{len(data)}", body, validators)
        self._partial(h, validators, f"bytes {start}-{start + (z - a)}/{len(data)}", body, encoding)

    def _not_partial(self, h: BaseHTTPRequestHandler, validators: dict[str, str], data: bytes, a: int, z: int) -> None:
        """Answers to a ranged GET that are not a 206."""
        if self.lie == "whole":  # Range ignored: 200 and the whole object
            h.send_response(200)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)
        elif self.lie in ("400", "416"):  # a refusal whose message reads like a cut connection
            msg = b"<Error><Message>connection reset: the body stopped, connection closed</Message></Error>"
            h.send_response(int(self.lie))
            h.send_header("Content-Length", str(len(msg)))
            h.end_headers()
            h.wfile.write(msg)
        else:  # the range asked for, and a Content-Range saying so, but 200
            h.send_response(200)
            for k, v in validators.items():
                h.send_header(k, v)
            h.send_header("Content-Range", f"bytes {a}-{z}/{len(data)}")
            h.send_header("Content-Length", str(z + 1 - a))
            h.end_headers()
            h.wfile.write(data[a : z + 1])

    @staticmethod
    def _trickle(h: BaseHTTPRequestHandler, span: str, body: bytes, validators: dict[str, str]) -> None:
        """The headers at once, then a byte now and then, never the end."""
        Served._partial(h, validators, span, b"", None, length=len(body))
        with contextlib.suppress(OSError):
            for i in range(len(body)):
                h.wfile.write(body[i : i + 1])
                h.wfile.flush()
                time.sleep(0.2)

    @staticmethod
    def _partial(
        h: BaseHTTPRequestHandler,
        validators: dict[str, str],
        span: str,
        body: bytes,
        encoding: str | None,
        length: int | None = None,
    ) -> None:
        h.send_response(206)
        for k, v in validators.items():
            h.send_header(k, v)
        h.send_header("Content-Range", span)
        if encoding:
            h.send_header("Content-Encoding", encoding)
        h.send_header("Content-Length", str(len(body) if length is None else length))
        h.end_headers()
        h.wfile.write(body)


@pytest.fixture
def served(tmp_path, monkeypatch) -> Iterator[tuple[Served, str, dict, bytes]]:
    """The served object (a checkpoint of two tensors), its URL, the local load, and the bytes
    of a second version of the same size."""
    t0 = [("a", "U8", (300_000,), bytes(300_000)), ("b", "U8", (200_000,), bytes(range(200)) * 1000)]
    t1 = [("a", "U8", (300_000,), b"\x01" * 300_000), ("b", "U8", (200_000,), bytes(range(200)) * 1000)]
    v0 = write(tmp_path / "v0.safetensors", t0).read_bytes()
    v1 = write(tmp_path / "v1.safetensors", t1).read_bytes()
    assert len(v0) == len(v1)
    s = Served(v0)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: object) -> None:
            pass

        def do_GET(self) -> None:
            s.answer(self, head=False)

        def do_HEAD(self) -> None:
            s.answer(self, head=True)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setenv("WEIGHTLIFT_SOURCE_PART", str(128 * 1024))  # several ranged reads per tensor
    forget_stores(retry=Retry(max_retries=2, init_backoff_s=0.01, max_backoff_s=0.02, retry_timeout_s=5))
    try:
        yield s, f"http://127.0.0.1:{httpd.server_address[1]}/m.safetensors", wl.load(tmp_path / "v0.safetensors"), v1
    finally:
        forget_stores(retry=Retry())
        httpd.shutdown()
        httpd.server_close()


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b) and all(raw_bytes(a[k]) == raw_bytes(b[k]) for k in b)


@pytest.mark.parametrize("validators", ["etag", "last_modified"])
def test_an_object_replaced_mid_load_at_the_same_size_is_an_error(served, validators):
    """The second ranged read onwards sees another version of the object, of the same size. With
    an ETag every read carries If-Match; a server that sends only Last-Modified (no ETag, as
    Python's own http.server) must be held to that date the same way: the load stops with a
    FormatError naming the object, never returning bytes of both versions."""
    s, url, _, v1 = served
    if validators == "last_modified":
        s.etag = None
    ck = wl.open(url)
    s.replace = (2, v1, "Tue, 01 Dec 2026 12:00:00 GMT")
    with pytest.raises(FormatError, match="changed in the store") as e:
        wl.load(ck, threads=1)
    assert url in str(e.value)


@pytest.mark.parametrize("validators", ["etag", "last_modified"])
def test_validators_on_head_only_and_if_match_ignored_never_yield_a_mix(served, validators):
    """A server that states the object's ETag (or Last-Modified) on HEAD but on no ranged
    answer, and ignores If-Match: the object is replaced after the second ranged read. The
    answers prove nothing, so the object is asked again after each read: the load stops with
    the FormatError naming it, never returning tensors of both versions."""
    s, url, _, v1 = served
    if validators == "last_modified":
        s.etag = None
    s.ranged_validators = False
    ck = wl.open(url)
    s.replace = (2, v1, "Tue, 01 Dec 2026 12:00:00 GMT")
    with pytest.raises(FormatError, match="changed in the store") as e:
        wl.load(ck, threads=1)
    assert url in str(e.value)


def test_validators_on_head_only_cost_a_head_per_read(served):
    """The same server, the object left alone: the load is exact, at one HEAD per ranged read."""
    s, url, local, _ = served
    s.ranged_validators = False
    ck = wl.open(url)
    heads, gets = s.heads, s.gets
    _same(wl.load(ck, threads=2), local)
    assert s.heads - heads == s.gets - gets > 1


def test_an_object_without_validators_is_read_only_by_a_verified_load(served, tmp_path):
    """No ETag and no Last-Modified anywhere, and the object replaced mid-load: an unverified
    load refuses it before reading a tensor byte (nothing could tell two versions apart); a load
    verified against the published manifest reads it, and its mix is an IntegrityError."""
    from weightlift.digest.published import make_manifest
    from weightlift.errors import IntegrityError

    s, url, local, v1 = served
    s.etag = s.last_modified = None
    manifest = make_manifest(tmp_path / "v0.safetensors")
    ck = wl.open(url)
    gets = s.gets
    with pytest.raises(FileError, match="neither an ETag nor a Last-Modified") as e:
        wl.load(ck, threads=1)
    assert url in str(e.value) and s.gets == gets
    _same(wl.load(ck, threads=1, verify=True, manifest=manifest), local)
    s.replace = (s.gets + 2, v1, None)
    with pytest.raises(IntegrityError):
        wl.load(ck, threads=1, verify=True, manifest=manifest)


def test_an_honest_server_without_etag_loads_exactly(served):
    s, url, local, _ = served
    s.etag = None
    _same(wl.load(wl.open(url), threads=2), local)


@pytest.mark.parametrize("lie", ["whole", "range", "longer", "gzip"])
def test_a_body_that_is_not_the_range_asked_for_is_refused(served, lie):
    """Range ignored (200 and the whole object), a Content-Range of another start, a body longer
    than the range, a body in an encoding nobody asked for: an error naming the object."""
    s, url, _, _ = served
    ck = wl.open(url)
    s.lie = lie
    with pytest.raises((FileError, TransportError), match=re.escape(url)):
        wl.load(ck, threads=1)


@pytest.mark.parametrize(("status", "error"), [("400", TransportError), ("416", FormatError)])
def test_a_refusal_is_not_retried_whatever_its_body_says(served, status, error):
    """A 400 or 416 whose body speaks of a connection reset and a body that stopped is a
    refusal, decided by its status: one request, and the error for that status naming the
    object (not eleven resumes and "the body stopped at byte 0")."""
    s, url, _, _ = served
    forget_stores(retry=Retry(max_retries=10, init_backoff_s=0.01, max_backoff_s=0.02, retry_timeout_s=30))
    ck = wl.open(url)
    s.lie = status
    gets = s.gets
    with pytest.raises(error, match=re.escape(url)) as e:
        wl.load(ck, threads=1)
    assert s.gets - gets == 1
    assert "times (" not in str(e.value) and (status in str(e.value) or "Range Not Satisfiable" in str(e.value))


@pytest.mark.parametrize("lie", ["200-range", "whole"])
def test_a_ranged_get_answered_200_is_refused_naming_it(served, lie):
    """A ranged GET answered 200, with a Content-Range of exactly the range asked (rclone's
    ``serve s3``, lakeFS) or with the whole object: the error says so, naming the object, after
    one request (a 200 does not become a 206 by asking again)."""
    s, url, _, _ = served
    ck = wl.open(url)
    s.lie = lie
    gets = s.gets
    with pytest.raises(TransportError, match="answered the ranged GET with 200 OK instead of 206") as e:
        wl.load(ck, threads=1)
    assert url in str(e.value) and s.gets - gets == 1


def test_a_push_reads_the_version_its_checkpoint_opened_when_the_url_was_opened_again(served):
    """``ck`` is opened; the object is replaced; the same URL is opened again (``again``, the new
    version). Pushing ``ck`` must send ``ck``'s version or stop with the FormatError that names
    the change, never the new version's bytes at the offsets of the old header."""
    from weightlift.remote.client import Client
    from weightlift.remote.server import Server

    s, url, local, v1 = served
    ck = wl.open(url)
    with s.lock:
        s.data, s.etag = v1, '"v1"'
    again = wl.open(url)
    with Server() as srv, Client(srv.address) as c:
        try:
            c.push(ck)
        except FormatError as e:
            assert "changed in the store" in str(e) and url in str(e)
        else:
            held = srv.tensors()
            assert {k: raw_bytes(held[k]) for k in local} == {k: raw_bytes(v) for k, v in local.items()}
    del again


def test_a_trickling_body_ends_in_an_error_within_the_retry_time(served):
    """A body that trickles (a byte now and then, never a whole chunk) makes no progress a resume
    could keep: the read gives up once no byte has landed for the retry time (``retry_timeout_s``),
    with an error that says so, rather than resuming it ``max_retries`` times, each of them
    retried that long again inside the client."""
    s, url, _, _ = served
    forget_stores(
        retry=Retry(max_retries=10, init_backoff_s=0.01, max_backoff_s=0.02, retry_timeout_s=1, timeout_s=0.5)
    )
    ck = wl.open(url)
    s.lie = "trickle"
    with pytest.raises(TransportError, match="no byte of the body arrived") as e:
        wl.load(ck, threads=1)
    assert url in str(e.value)


def test_a_listing_that_never_ends_is_refused_in_bounded_memory(monkeypatch):
    """An S3 endpoint whose listing of a prefix is always truncated, with a new continuation
    token and a thousand more keys each page (a broken or hostile store): resolving the prefix
    stops with an error naming it, holding a bounded number of names, instead of asking for
    pages forever while every one of them is kept."""
    served = {"pages": 0}
    keys = "".join(
        f"<Contents><Key>p/o{i:04d}.bin</Key><Size>1</Size><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
        f'<ETag>"e"</ETag></Contents>'
        for i in range(1000)
    )

    class Endless(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:
            served["pages"] += 1
            body = (
                '<?xml version="1.0"?><ListBucketResult><Name>b</Name><Prefix>p/</Prefix><KeyCount>1000</KeyCount>'
                f"<MaxKeys>1000</MaxKeys><IsTruncated>true</IsTruncated>"
                f"<NextContinuationToken>t{served['pages']}</NextContinuationToken>{keys}</ListBucketResult>"
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_NO_SIGN_REQUEST", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{httpd.server_address[1]}")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    forget_stores(retry=Retry(max_retries=1, init_backoff_s=0.01, max_backoff_s=0.02, retry_timeout_s=2))
    done: dict = {}

    def resolve() -> None:
        try:
            wl.open("s3://b/p/")
        except Exception as e:  # noqa: BLE001 - what it ended in is the point
            done["error"] = e

    t = threading.Thread(target=resolve, daemon=True)
    t.start()
    t.join(30)
    try:
        assert not t.is_alive(), f"still listing after {served['pages']} pages"
        assert isinstance(done.get("error"), FormatError) and "s3://b/p" in str(done["error"])
        assert served["pages"] <= 1100  # a bounded walk: what is kept is bounded with it
    finally:
        httpd.shutdown()
        httpd.server_close()
        forget_stores(retry=Retry())
