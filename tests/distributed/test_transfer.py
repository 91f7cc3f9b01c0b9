"""Sharded to sharded over a gloo group (weightlift.distributed.transfer): real processes, real DTensors.

Each group is 4 processes on loopback (this file, run with ``--worker``, is a rank's program);
every check of a group runs in one start-up, since importing torch is most of the cost. Senders
hold DTensors (``distribute_tensor`` on a mesh of the sender ranks, FSDP2's ``fully_shard``) or
plain shards with a ``src`` layout; every receiver compares what it got, byte for byte, with
``weightlift.load(unsharded_checkpoint, shard=the same Shard)`` (fused tensors: each part's
``torch.chunk``, stacked). The fault matrix runs every fault on the same group and expects the
same IntegrityError (or OptionError) on every rank, and no error on the clean runs around it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="resharding over a group needs torch")
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is unavailable", allow_module_level=True)

import weightlift as wl  # noqa: E402
from tests.checkpoints import byte_length, raw_bytes, write  # noqa: E402
from tests.distributed.ranks import free_port, run_ranks  # noqa: E402
from weightlift.distributed import Shard, reshard_transfer, verify_resharded  # noqa: E402
from weightlift.errors import IntegrityError, OptionError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 150.0  # seconds a group may take, start-up included, before it is a hang
WORLD = 4

QKV = [32, 8, 8]  # 8 query heads and 2 kv heads (grouped-query) of dimension 4, fused along dim 0
GATE_UP = [24, 24]
LAYOUT = [
    ("embed.weight", "BF16", (11, 16)),  # vocab-parallel, uneven
    ("l0.qkv_proj.weight", "BF16", (sum(QKV), 16)),
    ("l0.o_proj.weight", "BF16", (16, 32)),
    ("l0.gate_up_proj.weight", "F32", (sum(GATE_UP), 16)),
    ("l0.down_proj.weight", "F16", (16, 24)),
    ("l0.norm.weight", "F32", (16,)),
    ("l0.experts.w13", "BF16", (5, 12, 16)),  # 5 experts over the expert-parallel ranks
    ("l0.bias", "F32", (7,)),
    ("l0.scale", "F64", (3, 5)),
    ("l0.wide", "BF16", (300, 2048)),  # a run larger than the small chunk
    ("lm_head.weight", "F32", (11, 16)),
]
PARTS = {"l0.qkv_proj.weight": QKV, "l0.gate_up_proj.weight": GATE_UP}
# the engine's layout: vLLM's column and row parallel, vocab parallel, experts, replicated norms
ENGINE = {
    "embed.weight": "colwise",
    "*.qkv_proj.weight": "colwise",
    "*.o_proj.weight": "rowwise",
    "*.gate_up_proj.weight": "colwise",
    "*.down_proj.weight": "rowwise",
    "*.norm.weight": None,
    "*.experts.*": 0,
    "*.bias": 0,
    "*.scale": 1,
    "*.wide": 1,
    "lm_head.weight": 0,
}
# a tensor-parallel trainer's layout (no fused parts: DTensor's Shard(0) of a fused tensor is a plain chunk)
TRAINER_TP = {"*.o_proj.weight": 1, "*.down_proj.weight": 1, "*.norm.weight": None, "*.scale": None, "*": 0}


def _tensors(seed: int = 0) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    rng = np.random.default_rng(seed)
    return [(n, d, s, rng.integers(0, 256, byte_length(d, s), dtype=np.uint8).tobytes()) for n, d, s in LAYOUT]


# -- the groups -------------------------------------------------------------------------------------------


def _group(scenario: str, tmp: Path, path: Path) -> list[dict]:
    port = free_port()
    argvs = [[scenario, str(r), str(port), str(tmp), str(path)] for r in range(WORLD)]
    logs = run_ranks("tests.distributed.test_transfer", argvs, DEADLINE)
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


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from weightlift.digest.published import make_manifest

    d = tmp_path_factory.mktemp("reshard")
    path = write(d / "model.safetensors", _tensors())
    (d / "model.safetensors.manifest.json").write_text(make_manifest(path, sketch=True).to_json())
    return path


def test_two_trainers_into_two_engines(ckpt, tmp_path):
    """Ranks 0-1 hold FSDP dim-0 DTensors, then TP DTensors, then FSDP2 ``fully_shard`` parameters;
    ranks 2-3 receive the engine's layout (fused qkv and gate_up included); then the fault matrix."""
    reps = _group("two_to_two", tmp_path, ckpt)
    for rep in reps:
        assert rep["checked"] >= 5, rep
    need = sum(r["needed"]["fsdp"] for r in reps)
    assert need > 0 and sum(r["sent"]["fsdp"] + r["copied"]["fsdp"] for r in reps) == need  # each byte once
    assert all(r["faults"] == reps[0]["faults"] for r in reps)  # every rank saw the same verdicts
    assert reps[0]["faults"] == {
        "skip": "IntegrityError:l0.o_proj.weight",
        "wrong-slice": "IntegrityError:l0.down_proj.weight",
        "wire-flip": "IntegrityError:l0.wide",
        "memory-flip": "IntegrityError:l0.experts.w13",
        "stale": "IntegrityError:l0.bias",
        "stale-without-manifest": "ok",
        "missing": "IntegrityError:l0.norm.weight",
        "disagree": "OptionError",
        "clean": "ok",
    }


