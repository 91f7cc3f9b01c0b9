"""A push from a store URL to a tensor server: the server holds the object's bytes, part by part,
and nothing lands on local disk."""

from __future__ import annotations

import numpy as np
import pytest

import weightlift as wl
from tests.checkpoints import raw_bytes, write
from tests.sources.conftest import BUCKET
from weightlift.digest.published import make_manifest
from weightlift.errors import IntegrityError, NotFoundError


def test_push_from_s3_to_a_tensor_server(s3, tmp_path):
    from weightlift.remote.client import Client
    from weightlift.remote.server import Server

    client, proxy = s3
    rng = np.random.default_rng(4)
    # one tensor several parts long (parts are 256 KiB here), and small ones around it
    t = [("big", "F32", (512, 1024), rng.random((512, 1024), dtype=np.float32).tobytes())]
    t += [(f"s{i}", "I32", (7,), np.arange(7, dtype=np.int32).tobytes()) for i in range(3)]
    local = write(tmp_path / "m.safetensors", t)
    client.upload_file(str(local), BUCKET, "push/model.safetensors")
    url = f"s3://{BUCKET}/push/model.safetensors"
    with Server() as s, Client(s.address) as c:
        res = c.push(url)
        assert res.tensors == 4 and res.bytes == sum(len(x[3]) for x in t)
        c.pull(tmp_path / "pulled.safetensors")
    got, want = wl.load(tmp_path / "pulled.safetensors"), wl.load(local)
    assert sorted(got) == sorted(want) and all(raw_bytes(got[k]) == raw_bytes(want[k]) for k in want)


def _tensors(seed: int = 4) -> list:
    rng = np.random.default_rng(seed)
    t = [("big", "F32", (512, 1024), rng.random((512, 1024), dtype=np.float32).tobytes())]
    return t + [(f"s{i}", "I32", (7,), np.arange(7, dtype=np.int32).tobytes()) for i in range(3)]


def test_verified_push_from_s3_checks_every_tensor_against_the_published_manifest(s3, tmp_path):
    from weightlift.remote.client import Client
    from weightlift.remote.server import Server

    client, proxy = s3
    local = write(tmp_path / "m.safetensors", _tensors())
    client.upload_file(str(local), BUCKET, "push-verified/model.safetensors")
    url = f"s3://{BUCKET}/push-verified/model.safetensors"
    with Server() as s, Client(s.address) as c:
        with pytest.raises(NotFoundError, match="no published manifest"):
            c.push(url, verify=True)
    m = make_manifest(local)
    client.put_object(Bucket=BUCKET, Key="push-verified/model.safetensors.manifest.json", Body=m.to_json().encode())
    with Server() as s, Client(s.address) as c:
        f = proxy.reset()
        res = c.push(url, verify=True)
        assert res.verified == 4 and res.tensors == 4
        # the header, the manifest, big's parts, the small ones: the object is read once, not hashed first
        assert f.gets == 2 + -(-512 * 1024 * 4 // (256 * 1024)) + 3
        got = s.tensors()
        assert all(raw_bytes(got[k]) == raw_bytes(v) for k, v in wl.load(local).items())
    # the object replaced by one whose "big" differs from what was published: named, not accepted
    bad = _tensors()
    raw = bytearray(bad[0][3])
    raw[-4:] = bytes(4)
    bad[0] = (*bad[0][:3], bytes(raw))
    client.upload_file(str(write(tmp_path / "bad.safetensors", bad)), BUCKET, "push-verified/model.safetensors")
    with Server() as s, Client(s.address) as c:
        with pytest.raises(IntegrityError, match=r"1 of 4 tensors.*'big' \(server [0-9a-f]+, published"):
            c.push(url, verify=True)
    # a manifest that lacks a tensor, or gives another size: refused before a byte is sent
    short = make_manifest(write(tmp_path / "short.safetensors", _tensors()[:3]))
    client.put_object(Bucket=BUCKET, Key="push-verified/model.safetensors.manifest.json", Body=short.to_json().encode())
    with Server() as s, Client(s.address) as c:
        with pytest.raises(IntegrityError, match="s2"):
            c.push(url, verify=True)
        assert s.tensors() == {}


def test_verified_push_from_s3_with_a_manifest_given_by_path_or_url(s3, tmp_path):
    """``manifest=`` names the published manifest wherever it is (none beside the object here):
    a local file or another object; one that lies about a tensor is refused naming it, one that
    lacks a tensor before a byte is sent."""
    from dataclasses import replace

    from weightlift.digest.published import Manifest
    from weightlift.remote.client import Client
    from weightlift.remote.server import Server

    client, proxy = s3
    local = write(tmp_path / "m.safetensors", _tensors())
    client.upload_file(str(local), BUCKET, "push-given/model.safetensors")
    url = f"s3://{BUCKET}/push-given/model.safetensors"
    m = make_manifest(local)
    (tmp_path / "m.json").write_text(m.to_json())
    client.put_object(Bucket=BUCKET, Key="manifests/model.json", Body=m.to_json().encode())
    for given in (str(tmp_path / "m.json"), f"s3://{BUCKET}/manifests/model.json"):
        with Server() as s, Client(s.address) as c:
            res = c.push(url, verify=True, manifest=given)
            assert (res.verified, res.tensors, res.bytes_hashed) == (4, 4, 0)
            got = s.tensors()
            assert all(raw_bytes(got[k]) == raw_bytes(v) for k, v in wl.load(local).items())
    lies = Manifest(tuple(replace(e, blake3="11" * 32) if e.name == "s1" else e for e in m.entries))
    with Server() as s, Client(s.address) as c:
        with pytest.raises(IntegrityError, match=r"1 of 4 tensors.*'s1' \(server [0-9a-f]+, published 1111"):
            c.push(url, verify=True, manifest=lies)
    short = Manifest(tuple(e for e in m.entries if e.name != "big"))
    with Server() as s, Client(s.address) as c:
        f = proxy.reset()
        with pytest.raises(IntegrityError, match="big"):
            c.push(url, verify=True, manifest=short)
        assert s.stats()["bytes_received"] == 0 and f.gets <= 1  # at most the header was read


def test_cli_push_from_s3(s3, tmp_path):
    import json
    import subprocess
    import sys

    from weightlift.remote.server import Server

    client, _ = s3
    local = write(tmp_path / "m.safetensors", [("w", "F32", (256, 256), np.ones((256, 256), np.float32).tobytes())])
    client.upload_file(str(local), BUCKET, "push/cli.safetensors")
    with Server() as s:
        host, port = s.address[:2]
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "weightlift",
                "push",
                f"s3://{BUCKET}/push/cli.safetensors",
                "--to",
                f"{host}:{port}",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["tensors"] == 1
        assert raw_bytes(s.tensors()["w"]) == raw_bytes(wl.load(local)["w"])
