"""Fixtures of the store tests: one moto server (and a fault proxy before it) per session, an
nginx per session, and an environment that points botocore at them and at nothing else."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sources.servers import KEYS, FaultProxy, Moto, Nginx, RcloneS3, Recorder, SeaweedFS

BUCKET = "wl-test"


@pytest.fixture(scope="session")
def moto_server() -> Iterator[Moto]:
    pytest.importorskip("obstore", reason="store URLs need obstore (the s3 extra)")
    m = Moto()
    why = m.start()
    if why is not None:
        pytest.skip(f"no S3 server to test against: {why}")
    m.client().create_bucket(Bucket=BUCKET)
    yield m
    m.stop()


@pytest.fixture(scope="session")
def proxy(moto_server: Moto) -> Iterator[FaultProxy]:
    p = FaultProxy(moto_server.port)
    yield p
    p.close()


@pytest.fixture
def aws_env(tmp_path, monkeypatch):
    """Credentials in the environment, the endpoint the proxy, no shared files from the machine."""
    from weightlift.sources.store import forget_stores

    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_NO_SIGN_REQUEST", "AWS_SKIP_SIGNATURE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in KEYS.items():
        monkeypatch.setenv(k, v)
    (tmp_path / "aws").mkdir(exist_ok=True)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws" / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws" / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    forget_stores()
    yield monkeypatch
    forget_stores()


@pytest.fixture
def s3(moto_server: Moto, proxy: FaultProxy, aws_env):
    """(boto3 client of moto, the proxy, its faults) with botocore pointed at the proxy."""
    aws_env.setenv("AWS_ENDPOINT_URL", proxy.url)
    aws_env.setenv("WEIGHTLIFT_SOURCE_PART", str(256 * 1024))  # small parts: many requests on small files
    proxy.reset()
    return moto_server.client(), proxy


@pytest.fixture(scope="session")
def nginx(tmp_path_factory) -> Iterator[tuple[Nginx, object]]:
    pytest.importorskip("obstore", reason="store URLs need obstore (the s3 extra)")
    root = tmp_path_factory.mktemp("www")
    n = Nginx(root, tmp_path_factory.mktemp("nginx"))
    why = n.start()
    if why is not None:
        pytest.skip(f"no web server to test against: {why}")
    yield n, root
    n.stop()


@pytest.fixture
def recorder(aws_env) -> Iterator[Recorder]:
    """Every request of the store client sent to a :class:`Recorder` as its proxy, with few retries."""
    from weightlift.sources.credentials import Retry
    from weightlift.sources.store import forget_stores

    pytest.importorskip("obstore", reason="store URLs need obstore (the s3 extra)")
    r = Recorder()
    for k in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "http_proxy", "https_proxy"):
        aws_env.delenv(k, raising=False)
    aws_env.setenv("HTTP_PROXY", r.url)
    aws_env.setenv("HTTPS_PROXY", r.url)
    forget_stores(retry=Retry(max_retries=0, init_backoff_s=0.01, max_backoff_s=0.01, retry_timeout_s=2))
    yield r
    forget_stores(retry=Retry())
    r.close()


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory) -> Iterator[SeaweedFS]:
    """SeaweedFS's S3 gateway, a second S3 implementation beside moto (skips where not installed)."""
    pytest.importorskip("obstore", reason="store URLs need obstore (the s3 extra)")
    pytest.importorskip("boto3", reason="the test writes objects with boto3")
    w = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    why = w.start()
    if why is not None:
        pytest.skip(f"no SeaweedFS to test against: {why}")
    w.client().create_bucket(Bucket=BUCKET)
    yield w
    w.stop()


@pytest.fixture(scope="session")
def rclone_s3(tmp_path_factory) -> Iterator[tuple[RcloneS3, object]]:
    """``rclone serve s3`` over a folder holding the bucket's folder (skips where not installed)."""
    pytest.importorskip("obstore", reason="store URLs need obstore (the s3 extra)")
    root = tmp_path_factory.mktemp("rclone")
    (root / BUCKET).mkdir()
    r = RcloneS3(root)
    why = r.start()
    if why is not None:
        pytest.skip(f"no rclone S3 gateway to test against: {why}")
    yield r, root / BUCKET
    r.stop()
