"""The reshard plan and the sketch (weightlift.distributed.reshard), simulated with numpy.

Every case writes a real safetensors file, cuts each sender's local shard, executes the plan by
copying runs between flat byte buffers, and compares every receiver's buffer with what
``wl.load(path, shard=Shard(...))`` returns for that rank: the real reference.
"""

from __future__ import annotations

import numpy as np
import pytest

import weightlift as wl
from weightlift.distributed.reshard import (
    Layout,
    local_shape,
    plan,
    region,
    sketch,
    sketch_base,
    sketch_local,
    sketch_part,
)
from weightlift.distributed.shard import Shard
from weightlift.formats import TensorInfo

safetensors_numpy = pytest.importorskip("safetensors.numpy")

TENSORS = {
    "q.weight": ((10, 6), np.float32),  # uneven over 3 and 4
    "o.weight": ((6, 9), np.uint16),  # row-parallel (dim 1), bf16-like
    "embed.weight": ((11, 4), np.float16),  # vocab-parallel
    "norm.weight": ((7,), np.float32),  # replicated
    "experts.w": ((5, 3, 4), np.int8),  # MoE: Shard(0) over experts
    "cube": ((4, 5, 6), np.float64),  # 3-D cut along the middle
}
RX_RULES = {"q.*": "colwise", "o.*": "rowwise", "embed.*": 0, "norm.*": None, "experts.*": 0, "cube": 1}


def _write(tmp_path, seed=0):
    rng = np.random.default_rng(seed)
    arrs = {}
    for name, (shape, dt) in TENSORS.items():
        arrs[name] = (
            np.frombuffer(rng.bytes(int(np.prod(shape)) * np.dtype(dt).itemsize), dtype=dt).reshape(shape).copy()
        )
    path = tmp_path / "m.safetensors"
    safetensors_numpy.save_file(arrs, str(path))
    infos = [
        TensorInfo(
            n,
            {np.float32: "F32", np.uint16: "U16", np.float16: "F16", np.int8: "I8", np.float64: "F64"}[dt],
            shape,
            str(path),
            0,
            int(np.prod(shape)) * np.dtype(dt).itemsize,
        )
        for n, (shape, dt) in TENSORS.items()
    ]
    return path, arrs, infos


def _cut(arr, t, layout, rank):
    parts = []
    for seg in region(t, layout, rank):
        parts.append(arr[tuple(slice(a, b) for a, b in seg.box)])
    if not parts:
        return np.empty(local_shape(t, layout, rank), dtype=arr.dtype)
    dim = layout.placement(t)
    return parts[0] if dim is None else np.concatenate(parts, axis=dim)


def _execute(transfers, src_bufs, dst_bufs):
    for tr in transfers:
        src, dst = src_bufs[(tr.name, tr.sender)], dst_bufs[(tr.name, tr.receiver)]
        for run in tr.runs:
            for k in range(run.count):
                s, d = run.src + k * run.src_stride, run.dst + k * run.dst_stride
                assert not dst[1][d : d + run.length].any(), "a byte was sent twice"
                dst[0][d : d + run.length] = src[s : s + run.length]
                dst[1][d : d + run.length] = 1


SENDERS = [
    ("fsdp", lambda w: Layout(Shard(default=0), w)),
    ("tp", lambda w: Layout(Shard(RX_RULES), w)),
    ("rowwise-all", lambda w: Layout(Shard({"norm.*": None}, default=-1), w)),
    ("replicated", lambda w: Layout(Shard(), w)),
]