def test_one_to_three_three_to_one_and_colocated(ckpt, tmp_path):
    """Rank 0 holds the whole model (plain numpy) into receivers 1-3; then ranks 0-2 hold TP3
    DTensors and rank 3 receives it whole; then every rank is both a sender (FSDP 4) and a
    receiver (the engine's layout over 4): a quarter of the bytes are copies, not messages; then
    inputs one rank cannot describe are refused by all; then the sender dies mid-transfer and
    every receiver raises TransportError."""
    reps = _group("odd", tmp_path, ckpt)
    assert all(r["checked"] >= 3 for r in reps)
    total = sum(len(raw) for _, _, _, raw in _tensors())
    assert reps[3]["needed"]["three_to_one"] == total
    assert [r["killed"] for r in reps] == ["died"] + ["TransportError"] * 3
    assert all(
        r["refused"] == {"no src": "OptionError", "2-D mesh": "OptionError", "bad rank": "OptionError"} for r in reps
    )
    assert all(r["killed_s"] < 30 for r in reps[1:])  # the timeout, not a hang
    colo = [r["copied"]["colocated"] for r in reps]
    assert all(c > 0 for c in colo) and sum(colo) + sum(r["sent"]["colocated"] for r in reps) == sum(
        r["needed"]["colocated"] for r in reps
    )


# -- a rank's program -------------------------------------------------------------------------------------


def _reference(path: str, rank: int, world: int, fused: bool = True) -> dict:
    """What a receiver must hold: the sharded load; fused tensors are each part's chunk, stacked."""
    got = wl.load(path, shard=Shard(ENGINE, rank=rank, world=world), framework="torch")
    if fused:
        full = wl.load(path, framework="torch")
        for name, parts in PARTS.items():
            pieces = torch.split(full[name], parts)
            got[name] = torch.cat([_chunk(p, rank, world) for p in pieces])
    return got


def _chunk(t, rank: int, world: int):
    parts = torch.chunk(t, world)
    return parts[rank] if rank < len(parts) else t[:0]


def _compare(got: dict, want: dict, what: str, fails: list[str]) -> None:
    if set(got) != set(want):
        fails.append(f"{what}: names {sorted(set(got) ^ set(want))}")
    for name, w in want.items():
        g = got.get(name)
        if g is None or tuple(g.shape) != tuple(w.shape) or raw_bytes(g) != raw_bytes(w):
            fails.append(f"{what}: {name} differs ({None if g is None else tuple(g.shape)} vs {tuple(w.shape)})")


