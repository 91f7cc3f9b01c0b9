"""Sharded to sharded: time the plan and the sketch (weightlift.distributed.reshard).

``plan``: a model of ``--tensors`` 2-D bf16 weights (default 50,000; shapes cycling through a
transformer layer's q/k/v/o/gate/up/down and a norm), from ``--senders`` FSDP ranks (dim-0
``Shard(0)``) into ``--receivers`` TP ranks (column-parallel q/k/v/gate/up, row-parallel o/down,
replicated norms); the median of ``--runs`` plans, in ms. ``sketch``: one rank's sketch part of
a ``--mib`` bf16 tensor on one core, the median rate in GB/s. ``--json`` for one JSON object.

    PYTHONPATH=. python bench/reshard_plan.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from weightlift.distributed.reshard import Layout, plan, sketch_base, sketch_part
from weightlift.distributed.shard import Shard
from weightlift.formats import TensorInfo

LAYER = [
    ("q_proj.weight", (4096, 4096)),
    ("k_proj.weight", (1024, 4096)),
    ("v_proj.weight", (1024, 4096)),
    ("o_proj.weight", (4096, 4096)),
    ("gate_proj.weight", (14336, 4096)),
    ("up_proj.weight", (14336, 4096)),
    ("down_proj.weight", (4096, 14336)),
    ("input_layernorm.weight", (4096,)),
]
TP = {
    "*.q_proj.*": "colwise",
    "*.k_proj.*": "colwise",
    "*.v_proj.*": "colwise",
    "*.gate_proj.*": "colwise",
    "*.up_proj.*": "colwise",
    "*.o_proj.*": "rowwise",
    "*.down_proj.*": "rowwise",
    "*norm*": None,
}


def tensors(n: int) -> list[TensorInfo]:
    out, off = [], 0
    for i in range(n):
        name, shape = LAYER[i % len(LAYER)]
        length = 2 * int(np.prod(shape))
        out.append(TensorInfo(f"layers.{i // len(LAYER)}.{name}", "BF16", shape, "m", off, length))
        off += length
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=50_000)
    p.add_argument("--senders", type=int, default=4)
    p.add_argument("--receivers", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--mib", type=int, default=256, help="sketched tensor size (default 256)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    ts = tensors(a.tensors)
    senders = Layout(Shard(default=0), a.senders)
    receivers = Layout(Shard(TP), a.receivers)
    times, n = [], 0
    for _ in range(a.runs):
        t0 = time.perf_counter()
        n = sum(len(tp.moves) for tp in plan(ts, senders, receivers))
        times.append(time.perf_counter() - t0)
    rows = a.mib * (1 << 20) // (2 * 4096)
    x = np.random.default_rng(0).integers(0, 1 << 16, (rows, 4096), dtype=np.uint16)
    r = sketch_base("w")
    rates = []
    for _ in range(a.runs):
        t0 = time.perf_counter()
        sketch_part(x, (2 * rows, 4096), ((rows, 2 * rows), (0, 4096)), r)
        rates.append(x.nbytes / (time.perf_counter() - t0) / 1e9)
    out = {
        "tensors": a.tensors,
        "senders": a.senders,
        "receivers": a.receivers,
        "transfers": n,
        "plan_ms": round(statistics.median(times) * 1e3, 1),
        "sketch_mib": a.mib,
        "sketch_gbps_one_core": round(statistics.median(rates), 2),
    }
    print(json.dumps(out) if a.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
