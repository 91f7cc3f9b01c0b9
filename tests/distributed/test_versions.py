"""Versions and deltas across ranks (weightlift.distributed.transfer.Resharder): real processes on gloo.

Ranks 0-1 are trainers holding FSDP dim-0 shards (plain numpy, ``src=Shard(default=0)``) of four
successive versions of a checkpoint, each a ~1 % change of the one before; ranks 2-3 are engines
holding the tensor-parallel layout of tests/distributed/test_transfer.py (fused qkv and gate_up
included). After every update, clean or failed, each receiver compares what it serves, byte for
byte, with ``weightlift.load(that version, shard=the same Shard)``: a failed update must leave
every receiver on the version before it, and raise on every rank.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="resharding over a group needs torch")
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is unavailable", allow_module_level=True)

import weightlift as wl  # noqa: E402
from tests.checkpoints import write  # noqa: E402
from tests.distributed.ranks import free_port, run_ranks  # noqa: E402
from tests.distributed.test_transfer import ENGINE, PARTS, WORLD, _compare, _reference, _tensors  # noqa: E402
from weightlift.distributed import Resharder, Shard  # noqa: E402
from weightlift.errors import IntegrityError, TransportError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 150.0
VERSIONS = 4
CHANGE = 0.01  # the fraction of each tensor's elements a version changes


def _versions() -> list[list[tuple[str, str, tuple[int, ...], bytes]]]:
    """Version 1 and three more, each with ~1 % of every tensor's elements changed."""
    rng = np.random.default_rng(7)
    out = [_tensors()]
    for _ in range(VERSIONS - 1):
        nxt = []
        for name, dt, shape, raw in out[-1]:
            a = np.frombuffer(raw, np.uint8).copy()
            item = a.size // int(np.prod(shape))
            n = a.size // item
            idx = rng.choice(n, max(1, int(n * CHANGE)), replace=False)
            w = a.view(f"<u{item}")
            w[idx] ^= np.asarray(rng.integers(1, 1 << (8 * item - 1), idx.size), dtype=w.dtype)
            nxt.append((name, dt, shape, a.tobytes()))
        out.append(nxt)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from weightlift.digest.published import make_manifest

    d = tmp_path_factory.mktemp("versions")
    for v, tensors in enumerate(_versions(), 1):
        path = write(d / f"v{v}.safetensors", tensors)
        (d / f"v{v}.safetensors.manifest.json").write_text(make_manifest(path, sketch=True).to_json())
    return d


def _group(scenario: str, tmp: Path, ckpts: Path) -> list[dict]:
    port = free_port()
    argvs = [[scenario, str(r), str(port), str(tmp), str(ckpts)] for r in range(WORLD)]
    logs = run_ranks("tests.distributed.test_versions", argvs, DEADLINE)
    out = []
    for r in range(WORLD):
        f = tmp / f"{scenario}.{r}.json"
        if not f.exists():
            pytest.fail(f"{scenario} rank {r} left no report\n{logs[r][-4000:]}")
        rep = json.loads(f.read_text())
        if rep["failures"]:
            pytest.fail(f"{scenario} rank {r}: {rep['failures']}\n{logs[r][-3000:]}")
        out.append(rep)
    return out


def test_versions_switch_together_and_faults_leave_the_old_one(ckpts, tmp_path):
    """Full first, then deltas; a flipped byte on the wire, a skipped tensor and a stale base are
    refused on every rank with every receiver still on the version before; a sender killed
    mid-update leaves both receivers on the last good version."""
    reps = _group("versions", tmp_path, ckpts)
    assert all(r["faults"] == reps[0]["faults"] for r in reps[:2] + reps[2:])
    assert reps[0]["faults"] == {
        "wire-flip": "IntegrityError",
        "skip": "IntegrityError",
        "stale": "IntegrityError:stale base",
        "memory-flip": "IntegrityError",
        "clean": "ok",
    }
    assert all(r["versions"][:8] == [1, 2, 2, 2, 2, 2, 3, 4] for r in reps)
    assert [r["deltas"] for r in reps] == [[False, True, True, True]] * WORLD
    full, delta = (sum(r["sent"][k] for r in reps) for k in ("v1", "v2"))
    need = sum(r["needed"]["v1"] for r in reps)
    assert full == need  # the first update: every byte once
    assert 0 < delta < 0.06 * full, (delta, full)  # 1 % of the elements changed: a few % of the bytes
    assert reps[0]["killed"] == "died"
    assert [r["killed"] for r in reps[1:]] == ["TransportError"] * 3
    assert all(r["on_version_after_kill"] == 4 for r in reps[2:])


