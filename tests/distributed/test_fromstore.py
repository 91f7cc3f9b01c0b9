"""Group loads from a store (weightlift.distributed.fromstore): ``wl.load(url, group=pg)``.

s3:// through moto (behind the fault proxy of tests/sources) and http:// through nginx, in real
gloo groups of 2 and 4 processes on loopback: this file, run with ``--worker``, is the rank's
program, as in test_distributed. The store's egress is counted on the server's side: the body
bytes the proxy in front of moto wrote, and nginx's access log of body bytes sent, per object.
Each rank compares what it got with a load of the same file from local disk.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the distributed loads need torch")
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is unavailable", allow_module_level=True)

import weightlift as wl  # noqa: E402
from tests.checkpoints import every_dtype, raw_bytes, write, write_sharded  # noqa: E402
from tests.distributed.ranks import KILLED, free_port, run_ranks  # noqa: E402
from tests.distributed.test_distributed import RULES, _tensors, check_slices  # noqa: E402
from tests.sources.conftest import BUCKET  # noqa: E402
from weightlift.distributed import Shard  # noqa: E402
from weightlift.errors import OptionError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 150.0  # seconds a whole group may take, start-up included, before it is a hang
PART = 256 * 1024


def _pad(n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [
        (f"pad.{i}", "U8", (1280, 1024), rng.integers(0, 256, 1280 * 1024, dtype=np.uint8).tobytes()) for i in range(n)
    ]


def _write_gguf(path: Path) -> Path:
    """A GGUF of a few MB: plain F32 and F16 tensors, and quantized raw blocks."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter, quantize

    rng = np.random.default_rng(5)
    w = GGUFWriter(path, arch="llama")
    for i in range(5):
        w.add_tensor(f"blk.{i}.w", rng.standard_normal((256, 1024), dtype=np.float32))
    w.add_tensor("blk.h", rng.standard_normal((64, 512), dtype=np.float32).astype(np.float16))
    w.add_tensor("blk.q8", quantize(rng.standard_normal((256, 1024), dtype=np.float32), Q.Q8_0), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("storegroup")
    pytest.importorskip("gguf")
    from weightlift.digest.published import make_manifest

    small = every_dtype() + _pad(2, 9)
    out = {
        "st": write(d / "model.safetensors", _tensors() + _pad(4, 1)),  # ~9.5 MB
        "gguf": _write_gguf(d / "model.gguf"),
        "small": write(d / "small.safetensors", small),
        "other": write(d / "other.safetensors", every_dtype(seed=1) + _pad(2, 10)),  # same layout, other bytes
    }
    (d / "small.manifest.json").write_text(make_manifest(out["small"]).to_json())
    (d / "other.manifest.json").write_text(make_manifest(out["other"]).to_json())
    return out


@pytest.fixture
def stores(s3, nginx_counted, files, monkeypatch):
    """Every file in the bucket and on the web server; (config for the workers, proxy, nginx)."""
    client, proxy = s3
    server, root = nginx_counted
    monkeypatch.setenv("WEIGHTLIFT_SOURCE_PART", str(PART))
    monkeypatch.setenv("WEIGHTLIFT_SOURCE_CONNECTIONS", "4")  # 2 cores: few threads per rank
    for name in ("st", "gguf"):
        client.upload_file(str(files[name]), BUCKET, f"group/{files[name].name}")
        (root / files[name].name).write_bytes(files[name].read_bytes())
    client.upload_file(str(files["small"]), BUCKET, "group/small.safetensors")
    client.upload_file(str(files["st"]), BUCKET, "group/shard.safetensors")  # its own key: its own egress
    # a manifest beside "small", and a manifest of other bytes beside a copy of it
    client.upload_file(
        str(files["small"].with_suffix(".manifest.json")), BUCKET, "group/small.safetensors.manifest.json"
    )
    client.upload_file(str(files["small"]), BUCKET, "group/tampered.safetensors")
    client.upload_file(
        str(files["other"].with_suffix(".manifest.json")), BUCKET, "group/tampered.safetensors.manifest.json"
    )
    s3u = f"s3://{BUCKET}/group"
    loads = [
        {"key": "s3_st", "url": f"{s3u}/model.safetensors", "local": str(files["st"])},
        {"key": "s3_gguf", "url": f"{s3u}/model.gguf", "local": str(files["gguf"])},
        {"key": "s3_shard", "url": f"{s3u}/shard.safetensors", "local": str(files["st"]), "shard": True},
        {"key": "s3_verified", "url": f"{s3u}/small.safetensors", "local": str(files["small"]), "verify": True},
        {"key": "s3_tampered", "url": f"{s3u}/tampered.safetensors", "local": str(files["small"]), "verify": True},
        {"key": "http_st", "url": f"{server.url}/{files['st'].name}", "local": str(files["st"])},
        {"key": "s3_opened", "url": f"{s3u}/small.safetensors", "local": str(files["small"]), "open": True},
        {"key": "s3_missing", "url": f"{s3u}/missing.safetensors", "local": ""},
        {"key": "http_gguf", "url": f"{server.url}/{files['gguf'].name}", "local": str(files["gguf"])},
    ]
    proxy.reset()
    return {"loads": loads}, proxy, server, client


def run_group(world: int, scenario: str, tmp: Path, config: dict, *, may_die: tuple[int, ...] = ()) -> list:
    """Run ``scenario`` on ``world`` ranks; each rank's JSON report (None for a rank in ``may_die``)."""
    port = free_port()
    argvs = [[scenario, str(rank), str(world), str(port), str(tmp), json.dumps(config)] for rank in range(world)]
    logs = run_ranks("tests.distributed.test_fromstore", argvs, DEADLINE)
    assert KILLED not in logs, f"{scenario} still ran after {DEADLINE} s: a hang"
    reports = []
    for rank in range(world):
        f = tmp / f"{scenario}.{rank}.json"
        r = json.loads(f.read_text()) if f.exists() else None
        if r is None and rank not in may_die:
            pytest.fail(f"{scenario} rank {rank} left no report\n{logs[rank][-3000:]}")
        if r is not None and r.get("failures"):
            pytest.fail(f"{scenario} rank {rank}: {r['failures']}\n{logs[rank][-3000:]}")
        reports.append(r)
    return reports


def _path(url: str) -> str:
    """The path the server saw for an object's URL."""
    return "/" + url.split("://", 1)[1] if url.startswith("s3://") else "/" + url.split("/", 3)[3]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_group_loads_from_stores_read_each_byte_once(stores, files, world, tmp_path):
    config, proxy, server, _ = stores
    before = server.sent()
    reports = run_group(world, "main", tmp_path, config)
    sent = dict(proxy.faults.sent)
    for path, n in server.sent().items():
        sent[path] = sent.get(path, 0) + n - before.get(path, 0)
    by_key = {ld["key"]: ld for ld in config["loads"]}
    tensor_bytes = {k: sum(r["bytes_read"][k] for r in reports) for k in ("s3_st", "http_st", "s3_gguf", "http_gguf")}
    for key in ("s3_st", "http_st"):
        size = files["st"].stat().st_size
        out = sent.get(_path(by_key[key]["url"]), 0)
        # every tensor byte once, and the header once (rank 0's first ranged read)
        assert tensor_bytes[key] == wl.open(files["st"]).nbytes, (key, tensor_bytes)
        assert size <= out <= 1.05 * size, (key, out, size)
    for key in ("s3_gguf", "http_gguf"):
        ck = wl.open(files["gguf"])
        out = sent.get(_path(by_key[key]["url"]), 0)
        assert tensor_bytes[key] == ck.nbytes, (key, tensor_bytes)
        # the tensors once, and the header's prefix once: as much as one process reading it alone
        from weightlift.sources.objects import GGUF_FIRST

        assert out <= ck.nbytes + GGUF_FIRST, (key, out, ck.nbytes)
    shard_out = sent.get(_path(by_key["s3_shard"]["url"]), 0)
    assert shard_out <= 1.05 * files["st"].stat().st_size, shard_out
    for r in reports:
        assert r["verified"]["s3_verified"] == len(wl.open(files["small"]))
        assert r["errors"]["s3_tampered"][0] == "IntegrityError", r["errors"]
        assert "differ from the published manifest" in r["errors"]["s3_tampered"][1]
    # rank 0 opens the checkpoint: its own error; the others are told it failed
    assert reports[0]["errors"]["s3_missing"][0] == "NotFoundError", reports[0]["errors"]
    for r in reports[1:]:
        assert r["errors"]["s3_missing"][0] == "GroupError", r["errors"]
        assert "rank 0 failed to open its checkpoint" in r["errors"]["s3_missing"][1]
    if world > 1:
        assert reports[0]["paths"]["s3_shard"]["redistributed"] > 0  # the owners' scatter reads ran


def test_an_object_replaced_mid_load_is_refused_on_every_rank(stores, tmp_path):
    """Two objects, rank 0's stripe in the first, rank 1's reaching into the second, which is
    replaced once the header is read: rank 1 meets the change, rank 0 reads all it was given
    and is stopped before the gather by rank 1's failure; no rank returns tensors."""
    _, proxy, _, client = stores
    rng = np.random.default_rng(4)
    a, b = rng.integers(0, 256, 3 << 20, dtype=np.uint8), rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    idx = write_sharded(
        tmp_path / "two", [("a", "U8", (3 << 20,), a.tobytes()), ("b", "U8", (1 << 20,), b.tobytes())], 2
    )
    for f in sorted(idx.parent.iterdir()):
        client.upload_file(str(f), BUCKET, f"changed/{f.name}")
    second = "model-00002-of-00002.safetensors"
    other = tmp_path / "other.safetensors"
    write(other, [("b", "U8", (1 << 20,), (255 - b).tobytes())])  # same size, other bytes
    f = proxy.reset()
    f.replace_at = 4  # after rank 0's reads of the index and of the two headers
    f.replace = lambda: client.upload_file(str(other), BUCKET, f"changed/{second}")
    reports = run_group(2, "changed", tmp_path, {"url": f"s3://{BUCKET}/changed/"})
    assert "replace" in f.injected
    assert reports[1]["error"][0] == "FormatError", reports
    assert "changed in the store" in reports[1]["error"][1] and second in reports[1]["error"][1]
    assert reports[0]["error"][0] == "GroupError", reports
    assert "rank 1 of 2 failed in reading its stripe" in reports[0]["error"][1]


def test_a_rank_that_dies_fails_the_others(stores, tmp_path):
    config = stores[0]
    url = next(ld for ld in config["loads"] if ld["key"] == "s3_st")["url"]
    t0 = time.monotonic()
    reports = run_group(3, "die", tmp_path, {"url": url}, may_die=(1,))
    assert reports[1] is None  # it left with os._exit
    for rank in (0, 2):
        r = reports[rank]
        assert r["error"][0] == "TransportError", r
        assert "peer rank left" in r["error"][1]
        assert r["seconds"] < 30, r
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("row_min", [None, "1"])
def test_shard_without_a_group_reads_its_slices_from_the_store(stores, files, row_min, monkeypatch):
    """A rank's slices by ranged reads, no collectives: small rows as spans of whole rows, or
    (rows of at least WEIGHTLIFT_ROW_READ_MIN) a request per row and only the slice's bytes."""
    if row_min is not None:
        monkeypatch.setenv("WEIGHTLIFT_ROW_READ_MIN", row_min)
    url = next(ld for ld in stores[0]["loads"] if ld["key"] == "s3_shard")["url"]
    for rank in range(2):
        shard = Shard(RULES, rank=rank, world=2)
        rep: dict = {}
        got = wl.load(url, shard=shard, framework="torch", report=rep)
        assert check_slices(str(files["st"]), got, shard, rank, 2) == []
        assert rep["paths"] == {"local": len(got)}
        mine = sum(len(raw_bytes(v)) for v in got.values())
        if row_min is None:
            assert rep["bytes_read"] > mine  # spans: the rows between this rank's were read too
        else:
            assert rep["bytes_read"] == mine


def test_the_description_rank_0_sends_round_trips_and_is_checked(stores):
    """What the other ranks rebuild from rank 0's description: the same tensors, raw shapes and
    object versions; a tensor placed past its object's end is refused."""
    from weightlift.distributed.fromstore import _describe, _parse
    from weightlift.errors import RemoteProtocolError
    from weightlift.sources.objects import IDENTITY

    for key in ("s3_gguf", "s3_st"):
        url = next(ld for ld in stores[0]["loads"] if ld["key"] == key)["url"]
        ck = wl.open(url)
        got = _parse(_describe(ck), url)
        assert (got.path, got.format, got.files) == (ck.path, ck.format, ck.files)
        assert got.tensors == ck.tensors
        for a, b in zip(got.tensors, ck.tensors, strict=True):
            assert a.extra.get("raw_shape") == b.extra.get("raw_shape")
            assert a.extra[IDENTITY] == b.extra[IDENTITY] and a.extra[IDENTITY].etag
        assert got.source is not None and got.source.identity == ck.source.identity
    doc = json.loads(_describe(ck))
    doc["tensors"][-1][4] = doc["objects"][0]["size"]  # an offset at the object's end, with bytes
    with pytest.raises(RemoteProtocolError, match="leaves its object"):
        _parse(json.dumps(doc).encode(), url)


def test_a_bad_url_of_this_rank_is_not_blamed_on_rank_0():
    """The description parses against this rank's own URL: an error of that URL is said as
    such (an OptionError, a ValueError too), not re-wrapped as a malformed description."""
    from weightlift.distributed.fromstore import _FORMAT, _parse

    desc = json.dumps({"format": _FORMAT, "objects": [], "tensors": [], "path": "m", "kind": "safetensors"})
    with pytest.raises(OptionError) as got:
        _parse(desc.encode(), "s3://")
    assert str(got.value) == "'s3://' names no bucket"


def test_verify_is_refused_where_it_cannot_check():
    with pytest.raises(OptionError, match="verify=True is not supported together with shard= or group= of local"):
        wl.load("m.safetensors", group=object(), verify=True)
    with pytest.raises(OptionError, match="verify=True is not supported together with shard="):
        wl.load("s3://b/m.safetensors", shard=Shard(RULES, rank=0, world=2), verify=True)
    with pytest.raises(OptionError, match="manifest= is only used with verify=True"):
        wl.load("s3://b/m.safetensors", group=object(), manifest="m.json")


# -- the rank's program ----------------------------------------------------------------------------


def _worker(scenario: str, rank: int, world: int, port: int, tmp: Path, config: dict) -> None:
    import datetime

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=20),
    )
    report: dict = {"failures": [], "bytes_read": {}, "paths": {}, "verified": {}, "errors": {}}
    if scenario == "main":
        _main(rank, world, config, report)
    else:
        _fail(scenario, rank, config, report)
    (tmp / f"{scenario}.{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # no destroy_process_group: a dead peer can make it wait


def _main(rank: int, world: int, config: dict, report: dict) -> None:
    from weightlift.errors import WeightliftError

    for ld in config["loads"]:
        key, rep = ld["key"], {}
        shard = Shard(RULES) if ld.get("shard") else None
        try:
            got = wl.load(
                wl.open(ld["url"]) if ld.get("open") else ld["url"],  # opened by each rank itself
                group=dist.group.WORLD,
                shard=shard,
                verify=ld.get("verify", False),
                framework="torch",
                report=rep,
            )
        except WeightliftError as e:
            report["errors"][key] = [type(e).__name__, str(e)]
            continue
        if shard is not None:
            bad = check_slices(ld["local"], got, shard.resolved(rank, world), rank, world)
        else:
            want = wl.load(ld["local"], framework="torch")
            bad = [n for n in want if n not in got or raw_bytes(got[n]) != raw_bytes(want[n])]
            bad += [f"{n} (not in the checkpoint)" for n in got if n not in want]
        report["failures"].extend(f"{key}: {b}" for b in bad)
        report["bytes_read"][key] = rep.get("bytes_read")
        report["paths"][key] = rep.get("paths")
        report["verified"][key] = rep.get("verified")


def _fail(scenario: str, rank: int, config: dict, report: dict) -> None:
    from weightlift.distributed.fromstore import StoreReader

    if scenario == "die" and rank == 1:
        get = StoreReader._get
        calls = [0]

        def dying(self: StoreReader, *a: object) -> None:
            calls[0] += 1
            if calls[0] == 3:
                os._exit(3)  # mid-load, with this rank's stripes half read
            get(self, *a)  # type: ignore[arg-type]

        StoreReader._get = dying  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        wl.load(config["url"], group=dist.group.WORLD)
        report["error"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        report["error"] = [type(e).__name__, str(e)]
    report["seconds"] = time.monotonic() - t0


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    _worker(
        sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6]), json.loads(sys.argv[7])
    )