@pytest.mark.parametrize("sname,mk", SENDERS)
@pytest.mark.parametrize("sw,rw", [(2, 4), (4, 2), (3, 2), (1, 3)])
def test_plan_matches_sharded_load(tmp_path, sname, mk, sw, rw):
    path, arrs, infos = _write(tmp_path)
    senders, receivers = mk(sw), Layout(Shard(RX_RULES), rw)
    transfers = [tr for tp in plan(infos, senders, receivers) for tr in tp.transfers]
    assert transfers == [tr for tp in plan(infos, senders, receivers) for tr in tp.transfers]  # deterministic
    src_bufs = {(t.name, s): _cut(arrs[t.name], t, senders, s).tobytes() for t in infos for s in range(sw)}
    dst_bufs = {}
    for t in infos:
        for r in range(rw):
            n = int(np.prod(local_shape(t, receivers, r))) * arrs[t.name].itemsize
            dst_bufs[(t.name, r)] = (np.zeros(n, np.uint8), np.zeros(n, np.uint8))
    _execute(transfers, {k: np.frombuffer(v, np.uint8) for k, v in src_bufs.items()}, dst_bufs)
    for r in range(rw):
        got = wl.load(path, shard=Shard(RX_RULES, rank=r, world=rw))
        for t in infos:
            buf, seen = dst_bufs[(t.name, r)]
            assert seen.all(), f"{t.name} rank {r}: bytes missing"
            assert buf.tobytes() == np.ascontiguousarray(got[t.name]).tobytes(), (t.name, r)
    for r in range(rw):  # bytes sent == bytes needed
        need = sum(dst_bufs[(t.name, r)][0].size for t in infos)
        assert sum(tr.nbytes for tr in transfers if tr.receiver == r) == need


def test_replicated_senders_spread_the_load(tmp_path):
    _, _, infos = _write(tmp_path)
    transfers = [tr for tp in plan(infos, Layout(Shard(), 4), Layout(Shard(default=None), 4)) for tr in tp.transfers]
    assert sorted({tr.sender for tr in transfers}) == [0, 1, 2, 3]


def _fused(tmp_path, parts, name, sw, rw, rx_dim=0):
    rng = np.random.default_rng(1)
    shape = (sum(parts), 6)
    arr = rng.standard_normal(shape).astype(np.float32)
    t = TensorInfo(name, "F32", shape, "x", 0, arr.nbytes)
    # reference: the fused receiver slice is each part's torch.chunk, stacked (vLLM's QKV/merged column)
    senders = Layout(Shard(default=0), sw)
    receivers = Layout(Shard(default=rx_dim), rw, parts={name: parts})
    transfers = [tr for tp in plan([t], senders, receivers) for tr in tp.transfers]
    src = {(name, s): np.frombuffer(_cut(arr, t, senders, s).tobytes(), np.uint8) for s in range(sw)}
    for r in range(rw):
        n = int(np.prod(local_shape(t, receivers, r))) * 4
        dst = {(name, r): (np.zeros(n, np.uint8), np.zeros(n, np.uint8))}
        _execute([tr for tr in transfers if tr.receiver == r], src, dst)
        bounds = np.cumsum([0, *parts])
        want = np.concatenate([np.array_split(arr[bounds[i] : bounds[i + 1]], rw)[r] for i in range(len(parts))])
        assert dst[(name, r)][1].all()
        assert dst[(name, r)][0].tobytes() == want.tobytes()


@pytest.mark.parametrize("sw,rw", [(4, 2), (2, 4), (3, 2)])
def test_fused_qkv_gqa_and_gate_up(tmp_path, sw, rw):
    _fused(tmp_path, [8 * 2, 2 * 2, 2 * 2], "qkv_proj.weight", sw, rw)  # 8 q heads, 2 kv heads of dim 2
    _fused(tmp_path, [12, 12], "gate_up_proj.weight", sw, rw)


# --- the sketch ----------------------------------------------------------------------------------------


def _once(t, layout, f):
    """The sum of the ranks' parts; a replicated layout counts one rank."""
    if layout.placement(t) is None:
        return f(0)
    return sum(f(k) for k in range(layout.world)) % 2**64


def _sums(tmp_path, senders, receivers, mutate=None, seed=b"s"):
    _, arrs, infos = _write(tmp_path)
    transfers = [tr for tp in plan(infos, senders, receivers) for tr in tp.transfers]
    ok = True
    for t in infos:
        arr = arrs[t.name]
        whole = sketch(arr, t.name, seed)
        cuts = [_cut(arr, t, senders, k) for k in range(senders.world)]
        assert _once(t, senders, lambda k, t=t, cuts=cuts: sketch_local(t, senders, k, cuts[k], seed)) == whole
        src = {(t.name, k): np.frombuffer(cuts[k].tobytes(), np.uint8) for k in range(senders.world)}
        dst = {}
        for r in range(receivers.world):
            n = int(np.prod(local_shape(t, receivers, r))) * arr.itemsize
            dst[(t.name, r)] = (np.zeros(n, np.uint8), np.zeros(n, np.uint8))
        mine = [tr for tr in transfers if tr.name == t.name]
        if mutate:
            mine = mutate(t, mine, src)
        _execute(mine, src, dst)
        got = [
            dst[(t.name, r)][0].view(arr.dtype).reshape(local_shape(t, receivers, r)) for r in range(receivers.world)
        ]
        ok &= _once(t, receivers, lambda r, t=t, got=got: sketch_local(t, receivers, r, got[r], seed)) == whole
    return ok


