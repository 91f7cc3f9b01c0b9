"""Sharded loads, group loads, broadcast and parallel pushes (weightlift.distributed).

Slices are checked in this process against ``torch.chunk`` of the whole tensors (the convention
the loader documents); the collectives run in real gloo groups of 2 and 4 processes on
loopback: this file, run as a script with ``--worker``, is the rank's program. Each group runs
every check in one start-up (importing torch is most of the cost); a rank reports what it saw as
JSON, and the test holds the group to a wall-clock deadline, so a hang fails instead of
stalling the suite.
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
from tests.checkpoints import byte_length, every_dtype, raw_bytes, write, write_sharded  # noqa: E402
from tests.distributed.ranks import KILLED, free_port, run_ranks  # noqa: E402
from weightlift.distributed import Shard, chunk_bounds, push_many  # noqa: E402
from weightlift.distributed.push import PushError  # noqa: E402
from weightlift.errors import OptionError  # noqa: E402
from weightlift.formats.gguf import dequantize  # noqa: E402

ROOT = (
    Path(__file__).resolve().parents[2]
)  # the workers run as ``python -m tests.distributed.test_distributed`` from here
GROUP_DEADLINE = 60.0  # seconds a whole group may take, start-up included, before it is a hang

# name, dtype, shape: dim 0 (even and uneven), dim 1 with small rows (redistributed in a group
# by default) and with rows of 128 KiB, a 3-D tensor split along its middle, empty slices on
# the last rank of 4 along dim 0 and dim 1, replicated tensors and a scalar
LAYOUT = [
    ("emb.weight", "F16", (1001, 256)),
    ("l0.q_proj.weight", "F32", (512, 512)),
    ("l0.o_proj.weight", "BF16", (512, 512)),
    ("l0.down.weight", "F32", (64, 8192)),
    ("l0.norm.weight", "F32", (512,)),
    ("l0.bias", "F32", (7,)),
    ("l0.tiny", "I32", (3, 2)),
    ("l0.x3", "F32", (6, 10, 4)),
    ("l0.scalar", "F64", ()),
    ("l0.wide", "U8", (4, 1 << 18)),
    ("l0.narrow", "F32", (8, 3)),
]
RULES = {
    "emb.weight": "colwise",
    "*.q_proj.weight": "colwise",
    "*.o_proj.weight": "rowwise",
    "*.down.weight": 1,
    "*.bias": 0,
    "*.tiny": 0,
    "*.x3": 1,
    "*.wide": -1,
    "*.narrow": "rowwise",
}
GGUF_RULES = {"blk.0.ffn_down.weight": 1, "blk.0.attn_v.weight": 1, "blk.0.ffn_gate.weight": 0, "four_d": 2}


def _tensors(seed: int = 0) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    rng = np.random.default_rng(seed)
    return [(n, d, s, rng.integers(0, 256, byte_length(d, s), dtype=np.uint8).tobytes()) for n, d, s in LAYOUT]


def _write_all(folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = _tensors()
    paths = {
        "st": str(write(folder / "model.safetensors", tensors)),
        "index": str(write_sharded(folder / "sharded", tensors, 2)),
    }
    try:
        from tests.gguf_files import write_sample

        write_sample(folder / "model.gguf")
        paths["gguf"] = str(folder / "model.gguf")
    except ImportError:  # the gguf package is a dependency; guard anyway
        pass
    return paths


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _write_all(tmp_path_factory.mktemp("dist"))


# -- the reference: slices of whole tensors ---------------------------------------------------


def expected_slice(full: torch.Tensor, dim: int | None, rank: int, world: int) -> torch.Tensor:
    """``torch.chunk(full, world, dim)[rank]``, empty where torch.chunk returns fewer parts."""
    if dim is None:
        return full
    parts = torch.chunk(full, world, dim)
    return parts[rank] if rank < len(parts) else full.narrow(dim, full.shape[dim], 0)


def check_slices(path: str, got: dict, shard: Shard, rank: int, world: int) -> list[str]:
    """Differences between ``got`` and slices of the whole tensors; [] when byte for byte equal."""
    ck = wl.open(path)
    full = wl.load(path, framework="torch")
    bad = []
    for name, t in full.items():
        info = ck[name]
        dim = shard.placement(info) if shard is not None else None
        g = got[name]
        if info.quantized:
            # quantized: dequantized slice against the slice of the dequantized whole
            whole = torch.from_numpy(dequantize(t.numpy(), info.ggml_type))
            want = expected_slice(whole, dim, rank, world)
            have = torch.from_numpy(dequantize(g.numpy() if hasattr(g, "numpy") else g, info.ggml_type))
            if have.shape != want.shape or raw_bytes(have) != raw_bytes(want):
                bad.append(f"{name}: dequantized {tuple(have.shape)} != {tuple(want.shape)} or bytes differ")
            continue
        want = expected_slice(t, dim, rank, world)
        if tuple(g.shape) != tuple(want.shape) or raw_bytes(g) != raw_bytes(want):
            bad.append(f"{name}: shape {tuple(g.shape)} vs {tuple(want.shape)} or bytes differ")
    return bad


# -- in this process: slices without a group ----------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("engine", ["mmap", "pread"])
def test_shard_slices_equal_chunks_of_the_whole(ckpts, world, engine, monkeypatch):
    for row_min in ("1", str(1 << 30)):  # every strided slice row by row, then as spans
        monkeypatch.setenv("WEIGHTLIFT_ROW_READ_MIN", row_min)
        for rank in range(world):
            shard = Shard(RULES, rank=rank, world=world)
            rep: dict = {}
            got = wl.load(ckpts["st"], framework="torch", shard=shard, engine=engine, report=rep)
            assert check_slices(ckpts["st"], got, shard, rank, world) == []
            assert list(got) == [n for n, _, _ in LAYOUT]
            assert rep["bytes"] == sum(len(raw_bytes(v)) for v in got.values())
            if row_min == "1" or engine == "mmap":  # only the slice's own bytes were read
                assert rep["bytes_read"] == rep["bytes"]
            else:  # small rows: the spans were read, more than the slices
                assert rep["bytes_read"] > rep["bytes"]


def test_uneven_and_empty_follow_torch_chunk(ckpts):
    assert [chunk_bounds(5, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [chunk_bounds(7, r, 2) for r in range(2)] == [(0, 4), (4, 7)]
    got = wl.load(ckpts["st"], shard=Shard(RULES, rank=3, world=4))
    assert got["l0.tiny"].shape == (0, 2) and got["emb.weight"].shape == (248, 256)
    assert got["l0.bias"].shape == (1,) and got["l0.x3"].shape == (6, 1, 4)
    with pytest.raises(OptionError, match="not divisible"):
        wl.load(ckpts["st"], shard=Shard(RULES, rank=0, world=4, uneven="error"))


def test_copy_false_views_equal_copies(ckpts):
    for framework in ("numpy", "torch"):
        for rank in range(2):
            shard = Shard(RULES, rank=rank, world=2)
            views = wl.load(ckpts["st"], shard=shard, copy=False, framework=framework)
            assert check_slices(ckpts["st"], views, shard, rank, 2) == []
    v = wl.load(ckpts["st"], shard=Shard(RULES, rank=0, world=2), copy=False)
    assert not v["l0.o_proj.weight"].flags.writeable and not v["l0.o_proj.weight"].flags.c_contiguous


def test_gguf_block_aligned_split_and_misaligned_error(ckpts):
    if "gguf" not in ckpts:
        pytest.skip("gguf package missing")
    for rank in range(2):
        shard = Shard(GGUF_RULES, rank=rank, world=2)
        got = wl.load(ckpts["gguf"], framework="torch", shard=shard)
        assert check_slices(ckpts["gguf"], got, shard, rank, 2) == []
    # Q4_K rows of 512 over 4 ranks cut at 128, inside a 256-element block
    with pytest.raises(OptionError, match="block boundaries"):
        wl.load(ckpts["gguf"], shard=Shard({"blk.0.ffn_down.weight": 1}, rank=0, world=4))


def test_every_dtype_splits_on_dim_0_and_packed_types_only_on_bytes(tmp_path):
    tensors = every_dtype()
    path = write(tmp_path / "all.safetensors", tensors)
    shard = Shard([("t.f64", None), ("*", 0)], rank=1, world=2)  # the scalar cannot split
    got = wl.load(path, shard=shard)
    for name, _, shape, raw in tensors:
        if not shape:
            assert raw_bytes(got[name]) == raw
            continue
        row = len(raw) // shape[0] if shape[0] else 0
        a, b = chunk_bounds(shape[0], 1, 2)
        assert raw_bytes(got[name]) == raw[a * row : b * row], name
    # F4 rows of 6 elements are 3 bytes: halves of 12 bits fall inside a byte
    with pytest.raises(OptionError, match="byte"):
        wl.load(path, shard=Shard({"t.f4": 1}, rank=0, world=2))


def test_rows_split_covers_the_rows_in_order():
    from weightlift.distributed import Rows

    for rows in (Rows("f", 10, 7, 20, 9), Rows("f", 0, 100, 100, 1), Rows("f", 5, 50, 64, 3)):
        spans = []
        for at, sub in rows.split(16):
            assert sub.nbytes <= 16 or sub.count == 1
            spans += [(at + i * sub.seg, sub.offset + i * sub.stride, sub.seg) for i in range(sub.count)]
        flat = [(dst + k, src + k) for dst, src, n in spans for k in range(n)]
        want = [
            (i * rows.seg + k, rows.offset + i * rows.stride + k) for i in range(rows.count) for k in range(rows.seg)
        ]
        assert flat == want


def test_bad_rules_are_option_errors(ckpts):
    for bad in ({"*": "diagonal"}, {"*": True}, [("*",)]):
        with pytest.raises(OptionError):
            Shard(bad, rank=0, world=2)
    with pytest.raises(OptionError):
        Shard(RULES, rank=2, world=2)
    with pytest.raises(OptionError, match="no dimension 1"):
        wl.load(ckpts["st"], shard=Shard({"l0.norm.weight": 1}, rank=0, world=2))
    with pytest.raises(OptionError, match="process group"):
        wl.load(ckpts["st"], shard=Shard(RULES))  # no rank, no world, no group
    with pytest.raises(OptionError, match="dtype"):
        wl.load(ckpts["st"], shard=Shard(RULES, rank=0, world=2), dtype="F16")


def test_dtensor_placements_are_accepted():
    tensor_mod = pytest.importorskip("torch.distributed.tensor")
    s = Shard({"a": tensor_mod.Shard(1), "b": tensor_mod.Replicate()}, rank=0, world=2)
    info = wl.TensorInfo("a", "F32", (4, 4), "f", 0, 64)
    assert s.placement(info) == 1
    assert s.placement(wl.TensorInfo("b", "F32", (4, 4), "f", 0, 64)) is None


def test_push_many_sends_independent_selections(ckpts):
    with wl.Server(port=0) as a, wl.Server(port=0) as b:
        ha, pa = a.start()
        hb, pb = b.start()
        res = push_many(ckpts["st"], {f"{ha}:{pa}": "l0.*", (hb, pb): "emb.*"})
        got_a, got_b = a.tensors(), b.tensors()
    assert set(res) == {f"{ha}:{pa}", f"{hb}:{pb}"}
    assert set(got_a) == {n for n, _, _ in LAYOUT if n.startswith("l0.")} and set(got_b) == {"emb.weight"}
    raws = {n: r for n, _, _, r in _tensors()}
    for name, arr in {**got_a, **got_b}.items():
        assert raw_bytes(arr) == raws[name]


def test_push_many_reports_every_failure(ckpts):
    with wl.Server(port=0) as a:
        ha, pa = a.start()
        port = free_port()  # nothing listens there
        with pytest.raises(PushError) as ei:
            push_many(ckpts["st"], {f"{ha}:{pa}": "l0.*", f"127.0.0.1:{port}": "emb.*"}, timeout=5)
    assert set(ei.value.errors) == {f"127.0.0.1:{port}"} and set(ei.value.results) == {f"{ha}:{pa}"}


def test_push_many_reports_a_first_server_that_is_down(ckpts):
    with wl.Server(port=0) as a:
        ha, pa = a.start()
        port = free_port()
        with pytest.raises(PushError) as ei:
            push_many(ckpts["st"], {f"127.0.0.1:{port}": "emb.*", f"{ha}:{pa}": "l0.*"}, timeout=5)
        got = a.tensors()
    assert set(ei.value.errors) == {f"127.0.0.1:{port}"} and set(ei.value.results) == {f"{ha}:{pa}"}
    assert set(got) == {n for n, _, _ in LAYOUT if n.startswith("l0.")}


def test_client_push_to_several_servers_at_once(ckpts):
    with wl.Server(port=0) as a, wl.Server(port=0) as b, wl.Server(port=0) as c:
        (ha, pa), (hb, pb), (hc, pc) = a.start(), b.start(), c.start()
        with wl.Client(f"{ha}:{pa}") as cl:
            res = cl.push(ckpts["st"], select="l0.*", to={f"{hb}:{pb}": "emb.*", (hc, pc): "l0.*"})
            again = cl.push(ckpts["st"], select="emb.*")  # the client's own connection is still usable
        got = {k: s.tensors() for k, s in (("a", a), ("b", b), ("c", c))}
    assert set(res) == {f"{ha}:{pa}", f"{hb}:{pb}", f"{hc}:{pc}"} and again.tensors == 1
    raws = {n: r for n, _, _, r in _tensors()}
    l0 = {n for n, _, _ in LAYOUT if n.startswith("l0.")}
    assert set(got["a"]) == l0 | {"emb.weight"} and set(got["b"]) == {"emb.weight"} and set(got["c"]) == l0
    for tensors in got.values():
        for name, arr in tensors.items():
            assert raw_bytes(arr) == raws[name]
    assert res[f"{hb}:{pb}"].tensors == 1 and res[f"{hc}:{pc}"].tensors == len(l0)


def test_client_push_to_refuses_its_own_server_twice(ckpts):
    with wl.Server(port=0) as a:
        ha, pa = a.start()
        with wl.Client(f"{ha}:{pa}") as cl, pytest.raises(wl.OptionError):
            cl.push(ckpts["st"], to=[f"{ha}:{pa}"])


# -- gloo groups of processes --------------------------------------------------------------------


def run_group(
    world: int,
    scenario: str,
    tmp: Path,
    paths: dict[str, str],
    *,
    deadline: float = GROUP_DEADLINE,
    may_die: tuple[int, ...] = (),
) -> list[dict | None]:
    """Run ``scenario`` on ``world`` ranks; each rank's JSON report (None for a rank in ``may_die``
    that left without one; any other rank must report)."""
    port = free_port()
    argvs = [[scenario, str(rank), str(world), str(port), str(tmp), json.dumps(paths)] for rank in range(world)]
    logs = run_ranks("tests.distributed.test_distributed", argvs, deadline)
    hung = [r for r, log in enumerate(logs) if log == KILLED]
    assert not hung, f"ranks {hung} of {scenario} still ran after {deadline} s: a hang"
    reports = []
    for rank in range(world):
        f = tmp / f"{scenario}.{rank}.json"
        reports.append(json.loads(f.read_text()) if f.exists() else None)
    for rank, (r, log) in enumerate(zip(reports, logs, strict=False)):
        if r is None and rank not in may_die:
            pytest.fail(f"{scenario} rank {rank} left no report\n{log[-3000:]}")
        if r is not None and r.get("failures"):
            pytest.fail(f"{scenario} rank {rank}: {r['failures']}\n{log[-3000:]}")
    return reports


@pytest.mark.parametrize("world", [2, 4])
def test_group_loads_and_broadcast(ckpts, world, tmp_path):
    reports = run_group(world, "main", tmp_path, ckpts)
    total = sum(len(raw) for _, _, _, raw in _tensors())
    n = len(LAYOUT)
    for key in ("full", "index", "shard", "shard_rows", "shard_pread"):
        reads = [r["bytes_read"][key] for r in reports]
        assert sum(reads) == total, (key, reads)  # the group read each byte once
        if key in ("full", "index"):
            # stripes of 1/world of the arena each: off by no more than alignment padding
            for b in reads:
                assert abs(b - total / world) <= 64 * n + world, (key, reads)
    assert reports[0]["bytes_read"]["broadcast"] == total
    assert all(r["bytes_read"]["broadcast"] == 0 for r in reports[1:])
    paths = reports[0]["paths"]
    assert paths["shard"] == {"replicated": 2, "direct": 4, "redistributed": 5}
    assert paths["shard_rows"] == {"replicated": 2, "direct": 9, "redistributed": 0}


@pytest.mark.parametrize("who", ["receiver", "source"])
def test_a_rank_dying_mid_broadcast_fails_the_others(ckpts, tmp_path, who):
    world = 3 if who == "receiver" else 2
    t0 = time.monotonic()
    dead = world - 1 if who == "receiver" else 0
    reports = run_group(world, f"die_{who}", tmp_path, ckpts, deadline=45, may_die=(dead,))
    assert reports[dead] is None  # it left with os._exit
    for rank, r in enumerate(reports):
        if rank == dead:
            continue
        assert r is not None, f"rank {rank} left no report"
        assert r["error"] == "TransportError", r
        assert "peer rank left" in r["message"]
        assert r["seconds"] < 30, r
    assert time.monotonic() - t0 < 45


# -- the rank's program ----------------------------------------------------------------------------


def _worker(scenario: str, rank: int, world: int, port: int, tmp: Path, paths: dict[str, str]) -> None:
    import datetime

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=20),
    )
    report: dict = {"failures": [], "bytes_read": {}, "paths": {}}
    out = tmp / f"{scenario}.{rank}.json"
    if scenario == "main":
        _main_checks(rank, world, paths, report)
    else:
        _die_checks(scenario, rank, world, paths, report)
    out.write_text(json.dumps(report))
    os._exit(0)  # no destroy_process_group: a dead peer can make it wait


def _main_checks(rank: int, world: int, paths: dict[str, str], report: dict) -> None:
    fails = report["failures"]

    def record(key: str, got: dict, rep: dict, path: str, shard: Shard | None) -> None:
        bad = check_slices(path, got, shard, rank, world)
        fails.extend(f"{key}: {b}" for b in bad)
        report["bytes_read"][key] = rep.get("bytes_read")
        report["paths"][key] = rep.get("paths")

    def load(key: str, path: str, shard: Shard | None = None, **options) -> None:
        """Load ``path`` across the group and record what this rank got and read."""
        rep: dict = {}
        got = wl.load(path, shard=shard, group=dist.group.WORLD, report=rep, **options)
        record(key, got, rep, path, None if shard is None else shard.resolved(rank, world))

    load("full", paths["st"], framework="torch")
    load("index", paths["index"])
    shard = Shard(RULES)  # rank and world from the group
    load("shard", paths["st"], shard, framework="torch")
    os.environ["WEIGHTLIFT_ROW_READ_MIN"] = "1"  # every rank alike: strided slices row by row
    load("shard_rows", paths["st"], shard)
    del os.environ["WEIGHTLIFT_ROW_READ_MIN"]
    load("shard_pread", paths["st"], shard, engine="pread")
    if "gguf" in paths and world == 2:
        load("gguf", paths["gguf"], Shard(GGUF_RULES), framework="torch")
    if "gguf" in paths and world == 4:
        try:  # every rank refuses the misaligned split, none is left waiting in a collective
            wl.load(paths["gguf"], shard=Shard({"blk.0.ffn_down.weight": 1}), group=dist.group.WORLD)
            fails.append("gguf misaligned split loaded")
        except OptionError as e:
            if "block boundaries" not in str(e):
                fails.append(f"gguf misaligned: {e}")
    rep = {}
    got = wl.distributed.broadcast_load(
        paths["st"] if rank == 0 else None, dist.group.WORLD, framework="torch", chunk=1 << 20, timeout=20, report=rep
    )
    record("broadcast", got, rep, paths["st"], None)
    if "gguf" in paths:
        rep = {}
        got = wl.distributed.broadcast_load(
            paths["gguf"] if rank == world - 1 else None,
            src=world - 1,
            framework="torch",
            chunk=4096,
            timeout=20,
            report=rep,
        )
        record("broadcast_gguf", got, rep, paths["gguf"], None)


def _die_checks(scenario: str, rank: int, world: int, paths: dict[str, str], report: dict) -> None:
    dying = world - 1 if scenario == "die_receiver" else 0
    seen = [0]

    def progress(n: int) -> None:
        seen[0] += 1
        if rank == dying and seen[0] == 2:
            os._exit(3)  # mid-broadcast, with chunks still to come

    t0 = time.monotonic()
    try:
        wl.distributed.broadcast_load(
            paths["st"] if rank == 0 else None, dist.group.WORLD, chunk=64 << 10, timeout=10, progress=progress
        )
        report["error"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        report["error"] = type(e).__name__
        report["message"] = str(e)
    report["seconds"] = time.monotonic() - t0


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    _worker(
        sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6]), json.loads(sys.argv[7])
    )