def test_colocated_ranks_copy_their_own_part_of_a_delta(ckpts, tmp_path):
    """Every rank both sends (FSDP 4) and receives (the engine's layout over 4): a delta's pieces
    a rank sends itself are copied, the rest travel, and each rank ends equal to the sharded load."""
    reps = _group("colocated", tmp_path, ckpts)
    assert [r["deltas"] for r in reps] == [[False, True]] * WORLD
    assert all(r["copied"]["v2"] > 0 for r in reps)
    full, delta = (sum(r["sent"][k] for r in reps) for k in ("v1", "v2"))
    assert 0 < delta < 0.06 * full, (delta, full)


def test_a_base_or_kept_copy_without_its_role_is_refused():
    """Checked where the Resharder is made, before any collective."""
    from weightlift.errors import OptionError

    w = {"w": np.zeros(4, np.float32)}
    with pytest.raises(OptionError, match="base: the tensors a receiver serves"):
        Resharder(base=w)
    with pytest.raises(OptionError, match="keep=True"):
        Resharder(kept=w, src=Shard(rank=0, world=1))
    with pytest.raises(OptionError, match="framework"):
        Resharder(framework="jax")


# -- a rank's program -------------------------------------------------------------------------------------


def _verdict(fn) -> str:
    try:
        fn()
        return "ok"
    except IntegrityError as e:
        return "IntegrityError:stale base" if "stale base" in str(e) else "IntegrityError"


def _versions_run(rank: int, ckpts: Path, tmp: Path, rep: dict, fails: list[str]) -> None:
    import weightlift.distributed.transfer as tr

    sender = rank < 2
    src = Shard(default=0, rank=rank, world=2) if sender else None
    dst = None if sender else Shard(ENGINE, rank=rank - 2, world=2)
    path = {v: str(ckpts / f"v{v}.safetensors") for v in range(1, VERSIONS + 1)}

    def state(v):
        return wl.load(path[v], shard=src) if sender else None

    def want(v):
        return None if sender else _reference(path[v], rank - 2, 2)

    def check(res: Resharder, v: int, what: str) -> None:
        rep["versions"].append(res.version)
        if not sender:
            _compare(res.tensors, want(v), what, fails)

    r = Resharder(dst=dst, src=src, parts=PARTS, keep=True, framework="torch", chunk=1 << 16, timeout=30)
    for v in (1, 2):
        res = r.update(state(v), manifest=path[v] + ".manifest.json")
        rep["sent"][f"v{v}"], rep["needed"][f"v{v}"] = res.sent, res.needed
        rep["deltas"].append(res.delta)
        check(r, v, f"v{v}")

    faults = {}
    real_isend, sends = tr.Comm.isend, [0]

    def flipping(self, t, peer, *, what="send"):
        sends[0] += 1
        if rank == 1 and sends[0] == 2:  # a byte of a delta stream, on the wire only
            t = t.clone()
            t[-1] ^= 0x10
        return real_isend(self, t, peer, what=what)

    tr.Comm.isend = flipping
    try:
        faults["wire-flip"] = _verdict(lambda: r.update(state(3)))
    finally:
        tr.Comm.isend = real_isend
    check(r, 2, "after wire-flip")

    real_plan = tr.plan

    def skipping(infos, senders, receivers):
        return [
            tr.TensorPlan(tp.tensor, ()) if "o_proj" in tp.tensor.name else tp
            for tp in real_plan(infos, senders, receivers)
        ]

    tr.plan = skipping
    try:
        faults["skip"] = _verdict(lambda: r.update(state(3)))
    finally:
        tr.plan = real_plan
    check(r, 2, "after skip")

    # a receiver that comes back serving version 1 (loaded from disk) while the trainers kept version 2
    stale = r if sender else Resharder(dst=dst, parts=PARTS, base=want(1), version=1, framework="torch", timeout=30)
    faults["stale"] = _verdict(lambda: stale.update(state(3)))
    if not sender:
        _compare(stale.tensors, want(1), "the stale receiver", fails)
    check(r, 2, "after stale")

    # a byte of the version a receiver serves flipped in memory: its base no longer matches
    flip = r.tensors["l0.o_proj.weight"].view(torch.uint8).reshape(-1)[3:4] if rank == 3 else None
    if flip is not None:
        flip ^= 0x08
    faults["memory-flip"] = _verdict(lambda: r.update(state(3)))
    if flip is not None:
        flip ^= 0x08
    check(r, 2, "after memory-flip")

    faults["clean"] = _verdict(
        lambda: rep["deltas"].append(r.update(state(3), manifest=path[3] + ".manifest.json").delta)
    )
    check(r, 3, "v3")
    rep["faults"] = faults

    # receivers restarted from the checkpoint of the version the trainers kept: the bases are
    # proven equal by their sketches, and the next update is a delta again (made with the default
    # chunk, not the senders': the group cuts its messages by the smallest)
    if not sender:
        r = Resharder(dst=dst, parts=PARTS, base=want(3), version=3, framework="torch", timeout=30)
    res = r.update(state(4))
    rep["deltas"].append(res.delta)
    check(r, 4, "v4 into restarted receivers")
    _killed(rank, r, state(4), tmp, rep, fails, check)