@pytest.mark.parametrize("sw,rw", [(2, 4), (4, 2), (3, 2)])
def test_sketch_composes(tmp_path, sw, rw):
    assert _sums(tmp_path, Layout(Shard(default=0), sw), Layout(Shard(RX_RULES), rw))
    assert _sums(tmp_path, Layout(Shard(RX_RULES), sw), Layout(Shard(default=-1), rw))


def test_sketch_of_a_box_matches_the_definition():
    rng = np.random.default_rng(3)
    x = rng.integers(0, 2**16, (5, 7), dtype=np.uint16)
    r = sketch_base("t", b"k")
    want = sum(int(v) * pow(r, i, 2**64) for i, v in enumerate(x.reshape(-1))) % 2**64
    assert sketch(x, "t", b"k") == want
    box = ((1, 4), (2, 6))
    want_box = sum(int(x[i, j]) * pow(r, i * 7 + j, 2**64) for i in range(1, 4) for j in range(2, 6)) % 2**64
    assert sketch_part(x[1:4, 2:6], x.shape, box, r, rows_per_block=1) == want_box


def _flip(byte):
    def mutate(t, transfers, src):
        if t.name == "o.weight":  # a flipped byte in flight: copy the sender buffer and flip one byte
            tr = transfers[0]
            buf = src[(t.name, tr.sender)].copy()
            run = tr.runs[0]
            buf[run.src + byte] ^= 0x10
            src[(t.name, tr.sender)] = buf
        return transfers

    return mutate


def _skip(t, transfers, src):
    return [] if t.name == "q.weight" else transfers


def _off_by_one(t, transfers, src):
    if t.name == "cube":
        tr = transfers[0]
        r0 = tr.runs[0]
        from dataclasses import replace

        transfers = [replace(tr, runs=(replace(r0, src=r0.src + 8),) + tr.runs[1:])] + transfers[1:]
    return transfers


def _stale(t, transfers, src):
    if t.name == "embed.weight":
        for k, v in list(src.items()):
            src[k] = v.copy()
            src[k][::7] = 0  # an older version of some elements
    return transfers


@pytest.mark.parametrize(
    "fault",
    [_flip(0), _flip(1), _skip, _off_by_one, _stale],
    ids=["flip-low", "flip-high", "skip", "off-by-one", "stale"],
)
def test_sketch_detects_faults(tmp_path, fault):
    senders, receivers = Layout(Shard(default=0), 4), Layout(Shard(RX_RULES), 2)
    assert not _sums(tmp_path, senders, receivers, mutate=fault)


@pytest.mark.parametrize("seed", [b"a", b"b", b"c", b"d"])
def test_sketch_no_false_alarm(tmp_path, seed):
    assert _sums(tmp_path, Layout(Shard(default=0), 4), Layout(Shard(RX_RULES), 3), seed=seed)


def test_bad_input_is_an_option_error():
    from weightlift.errors import OptionError

    t = TensorInfo("qkv", "F32", (10, 4), "x", 0, 160)
    with pytest.raises(OptionError, match="fused parts"):
        plan([t], Layout(Shard(default=0), 2), Layout(Shard(default=0), 2, parts={"qkv": [4, 4]}))
    with pytest.raises(OptionError, match="bytes do not make"):
        plan([TensorInfo("w", "F32", (10, 4), "x", 0, 100)], Layout(Shard(default=0), 2), Layout(Shard(), 2))
    with pytest.raises(OptionError, match="sub-byte"):
        plan([TensorInfo("w", "F4", (10, 4), "x", 0, 20)], Layout(Shard(default=0), 2), Layout(Shard(), 2))
    with pytest.raises(OptionError, match="no dimension"):
        plan([TensorInfo("w", "F32", (10,), "x", 0, 40)], Layout(Shard(default=1), 2), Layout(Shard(), 2))
