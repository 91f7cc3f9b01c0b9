"""Loads from an S3 server (moto, behind the fault proxy) equal the local load byte for byte."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import weightlift as wl
from tests.checkpoints import every_dtype, raw_bytes, write, write_sharded
from tests.sources.conftest import BUCKET
from weightlift.digest.published import make_manifest
from weightlift.errors import IntegrityError, NotFoundError


def _upload(client, local, key: str) -> str:
    client.upload_file(str(local), BUCKET, key)
    return f"s3://{BUCKET}/{key}"


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in b:
        assert raw_bytes(a[k]) == raw_bytes(b[k]), k
        assert tuple(a[k].shape) == tuple(b[k].shape), k


def _big(n: int = 12, shape=(64, 1024)) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    rng = np.random.default_rng(1)
    return [(f"layer.{i}.w", "F32", shape, rng.random(shape, dtype=np.float32).tobytes()) for i in range(n)]


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_every_dtype_equals_the_local_load(s3, tmp_path, framework):
    if framework == "torch":
        pytest.importorskip("torch")
    client, _ = s3
    local = write(tmp_path / "m.safetensors", every_dtype() + _big(4))
    url = _upload(client, local, f"dtypes-{framework}/model.safetensors")
    _same(wl.load(url, framework=framework), wl.load(local, framework=framework))


def test_header_in_one_request_and_tensors_in_parts(s3, tmp_path):
    client, proxy = s3
    local = write(tmp_path / "m.safetensors", _big(8))
    url = _upload(client, local, "parts/model.safetensors")
    f = proxy.reset()
    ck = wl.open(url)
    assert f.gets == 1  # the header: one ranged read
    rep: dict = {}
    wl.load(ck, report=rep)
    nbytes = sum(t.length for t in ck)
    assert rep["source"]["requests"] == -(-nbytes // (256 * 1024))  # contiguous tensors share requests
    assert f.gets == 1 + rep["source"]["requests"]
    # S3 states the ETag on every ranged answer: no HEAD besides the one at open re-checks it
    assert len(f.authorization) == f.gets + 1


def test_sharded_prefix_and_selection(s3, tmp_path):
    client, _ = s3
    tensors = every_dtype() + _big(6)
    idx = write_sharded(tmp_path / "sh", tensors, 3)
    for p in (tmp_path / "sh").iterdir():
        _upload(client, p, f"sharded/{p.name}")
    local = wl.load(idx)
    _same(wl.load(f"s3://{BUCKET}/sharded/"), local)
    _same(wl.load(f"s3://{BUCKET}/sharded"), local)  # a prefix without its slash
    picked = wl.load(f"s3://{BUCKET}/sharded/model.safetensors.index.json", select="layer.*")
    _same(picked, {k: v for k, v in local.items() if k.startswith("layer.")})
    assert len(wl.open(f"s3://{BUCKET}/sharded/").files) == 3


def test_gguf_equals_the_local_load(s3, tmp_path):
    pytest.importorskip("gguf")
    from tests.gguf_files import write_sample

    client, _ = s3
    write_sample(tmp_path / "m.gguf")
    url = _upload(client, tmp_path / "m.gguf", "gguf/model.gguf")
    _same(wl.load(url), wl.load(tmp_path / "m.gguf"))
    deq = wl.load(url, dequantize=True)
    _same(deq, wl.load(tmp_path / "m.gguf", dequantize=True))


def test_verify_against_the_published_manifest(s3, tmp_path):
    client, _ = s3
    local = write(tmp_path / "m.safetensors", _big(4))
    url = _upload(client, local, "verified/model.safetensors")
    with pytest.raises(NotFoundError, match="no published manifest"):
        wl.load(url, verify=True)
    m = make_manifest(url)  # hashed streaming from the store
    assert m == make_manifest(local)
    client.put_object(Bucket=BUCKET, Key="verified/model.safetensors.manifest.json", Body=m.to_json().encode())
    rep: dict = {}
    _same(wl.load(url, verify=True, report=rep), wl.load(local))
    assert rep["verified"] == 4
    # a manifest that disagrees with the bytes: nothing is returned
    other = write(
        tmp_path / "o.safetensors", _big(4, shape=(64, 1024))[:3] + [("layer.3.w", "F32", (64, 1024), bytes(262144))]
    )
    wrong = make_manifest(other)
    with pytest.raises(IntegrityError, match="layer.3.w"):
        wl.load(url, verify=True, manifest=wrong)


def test_a_store_prefix_finds_its_published_manifest_by_the_same_name_as_a_folder(s3, tmp_path):
    client, _ = s3
    local = write(tmp_path / "m.safetensors", _big(2))
    _upload(client, local, "prefix/model.safetensors")
    prefix = f"s3://{BUCKET}/prefix/"
    with pytest.raises(NotFoundError, match="no published manifest"):  # a store keeps no hashes of its own
        wl.load(prefix, verify=True)
    client.put_object(
        Bucket=BUCKET, Key="prefix/weightlift.manifest.json", Body=make_manifest(local).to_json().encode()
    )
    rep: dict = {}
    _same(wl.load(prefix, verify=True, report=rep), wl.load(local))
    assert rep["manifest"] == prefix + "weightlift.manifest.json" and rep["verified"] == 2
    assert rep["verify"].startswith(
        f"verified 2 tensors against the published manifest {prefix}weightlift.manifest.json"
    )
    # a manifest published for other bytes: the load names the tensor and the manifest
    other = write(tmp_path / "o.safetensors", _big(1) + [("layer.1.w", "F32", (64, 1024), bytes(262144))])
    client.put_object(
        Bucket=BUCKET, Key="prefix/weightlift.manifest.json", Body=make_manifest(other).to_json().encode()
    )
    with pytest.raises(IntegrityError, match=r"weightlift\.manifest\.json: layer\.1\.w$"):
        wl.load(prefix, verify=True)


def test_missing_object_names_it(s3):
    with pytest.raises(NotFoundError, match=f"s3://{BUCKET}/nothing/here.safetensors"):
        wl.open(f"s3://{BUCKET}/nothing/here.safetensors")


def _castable() -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """Every dtype, and floating-point tensors several parts long (parts are 256 KiB here) with
    lengths that are no multiple of a part."""
    rng = np.random.default_rng(3)
    big = rng.random((301, 1031), dtype=np.float32)
    return every_dtype() + [
        ("big.f32", "F32", big.shape, big.tobytes()),
        ("big.f16", "F16", big.shape, big.astype(np.float16).tobytes()),
        ("big.bf16", "BF16", (301, 1031), rng.integers(0, 1 << 15, 301 * 1031, dtype=np.uint16).tobytes()),
        ("big.i32", "I32", (257, 1024), rng.integers(0, 1 << 30, 257 * 1024, dtype=np.int32).tobytes()),
    ]


# random bytes hold values float16 cannot: both loads overflow them the same way
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32"])
def test_dtype_casts_as_the_local_load(s3, tmp_path, framework, dtype):
    if framework == "torch":
        pytest.importorskip("torch")
    client, _ = s3
    local = write(tmp_path / "m.safetensors", _castable())
    url = _upload(client, local, f"cast-{framework}/model.safetensors")
    want = wl.load(local, framework=framework, dtype=dtype)
    rep: dict = {}
    got = wl.load(url, framework=framework, dtype=dtype, report=rep)
    _same(got, want)
    assert str(got["big.f32"].dtype) == str(want["big.f32"].dtype)
    assert rep["source"]["requests"] > 3  # the long tensors went in parts


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_dtype_with_verify_and_a_selection(s3, tmp_path):
    client, _ = s3
    local = write(tmp_path / "m.safetensors", _castable())
    url = _upload(client, local, "cast-verified/model.safetensors")
    m = make_manifest(local)
    got = wl.load(url, dtype="F16", verify=True, manifest=m, select="big.*")
    _same(got, wl.load(local, dtype="F16", select="big.*"))
    # the digests are of the bytes in the store, before the cast: a wrong one is named
    other = [t if t[0] != "big.bf16" else (t[0], t[1], t[2], bytes(len(t[3]))) for t in _castable()]
    wrong = make_manifest(write(tmp_path / "o.safetensors", other))
    with pytest.raises(IntegrityError, match="big.bf16"):
        wl.load(url, dtype="F16", verify=True, manifest=wrong, select="big.*")


def test_cli_inspect_load_manifest_verify(s3, tmp_path):
    client, _ = s3
    local = write(tmp_path / "m.safetensors", _big(3))
    url = _upload(client, local, "cli/model.safetensors")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "weightlift", *args], capture_output=True, text=True, timeout=120)

    r = cli("inspect", url)
    assert r.returncode == 0 and "layer.2.w" in r.stdout, r.stderr
    r = cli("manifest", url)
    assert r.returncode == 0 and f"written to {url}.manifest.json" in r.stdout, r.stderr
    r = cli("verify", url, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stderr
    r = cli("load", url, "--verify", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["verified"] == 3


def test_prefetch_of_a_url_opens_it_and_reads_nothing_ahead(s3, tmp_path):
    client, proxy = s3
    url = _upload(client, write(tmp_path / "m.safetensors", _big(2)), "prefetch/model.safetensors")
    f = proxy.reset()
    job = wl.prefetch(url)
    job.wait()
    assert f.gets == 1  # the header only: a store has no page cache to fill
    with pytest.raises(NotFoundError):
        wl.prefetch(f"s3://{BUCKET}/prefetch/missing.safetensors")


def test_profile_shows_the_store_phases(s3, tmp_path):
    client, _ = s3
    url = _upload(client, write(tmp_path / "m.safetensors", _big(4)), "profile/model.safetensors")
    rep: dict = {}
    wl.load(url, profile=True, report=rep)
    prof = rep["profile"]
    requests = rep["source"]["requests"]
    assert prof["commands"]["GET headers"]["count"] == requests
    assert prof["commands"]["GET first byte"]["count"] == requests
    assert prof["phase_bytes"]["read"] == sum(t.length for t in wl.open(url))
    assert prof["work_s"]["wire"] > 0


def test_a_prefix_with_sub_prefixes_resolves_by_its_own_objects(s3, tmp_path):
    """Objects under sub-prefixes are not the prefix's own: the one .safetensors directly inside
    is the checkpoint, however many more lie below (the listing steps over each sub-prefix)."""
    client, _ = s3
    local = write(tmp_path / "w.safetensors", _big(2))
    _upload(client, local, "nested/weights.safetensors")
    for sub in ("a", "b", "b0", "z"):
        for k in range(3):
            _upload(client, local, f"nested/{sub}/{k}/other.safetensors")
    client.put_object(Bucket=BUCKET, Key="nested/b0", Body=b"a direct object named like a sub-prefix")
    _same(wl.load(f"s3://{BUCKET}/nested/"), wl.load(local))


def test_a_prefix_whose_names_need_escaping_lists_its_own_objects(s3, tmp_path):
    client, _ = s3
    local = write(tmp_path / "w.safetensors", _big(2))
    _upload(client, local, "odd names %41 +é/weights.safetensors")
    _upload(client, local, "odd names %41 +é/sub dir %/other.safetensors")
    _same(wl.load(f"s3://{BUCKET}/odd names %41 +é/"), wl.load(local))


def test_a_prefix_beside_many_small_sub_prefixes_is_listed_in_a_page_not_a_request_each(s3, tmp_path, monkeypatch):
    """A training run's folder: the weights, and a sub-prefix for each saved step, a few
    objects each. Their keys fit in one listing page; asking again past each sub-prefix
    made it a request each (seconds before a load began), and past the page bound (a thousand
    steps) a FormatError for a well-behaved store."""
    import obstore

    from weightlift.sources import store as store_mod

    client, _ = s3
    local = write(tmp_path / "w.safetensors", _big(2))
    _upload(client, local, "run/model.safetensors")
    for step in range(40):
        for part in ("optimizer.pt", "trainer_state.json"):
            client.put_object(Bucket=BUCKET, Key=f"run/checkpoint-{step:03d}/{part}", Body=b"x")
    calls = []
    real = obstore.list

    def counted(*a, **kw):
        calls.append(kw.get("offset"))
        return real(*a, **kw)

    monkeypatch.setattr(obstore, "list", counted)
    monkeypatch.setattr(store_mod, "MAX_LIST_PAGES", 10)
    _same(wl.load(f"s3://{BUCKET}/run/"), wl.load(local))
    assert len(calls) <= 2, f"{len(calls)} listing requests for {40 * 2 + 1} keys"


@pytest.mark.parametrize("key", ["", "prefix/", "prefix/model.safetensors"])
def test_a_missing_bucket_is_not_found(s3, key):
    """A bucket that does not exist, asked for an object or listed as a prefix: NotFoundError
    naming the URL and the bucket (not a TransportError, as if the network had failed)."""
    url = f"s3://wl-no-such-bucket/{key}"
    with pytest.raises(NotFoundError, match="no such bucket 'wl-no-such-bucket'") as e:
        wl.open(url)
    assert url in str(e.value)


def test_keys_with_a_hash_or_a_question_mark_can_be_named(s3, tmp_path):
    """S3 keys may hold ``#`` and ``?``; in an s3:// URL everything after the bucket is the key."""
    client, _ = s3
    local = write(tmp_path / "w.safetensors", _big(2))
    url = _upload(client, local, "odd#dir?/model#1?v=2.safetensors")
    _same(wl.load(url), wl.load(local))
    _same(wl.load(f"s3://{BUCKET}/odd#dir?/"), wl.load(local))
