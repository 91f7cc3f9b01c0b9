"""Credentials and endpoints the AWS way: a profile in shared files, anonymous access; no secret shown."""

from __future__ import annotations

import numpy as np
import pytest

import weightlift as wl
from tests.checkpoints import raw_bytes, write
from tests.sources.conftest import BUCKET
from tests.sources.servers import KEYS
from weightlift.errors import FileError, NotFoundError, WeightliftError


def _ckpt(tmp_path, client, key: str, public: bool = False) -> tuple[str, dict]:
    t = [("w", "F32", (32, 32), np.arange(1024, dtype=np.float32).tobytes())]
    local = write(tmp_path / "m.safetensors", t)
    client.upload_file(str(local), BUCKET, key, ExtraArgs={"ACL": "public-read"} if public else None)
    return f"s3://{BUCKET}/{key}", wl.load(local)


def test_credentials_and_endpoint_from_a_profile(moto_server, proxy, aws_env, tmp_path):
    client = moto_server.client()
    url, local = _ckpt(tmp_path, client, "profile/model.safetensors")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL"):
        aws_env.delenv(k, raising=False)
    (tmp_path / "aws" / "config").write_text(f"[profile wl]\nregion = eu-west-3\nendpoint_url = {proxy.url}\n")
    (tmp_path / "aws" / "credentials").write_text(
        "[wl]\naws_access_key_id = AKIAFROMPROFILE\naws_secret_access_key = profile-secret-never-shown\n"
    )
    aws_env.setenv("AWS_PROFILE", "wl")
    f = proxy.reset()
    out = wl.load(url)
    assert raw_bytes(out["w"]) == raw_bytes(local["w"])
    assert f.authorization and all("Credential=AKIAFROMPROFILE/" in a for a in f.authorization)
    assert all("/eu-west-3/s3/" in a for a in f.authorization)


def test_anonymous_when_no_credentials(moto_server, proxy, aws_env, tmp_path):
    client = moto_server.client()
    url, local = _ckpt(tmp_path, client, "public/model.safetensors", public=True)
    aws_env.delenv("AWS_ACCESS_KEY_ID")
    aws_env.delenv("AWS_SECRET_ACCESS_KEY")
    aws_env.setenv("AWS_ENDPOINT_URL", proxy.url)
    f = proxy.reset()
    out = wl.load(url)
    assert raw_bytes(out["w"]) == raw_bytes(local["w"])
    assert f.authorization and not any(f.authorization)  # no request was signed


def test_no_sign_request_forces_anonymous(moto_server, proxy, aws_env, tmp_path):
    url, _ = _ckpt(tmp_path, moto_server.client(), "nosign/model.safetensors", public=True)
    aws_env.setenv("AWS_ENDPOINT_URL", proxy.url)
    aws_env.setenv("AWS_NO_SIGN_REQUEST", "true")
    f = proxy.reset()
    wl.load(url)
    assert not any(f.authorization)


def test_denied_names_the_object_and_no_secret(moto_server, proxy, aws_env, tmp_path):
    url, _ = _ckpt(tmp_path, moto_server.client(), "denied/model.safetensors")
    aws_env.setenv("AWS_ENDPOINT_URL", proxy.url)
    f = proxy.reset()
    f.deny = True
    with pytest.raises(FileError) as e:
        wl.open(url)
    text = str(e.value)
    assert url in text and "access denied" in text and "credentials" in text
    assert KEYS["AWS_SECRET_ACCESS_KEY"] not in text and KEYS["AWS_ACCESS_KEY_ID"] not in text
    assert KEYS["AWS_SECRET_ACCESS_KEY"] not in repr(e.value.__cause__) + repr(e.value.__context__)


def test_service_endpoint_beats_the_global_one(moto_server, proxy, aws_env, tmp_path):
    url, local = _ckpt(tmp_path, moto_server.client(), "endpoint/model.safetensors")
    aws_env.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    aws_env.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
    proxy.reset()
    assert raw_bytes(wl.load(url)["w"]) == raw_bytes(local["w"])


@pytest.mark.parametrize("where", ["environment", "profile"])
def test_ignore_configured_endpoint_urls_is_honoured(recorder, aws_env, tmp_path, where):
    """``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS`` (or the profile's ``ignore_configured_endpoint_urls``)
    with an endpoint in the environment: the requests go to AWS, not to that endpoint (obstore
    read AWS_ENDPOINT_URL from the environment itself)."""
    aws_env.setenv("AWS_ENDPOINT_URL", "http://configured.invalid:9")
    if where == "environment":
        aws_env.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    else:
        (tmp_path / "aws" / "config").write_text("[default]\nignore_configured_endpoint_urls = true\n")
    with pytest.raises(WeightliftError):
        wl.open(f"s3://{BUCKET}/ignored/model.safetensors")
    assert recorder.targets and all(t == "s3.us-east-1.amazonaws.com:443" for t in recorder.targets), recorder.targets


def test_a_profiles_virtual_addressing_style_is_honoured(recorder, aws_env, tmp_path):
    """``s3 = addressing_style = virtual`` in the profile: the bucket is in the host name, not
    in the path (the object is missing there: NotFoundError naming it)."""
    (tmp_path / "aws" / "config").write_text(
        "[profile wl]\nendpoint_url = http://s3.test.invalid:9\ns3 =\n    addressing_style = virtual\n"
    )
    aws_env.setenv("AWS_PROFILE", "wl")
    url = f"s3://{BUCKET}/virtual/model.safetensors"
    with pytest.raises(NotFoundError, match=url):
        wl.open(url)
    # the object's HEAD, then the listing of it as a prefix: both at the bucket's own host
    assert recorder.targets[0] == f"http://{BUCKET}.s3.test.invalid:9/virtual/model.safetensors"
    assert all(t.startswith(f"http://{BUCKET}.s3.test.invalid:9/") for t in recorder.targets), recorder.targets
