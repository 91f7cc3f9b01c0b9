"""Sharded pushes into sharded servers (weightlift.distributed.regions), over real sockets on loopback.

Senders hold FSDP dim-0 shards (``ShardOf`` with explicit regions, or real DTensors on a gloo
mesh of two processes); servers hold tensor-parallel slices (column, row, vocab-parallel, fused
qkv with grouped-query heads, gate_up, experts, replicated, uneven sizes). Every server's tensors
are compared byte for byte with ``wl.load(checkpoint, shard=the same Shard)`` (fused tensors:
each part's chunk, stacked, as vLLM's QKV and merged column layers hold them), the payload bytes
with what the receivers need, and the sketches with the unsharded checkpoint's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import weightlift as wl
from tests.waiting import wait_for
from weightlift.distributed.regions import (
    ShardOf,
    ShardPush,
    abort_all,
    check_sketches,
    push_shards,
    server_layout,
    server_sketches,
    switch_all,
)
from weightlift.distributed.reshard import sketch, sketch_base, sketch_part
from weightlift.distributed.shard import Shard, chunk_bounds
from weightlift.errors import IntegrityError, OptionError, RemoteProtocolError, TransportTimeout
from weightlift.remote.protocol import Decoder, Expect, Region, SketchReply, SketchRequest, Switch, SwitchReply, send

safetensors_numpy = pytest.importorskip("safetensors.numpy")

ROOT = Path(__file__).resolve().parents[2]
TENSORS = {
    "layers.0.q_proj.weight": ((11, 6), np.float32),  # column-parallel, uneven over 2 and 3
    "layers.0.o_proj.weight": ((6, 9), np.uint16),  # row-parallel (bf16-like), uneven
    "embed_tokens.weight": ((11, 4), np.float16),  # vocab-parallel, uneven
    "norm.weight": ((7,), np.float32),  # replicated
    "layers.0.qkv_proj.weight": ((24, 6), np.float32),  # fused: 8 q heads, 2 kv heads, head dim 2
    "layers.0.gate_up_proj.weight": ((24, 5), np.uint16),  # fused gate and up
    "experts.w": ((5, 3, 4), np.int8),  # experts by expert-parallel rank, uneven
}
RULES = {
    "*q_proj*": "colwise",
    "*o_proj*": "rowwise",
    "embed*": 0,
    "norm*": None,
    "*qkv_proj*": 0,
    "*gate_up*": 0,
    "experts*": 0,
}
FUSED = {"layers.0.qkv_proj.weight": (16, 4, 4), "layers.0.gate_up_proj.weight": (12, 12)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    rng = np.random.default_rng(7)
    arrs = {}
    for name, (shape, dt) in TENSORS.items():
        n = int(np.prod(shape)) * np.dtype(dt).itemsize
        arrs[name] = np.frombuffer(rng.bytes(n), dtype=dt).reshape(shape).copy()
        if np.dtype(dt).kind == "f":
            arrs[name][~np.isfinite(arrs[name])] = 0  # safetensors does not care, numpy comparisons do
    path = tmp_path_factory.mktemp("ck") / "m.safetensors"
    safetensors_numpy.save_file(arrs, str(path))
    return path, arrs


def _expected(path, arrs, rank, world):
    """What server ``rank`` of ``world`` must hold: the sharded load, fused tensors per part."""
    want = wl.load(path, shard=Shard(RULES, rank=rank, world=world))
    for name, parts in FUSED.items():
        full, base, rows = arrs[name], 0, []
        for n in parts:
            a, b = chunk_bounds(n, rank, world)
            rows.append(full[base + a : base + b])
            base += n
        want[name] = np.concatenate(rows)
    return want


def _servers(world, **kw):
    out = [wl.Server(port=0, shard=Shard(RULES, rank=r, world=world), fused=FUSED, **kw) for r in range(world)]
    for s in out:
        s.start()
    return out


def _fsdp(arrs, rank, world):
    """Rank's FSDP2 shard of every tensor: torch.chunk of dim 0, with its place in the whole."""
    out = {}
    for name, a in arrs.items():
        lo, hi = chunk_bounds(a.shape[0], rank, world)
        out[name] = ShardOf(a[lo:hi], a.shape, (lo,) + (0,) * (a.ndim - 1))
    return out


