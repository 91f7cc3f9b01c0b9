"""DELTA encodings on a synthetic RL step: encoded size, encode and apply speed.

A bf16 tensor (``--mib``, default 128) gets an Adam-like step at a learning rate where the given
fractions of its values change (1 %, 10 %, 100 % by default; a changed value moves by one unit
in its last place, as small steps do). For each fraction and each encoding (SPARSE, XOR, PLANES) this
prints the payload's size and rates in GB/s of tensor: ``encode`` (:func:`~weightlift.remote.delta.encode`,
every core, no hash), ``scan`` (the client's one pass: hash, compare, encode and refresh the kept
base, one thread), ``apply`` into fresh memory and ``inplace`` (every core, no hash), ``+hash``
(apply, then a BLAKE3 pass over the result), and ``fused`` / ``fusedip`` (the server's
:func:`~weightlift.remote.delta.apply_hashed`: the chunks applied on every core and hashed in
order on the calling thread as each is applied, fresh memory and in place). ``--json`` for one
JSON object.

    PYTHONPATH=. python bench/delta_codec.py --mib 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import ml_dtypes
import numpy as np

from weightlift.digest.blake import hash_buffer
from weightlift.remote import delta as D


def step(w: np.ndarray, frac: float, rng: np.random.Generator) -> np.ndarray:
    new = w.copy()
    bits = new.view(np.uint16)
    k = int(bits.size * frac)
    idx = np.arange(bits.size) if frac >= 1 else rng.choice(bits.size, k, replace=False)
    up = rng.integers(0, 2, len(idx), dtype=np.uint16).astype(bool)
    bits[idx] = np.where(up, bits[idx] + 1, bits[idx] - 1)  # one ulp either way
    return new


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(enc: int, new: np.ndarray, base: np.ndarray, out: np.ndarray, repeat: int) -> dict:
    parts: list = []

    def encode() -> None:
        parts[:] = D.encode(enc, new, base, 2, limit=1 << 40)

    enc_s = timed(encode, repeat)
    payload = memoryview(b"".join(parts))
    kept = base.copy()
    scans = []
    for _ in range(repeat):  # the sender's one pass: hash, compare, encode, refresh the kept base
        np.copyto(kept, base)
        t0 = time.perf_counter()
        got, digest = D.scan(enc, new, kept, 2, limit=1 << 40, update=True)
        scans.append(time.perf_counter() - t0)
        assert b"".join(got) == payload and kept.tobytes() == new.tobytes()
    apply_s = timed(lambda: D.apply(enc, payload, base, out, 2), repeat)
    assert out.tobytes() == new.tobytes()
    hashed_s = timed(lambda: D.apply_hashed(enc, payload, base, out, 2), repeat)
    assert D.apply_hashed(enc, payload, base, out, 2) == digest
    work = base.copy()
    t0 = time.perf_counter()
    D.apply(enc, payload, work, work, 2, undo=D.Undo())
    inplace_s = time.perf_counter() - t0
    assert work.tobytes() == new.tobytes()
    work = base.copy()
    t0 = time.perf_counter()
    D.apply_hashed(enc, payload, work, work, 2, undo=D.Undo())
    inplace_hashed_s = time.perf_counter() - t0
    gbs = lambda s: round(base.nbytes / s / 1e9, 2)  # noqa: E731
    return {
        "payload_mib": round(len(payload) / 2**20, 2),
        "ratio": round(len(payload) / base.nbytes, 4),
        "encode_gbs": gbs(enc_s),
        "scan_gbs": gbs(statistics.median(scans)),
        "apply_gbs": gbs(apply_s),
        "apply_in_place_gbs": gbs(inplace_s),
        "apply_hashed_gbs": gbs(hashed_s),
        "apply_hashed_in_place_gbs": gbs(inplace_hashed_s),
        "apply_s": apply_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--fractions", default="0.01,0.1,1.0")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n = args.mib << 19  # bf16 elements
    w = (rng.standard_normal(n, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    base = w.view(np.uint8)
    out = np.empty_like(base)
    out[:] = 0  # touched, as a server's pooled memory is
    rows = []
    hash_s = timed(lambda: hash_buffer(base), args.repeat)
    for frac in (float(f) for f in args.fractions.split(",")):
        new = step(w, frac, rng).view(np.uint8)
        changed = float((new.view(np.uint16) != base.view(np.uint16)).mean())
        chosen = D.choose(new, base, 2, planes=True)
        for name, enc in (("sparse", D.SPARSE), ("xor", D.XOR), ("planes", D.PLANES)):
            row = measure(enc, new, base, out, args.repeat)
            row.update(
                changed=round(changed, 4),
                encoding=name,
                chosen={D.SPARSE: "sparse", D.XOR: "xor", D.PLANES: "planes", None: "whole"}[chosen],
            )
            row["apply_and_hash_gbs"] = round(base.nbytes / (row.pop("apply_s") + hash_s) / 1e9, 2)
            rows.append(row)
    result = {
        "tensor_mib": args.mib,
        "dtype": "BF16",
        "cores": os.cpu_count(),
        "hash_gbs": round(base.nbytes / hash_s / 1e9, 2),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.mib} MiB bf16, {os.cpu_count()} cores, BLAKE3 of the result {result['hash_gbs']} GB/s")
    print(
        f"{'changed':>8} {'enc':>6} {'chosen':>6} {'MiB':>7} {'ratio':>6} {'encode':>7} {'scan':>6} {'apply':>7} "
        f"{'inplace':>7} {'+hash':>6} {'fused':>6} {'fusedip':>7}  (GB/s)"
    )
    for r in rows:
        print(
            f"{r['changed']:8.3f} {r['encoding']:>6} {r['chosen']:>6} {r['payload_mib']:7.2f} {r['ratio']:6.3f} "
            f"{r['encode_gbs']:7.2f} {r['scan_gbs']:6.2f} {r['apply_gbs']:7.2f} {r['apply_in_place_gbs']:7.2f} "
            f"{r['apply_and_hash_gbs']:6.2f} {r['apply_hashed_gbs']:6.2f} {r['apply_hashed_in_place_gbs']:7.2f}"
        )


if __name__ == "__main__":
    main()