def _verdict(fn) -> str:
    try:
        fn()
        return "ok"
    except IntegrityError as e:
        names = [n for n, _, _ in LAYOUT if n in str(e)]
        return f"IntegrityError:{','.join(names)}"
    except OptionError:
        return "OptionError"


def _two_to_two(rank: int, path: str, tmp: Path, rep: dict, fails: list[str]) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor import Shard as DShard

    import weightlift.distributed.transfer as tr

    mesh = DeviceMesh("cpu", [0, 1])  # every rank builds it; only ranks 0 and 1 are on it
    sender = rank < 2
    dst = Shard(ENGINE, rank=rank - 2, world=2) if not sender else None
    full = wl.load(path, framework="torch") if sender else None
    want = _reference(path, rank - 2, 2) if not sender else None
    manifest = path + ".manifest.json"

    def state(rules=None, drop=(), stale=()):
        if not sender:
            return None
        out = {}
        for n, t in full.items():
            if n in drop:
                continue
            d = Shard(rules).placement(wl.open(path)[n]) if rules else 0
            x = t.clone() if n in stale else t
            if n in stale:
                x.view(torch.uint8).reshape(-1)[:1] ^= 1  # an older version of the first element
            out[n] = distribute_tensor(x, mesh, [Replicate() if d is None else DShard(d)], src_data_rank=None)
        return out

    def run(what, st, compare=True, **kw):
        res = reshard_transfer(st, dst=dst, parts=PARTS, framework="torch", timeout=60, **kw)
        for k in ("sent", "copied", "needed"):
            rep[k][what] = getattr(res, k)
        if want is not None and compare:
            _compare(res.tensors, want, what, fails)
        rep["checked"] += 1
        return res

    run("fsdp", state())  # FSDP2's placement: Shard(0) everywhere
    run("tp", state(TRAINER_TP), manifest=manifest)  # against the saved model's manifest
    run("small-chunks", state(TRAINER_TP), chunk=100, inflight=2)  # strided runs through staging

    _fsdp2(rank, mesh, tmp, rep, fails)

    # the fault matrix: each on every rank, each named, none on a clean run
    faults = _plan_faults(run, state)
    real_isend = tr.Comm.isend
    sends = [0]

    def flipping(self, t, peer, *, what="send"):
        sends[0] += 1
        if rank == 1 and t.numel() > 60000 and sends[0] > 3:  # a byte of l0.wide, on the wire only
            t = t.clone()
            t[7] ^= 0x40
            sends[0] = -(1 << 30)
        return real_isend(self, t, peer, what=what)

    tr.Comm.isend = flipping
    try:
        faults["wire-flip"] = _verdict(lambda: run("wire-flip", state(), chunk=1 << 16))
    finally:
        tr.Comm.isend = real_isend

    res = run("memory-flip", state(), verify=False)
    if rank == 3:
        res.tensors["l0.experts.w13"].view(torch.uint8).reshape(-1)[5] ^= 0x01  # after it landed
    faults["memory-flip"] = _verdict(lambda: verify_resharded(res))
    faults["stale"] = _verdict(lambda: run("stale", state(stale=("l0.bias",)), manifest=manifest))
    faults["stale-without-manifest"] = _verdict(lambda: run("stale2", state(stale=("l0.bias",)), compare=False))
    faults["missing"] = _verdict(
        lambda: reshard_transfer(state(drop=("l0.norm.weight",)), dst=dst, parts=PARTS, manifest=manifest, timeout=60)
    )
    faults["disagree"] = _verdict(
        lambda: reshard_transfer(state(drop=("l0.norm.weight",) if rank == 1 else ()), dst=dst, parts=PARTS, timeout=60)
    )
    faults["clean"] = _verdict(lambda: run("clean", state(), manifest=manifest))
    rep["faults"] = faults


