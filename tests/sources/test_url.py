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
    "url", ["s3:///key", "https://h/m?X-Amz-Signature=secret", "https://user:secret@h/m", "s3://b/../k", "ftp://h/k"]
)
def test_refused_without_echoing_secrets(url):
    with pytest.raises(OptionError) as e:
        parse(url)
    assert "secret" not in str(e.value)
