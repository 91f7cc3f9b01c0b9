"""Versions and deltas across ranks: a 1 % step as a delta against a full update (Resharder).

The synthetic bf16 model of ``bench/reshard_transfer.py`` (``--layers`` Llama-like layers,
``--hidden`` 1024: about 22.5 MB a layer), held by ``--senders`` FSDP ranks as plain ``Shard(0)``
shards, synced into ``--receivers`` tensor-parallel ranks by one :class:`Resharder` per process
(senders ``keep=True``). Before every update each sender changes ``--change`` of its shard's
elements at random, in place (the steps differ from run to run, the fraction does not), or with
``--dense D`` multiplies every element by ``1 + D * N(0, 1)`` (an optimizer's small dense step). Arms,
interleaved ``--runs`` times after one first full update: ``full`` (``update(full=True)``) and
``delta``. Reported: payload bytes sent, what the receivers need, and the medians of each
arm's wall time (slowest rank) and CPU time (all processes). Every update is proven; on a
machine with fewer cores than processes the wall times measure contention, the bytes do not.

    PYTHONPATH=. python bench/reshard_versions.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reshard_transfer import TP, layer  # noqa: E402


def worker(rank: int, world: int, senders: int, layers: int, runs: int, port: int, out: Path, a: dict) -> None:
    import torch
    import torch.distributed as dist

    from weightlift.distributed import Resharder, Shard
    from weightlift.distributed.shard import chunk_bounds

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state, src, dst = None, None, None
    rng = np.random.default_rng(rank)
    if rank < senders:
        src = Shard(default=0, rank=rank, world=senders)
        state = {}
        for i in range(layers):
            for name, shape in layer(a["hidden"]):
                lo, hi = chunk_bounds(shape[0], rank, senders)
                n = (hi - lo) * int(np.prod(shape[1:]))
                raw = torch.from_numpy(rng.integers(0, 1 << 16, n, dtype=np.uint16).view(np.int16))
                state[f"layers.{i}.{name}"] = raw.view(torch.bfloat16).reshape((hi - lo, *shape[1:]))
    else:
        dst = Shard(TP, rank=rank - senders, world=world - senders)
    sync = Resharder(src=src, dst=dst, keep=state is not None, timeout=120)

    gen = torch.Generator().manual_seed(rank)

    def step() -> None:
        for t in (state or {}).values():
            if a["dense"]:  # every element moves a little, as an optimizer step moves them
                t.mul_(1 + a["dense"] * torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))
                continue
            w = t.view(torch.int16).reshape(-1)
            idx = torch.from_numpy(rng.choice(w.numel(), max(1, int(w.numel() * a["change"])), replace=False))
            w[idx] ^= 0x0101

    sync.update(state)  # the first version: everything
    rows = []
    for k in range(2 * runs):
        full = k % 2 == 0  # full, delta, full, delta, ...
        step()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        res = sync.update(state, full=full)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        rows.append(
            {"arm": "full" if full else "delta", "delta": res.delta, "wall_s": wall, "cpu_s": cpu,
             "moves_s": res.seconds, "sent": res.sent, "needed": res.needed, "verified": res.verified}
        )  # fmt: skip
    (out / f"{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--senders", type=int, default=2)
    p.add_argument("--receivers", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--change", type=float, default=0.01, help="fraction of the elements a step changes")
    p.add_argument(
        "--dense", type=float, default=0.0, help="instead: every element times (1 + DENSE * N(0, 1)), bf16-rounded"
    )
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    world = a.senders + a.receivers
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        opts = json.dumps({"hidden": a.hidden, "change": a.change, "dense": a.dense})
        args = [str(world), str(a.senders), str(a.layers), str(a.runs), str(port), tmp, opts]
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), *args], env=env) for r in range(world)]
        for pr in procs:
            if pr.wait(timeout=900):
                raise SystemExit(f"a rank failed (exit {pr.returncode})")
        reps = [json.loads((Path(tmp) / f"{r}.json").read_text()) for r in range(world)]
    out: dict[str, object] = {"senders": a.senders, "receivers": a.receivers, "layers": a.layers}
    out.update({"dense": a.dense} if a.dense else {"change": a.change})
    need = sum(r[0]["needed"] for r in reps)
    out["model_mb"] = round(need / 1e6, 1)
    for arm in ("full", "delta"):
        ks = [k for k in range(len(reps[0])) if reps[0][k]["arm"] == arm]
        assert all(reps[0][k]["delta"] == (arm == "delta") for k in ks)
        sent = [sum(r[k]["sent"] for r in reps) for k in ks]
        walls = [max(r[k]["wall_s"] for r in reps) for k in ks]
        cpus = [sum(r[k]["cpu_s"] for r in reps) for k in ks]
        out[f"{arm}_sent_bytes_median"] = int(statistics.median(sent))
        out[f"{arm}_wall_s_median"] = round(statistics.median(walls), 3)
        out[f"{arm}_wall_s_all"] = [round(w, 3) for w in walls]
        out[f"{arm}_cpu_s_median"] = round(statistics.median(cpus), 3)
    out["delta_bytes_share"] = round(out["delta_sent_bytes_median"] / out["full_sent_bytes_median"], 4)  # type: ignore[operator]
    print(json.dumps(out) if a.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        r, w, s, layers, runs, port, out, opts = sys.argv[2:10]
        worker(int(r), int(w), int(s), int(layers), int(runs), int(port), Path(out), json.loads(opts))
    else:
        main()