def _colocated(rank: int, ckpts: Path, tmp: Path, rep: dict, fails: list[str]) -> None:
    src = Shard(default=0, rank=rank, world=WORLD)
    dst = Shard(ENGINE, rank=rank, world=WORLD)
    r = Resharder(src=src, dst=dst, parts=PARTS, keep=True, framework="torch", chunk=4096, timeout=30)
    for v in (1, 2):
        path = str(ckpts / f"v{v}.safetensors")
        res = r.update(wl.load(path, shard=src))
        rep["deltas"].append(res.delta)
        rep["sent"][f"v{v}"], rep["copied"][f"v{v}"] = res.sent, res.copied
        _compare(r.tensors, _reference(path, rank, WORLD), f"colocated v{v}", fails)


def _killed(rank: int, r: Resharder, st, tmp: Path, rep: dict, fails: list[str], check) -> None:
    """Sender rank 0 dies after its second message of the next update: every other rank raises
    TransportError within the timeout, and both receivers still serve version 4."""
    import weightlift.distributed.transfer as tr

    rep["exit_now"] = True
    real_isend, calls = tr.Comm.isend, [0]

    def dying(self, t, peer, *, what="send"):
        calls[0] += 1
        if rank == 0 and calls[0] == 2:
            rep["killed"] = "died"
            (tmp / f"versions.{rank}.json").write_text(json.dumps(rep))
            os._exit(0)
        return real_isend(self, t, peer, what=what)

    tr.Comm.isend = dying
    r.timeout = 5
    try:
        r.update(st)
        rep["killed"] = "no error"
    except TransportError:
        rep["killed"] = "TransportError"
    rep["on_version_after_kill"] = r.version
    check(r, 4, "after the kill")


def _worker(scenario: str, rank: int, port: int, tmp: Path, ckpts: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    rep: dict = {"failures": [], "versions": [], "deltas": [], "sent": {}, "needed": {}, "copied": {}}
    try:
        {"versions": _versions_run, "colocated": _colocated}[scenario](rank, ckpts, tmp, rep, rep["failures"])
    except Exception:  # noqa: BLE001 - reported to the test
        rep["failures"].append(traceback.format_exc())
    (tmp / f"{scenario}.{rank}.json").write_text(json.dumps(rep))
    if rep.get("exit_now"):
        os._exit(0)  # a peer died: the group cannot be torn down in order
    dist.destroy_process_group()


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]), Path(sys.argv[6]))
