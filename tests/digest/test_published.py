"""Manifests, verify, and verified loads: exact bytes, a flipped byte caught and named."""

from __future__ import annotations

import json
import os

import blake3
import numpy as np
import pytest

import weightlift
from weightlift.checkpoint import open_checkpoint
from weightlift.cli.main import main
from weightlift.digest.published import (
    default_manifest_path,
    make_manifest,
    read_manifest,
    verify_checkpoint,
)
from weightlift.digest.sidecar import SIDECAR_SUFFIX, Sidecar
from weightlift.errors import IntegrityError, OptionError
from weightlift.local import mover

from ..checkpoints import every_dtype, write


def _tensors(n: int = 6, size: int = 20_000) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    rng = np.random.default_rng(7)
    out = [(f"layer.{i}", "U8", (size,), rng.integers(0, 256, size, dtype=np.uint8).tobytes()) for i in range(n)]
    return out + every_dtype()


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_manifest_round_trip_and_digests(tmp_path):
    ts = _tensors()
    path = write(tmp_path / "m.safetensors", ts)
    m = make_manifest(path)
    assert [e.name for e in m.entries] == [t.name for t in open_checkpoint(path).select()]  # file order
    by_name = m.by_name()
    for name, dtype, shape, raw in ts:
        e = by_name[name]
        assert (e.dtype, e.shape, e.length, e.blake3) == (dtype, shape, len(raw), blake3.blake3(raw).hexdigest())
    out = tmp_path / "published.json"
    out.write_text(m.to_json())
    back = read_manifest(out)
    assert back == m and back.digest == m.digest
    doc = json.loads(out.read_text())
    assert (
        doc["digest"]
        == blake3.blake3(
            json.dumps([e.as_dict() for e in m.entries], separators=(",", ":"), sort_keys=True).encode()
        ).hexdigest()
    )
    assert verify_checkpoint(path, back) == []
    # the cache of hashes the push client uses was filled (in weightlift's cache folder, not
    # beside the model): a second manifest hashes nothing new
    assert not (tmp_path / ("m.safetensors" + SIDECAR_SUFFIX)).exists()
    assert len(Sidecar.load(path)) == len(ts)


def test_edited_manifest_is_refused(tmp_path):
    path = write(tmp_path / "m.safetensors", _tensors(2))
    doc = json.loads(make_manifest(path).to_json())
    doc["tensors"][0]["blake3"] = "00" * 32
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match="own digest"):
        read_manifest(tmp_path / "bad.json")


@pytest.mark.parametrize("doc", ["[" * 100_000, '{"format": ' * 100_000], ids=["array", "object"])
def test_a_manifest_nested_past_the_parser_is_refused_naming_it(tmp_path, doc):
    (tmp_path / "deep.json").write_text(doc)
    with pytest.raises(IntegrityError, match="deep.json"):
        read_manifest(tmp_path / "deep.json")


