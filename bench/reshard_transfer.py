"""Sharded to sharded over gloo: bytes on the wire and the proof's cost (weightlift.distributed.transfer).

A synthetic bf16 model of ``--layers`` Llama-like layers (``--hidden`` 1024, MLP 2816,
grouped-query k/v of 256 rows; about 22.5 MB a layer; every shape scales with ``--hidden``), held by ``--senders`` FSDP ranks (``Shard(0)`` plain
shards, each made by its own rank: nothing is gathered anywhere) and moved into ``--receivers``
tensor-parallel ranks (column-parallel q/k/v/gate/up, row-parallel o/down, replicated norms), on
one machine's loopback. Arms, interleaved ``--runs`` times in one group: ``plain`` (no proof)
and ``proof`` (each sender sketches its shard on a second thread while sending, each receiver
what it received, one all_gather of the sketches). Reported: payload bytes sent and what the
receivers need; bytes the senders' processes wrote to sockets (``/proc/self/io`` ``wchar``:
payload plus gloo's framing); the medians of each arm's wall time (slowest rank) and CPU time
(all processes), and of the sketches' CPU time (all processes). On a machine with fewer cores
than processes the wall times measure contention; the CPU figures do not.

    PYTHONPATH=. python bench/reshard_transfer.py --json
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

LAYER = [
    ("q_proj.weight", (1024, 1024)),
    ("k_proj.weight", (256, 1024)),
    ("v_proj.weight", (256, 1024)),
    ("o_proj.weight", (1024, 1024)),
    ("gate_proj.weight", (2816, 1024)),
    ("up_proj.weight", (2816, 1024)),
    ("down_proj.weight", (1024, 2816)),
    ("input_layernorm.weight", (1024,)),
]
TP = {"*.o_proj.*": "rowwise", "*.down_proj.*": "rowwise", "*norm*": None, "*": "colwise"}


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def layer(hidden: int) -> list[tuple[str, tuple[int, ...]]]:
    """LAYER's shapes scaled to ``hidden`` (1024: LAYER itself)."""
    return [(n, tuple(d * hidden // 1024 for d in shape)) for n, shape in LAYER]


def worker(rank: int, world: int, senders: int, layers: int, runs: int, port: int, out: Path, hidden: int) -> None:
    import torch
    import torch.distributed as dist

    from weightlift.distributed import Shard, reshard_transfer
    from weightlift.distributed.shard import chunk_bounds

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state, src, dst = None, None, None
    if rank < senders:
        src = Shard(default=0, rank=rank, world=senders)
        rng = np.random.default_rng(rank)
        state = {}
        for i in range(layers):
            for name, shape in layer(hidden):
                a, b = chunk_bounds(shape[0], rank, senders)
                n = (b - a) * int(np.prod(shape[1:]))
                raw = torch.from_numpy(rng.integers(0, 1 << 16, n, dtype=np.uint16).view(np.int16))
                state[f"layers.{i}.{name}"] = raw.view(torch.bfloat16).reshape((b - a, *shape[1:]))
    else:
        dst = Shard(TP, rank=rank - senders, world=world - senders)
    rows = []
    for k in range(2 * runs):
        verify = k % 2 == 1  # plain, proof, plain, proof, ...
        dist.barrier()
        w0, t0, c0 = _wchar(), time.perf_counter(), time.process_time()
        res = reshard_transfer(state, src=src, dst=dst, verify=verify, timeout=120)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        rows.append(
            {
                "arm": "proof" if verify else "plain",
                "wall_s": wall,
                "cpu_s": cpu,
                "moves_s": res.seconds,
                "sketch_s": res.sketch_seconds,
                "sent": res.sent,
                "copied": res.copied,
                "needed": res.needed,
                "wrote": _wchar() - w0,
                "messages": res.messages,
            }
        )
        del res
    (out / f"{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--senders", type=int, default=2)
    p.add_argument("--receivers", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--hidden", type=int, default=1024, help="scales every shape (64: many small tensors)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    world = a.senders + a.receivers
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        args = [str(world), str(a.senders), str(a.layers), str(a.runs), str(port), tmp, str(a.hidden)]
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), *args], env=env) for r in range(world)]
        for pr in procs:
            if pr.wait(timeout=600):
                raise SystemExit(f"a rank failed (exit {pr.returncode})")
        reps = [json.loads((Path(tmp) / f"{r}.json").read_text()) for r in range(world)]
    out: dict[str, object] = {"senders": a.senders, "receivers": a.receivers, "layers": a.layers, "hidden": a.hidden}
    first = [r[0] for r in reps]
    need = sum(x["needed"] for x in first)
    sent = sum(x["sent"] + x["copied"] for x in first)
    wrote = sum(reps[r][0]["wrote"] for r in range(a.senders))
    out.update(
        model_mb=round(need / 1e6, 1),
        needed_bytes=need,
        payload_sent_bytes=sent,
        payload_ratio=round(sent / need, 4),
        socket_written_bytes=wrote,
        socket_ratio=round(wrote / need, 4),
        messages_per_sender=first[0]["messages"],
    )
    for arm in ("plain", "proof"):
        walls = [
            max(reps[r][k]["wall_s"] for r in range(world)) for k in range(len(reps[0])) if reps[0][k]["arm"] == arm
        ]
        out[f"{arm}_wall_s_median"] = round(statistics.median(walls), 3)
        out[f"{arm}_wall_s_all"] = [round(w, 3) for w in walls]
        out[f"{arm}_gbps"] = round(need / statistics.median(walls) / 1e9, 3)
        moves = [
            max(reps[r][k]["moves_s"] for r in range(world)) for k in range(len(reps[0])) if reps[0][k]["arm"] == arm
        ]
        out[f"{arm}_moves_s_median"] = round(statistics.median(moves), 3)
    for arm in ("plain", "proof"):  # CPU seconds of all processes together: what contention cannot inflate
        cpu = [sum(reps[r][k]["cpu_s"] for r in range(world)) for k in range(len(reps[0])) if reps[0][k]["arm"] == arm]
        out[f"{arm}_cpu_s_median"] = round(statistics.median(cpu), 3)
    sk = [
        sum(reps[r][k]["sketch_s"] for r in range(world)) for k in range(len(reps[0])) if reps[0][k]["arm"] == "proof"
    ]
    out["sketch_cpu_s_median"] = round(statistics.median(sk), 3)
    out["sketch_gbps_per_core"] = round(2 * need / statistics.median(sk) / 1e9, 2)  # each byte sketched twice
    out["proof_wall_overhead"] = round(out["proof_wall_s_median"] / out["plain_wall_s_median"] - 1, 3)  # type: ignore[operator]
    out["proof_cpu_overhead"] = round(out["proof_cpu_s_median"] / out["plain_cpu_s_median"] - 1, 3)  # type: ignore[operator]
    print(json.dumps(out) if a.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        r, w, s, layers, runs, port, out, hidden = sys.argv[2:10]
        worker(int(r), int(w), int(s), int(layers), int(runs), int(port), Path(out), int(hidden))
    else:
        main()
