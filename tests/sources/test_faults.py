"""Injected faults, each ending in its documented result (see weightlift.sources.store).

* throttling (503 SlowDown), a connection reset before its response, and a body cut mid-way or
  ended early: retried or resumed, and the load equals the local one byte for byte;
* faults that persist past the retry limit: TransportError naming the object;
* an object replaced while the load reads it: FormatError, nothing returned, never mixed bytes;
* an object shorter than its header says: FormatError when it is opened.
"""

from __future__ import annotations

import numpy as np
import pytest

import weightlift as wl
from tests.checkpoints import raw_bytes, write
from tests.sources.conftest import BUCKET
from weightlift.errors import FormatError, TransportError
from weightlift.sources.credentials import Retry
from weightlift.sources.store import forget_stores


@pytest.fixture
def ckpt(s3, tmp_path):
    client, proxy = s3
    rng = np.random.default_rng(3)
    t = [(f"w{i}", "F32", (128, 1024), rng.random((128, 1024), dtype=np.float32).tobytes()) for i in range(4)]
    local = write(tmp_path / "m.safetensors", t)
    key = f"faults/{tmp_path.name}.safetensors"
    client.upload_file(str(local), BUCKET, key)
    forget_stores(retry=Retry(max_retries=4, init_backoff_s=0.01, max_backoff_s=0.05, retry_timeout_s=10))
    yield f"s3://{BUCKET}/{key}", wl.load(local), client, key, proxy
    forget_stores(retry=Retry())


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b) and all(raw_bytes(a[k]) == raw_bytes(b[k]) for k in b)


@pytest.mark.parametrize("fault", ["throttle", "reset", "cut", "short"])
def test_transient_faults_are_retried_and_the_bytes_are_exact(ckpt, fault):
    url, local, _, _, proxy = ckpt
    ck = wl.open(url)
    f = proxy.reset()
    setattr(f, fault, 3)
    _same(wl.load(ck), local)
    assert f.injected.count(fault) == 3


@pytest.mark.parametrize("fault", ["cut", "short"])
def test_a_verified_load_hashes_the_bytes_before_a_cut_once(ckpt, tmp_path, fault, monkeypatch):
    from weightlift.digest.published import make_manifest

    url, local, _, _, proxy = ckpt
    monkeypatch.setenv("WEIGHTLIFT_SOURCE_PART", str(4 << 20))  # a part of several pieces, cut inside one
    ck = wl.open(url)
    manifest = make_manifest(
        write(tmp_path / "local.safetensors", [(k, "F32", (128, 1024), raw_bytes(v)) for k, v in local.items()])
    )
    f = proxy.reset()
    setattr(f, fault, 2)
    rep: dict = {}
    _same(wl.load(ck, verify=True, manifest=manifest, report=rep), local)
    assert rep["verified"] == 4 and f.injected.count(fault) == 2


@pytest.mark.parametrize("fault", ["cut", "short"])
def test_persistent_faults_end_in_a_transport_error(ckpt, fault):
    url, _, _, _, proxy = ckpt
    ck = wl.open(url)
    f = proxy.reset()
    setattr(f, fault, 10_000)
    with pytest.raises(TransportError, match=url):
        wl.load(ck, threads=1)


def test_object_replaced_mid_load_is_an_error(ckpt, tmp_path):
    url, _, client, key, proxy = ckpt
    ck = wl.open(url)
    other = write(tmp_path / "other.safetensors", [(f"w{i}", "F32", (128, 1024), bytes(512 * 1024)) for i in range(4)])
    f = proxy.reset()
    f.replace_at = 3  # after two parts have landed
    f.replace = lambda: client.upload_file(str(other), BUCKET, key)
    with pytest.raises(FormatError, match="changed in the store"):
        wl.load(ck, threads=2)
    assert "replace" in f.injected


def test_truncated_object_is_refused_at_open(s3, tmp_path):
    client, _ = s3
    local = write(tmp_path / "m.safetensors", [("w", "F32", (64, 64), bytes(16384))])
    data = local.read_bytes()[:-100]
    client.put_object(Bucket=BUCKET, Key="faults/truncated.safetensors", Body=data)
    with pytest.raises(FormatError, match="truncated.safetensors"):
        wl.open(f"s3://{BUCKET}/faults/truncated.safetensors")