def test_flipped_byte_in_file_is_named(tmp_path, capsys):
    ts = _tensors()
    path = write(tmp_path / "m.safetensors", ts)
    assert main(["manifest", str(path)]) == 0
    assert (tmp_path / "m.safetensors.manifest.json").exists() and default_manifest_path(path).endswith(
        ".manifest.json"
    )
    assert main(["verify", str(path)]) == 0
    t3 = open_checkpoint(path).select("layer.3")[0]
    _flip(path, t3.offset + 1234)
    capsys.readouterr()
    assert main(["verify", str(path), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["differ"] == ["layer.3 (BLAKE3 differs)"]


@pytest.mark.parametrize("threads", [1, 4])
def test_verified_load_matches(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(mover, "CHUNK", 4096)  # many chunks per tensor, landing out of order
    ts = _tensors()
    path = write(tmp_path / "m.safetensors", ts)
    (tmp_path / "pub.json").write_text(make_manifest(path).to_json())
    for manifest in (None, str(tmp_path / "pub.json")):
        out = weightlift.load(path, verify=True, manifest=manifest, threads=threads)
        assert {k: v.tobytes() for k, v in out.items()} == {n: raw for n, _, _, raw in ts}


def test_flipped_byte_in_destination_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(mover, "CHUNK", 4096)
    ts = _tensors()
    path = write(tmp_path / "m.safetensors", ts)
    target = open_checkpoint(path).select("layer.4")[0]
    real = mover.Mover._read_into

    def corrupting(self, file, off, dst, landed=None):
        def changed_then_hashed(f, o, data, stable=True):
            if o <= target.offset + 5000 < o + len(data):  # landed right, then changed in memory
                data[target.offset + 5000 - o] ^= 1
            landed(f, o, data, stable=stable)

        real(self, file, off, dst, changed_then_hashed if landed is not None else None)

    monkeypatch.setattr(mover.Mover, "_read_into", corrupting)
    with pytest.raises(IntegrityError, match=r"1 tensor\(s\).*: layer\.4$"):
        weightlift.load(path, verify=True, threads=4)
    assert main(["load", str(path), "--verify"]) == 1


def test_verify_options(tmp_path):
    path = write(tmp_path / "m.safetensors", _tensors(1))
    with pytest.raises(OptionError):
        weightlift.load(path, manifest=str(tmp_path / "x.json"))
    (tmp_path / "pub.json").write_text(make_manifest(path, select="layer.*").to_json())
    with pytest.raises(IntegrityError, match="not in the manifest"):
        weightlift.load(path, verify=True, manifest=str(tmp_path / "pub.json"))


def test_verified_load_every_path(tmp_path):
    from ..checkpoints import write_sharded

    ts = _tensors(4)
    idx = write_sharded(tmp_path / "sharded", ts, shards=3)
    (tmp_path / "pub.json").write_text(make_manifest(idx).to_json())
    want = {n: raw for n, _, _, raw in ts}
    for kw in ({}, {"copy": False}, {"engine": "pread"}, {"threads": 3}):
        out = weightlift.load(idx, verify=True, manifest=str(tmp_path / "pub.json"), **kw)
        assert {k: np.ascontiguousarray(v).tobytes() for k, v in out.items()} == want
    # a dtype cast hashes the bytes it read: the source still proves to be the manifest's
    floats = [(n, d, s, raw) for n, d, s, raw in ts if d in ("F32", "F16", "BF16")]
    path = write(tmp_path / "f.safetensors", floats)
    out = weightlift.load(path, verify=True, dtype="F32")
    assert sorted(out) == sorted(n for n, *_ in floats)


def test_cli_load_verify_with_a_published_manifest(tmp_path, capsys):
    path = write(tmp_path / "m.safetensors", _tensors(3))
    out = tmp_path / "pub.json"
    assert main(["manifest", str(path), "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["load", str(path), "--verify", "--manifest", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verified"] == len(_tensors(3))
    _flip(path, open_checkpoint(path).select("layer.1")[0].offset)
    assert main(["load", str(path), "--verify", "--manifest", str(out)]) == 1
    assert "layer.1" in capsys.readouterr().err


def test_manifest_entry_of_another_dtype_or_shape_is_refused(tmp_path):
    """Same length, same bytes' digest, but another dtype or shape: the load would give a tensor
    the publisher did not describe, so the manifest does not vouch for it."""
    from dataclasses import replace

    from weightlift.digest.published import Manifest, expected_digests

    path = write(tmp_path / "m.safetensors", [("w", "F32", (4, 6), np.arange(24, dtype=np.float32).tobytes())])
    m = make_manifest(path)
    infos = open_checkpoint(path).select()
    assert expected_digests(infos, m)["w"].hex() == m.entries[0].blake3
    for lie in (replace(m.entries[0], dtype="I32"), replace(m.entries[0], shape=(6, 4))):
        with pytest.raises(IntegrityError, match="another dtype, shape or size: w"):
            expected_digests(infos, Manifest((lie,)))


def test_manifest_naming_a_tensor_twice_is_refused(tmp_path):
    from weightlift.digest.published import Manifest

    path = write(tmp_path / "m.safetensors", _tensors(2))
    m = make_manifest(path)
    twice = Manifest((*m.entries, m.entries[0]))
    (tmp_path / "twice.json").write_text(twice.to_json())
    with pytest.raises(IntegrityError, match="more than once"):
        read_manifest(tmp_path / "twice.json")


# -- what a verify checks against: the manifest named, else the one published beside, else none --


def _folder(tmp_path) -> tuple[str, str]:
    """A model folder with a published manifest (``weightlift manifest``) and one file; returns
    the folder and its file."""
    folder = tmp_path / "model"
    folder.mkdir()
    path = write(folder / "model.safetensors", _tensors(3))
    assert main(["manifest", str(folder)]) == 0
    return str(folder), str(path)


def test_a_flipped_byte_after_publishing_fails_a_verified_load(tmp_path, capsys):
    folder, path = _folder(tmp_path)
    weightlift.load(folder, verify=True)  # intact: passes (and may record hashes of the file)
    _flip(path, open_checkpoint(path).select("layer.1")[0].offset + 7)
    with pytest.raises(IntegrityError, match=r"published manifest .*weightlift\.manifest\.json: layer\.1$"):
        weightlift.load(folder, verify=True)
    with pytest.raises(IntegrityError, match="layer.1"):  # a file of the folder finds the folder's manifest
        weightlift.load(path, verify=True)
    capsys.readouterr()
    assert main(["load", folder, "--verify"]) == 1
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.count("\n") == 1
    assert "layer.1" in cap.err and "weightlift.manifest.json" in cap.err and "matches" not in cap.err
    assert main(["verify", folder]) == 1  # and the published manifest agrees
    assert main(["verify", path]) == 1  # found for a file of the folder as a load finds it
    assert "weightlift.manifest.json" in capsys.readouterr().out


def test_a_verified_load_says_what_it_checked_against(tmp_path, capsys):
    folder, path = _folder(tmp_path)
    rep: dict = {}
    weightlift.load(folder, verify=True, report=rep)
    published = os.path.join(folder, "weightlift.manifest.json")
    assert rep["manifest"] == published and rep["verified"] == 3 + len(every_dtype())
    assert rep["verify"] == (
        f"verified {rep['verified']} tensors against the published manifest {published}: "
        "every landed byte matches its published BLAKE3"
    )
    capsys.readouterr()
    assert main(["load", path, "--verify"]) == 0
    assert f"against the published manifest {published}" in capsys.readouterr().out
    # the manifest named wins over the one beside
    named = str(tmp_path / "named.json")
    assert main(["manifest", path, "-o", named]) == 0
    weightlift.load(path, verify=True, manifest=named, report=rep)
    assert rep["manifest"] == named and rep["verify"].startswith(
        f"verified {rep['verified']} tensors against the manifest {named}:"
    )


def test_a_load_with_verify_and_no_manifest_says_so_in_one_line(tmp_path, capsys, caplog):
    path = write(tmp_path / "m.safetensors", _tensors(2))
    rep: dict = {}
    weightlift.load(path, verify=True, report=rep)
    line = rep["verify"]
    assert rep["manifest"] is None and "verified" not in rep
    assert line == (
        f"no published manifest at {path}.manifest.json or {tmp_path / 'weightlift.manifest.json'}: checked only "
        f"that the {2 + len(every_dtype())} tensors landed equal to the files as they are now, not that they are "
        "what was published (write one with `weightlift manifest`)"
    )
    assert "verified" not in line and "matches" not in line and "\n" not in line
    with caplog.at_level("INFO", logger="weightlift"):  # without a report, the line is logged
        weightlift.load(path, verify=True)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("WARNING", line)]
    capsys.readouterr()
    assert main(["load", str(path), "--verify"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == line and "verified" not in out and "matches its BLAKE3" not in out


def test_a_verified_load_writes_nothing_into_the_model_folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    write(folder / "model.safetensors", _tensors(3))
    before = sorted(os.listdir(folder))
    weightlift.load(folder, verify=True)  # no manifest: the files' own digests, hashed
    weightlift.load(folder, verify=True)
    assert sorted(os.listdir(folder)) == before
    assert main(["manifest", str(folder)]) == 0  # asked: the published manifest, and nothing else
    assert sorted(os.listdir(folder)) == sorted([*before, "weightlift.manifest.json"])
    weightlift.load(folder, verify=True)
    assert sorted(os.listdir(folder)) == sorted([*before, "weightlift.manifest.json"])


def test_a_damaged_published_manifest_beside_fails_the_load(tmp_path):
    folder, _ = _folder(tmp_path)
    with open(os.path.join(folder, "weightlift.manifest.json"), "a") as f:
        f.write("garbage")
    with pytest.raises(IntegrityError, match="weightlift.manifest.json"):
        weightlift.load(folder, verify=True)


def test_a_verified_device_load_proves_the_bytes_that_landed_not_its_staging(tmp_path, monkeypatch):
    """A target a memcpy cannot fill (a device) gets its bytes through staging; a copy that then
    lands wrong (a race on the device) must fail the verified load. The loader's real path, with
    a host target that fills through staging as a CUDA target does."""
    import weightlift.local.loader as loader_mod
    from weightlift.memory.targets import HostTarget

    class Device(HostTarget):
        memcpy_ok = False  # staged, as a CUDA target is
        racy = False

        def write(self, dest, offset, data):
            super().write(dest, offset, data)
            if self.racy:  # the staging was right; one byte of what landed is not
                dest.reshape(-1).view(np.uint8)[offset] ^= 1

    ts = _tensors()
    path = write(tmp_path / "m.safetensors", ts)
    monkeypatch.setattr(loader_mod, "target_for", lambda place: Device(place.framework))
    out = weightlift.load(path, verify=True, threads=2)
    assert {k: v.tobytes() for k, v in out.items()} == {n: raw for n, _, _, raw in ts}
    monkeypatch.setattr(Device, "racy", True)
    with pytest.raises(IntegrityError, match="BLAKE3|differ"):
        weightlift.load(path, verify=True, threads=2)


def test_a_published_manifest_found_beside_that_lacks_a_tensor_is_named(tmp_path, capsys):
    # the model gained a tensor since it was published: the error must say which manifest,
    # since the caller named none
    folder, path = _folder(tmp_path)
    write(path, [*_tensors(3), ("added", "U8", (4,), b"abcd")])
    published = os.path.join(folder, "weightlift.manifest.json")
    with pytest.raises(IntegrityError, match=f"^{published}: 1 tensor.* not in the manifest .*: added$"):
        weightlift.load(folder, verify=True)
    capsys.readouterr()
    assert main(["load", folder, "--verify"]) == 1
    assert published in capsys.readouterr().err


def test_sketches_are_optional_and_leave_old_digests_alone(tmp_path, capsys):
    """A manifest without sketches has the digest it always had; one with them carries each
    tensor's sketch (checked here against the sketch of the loaded tensor) under its digest."""
    from weightlift.digest.sketch import sketch

    ts = _tensors(2)
    path = write(tmp_path / "m.safetensors", ts)
    plain = make_manifest(path)
    assert all(e.sketch64 is None for e in plain.entries) and "sketch64" not in plain.to_json()
    old = blake3.blake3(
        json.dumps(
            [{k: v for k, v in e.as_dict().items()} for e in plain.entries], separators=(",", ":"), sort_keys=True
        ).encode()
    ).hexdigest()
    assert plain.digest == old
    sk = make_manifest(path, sketch=True)
    assert [e.blake3 for e in sk.entries] == [e.blake3 for e in plain.entries]
    assert sk.digest != plain.digest  # the sketches are part of what the digest names
    got = weightlift.load(path)
    want = {t.name: sketch(np.asarray(got[t.name]), t.name) for t in open_checkpoint(path).select()
            if t.name in sk.sketches()}  # fmt: skip
    assert sk.sketches() == want and "layer.0" in want and "t.f64" in want and "t.f4" not in want
    assert main(["manifest", str(path), "--sketch", "-o", str(tmp_path / "s.json")]) == 0
    back = read_manifest(tmp_path / "s.json")
    assert back == sk and back.sketches() == want
    doc = json.loads((tmp_path / "s.json").read_text())
    doc["tensors"][0]["sketch64"] = "0" * 16  # an edited sketch: the manifest's digest refuses it
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match="own digest"):
        read_manifest(tmp_path / "bad.json")
    doc["tensors"][0]["sketch64"] = "xyz"
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match="malformed"):
        read_manifest(tmp_path / "bad.json")