def _push_all(servers, states):
    """Every sender pushes to every server at once, one thread (and connection) per pair."""
    pushes: dict[tuple[int, int], ShardPush] = {}
    errors = []

    def run(i, r):
        try:
            with wl.Client(servers[r].address) as c:
                pushes[(i, r)] = push_shards(c, states[i])
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, r)) for i in range(len(states)) for r in range(len(servers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return pushes


def _status(server, names, timeout=5.0):
    with wl.Client(server.address) as c:
        return server_sketches(c, list(names), timeout=timeout)


@pytest.mark.parametrize("senders", [2, 3])
def test_fsdp_senders_into_tp2_servers_byte_for_byte(ckpt, senders):
    path, arrs = ckpt
    servers = _servers(2)
    try:
        pushes = _push_all(servers, [_fsdp(arrs, i, senders) for i in range(senders)])
        total = {n: 0 for n in arrs}
        for r, s in enumerate(servers):
            status = _status(s, arrs)
            check_sketches([pushes[(i, r)] for i in range(senders)], status)
            got, want = s.tensors(), _expected(path, arrs, r, 2)
            assert set(got) == set(arrs)
            for n in arrs:
                assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape, n
                assert got[n].tobytes() == want[n].tobytes(), n
            # the bytes sent are exactly the bytes this receiver needs, counted by both ends
            need = sum(want[n].nbytes for n in arrs)
            assert sum(pushes[(i, r)].bytes_sent for i in range(senders)) == need
            assert s.stats().bytes_received == need
            assert {n: e.received for n, e in status.items()} == {n: want[n].nbytes for n in arrs}
            for n in arrs:
                total[n] = (total[n] + status[n].sketch) % (1 << 64)
        # the proof without a gather: the servers' sketches add up to the unsharded checkpoint's
        for n, a in arrs.items():
            whole = sketch(a, n)
            if n == "norm.weight":  # replicated: each server holds it whole
                assert all(_status(s, [n])[n].sketch == whole for s in servers)
            else:
                assert total[n] == whole, n
    finally:
        for s in servers:
            s.close()


def test_the_layout_a_sender_sees(ckpt):
    servers = _servers(2)
    try:
        with wl.Client(servers[1].address) as c:
            lay = server_layout(c)
        assert (lay.rank, lay.world, lay.parts) == (1, 2, FUSED)
        assert lay.local_shape("layers.0.qkv_proj.weight", "F32", (24, 6)) == (12, 6)
        assert lay.local_shape("layers.0.o_proj.weight", "U16", (6, 9)) == (6, 4)
    finally:
        for s in servers:
            s.close()


def _one(arrs, name, rank, world):
    return {name: _fsdp(arrs, rank, world)[name]}


def test_a_skipped_region_leaves_the_set_invisible_and_says_which(ckpt):
    path, arrs = ckpt
    server = wl.Server(port=0, shard=Shard(RULES, rank=0, world=1))
    server.start()
    try:
        name = "layers.0.q_proj.weight"
        with wl.Client(server.address) as c:
            p = push_shards(c, {**_one(arrs, name, 0, 2), "norm.weight": arrs["norm.weight"]})
            assert p.status[name].complete is False and p.status[name].received == 144
            with pytest.raises(TransportTimeout, match=r"'layers\.0\.q_proj\.weight' \(144 of 264 bytes\)") as e:
                server_sketches(c, [name, "norm.weight"], timeout=0.05)
            assert "'norm.weight' (all 28 bytes, held until the rest of its set is complete)" in str(e.value)
        assert server.tensors() == {}  # one set: norm.weight, complete, waits for q_proj
        with wl.Client(server.address) as c:  # the missing part, from another sender, completes the set
            push_shards(c, _one(arrs, name, 1, 2))
        assert set(server.tensors()) == {name, "norm.weight"}
        assert _status(server, [name])[name].sketch == sketch(arrs[name], name)
        assert server.tensors()[name].tobytes() == arrs[name].tobytes()
    finally:
        server.close()


def test_without_a_set_each_tensor_shows_as_it_completes(ckpt):
    path, arrs = ckpt
    server = wl.Server(port=0, shard=Shard(RULES, rank=0, world=1))
    server.start()
    try:
        name = "layers.0.q_proj.weight"
        with wl.Client(server.address) as c:
            push_shards(c, {**_one(arrs, name, 0, 2), "norm.weight": arrs["norm.weight"]}, atomic=False)
        assert set(server.tensors()) == {"norm.weight"}
    finally:
        server.close()


def test_refused_regions_change_nothing(ckpt):
    path, arrs = ckpt
    servers = _servers(2)
    try:
        name = "layers.0.q_proj.weight"  # server 0 holds rows [0, 6)
        a = arrs[name]
        with wl.Client(servers[0].address) as c:
            lay = server_layout(c)
            # outside this server's slice (rows 6..8 are server 1's): refused, named
            conn = c.connections[0]
            bad = np.ascontiguousarray(a[6:8]).view(np.uint8).reshape(-1)
            conn.send(conn.frame(Region(name, "F32", a.shape, (6, 0), (8, 6), bad.nbytes)), bad)
            with pytest.raises(RemoteProtocolError, match=r"not inside this server's slice"):
                push_shards(c, {}, layout=lay)
            assert servers[0].memory_used == 0  # the refused first box left no slice charged
            push_shards(c, {name: ShardOf(a[0:3], a.shape, (0, 0))}, layout=lay)
            # overlapping what came before: refused, the bytes already placed stay as they were
            with pytest.raises(RemoteProtocolError, match=r"overlaps box \[\[0, 3\], \[0, 6\]\]"):
                push_shards(c, {name: ShardOf(np.zeros((2, 6), np.float32), a.shape, (2, 0))}, layout=lay)
            # another dtype or shape for the same tensor: refused
            with pytest.raises(RemoteProtocolError, match=r"a region of U32 \[11, 6\], but its slice is of F32"):
                push_shards(c, {name: ShardOf(a[3:6].view(np.uint32), a.shape, (3, 0))}, layout=lay)
            with pytest.raises(RemoteProtocolError, match=r"a region of F32 \[12, 6\]"):
                push_shards(c, {name: ShardOf(a[3:6], (12, 6), (3, 0))}, layout=lay)
            assert name not in servers[0].tensors()
            done = push_shards(c, {name: ShardOf(a[3:6], a.shape, (3, 0))}, layout=lay)
        assert done.status[name].complete
        assert done.status[name].sketch == sketch_part(a[0:6], a.shape, ((0, 6), (0, 6)), sketch_base(name))
        assert servers[0].tensors()[name].tobytes() == a[0:6].tobytes()
        assert servers[0].stats().bytes_received == 6 * 6 * 4  # the refused payloads never counted
    finally:
        for s in servers:
            s.close()


def test_a_box_outside_the_tensor_is_a_protocol_error():
    raw = bytearray(send(Region("w", "F32", (4, 3), (1, 0), (3, 3), 24)))
    raw[8 + 14 + 1 + 16] = 5  # after prefix, head, name and dims: dim 0's start, now 5 of the tensor's 4 rows
    dec = Decoder(our_role="server")
    dec.feed(bytes(raw))
    with pytest.raises(RemoteProtocolError, match=r"dimension 0 of the box, \[5, 3\), is not inside \[0, 4\)"):
        dec.next_event()
    with pytest.raises(OptionError, match="runs outside"):
        ShardOf(np.zeros((3, 3)), (4, 3), (2, 0))


def test_a_flipped_byte_on_the_wire_is_caught_by_the_sketch(ckpt):
    from tests.remote.relay import Relay

    path, arrs = ckpt
    server = wl.Server(port=0, shard=Shard(RULES, rank=0, world=2), fused=FUSED)
    server.start()
    a = np.arange(64, dtype=np.uint8).reshape(8, 8) + 100  # a payload pattern found on the wire once
    relay = Relay(server.address, tamper=("c2s", bytes(range(100, 116)), 5))
    try:
        with wl.Client(relay.address) as c:
            p = push_shards(c, {"experts.w": a})
        assert relay.flipped.is_set()
        assert p.status["experts.w"].complete  # landed, but not as sent ...
        with pytest.raises(IntegrityError, match=r"experts\.w"):
            check_sketches([p], p.status)  # ... and the sketch says so
        with wl.Client(server.address) as c:  # no false alarm on the same push without the flip
            q = push_shards(c, {"experts.w": a})
        check_sketches([q], q.status)
    finally:
        relay.close()
        server.close()


def test_a_wrong_slice_is_caught_against_the_checkpoint(ckpt):
    """A sender that mislabels its rows sends consistent sketches; the unsharded checkpoint's
    sketch (``reshard.sketch`` of the file, no gather) is what catches it."""
    path, arrs = ckpt
    name = "layers.0.q_proj.weight"
    a = arrs[name]
    servers = _servers(2)
    try:
        wrong = [
            {name: ShardOf(a[5:11], a.shape, (0, 0))},  # rows 5..11 said to be rows 0..6
            {name: ShardOf(a[0:5], a.shape, (6, 0))},
        ]
        pushes = _push_all(servers, wrong)
        parts = []
        for r, s in enumerate(servers):
            st = _status(s, [name])
            check_sketches([pushes[(0, r)], pushes[(1, r)]], st)  # consistent with what was sent
            parts.append(st[name].sketch)
        assert sum(parts) % (1 << 64) != sketch(a, name)
    finally:
        for s in servers:
            s.close()


def test_a_server_without_shard_takes_no_regions(ckpt):
    path, arrs = ckpt
    server = wl.Server(port=0)
    server.start()
    try:
        with wl.Client(server.address) as c, pytest.raises(OptionError, match="takes no REGIONs"):
            push_shards(c, {"norm.weight": arrs["norm.weight"]})
    finally:
        server.close()


_DTENSOR_WORKER = r"""
import json, os, sys
import numpy as np, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard as DShard
import weightlift as wl
from weightlift.distributed.regions import push_shards

rank = int(sys.argv[1]); addrs = json.loads(sys.argv[2]); ckpt = sys.argv[3]
dist.init_process_group("gloo", rank=rank, world_size=2)
mesh = init_device_mesh("cpu", (2,))
full = {k: torch.from_numpy(v.copy()) for k, v in wl.load(ckpt).items()}
state = {}
for name, t in full.items():
    if name.startswith("norm"):
        place = [Replicate()]
    elif "o_proj" in name:
        place = [DShard(1)]  # a tensor-parallel trainer's row-parallel weight
    else:
        place = [DShard(0)]  # FSDP2
    d = place[0].dim if isinstance(place[0], DShard) else None
    parts = torch.chunk(t, 2, dim=d) if d is not None else (t, t)
    local = parts[rank] if rank < len(parts) else t.narrow(d, t.shape[d], 0)
    # each rank holds its own chunk, as FSDP2 and TP leave it (no scatter from a source rank)
    state[name] = DTensor.from_local(local.contiguous(), mesh, place, shape=t.shape, stride=t.stride())
out = {}
for r, a in enumerate(addrs):
    with wl.Client(tuple(a)) as c:
        p = push_shards(c, state)
        out[r] = {"bytes": p.bytes_sent, "sketches": p.sketches}
print(json.dumps(out))
dist.destroy_process_group()
"""


def test_dtensor_senders_on_a_gloo_mesh(ckpt, tmp_path):
    pytest.importorskip("torch.distributed.tensor")
    path, arrs = ckpt
    servers = _servers(2)
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29500 + os.getpid() % 1000),
        "PYTHONPATH": str(ROOT),
    }
    env["OMP_NUM_THREADS"] = "1"
    addrs = json.dumps([list(s.address) for s in servers])
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _DTENSOR_WORKER, str(i), addrs, str(path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        outs = []
        for p in procs:
            o, e = p.communicate(timeout=240)
            assert p.returncode == 0, e[-3000:]
            outs.append(json.loads(o.strip().splitlines()[-1]))
        for r, s in enumerate(servers):
            status = _status(s, arrs)
            pushes = [ShardPush(sketches=o[str(r)]["sketches"]) for o in outs]
            check_sketches(pushes, status)
            got, want = s.tensors(), _expected(path, arrs, r, 2)
            for n in arrs:
                assert got[n].tobytes() == want[n].tobytes(), n
            assert sum(o[str(r)]["bytes"] for o in outs) == sum(want[n].nbytes for n in arrs)
    finally:
        for s in servers:
            s.close()


def test_a_sharded_server_refuses_whole_tensors(ckpt):
    path, arrs = ckpt
    (server,) = _servers(1)
    try:
        with wl.Client(server.address) as c, pytest.raises(RemoteProtocolError, match="holds slices"):
            c.push({"norm.weight": arrs["norm.weight"]})
        assert server.tensors() == {}
    finally:
        server.close()


def test_weightlift_serve_with_shard_rules(ckpt, tmp_path):
    from tests.cli.test_serve_ops import _serve

    path, arrs = ckpt
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": RULES, "fused": {k: list(v) for k, v in FUSED.items()}}))
    proc, _, address = _serve(tmp_path, "--shard-rules", str(rules), "--rank", "1", "--world", "2")
    try:
        with wl.Client(address) as c:
            assert server_layout(c).local_shape("layers.0.qkv_proj.weight", "F32", (24, 6)) == (12, 6)
            push_shards(c, arrs)
            got = server_sketches(c, list(arrs), timeout=5)
            c.pull(tmp_path / "pulled.safetensors")
        want = _expected(path, arrs, 1, 2)
        assert {n: e.received for n, e in got.items()} == {n: w.nbytes for n, w in want.items()}
        pulled = wl.load(tmp_path / "pulled.safetensors")
        assert all(pulled[n].tobytes() == want[n].tobytes() for n in arrs)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    bad = subprocess.run(
        [sys.executable, "-m", "weightlift", "serve", "--port", "0", "--shard-rules", "llama", "--rank", "0"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
    )
    assert bad.returncode != 0 and "--shard-rules needs --rank and --world" in bad.stderr


def test_small_chunks_and_a_protected_connection(ckpt):
    """Boxes cut into many REGIONs (rows, and pieces of one row), every frame under a MAC."""
    path, arrs = ckpt
    token = "t" * 32
    servers = _servers(2, token=token)
    try:
        pushes = {}
        for r, s in enumerate(servers):
            with wl.Client(s.address, token=token) as c:
                pushes[r] = push_shards(c, arrs, chunk=20)
            got, want = s.tensors(), _expected(path, arrs, r, 2)
            assert all(got[n].tobytes() == want[n].tobytes() for n in arrs)
            assert pushes[r].regions > 3 * len(arrs)  # really cut small
            with wl.Client(s.address, token=token) as c:
                check_sketches([pushes[r]], server_sketches(c, list(arrs)))
    finally:
        for s in servers:
            s.close()


def test_sketch_replies_stay_within_a_frame(ckpt):
    """Many long names: the client asks in batches, and every entry comes back."""
    from weightlift.distributed.regions import _batches
    from weightlift.remote.protocol import MAX_SKETCH_BYTES

    names = tuple(f"{'x' * 4000}.{i}" for i in range(300))  # 1.2 MB of names
    batches = list(_batches(names))
    assert len(batches) == 3 and sum(batches, ()) == names
    assert all(sum(27 + len(n) for n in b) <= MAX_SKETCH_BYTES for b in batches)
    server = wl.Server(port=0, shard=Shard({}, rank=0, world=1))
    server.start()
    try:
        with wl.Client(server.address) as c:
            push_shards(c, {n: np.zeros(1, np.int8) for n in names})
            assert set(server_sketches(c, list(names))) == set(names)
    finally:
        server.close()


def test_client_push_points_shards_to_push_shards(ckpt):
    path, arrs = ckpt
    server = wl.Server(port=0)
    server.start()
    try:
        shard = _fsdp(arrs, 0, 2)["norm.weight"]
        with wl.Client(server.address) as c, pytest.raises(OptionError, match="push_shards"):
            c.push({"norm.weight": shard})
    finally:
        server.close()


def test_a_byte_flipped_in_the_servers_memory_is_caught(ckpt):
    path, arrs = ckpt
    servers = _servers(2)
    try:
        pushes = _push_all(servers, [_fsdp(arrs, i, 2) for i in range(2)])
        name = "layers.0.o_proj.weight"  # row-parallel: its slice is columns of every row
        for r, s in enumerate(servers):  # no false alarm, as landed or as held now
            for again in (False, True):
                with wl.Client(s.address) as c:
                    check_sketches([pushes[(0, r)], pushes[(1, r)]], server_sketches(c, list(arrs), recompute=again))
        t = servers[1].tensors(writable=True)[name]
        t[3, 2] ^= 0x0100
        with wl.Client(servers[1].address) as c:
            landed = server_sketches(c, list(arrs))
            now = server_sketches(c, list(arrs), recompute=True)
        check_sketches([pushes[(0, 1)], pushes[(1, 1)]], landed)  # as it landed: fine
        with pytest.raises(IntegrityError, match=r"layers\.0\.o_proj\.weight"):
            check_sketches([pushes[(0, 1)], pushes[(1, 1)]], now)  # as it is now: caught
    finally:
        for s in servers:
            s.close()


def test_a_sender_killed_mid_update_leaves_the_old_version(ckpt):
    path, arrs = ckpt
    (server,) = _servers(1)
    try:
        v1 = {n: arrs[n] for n in ("layers.0.q_proj.weight", "norm.weight")}
        with wl.Client(server.address) as c:
            push_shards(c, v1)
        v2 = {n: a + 1 for n, a in v1.items()}
        name = "layers.0.q_proj.weight"
        c = wl.Client(server.address)
        conn = c.connections[0]
        lay = server_layout(c)
        push_shards(c, {"norm.weight": v2["norm.weight"], name: ShardOf(v2[name][:5], (11, 6), (0, 0))}, layout=lay)
        raw = np.ascontiguousarray(v2[name][5:]).view(np.uint8).reshape(-1)
        conn.send(conn.frame(Region(name, "F32", (11, 6), (5, 0), (11, 6), raw.nbytes)), raw[:40])
        c.close()  # killed inside a REGION's payload
        with wl.Client(server.address) as c2:
            with pytest.raises(TransportTimeout, match=r"q_proj\.weight' \(120 of 264 bytes\)"):
                server_sketches(c2, list(v1), timeout=0.2)
            held = server.tensors()
            assert all(held[n].tobytes() == v1[n].tobytes() for n in v1)  # v1, all of it
            # the box the dead sender claimed is free again: another sender completes the update
            push_shards(c2, {name: ShardOf(v2[name][5:], (11, 6), (5, 0))})
            server_sketches(c2, list(v1), timeout=5)
        held = server.tensors()
        assert all(held[n].tobytes() == v2[n].tobytes() for n in v2)
    finally:
        server.close()


def test_regions_are_refused_outside_the_default_model(ckpt):
    # the assembly keeps the default model's tensors: a REGION after MODEL "m" would have landed
    # there silently, and one named with the store's NUL mark inside another model's namespace
    path, arrs = ckpt
    server = wl.Server(port=0, shard=Shard(RULES, rank=0, world=1))
    server.start()
    try:
        a = arrs["norm.weight"]
        with wl.Client(server.address) as c:
            lay = server_layout(c)
            conn = c.connections[0]
            conn.use("m")
            with pytest.raises(RemoteProtocolError, match=r"model 'm': REGIONs fill the default model only"):
                push_shards(c, {"norm.weight": a}, layout=lay, atomic=False)
            conn.use("")
            raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
            evil = "\x00m\x00norm.weight"
            conn.send(conn.frame(Region(evil, "F32", a.shape, (0,), a.shape, raw.nbytes)), raw)
            with pytest.raises(RemoteProtocolError, match=r"cannot begin with NUL"):
                push_shards(c, {}, layout=lay)
            assert server.tensors() == {} and server.tensors(model="m") == {}
            push_shards(c, {"norm.weight": a}, layout=lay, atomic=False)  # still in step
        assert server.tensors()["norm.weight"].tobytes() == a.tobytes()
    finally:
        server.close()


def test_the_open_set_of_names_is_bounded(ckpt, monkeypatch):
    # every EXPECT added its names to the server's open set, without end: a client repeating
    # EXPECT frames of 65536 names grew the server's memory past any limit it was started with
    import weightlift.remote.server.store as store_mod
    from weightlift.remote.protocol import Expect

    monkeypatch.setattr(store_mod, "MAX_SET_BYTES", 1000)
    path, arrs = ckpt
    server = wl.Server(port=0, shard=Shard(RULES, rank=0, world=1))
    server.start()
    try:
        with wl.Client(server.address) as c:
            lay = server_layout(c)
            conn = c.connections[0]
            conn.send(conn.frame(Expect(tuple(f"x{i:03d}" for i in range(200)))))  # 800 characters: taken
            conn.send(conn.frame(Expect(tuple(f"y{i:03d}" for i in range(100)))))  # past 1000: refused
            with pytest.raises(RemoteProtocolError, match=r"EXPECT of 100 names: the open set"):
                push_shards(c, {}, layout=lay)
            conn.send(conn.frame(Expect(tuple(f"x{i:03d}" for i in range(200)))))  # names it holds: no growth
            push_shards(c, {}, layout=lay)
    finally:
        server.close()


def test_a_tensor_larger_than_the_servers_memory_whose_slice_fits(ckpt):
    # the decoder capped a REGION's unsharded tensor at the server's max_memory, as if it held it
    # whole: a TP server whose slice of a large tensor fits its memory refused every box of it
    from weightlift.remote.server.store import entry_cost

    a = np.arange(4096 * 8, dtype=np.float32).reshape(4096, 8)  # 128 KiB whole, 64 KiB a slice
    limit = entry_cost("w", a.nbytes // 2, 2) + 1024
    server = wl.Server(port=0, shard=Shard({"*": 0}, rank=0, world=2), max_memory=limit)
    server.start()
    try:
        with wl.Client(server.address) as c:
            done = push_shards(c, {"w": a}, atomic=False)
        assert done.status["w"].complete
        assert server.tensors()["w"].tobytes() == a[:2048].tobytes()
    finally:
        server.close()


def test_a_box_staged_before_it_is_scattered_is_charged(ckpt):
    # a box that is not one contiguous range of the slice is staged whole (up to 64 MiB) before
    # it is scattered: that buffer is memory the server allocates for a client, charged like
    # WRITE's staging, so a server at its limit refuses the box instead of allocating past it
    from weightlift.remote.server.store import entry_cost

    rows = 4096
    slice_bytes = rows * 4 * 4  # (rows, 8) float32 split by columns over 2: (rows, 4) here
    limit = entry_cost("w", slice_bytes, 2) + slice_bytes // 2 - 1  # the slice fits, slice + a half-box not
    server = wl.Server(port=0, shard=Shard({"*": 1}, rank=0, world=2), max_memory=limit)
    server.start()
    try:
        a = np.arange(rows * 8, dtype=np.float32).reshape(rows, 8)
        with wl.Client(server.address) as c:
            lay = server_layout(c)
            left = ShardOf(np.ascontiguousarray(a[:, :2]), a.shape, (0, 0))  # columns 0..2 of 0..4: strided here
            with pytest.raises(RemoteProtocolError, match=r"staging a box of \d+ bytes.*memory limit"):
                push_shards(c, {"w": left}, layout=lay, atomic=False)
            assert server.stats()["memory_used"] == entry_cost("w", slice_bytes, 2)  # the slice only
    finally:
        server.close()


def test_a_fused_tensor_of_more_parts_than_layout_reply_carries_is_refused_at_start():
    # LAYOUT_REPLY carries a fused tensor's part sizes as dims (at most 64): a server started
    # with more answered every LAYOUT with an internal error about a "shape" of 65 dimensions
    with pytest.raises(OptionError, match=r"fused tensor 'experts\.w': 65 parts; a server takes at most 64"):
        wl.Server(port=0, shard=Shard({"*": 0}, rank=0, world=2), fused={"experts.w": [2] * 65})
    wl.Server(port=0, shard=Shard({"*": 0}, rank=0, world=2), fused={"experts.w": [2] * 64}).close()


def _closed(server, still_open=0):
    """Wait until the server has closed all but ``still_open`` connections (and let go of what they built)."""
    wait_for(lambda: server.stats().open_connections == still_open)


def test_a_build_its_senders_abandoned_gives_way_to_a_fresh_version(ckpt):
    # a sender that died part-way kept its claims for good: a restarted sender pushing the next
    # version whole was refused ("overlaps ... received before") and the slice stayed charged
    path, arrs = ckpt
    (server,) = _servers(1)
    try:
        name, a = "layers.0.q_proj.weight", arrs["layers.0.q_proj.weight"]
        with wl.Client(server.address) as c:
            push_shards(c, {name: ShardOf(a[:5], a.shape, (0, 0))}, atomic=False)
            charged = server.memory_used
            with wl.Client(server.address) as c2:  # while its sender is open the build stands
                with pytest.raises(RemoteProtocolError, match=r"overlaps box \[\[0, 5\], \[0, 6\]\]"):
                    push_shards(c2, {name: a + 1}, atomic=False)
        _closed(server)
        with wl.Client(server.address) as c:  # its sender gone: the next version, whole, starts afresh
            done = push_shards(c, {name: a + 1}, atomic=False)
        assert done.status[name].complete and done.status[name].received == a.nbytes
        assert server.tensors()[name].tobytes() == (a + 1).tobytes()
        assert server.memory_used == charged  # one slice charged: the abandoned one's went back
        # a first box of the wrong dtype held the name the same way
        n = arrs["norm.weight"]
        with wl.Client(server.address) as c:
            push_shards(c, {"norm.weight": ShardOf(n[:3].view(np.uint32), n.shape, (0,))}, atomic=False)
        _closed(server)
        with wl.Client(server.address) as c:
            done = push_shards(c, {"norm.weight": n}, atomic=False)
        assert done.status["norm.weight"].complete
        assert server.tensors()["norm.weight"].tobytes() == n.tobytes()
    finally:
        server.close()


def test_an_abandoned_set_gives_way_to_the_next_update(ckpt):
    # the open set never expired: a name whose sender died before it arrived held back every
    # later atomic push, whatever it named
    path, arrs = ckpt
    (server,) = _servers(1)
    try:
        name, a, n = "layers.0.q_proj.weight", arrs["layers.0.q_proj.weight"], arrs["norm.weight"]
        with wl.Client(server.address) as c:  # one set of both; q_proj never completes
            push_shards(c, {"norm.weight": n, name: ShardOf(a[:5], a.shape, (0, 0))})
        _closed(server)
        assert server.tensors() == {}
        with wl.Client(server.address) as c:  # the next update names norm.weight only
            push_shards(c, {"norm.weight": n + 1})
            server_sketches(c, ["norm.weight"], timeout=5)
        assert {k: t.tobytes() for k, t in server.tensors().items()} == {"norm.weight": (n + 1).tobytes()}
        _closed(server)
        with wl.Client(server.address) as c:  # a restarted trainer pushes both, whole
            push_shards(c, {"norm.weight": n + 2, name: a + 2})
            server_sketches(c, ["norm.weight", name], timeout=5)
        held = server.tensors()
        assert held["norm.weight"].tobytes() == (n + 2).tobytes() and held[name].tobytes() == (a + 2).tobytes()
    finally:
        server.close()


def test_a_freed_or_removed_tensor_is_no_longer_sketched_complete(ckpt):
    path, arrs = ckpt
    (server,) = _servers(1)
    try:
        n = arrs["norm.weight"]
        with wl.Client(server.address) as c:
            push_shards(c, {"norm.weight": n, "embed_tokens.weight": arrs["embed_tokens.weight"]}, atomic=False)
            server_sketches(c, ["norm.weight", "embed_tokens.weight"])
            assert c.free("norm.weight") == 1
            with pytest.raises(TransportTimeout, match=r"'norm\.weight' \(nothing\)"):
                server_sketches(c, ["norm.weight"])
            assert c.remove() == 1
            with pytest.raises(TransportTimeout, match=r"'embed_tokens\.weight' \(nothing\)"):
                server_sketches(c, ["embed_tokens.weight"])
            push_shards(c, {"norm.weight": n}, atomic=False)  # pushed again, it shows again
            server_sketches(c, ["norm.weight"])
    finally:
        server.close()


def test_removing_the_default_model_during_a_sharded_build_is_refused(ckpt):
    # REMOVE ignored the assembly: it succeeded, and the build published afterwards
    from weightlift.remote.client.connection import Busy

    path, arrs = ckpt
    (server,) = _servers(1)
    try:
        name, a, n = "layers.0.q_proj.weight", arrs["layers.0.q_proj.weight"], arrs["norm.weight"]
        with wl.Client(server.address) as c:
            push_shards(c, {"norm.weight": n}, atomic=False)
            with wl.Client(server.address) as sender:
                push_shards(sender, {name: ShardOf(a[:5], a.shape, (0, 0))}, atomic=False)
                with pytest.raises(Busy, match=r"'layers\.0\.q_proj\.weight' is being assembled"):
                    c.remove()
                assert set(server.tensors()) == {"norm.weight"}  # nothing removed
            _closed(server, still_open=1)
            assert c.remove() == 1  # its sender gone, the build is dropped with the model
            push_shards(c, {name: ShardOf(a[5:], a.shape, (5, 0))}, atomic=False)
            with pytest.raises(TransportTimeout, match=r"\(144 of 264 bytes\)"):
                server_sketches(c, [name])
        assert server.tensors() == {}
    finally:
        server.close()


# -- the two-phase switch: every receiver of one update switches, or none --------------------------


def _flip(arrs):
    """Another version of every tensor, each of its bytes changed (slicing commutes with it)."""
    return {n: (a.view(np.uint8) ^ 0x5A).view(a.dtype) for n, a in arrs.items()}


def _bytes(held):
    return {n: np.ascontiguousarray(t).tobytes() for n, t in held.items()}


def _push_held(servers, states, set_id, *, skip=None):
    """Every sender pushes its state to every server with ``set_id``; ``skip``: (sender, server,
    tensor) that sender is killed before sending (its connection closes without it)."""
    pushes = {}
    for i, state in enumerate(states):
        for r, server in enumerate(servers):
            sent = {n: v for n, v in state.items() if skip is None or (i, r, n) != skip}
            with wl.Client(server.address) as c:
                pushes[(i, r)] = push_shards(c, sent, set_id=set_id, chunk=64)
    return [[pushes[(i, r)] for i in range(len(states))] for r in range(len(servers))]


class _Reader:
    """Reads every tensor of a server (one snapshot under the store's lock) until stopped, and
    records each snapshot that is neither all of ``old`` nor all of ``new``."""

    def __init__(self, server, old, new):
        self.mixed, self.seen = [], set()
        self._stop = threading.Event()

        def run():
            while not self._stop.is_set():
                got = _bytes(server.tensors())
                kinds = {("old" if got[n] == old[n] else "new" if got[n] == new[n] else "other") for n in old}
                self.seen |= kinds
                if len(kinds) != 1:
                    self.mixed.append(kinds)

        self._t = threading.Thread(target=run)
        self._t.start()

    def stop(self):
        self._stop.set()
        self._t.join()


def test_held_sets_switch_on_every_server_together(ckpt):
    path, arrs = ckpt
    servers = _servers(2)
    try:
        v2 = _flip(arrs)
        _push_all(servers, [_fsdp(arrs, i, 2) for i in range(2)])
        old = [_bytes(_expected(path, arrs, r, 2)) for r in range(2)]
        new = [{n: (np.frombuffer(b, np.uint8) ^ 0x5A).tobytes() for n, b in o.items()} for o in old]
        for r, s in enumerate(servers):
            wait_for(lambda s=s, r=r: _bytes(s.tensors()) == old[r])
        pushes = _push_held(servers, [_fsdp(v2, i, 2) for i in range(2)], set_id=2)
        for r, s in enumerate(servers):  # complete everywhere, and shown nowhere
            assert _bytes(s.tensors()) == old[r]
            with wl.Client(s.address) as c:
                held = server_sketches(c, list(arrs), set_id=2, timeout=5)
            assert all(e.received == e.needed and not e.complete for e in held.values())
        readers = [_Reader(s, old[r], new[r]) for r, s in enumerate(servers)]
        clients = [wl.Client(s.address) for s in servers]
        try:
            generations = switch_all(clients, 2, list(arrs), pushes)
            for c in clients:  # a second SWITCH: refused, nothing changed
                conn = c.connections[0]
                conn.send(conn.frame(Switch(2)))
                assert "switched in already" in conn.expect(SwitchReply).message
        finally:
            for c in clients:
                c.close()
            for rd in readers:
                rd.stop()
        for r, s in enumerate(servers):
            assert _bytes(s.tensors()) == new[r]  # v2, byte for byte, on both
        assert all(rd.mixed == [] for rd in readers)  # a reader saw all of v1 or all of v2, never a mix
        assert all(rd.seen <= {"old", "new"} for rd in readers)
        assert all(g >= 2 for g in generations)
    finally:
        for s in servers:
            s.close()


def test_a_sender_killed_before_its_last_box_for_one_server_switches_neither(ckpt):
    path, arrs = ckpt
    servers = _servers(2)
    try:
        _push_all(servers, [_fsdp(arrs, i, 2) for i in range(2)])
        old = [_bytes(_expected(path, arrs, r, 2)) for r in range(2)]
        for r, s in enumerate(servers):
            wait_for(lambda s=s, r=r: _bytes(s.tensors()) == old[r])
        v2 = _flip(arrs)
        name = "layers.0.o_proj.weight"
        pushes = _push_held(servers, [_fsdp(v2, i, 2) for i in range(2)], set_id=5, skip=(1, 1, name))
        with wl.Client(servers[0].address) as c:  # server A holds the complete set, unseen
            assert server_sketches(c, list(arrs), set_id=5, timeout=5)
        clients = [wl.Client(s.address) for s in servers]
        try:
            with pytest.raises(TransportTimeout, match=r"o_proj\.weight' \(\d+ of \d+ bytes\)"):
                switch_all(clients, 5, list(arrs), pushes, timeout=0.3)
            for c in clients:  # the set was dropped on both: nothing is open, nothing to switch
                conn = c.connections[0]
                conn.send(conn.frame(SketchRequest(())))
                assert conn.expect(SketchReply).set_state == SketchReply.SET_NONE
                conn.send(conn.frame(Switch(5)))
                reply = conn.expect(SwitchReply)
                assert not reply.ok and "no such held set" in reply.message
        finally:
            for c in clients:
                c.close()
        for r, s in enumerate(servers):
            assert _bytes(s.tensors()) == old[r]  # both still serve v1, byte for byte
        # the next update, with its own id, goes through on both
        pushes = _push_held(servers, [_fsdp(v2, i, 2) for i in range(2)], set_id=6)
        clients = [wl.Client(s.address) for s in servers]
        try:
            switch_all(clients, 6, list(arrs), pushes)
        finally:
            for c in clients:
                c.close()
        for r, s in enumerate(servers):
            assert _bytes(s.tensors()) == {n: (np.frombuffer(b, np.uint8) ^ 0x5A).tobytes() for n, b in old[r].items()}
    finally:
        for s in servers:
            s.close()


def test_a_flipped_byte_on_one_server_switches_neither(ckpt):
    from tests.remote.relay import Relay

    servers = _servers(2)
    v1 = np.zeros((8, 8), np.uint8)
    v2 = np.arange(64, dtype=np.uint8).reshape(8, 8) + 100  # server B's rows 4..8 hold 132..163
    relay = Relay(servers[1].address, tamper=("c2s", bytes(range(140, 156)), 5))
    try:
        for s in servers:
            with wl.Client(s.address) as c:
                push_shards(c, {"experts.w": v1})
                server_sketches(c, ["experts.w"], timeout=5)

        def push(set_id, via):
            out = [[], []]
            for i in range(2):  # two FSDP senders, rows 0..4 and 4..8
                state = {"experts.w": ShardOf(v2[4 * i : 4 * i + 4], v2.shape, (4 * i, 0))}
                for r in range(2):
                    with wl.Client(via[r]) as c:
                        out[r].append(push_shards(c, state, set_id=set_id))
            return out

        pushes = push(3, [servers[0].address, relay.address])
        assert relay.flipped.is_set()
        clients = [wl.Client(s.address) for s in servers]
        try:
            with pytest.raises(IntegrityError, match=r"experts\.w"):
                switch_all(clients, 3, ["experts.w"], pushes)
            for s in servers:
                assert s.tensors()["experts.w"].tobytes() == v1[:4].tobytes()  # v1 on both
            pushes = push(4, [s.address for s in servers])  # no false alarm without the flip
            switch_all(clients, 4, ["experts.w"], pushes)
        finally:
            for c in clients:
                c.close()
        for r, s in enumerate(servers):
            assert s.tensors()["experts.w"].tobytes() == v2[4 * r : 4 * r + 4].tobytes()
    finally:
        relay.close()
        for s in servers:
            s.close()


def test_switch_refuses_what_it_cannot_switch_and_changes_nothing(ckpt):
    path, arrs = ckpt
    (server,) = _servers(1)
    n, q = arrs["norm.weight"], arrs["layers.0.q_proj.weight"]
    try:
        with wl.Client(server.address) as c:
            push_shards(c, {"norm.weight": n})
            conn = c.connections[0]

            def switch(set_id, flags=0):
                conn.send(conn.frame(Switch(set_id, flags)))
                return conn.expect(SwitchReply)

            assert "no set is open" in switch(9).message  # an unknown set
            assert "no set is open" in abort_all([c], 9)[0].message
            # an incomplete held set: refused, nothing switched
            push_shards(c, {"norm.weight": n + 1, "layers.0.q_proj.weight": ShardOf(q[:5], q.shape, (0, 0))}, set_id=9)
            r = switch(9)
            assert not r.ok and "1 of its 2 tensors incomplete, 'layers.0.q_proj.weight'" in r.message
            assert server.tensors()["norm.weight"].tobytes() == n.tobytes()
            assert "no such held set (set 9 (held) is open)" in switch(8).message  # another id
            # another update's EXPECT while this set's sender is open: refused (reported at SKETCH)
            with wl.Client(server.address) as c2:
                c2.connections[0].send(c2.connections[0].frame(Expect(("norm.weight",), 1, 10)))
                with pytest.raises(RemoteProtocolError, match=r"EXPECT of set 10 \(held\): set 9 \(held\) is open"):
                    server_sketches(c2, ["norm.weight"])
            push_shards(c, {"layers.0.q_proj.weight": ShardOf(q[5:], q.shape, (5, 0))}, set_id=9)
            assert server.tensors()["norm.weight"].tobytes() == n.tobytes()  # complete, still held
            r = switch(9)
            assert r.ok and r.tensors == 2 and r.generation >= 2
            assert server.tensors()["norm.weight"].tobytes() == (n + 1).tobytes()
            with pytest.raises(TransportTimeout, match=r"set 9 not held \(the server's open set: 0, none\)"):
                server_sketches(c, ["norm.weight"], set_id=9)  # every tensor in, but no set is held
            r2 = switch(9)  # twice: refused
            assert not r2.ok and "switched in already" in r2.message
            assert server.tensors()["norm.weight"].tobytes() == (n + 1).tobytes()
            # a server that holds no slices answers SWITCH with a refusal
        plain = wl.Server(port=0)
        plain.start()
        try:
            with wl.Client(plain.address) as c:
                conn = c.connections[0]
                conn.send(conn.frame(Switch(1)))
                assert "holds no slices" in conn.expect(SwitchReply).message
        finally:
            plain.close()
    finally:
        server.close()


def test_an_abandoned_held_set_gives_way_to_the_next_updates(ckpt):
    # a coordinator that died before deciding leaves a held set behind: once its senders are gone
    # the next update's EXPECT (another id) drops it instead of being refused for good
    path, arrs = ckpt
    (server,) = _servers(1)
    n, q = arrs["norm.weight"], arrs["layers.0.q_proj.weight"]
    try:
        with wl.Client(server.address) as c:
            push_shards(c, {"norm.weight": n})
            push_shards(c, {"norm.weight": n + 1, "layers.0.q_proj.weight": ShardOf(q[:5], q.shape, (0, 0))}, set_id=7)
        _closed(server)
        with wl.Client(server.address) as c:
            pushed = push_shards(c, {"norm.weight": n + 2}, set_id=8)
            assert server.tensors()["norm.weight"].tobytes() == n.tobytes()  # 8 held, 7 gone unshown
            assert "no such held set (set 8 (held) is open)" in abort_all([c], 7)[0].message
            assert switch_all([c], 8, ["norm.weight"], [[pushed]])[0] >= 2
        assert set(server.tensors()) == {"norm.weight"}
        assert server.tensors()["norm.weight"].tobytes() == (n + 2).tobytes()
    finally:
        server.close()