def _fsdp2(rank: int, mesh, tmp: Path, rep: dict, fails: list[str]) -> None:
    """FSDP2 itself: a module sharded by ``fully_shard``, its state dict as the trainer holds it."""
    sender = rank < 2
    from safetensors.torch import save_file
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.LayerNorm(24), torch.nn.Linear(24, 5))
    saved = str(tmp / "fsdp.safetensors")
    if rank == 0:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, saved)
    dist.barrier()
    rules = {"0.weight": 0, "0.bias": 0, "1.*": None, "2.weight": 1, "2.bias": None}
    if sender:
        fully_shard(model, mesh=mesh)
    res = reshard_transfer(
        model.state_dict() if sender else None,
        dst=Shard(rules, rank=rank - 2, world=2) if not sender else None,
        framework="torch",
        timeout=60,
    )
    if not sender:
        _compare(
            res.tensors, wl.load(saved, shard=Shard(rules, rank=rank - 2, world=2), framework="torch"), "fsdp2", fails
        )
    rep["checked"] += 1


def _plan_faults(run, state) -> dict[str, str]:
    """A tensor the plan skips, a run read from the wrong offset: on every process alike."""
    import weightlift.distributed.transfer as tr

    faults = {}
    real_plan = tr.plan

    def patched(change):
        def plan(infos, senders, receivers):
            return [change(tp) for tp in real_plan(infos, senders, receivers)]

        return plan

    def skip(tp):
        return tr.TensorPlan(tp.tensor, ()) if tp.tensor.name == "l0.o_proj.weight" else tp

    def wrong(tp):
        if tp.tensor.name != "l0.down_proj.weight":
            return tp
        s, r, box, runs = tp.moves[0]
        r0 = runs[0]
        shifted = type(r0)(
            r0.src + (2 if r0.src < 2 else -2), r0.dst, r0.length, r0.count, r0.src_stride, r0.dst_stride
        )
        return tr.TensorPlan(tp.tensor, ((s, r, box, (shifted, *runs[1:])), *tp.moves[1:]))

    for name, change in (("skip", skip), ("wrong-slice", wrong)):
        tr.plan = patched(change)
        try:
            faults[name] = _verdict(lambda name=name: run(name, state()))
        finally:
            tr.plan = real_plan
    return faults


def _odd(rank: int, path: str, tmp: Path, rep: dict, fails: list[str]) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor import Shard as DShard

    def record(what, res):
        for k in ("sent", "copied", "needed"):
            rep[k][what] = getattr(res, k)
        rep["checked"] += 1

    # 1 -> 3: plain numpy arrays on rank 0, its whole model (src: one rank of one)
    st = wl.load(path) if rank == 0 else None
    res = reshard_transfer(
        st, src=Shard(rank=0, world=1) if rank == 0 else None,
        dst=Shard(ENGINE, rank=rank - 1, world=3) if rank else None, parts=PARTS, timeout=60,
    )  # fmt: skip
    if rank:
        _compare(res.tensors, _reference(path, rank - 1, 3), "one_to_three", fails)
    record("one_to_three", res)

    # 3 -> 1: TP3 DTensors on ranks 0-2 (uneven everywhere), rank 3 receives the whole model
    mesh = DeviceMesh("cpu", [0, 1, 2])
    full = wl.load(path, framework="torch")
    state = None
    if rank < 3:
        ck = wl.open(path)
        state = {}
        for n, t in full.items():
            d = Shard(TRAINER_TP).placement(ck[n])
            state[n] = distribute_tensor(t, mesh, [Replicate() if d is None else DShard(d)], src_data_rank=None)
    res = reshard_transfer(state, dst=Shard(rank=0, world=1) if rank == 3 else None, framework="torch", timeout=60)
    if rank == 3:
        _compare(res.tensors, full, "three_to_one", fails)
    record("three_to_one", res)

    # colocated: every rank sends its FSDP 4 shard and receives its engine slice (plain torch shards)
    src = Shard(default=0, rank=rank, world=4)
    mine = wl.load(path, shard=src, framework="torch")
    res = reshard_transfer(
        mine, src=src, dst=Shard(ENGINE, rank=rank, world=4), parts=PARTS, chunk=4096, framework="torch", timeout=60
    )
    _compare(res.tensors, _reference(path, rank, 4), "colocated", fails)
    record("colocated", res)
    try:  # a plain shard that is not the torch.chunk slice its rank should hold: refused by every rank
        bad = {k: (v[:-1] if rank == 0 and v.shape[0] > 1 else v) for k, v in mine.items()}
        reshard_transfer(bad, src=src, dst=Shard(ENGINE, rank=rank, world=4), parts=PARTS, timeout=60)
        fails.append("a wrong shard size was accepted")
    except OptionError as e:
        if "torch.chunk slice" not in str(e):
            fails.append(f"wrong shard size: {e}")
    _refused(rank, path, rep, fails)
    _killed(rank, path, tmp, rep)


