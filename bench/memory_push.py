"""A push from memory against a push of the same bytes from a file, on loopback.

One server (``weightlift serve``, its own process) takes, in turns (A B A B ...), a push of a
safetensors file (its pages cached: sendfile from the page cache) and a push of the same tensors
as numpy arrays (sendmsg from the arrays' memory: ``memory`` a plain push at minor 2,
``memory_update`` an update at minor 3, which both ends hash to prove), replacing the same names each time so every
push lands in touched memory. Also, with ``--update``, a second memory push of a step that
changed 1 % of the values, sent as DELTAs. Prints each arm's median seconds and GB/s.

    PYTHONPATH=. python bench/memory_push.py --mib 512 --runs 5
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from weightlift.remote.client.client import Client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    import safetensors.numpy

    safetensors.numpy.save_file({n: a.view(np.uint16) for n, a in tensors.items()}, str(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    per = (args.mib << 20) // args.tensors // 2
    tensors = {
        f"layer.{i}": (rng.standard_normal(per, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        for i in range(args.tensors)
    }
    as_u16 = {n: a.view(np.uint16) for n, a in tensors.items()}  # the file holds U16 (numpy has no bf16 in safetensors)
    total = sum(a.nbytes for a in tensors.values())
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.safetensors"
        write_safetensors(path, tensors)
        path.read_bytes()  # into the page cache
        server = subprocess.Popen(
            [sys.executable, "-m", "weightlift", "serve", "--port", str(port)], stderr=subprocess.DEVNULL
        )
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    client = Client(("127.0.0.1", port))
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            times: dict[str, list[float]] = {"file": [], "memory": [], "memory_update": []}
            plain = Client(("127.0.0.1", port), protocol_minor=2)  # a plain push: no update, no proof
            with client, plain:
                for _ in range(args.runs):
                    for arm in times:
                        t0 = time.perf_counter()
                        if arm == "file":
                            client.push(str(path))
                        else:
                            (plain if arm == "memory" else client).push(as_u16)
                        times[arm].append(time.perf_counter() - t0)
            with Client(("127.0.0.1", port), keep_base=True) as upd:
                upd.push(tensors)
                stepped = {}
                for n, a in tensors.items():
                    b = a.copy()
                    bits = b.view(np.uint16)
                    idx = rng.choice(bits.size, bits.size // 100, replace=False)
                    bits[idx] ^= 1
                    stepped[n] = b
                t0 = time.perf_counter()
                r = upd.push(stepped)
                times["delta_1pct"] = [time.perf_counter() - t0]
                delta_sent = r.bytes_sent
        finally:
            server.terminate()
            server.wait(10)
    out = {
        arm: {
            "median_s": round(statistics.median(t), 4),
            "gbs": round(total / statistics.median(t) / 1e9, 2),
            "runs": [round(x, 4) for x in t],
        }
        for arm, t in times.items()
    }
    out["bytes"] = total
    out["delta_bytes_sent"] = delta_sent
    if args.json:
        print(json.dumps(out))
        return
    print(f"{total / 2**20:.0f} MiB in {args.tensors} tensors, loopback, {args.runs} runs each, interleaved")
    for arm in ("file", "memory", "memory_update", "delta_1pct"):
        o = out[arm]
        print(f"{arm:>10}: median {o['median_s']:.3f} s  {o['gbs']:.2f} GB/s  runs {o['runs']}")
    print(f"1 % update sent {delta_sent / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
