"""Store URLs parsed without I/O; what is refused, and that nothing secret is echoed."""

from __future__ import annotations

import pytest

from weightlift.errors import OptionError
from weightlift.sources.url import Location, is_url, parse


def test_forms():
    assert parse("s3://bucket/a/b.safetensors") == Location("s3", "bucket", "a/b.safetensors")
    assert parse("https://h:8443/x/m.gguf") == Location("https", "https://h:8443", "x/m.gguf")
    loc = parse("s3://bucket/p/model.safetensors.index.json")
    assert loc.sibling("model-00001-of-00002.safetensors").url == "s3://bucket/p/model-00001-of-00002.safetensors"
    assert parse("s3://bucket/p").child("model.safetensors").url == "s3://bucket/p/model.safetensors"
    assert parse("s3://bucket/p/").child("x").url == "s3://bucket/p/x"
    assert is_url("s3://b/k") and is_url("HTTP://h/k") and not is_url("/tmp/x") and not is_url("file://x")


@pytest.mark.parametrize(
    "url",
    [
        "s3:///key",
        "https://h/m?X-Amz-Signature=secret",
        "https://user:secret@h/m",
        "s3://user:secret@b/k",
        "s3://b/../k",
        "ftp://h/k",
    ],
)
def test_refused_without_echoing_secrets(url):
    with pytest.raises(OptionError) as e:
        parse(url)
    assert "secret" not in str(e.value)


def test_an_http_url_is_decoded_once():
    """``%20`` in an http(s) URL is a space in the file's name: the key holds it decoded (the
    client encodes it on the wire), and the URL shown encodes it back."""
    loc = parse("https://h/a%20b/m%2B%25.safetensors")
    assert loc.key == "a b/m+%.safetensors"
    assert loc.url == "https://h/a%20b/m+%25.safetensors"
    assert parse(loc.url) == loc
    assert loc.sibling("x y.json").url == "https://h/a%20b/x%20y.json"
    with pytest.raises(OptionError):
        parse("https://h/a/%2E%2E/k")


def test_an_s3_key_is_everything_after_the_bucket():
    """An s3:// URL is not parsed as an http URL: ``#``, ``?``, ``%`` and spaces are the key's."""
    for key in ("a#b.safetensors", "p/q?x=1/m.safetensors", "odd %41 +é/k#", "k?"):
        loc = parse(f"s3://bucket/{key}")
        assert loc == Location("s3", "bucket", key)
        assert loc.url == f"s3://bucket/{key}" and parse(loc.url) == loc
    assert parse("S3://bucket/a?b").key == "a?b"