def _refused(rank: int, path: str, rep: dict, fails: list[str]) -> None:
    """Input one rank cannot describe is refused by every rank, none left waiting in a collective."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor import distribute_tensor

    t = wl.load(path, framework="torch")["l0.o_proj.weight"]
    mesh2d = DeviceMesh("cpu", [[0, 1], [2, 3]])
    cases = {
        "no src": ({"w": t} if rank == 1 else None, None, "plain"),
        "2-D mesh": ({"w": distribute_tensor(t, mesh2d, [DShard(0), DShard(1)], src_data_rank=None)}, None, "2-D"),
        "bad rank": (None, Shard(rank=rank % 2, world=2), "claimed"),
    }
    for what, (state, dst, words) in cases.items():
        if what == "bad rank":  # ranks 0-2 send whole tensors; 1 and 3 both claim receiver rank 1
            state = {"w": t} if rank == 0 else None
            src = Shard(rank=0, world=1) if rank == 0 else None
            dst = Shard(rank=1 if rank in (1, 3) else 0, world=2) if rank else None
        else:
            src = None
        try:
            reshard_transfer(state, src=src, dst=dst or (Shard(rank=0, world=1) if rank == 3 else None), timeout=20)
            fails.append(f"{what}: accepted")
        except OptionError as e:
            rep.setdefault("refused", {})[what] = "OptionError"
            if words not in str(e):
                fails.append(f"{what}: {e}")


def _killed(rank: int, path: str, tmp: Path, rep: dict) -> None:
    """The only sender dies after its third message: every receiver gets a TransportError within
    the timeout, none hangs (then every rank leaves without tearing down the broken group)."""
    import weightlift.distributed.transfer as tr
    from weightlift.errors import TransportError

    rep["exit_now"] = True
    real_isend, calls = tr.Comm.isend, [0]

    def dying(self, t, peer, *, what="send"):
        calls[0] += 1
        if calls[0] == 3:
            rep["killed"] = "died"
            (tmp / f"odd.{rank}.json").write_text(json.dumps(rep))
            os._exit(0)
        return real_isend(self, t, peer, what=what)

    tr.Comm.isend = dying
    t0 = time.monotonic()
    try:
        reshard_transfer(
            wl.load(path) if rank == 0 else None, src=Shard(rank=0, world=1) if rank == 0 else None,
            dst=Shard(ENGINE, rank=rank - 1, world=3) if rank else None, parts=PARTS, chunk=4096, timeout=5,
        )  # fmt: skip
        rep["killed"] = "no error"
    except TransportError:
        rep["killed"] = "TransportError"
    rep["killed_s"] = time.monotonic() - t0


def _worker(scenario: str, rank: int, port: int, tmp: Path, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    rep: dict = {"failures": [], "checked": 0, "sent": {}, "copied": {}, "needed": {}}
    try:
        {"two_to_two": _two_to_two, "odd": _odd}[scenario](rank, path, tmp, rep, rep["failures"])
    except Exception:  # noqa: BLE001 - reported to the test
        rep["failures"].append(traceback.format_exc())
    (tmp / f"{scenario}.{rank}.json").write_text(json.dumps(rep))
    if rep.get("exit_now"):
        os._exit(0)  # a peer died: the group cannot be torn down in order
    dist.destroy_process_group()


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]), sys.argv[6])
