#!/usr/bin/env python3
"""Loads from an S3 server on loopback: weightlift against its floor and against runai-model-streamer.

One synthetic safetensors checkpoint is uploaded once to each server; every run is a fresh
process, the arms of a round in a seeded shuffled order, medians over the rounds.

* ``floor.N``: obstore's own parallel ranged reads (the client weightlift uses), N connections,
  parts of the size weightlift's calibration chose for the endpoint, streamed in 64 KiB chunks
  or more (weightlift's ``CHUNK``) into one preallocated buffer of fresh memory, faulted in by
  the copies into it, inside the clock, as weightlift's result is: the most this client moves.
  The floor is the best N.
* ``hot.N``: the same reads into a buffer faulted in before the clock starts: the client and
  server alone, a ceiling no load reaches (a load's destination is fresh memory).
* ``wl``: ``weightlift.load("s3://...")`` after ``weightlift.sources.tuning.calibrate`` ran once
  for the endpoint (as a deployment calibrates once per store), nothing else set.
* ``wl.N``: the same load with ``threads=N`` (N connections) and the floor's part size: the
  floor's search, so that best ``wl.N`` against best ``floor.N`` is weightlift's own cost.
* ``runai``: runai-model-streamer's ``SafetensorsStreamer`` on the same object (its S3 path,
  defaults; tensors iterated, not copied, which favours it).

Servers: ``moto`` (moto's S3 server, Python: the test server of the suite) and ``nginx``
(static files answering the same path-style ranged GETs, HEAD and If-Match, so the clients, not
the server, set the pace). Each child also reports its peak anonymous memory above what it held
before the load, less the destination's own bytes.

    python bench/objstore.py --size-mib 256 --runs 3 --json objstore.json
    python bench/objstore.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20
CHUNK = 64 << 10  # weightlift.sources.store.CHUNK: obstore's smallest chunk of a body
BUCKET = "wl-bench"
KEY = "model/model.safetensors"
KEYS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_DEFAULT_REGION": "us-east-1"}


# -- children ------------------------------------------------------------------------------------


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class _Peak(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.base = _rss_anon()
        self.peak = self.base
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, _rss_anon())
            time.sleep(0.005)


def _floor(endpoint: str, conns: int, part: int = 8 * MIB, buf: Any = None) -> int:
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import obstore
    from obstore.store import S3Store

    st = S3Store(
        BUCKET, endpoint=endpoint, region="us-east-1", client_options={"allow_http": True},
        access_key_id=KEYS["AWS_ACCESS_KEY_ID"], secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"],
        virtual_hosted_style_request=False,
    )  # fmt: skip
    size = obstore.head(st, KEY)["size"]
    if buf is None:
        # fresh memory, faulted in on the clock by the parallel copies into it, as a load's
        # destination is (touching it first, on one thread, would put the faults in series)
        buf = np.empty(size, np.uint8)
    mv = memoryview(buf.data).cast("B")

    def get(o: int) -> None:
        n, d = min(part, size - o), o
        for piece in obstore.get(st, KEY, options={"range": (o, o + n)}).stream(min_chunk_size=CHUNK):
            k = len(piece)
            mv[d : d + k] = piece
            d += k

    with ThreadPoolExecutor(conns) as ex:
        list(ex.map(get, range(0, size, part)))
    return size


def _wl(url: str, conns: int | None) -> int:
    import weightlift as wl

    out = wl.load(url, threads=conns)
    return sum(v.nbytes for v in out.values())


def _runai(url: str) -> int:
    from runai_model_streamer import SafetensorsStreamer

    n = 0
    with SafetensorsStreamer() as s:
        s.stream_file(url)
        for _, t in s.get_tensors():
            n += t.numel() * t.element_size()
    return n


def child(arm: str, endpoint: str, url: str, part: int) -> None:
    if arm == "runai":
        import runai_model_streamer  # noqa: F401 - imported before the clock, as the others are
    elif arm.startswith("wl"):
        import botocore.session  # noqa: F401 - weightlift imports these when a URL is first opened
        import obstore  # noqa: F401

        import weightlift  # noqa: F401
    else:
        import obstore  # noqa: F401
    import numpy  # noqa: F401

    hot = None
    if arm.startswith("hot."):
        import obstore
        from obstore.store import S3Store

        store = S3Store(BUCKET, endpoint=endpoint, region="us-east-1", client_options={"allow_http": True},
                        access_key_id=KEYS["AWS_ACCESS_KEY_ID"], secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"],
                        virtual_hosted_style_request=False)  # fmt: skip
        size = obstore.head(store, KEY)["size"]
        hot = numpy.ones(size, numpy.uint8)
    peak = _Peak()
    peak.start()
    t0 = time.perf_counter()
    if arm.startswith("hot."):
        n = _floor(endpoint, int(arm.split(".")[1]), part, hot)
    elif arm.startswith("floor."):
        n = _floor(endpoint, int(arm.split(".")[1]), part)
    elif arm == "wl" or arm.startswith("wl."):
        n = _wl(url, int(arm.split(".")[1]) if "." in arm else None)
    else:
        n = _runai(url)
    dt = time.perf_counter() - t0
    peak.stop.set()
    peak.join()
    dest = 0 if arm == "runai" or hot is not None else n  # runai's tensors are views of its own buffer
    print(
        "RESULT "
        + json.dumps({"arm": arm, "seconds": dt, "bytes": n, "extra_mib": (peak.peak - peak.base - dest) / MIB})
    )


# -- servers -------------------------------------------------------------------------------------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(port: int, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(400):
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("server did not start")


def start_moto(ckpt: Path) -> tuple[str, subprocess.Popen[bytes]]:
    port = _port()
    env = dict(os.environ, **KEYS)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)  # fmt: skip
    _wait(port, proc)
    import boto3

    c = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                     aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"], aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"])  # fmt: skip
    c.create_bucket(Bucket=BUCKET)
    c.upload_file(str(ckpt), BUCKET, KEY)
    return f"http://127.0.0.1:{port}", proc


def start_nginx(ckpt: Path, work: Path) -> tuple[str, subprocess.Popen[bytes]]:
    exe = shutil.which("nginx") or "/usr/sbin/nginx"
    root = work / "www"
    (root / BUCKET / os.path.dirname(KEY)).mkdir(parents=True)
    os.link(ckpt, root / BUCKET / KEY) if ckpt.stat().st_dev == root.stat().st_dev else shutil.copy(
        ckpt, root / BUCKET / KEY
    )
    port = _port()
    temps = " ".join(f"{k}_temp_path {work / k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    (work / "logs").mkdir()
    (work / "nginx.conf").write_text(
        ("user root;\n" if os.geteuid() == 0 else "")
        + f"daemon off; worker_processes 2; error_log {work / 'logs/error.log'}; pid {work / 'nginx.pid'};\n"
        + "events { worker_connections 512; }\n"
        + f"http {{ access_log off; sendfile on; keepalive_requests 100000; {temps}\n"
        + f"  server {{ listen 127.0.0.1:{port}; root {root}; location / {{ }} }} }}\n"
    )
    proc = subprocess.Popen([exe, "-c", str(work / "nginx.conf"), "-p", str(work)], stderr=subprocess.DEVNULL)
    _wait(port, proc)
    return f"http://127.0.0.1:{port}", proc


# -- parent --------------------------------------------------------------------------------------


def _write_checkpoint(path: Path, size_mib: int) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    n = max(1, size_mib // 16)  # 16 MiB tensors, as a 7B model's are (and many smaller ones)
    tensors = {f"layers.{i}.w": rng.integers(0, 255, (4 * MIB,), dtype=np.int32).astype(np.float32) for i in range(n)}
    tensors.update({f"layers.{i}.norm": np.ones(4096, np.float32) for i in range(n)})
    save_file(tensors, str(path))


def _run(arm: str, endpoint: str, url: str, cache: str, part: int) -> dict[str, Any]:
    env = dict(os.environ, **KEYS, AWS_ENDPOINT_URL=endpoint, AWS_EC2_METADATA_DISABLED="true",
               RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0", WEIGHTLIFT_CACHE=cache)  # fmt: skip
    if arm.startswith("wl."):
        env["WEIGHTLIFT_SOURCE_PART"] = str(part)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, __file__, "--child", arm, "--endpoint", endpoint, "--url", url, "--part", str(part)],
                       capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"arm": arm, "error": (r.stderr or r.stdout)[-400:]}


def _calibrate(endpoint: str, url: str, cache: str, size_mib: int) -> dict[str, Any]:
    """weightlift's tuning for this endpoint, measured once and recorded where the wl arm finds it."""
    env = dict(os.environ, **KEYS, AWS_ENDPOINT_URL=endpoint, WEIGHTLIFT_CACHE=cache)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    code = (
        "import json, sys; from weightlift.sources.tuning import calibrate; "
        f"t, r = calibrate({url!r}, nbytes={min(size_mib, 128)} << 20); "
        "print(json.dumps({'connections': t.connections, 'part_mib': t.part >> 20, 'gbps': r}))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"calibration failed: {r.stderr[-400:]}")
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def _summary(results: list[dict[str, Any]], nbytes: int) -> dict[str, dict[str, float]]:
    by: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if "error" not in r:
            by.setdefault(r["arm"], []).append(r)
    out = {}
    for arm, rs in sorted(by.items()):
        rates = [nbytes / r["seconds"] / 1e9 for r in rs]
        out[arm] = {
            "gbps": statistics.median(rates),
            "min": min(rates),
            "max": max(rates),
            "seconds": statistics.median(r["seconds"] for r in rs),
            "extra_mib": statistics.median(r["extra_mib"] for r in rs),
            "runs": len(rs),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--servers", default="moto,nginx")
    ap.add_argument("--floor-conns", default="4,8,16")
    ap.add_argument("--no-runai", action="store_true")
    ap.add_argument("--quick", action="store_true", help="64 MiB, one round")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--part", type=int, default=8 * MIB, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.endpoint, a.url, a.part)
        return
    if a.quick:
        a.size_mib, a.runs = 64, 1
    conns = a.floor_conns.split(",")
    arms = [f"floor.{n}" for n in conns] + [f"wl.{n}" for n in conns] + ["wl", f"hot.{max(conns, key=int)}"]
    if not a.no_runai:
        try:
            import runai_model_streamer  # noqa: F401

            arms.append("runai")
        except ImportError:
            print("runai-model-streamer is not installed: its arm is left out", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="wl-objstore-"))
    procs = []
    report: dict[str, Any] = {"size_mib": a.size_mib, "runs": a.runs, "servers": {}}
    try:
        ckpt = work / "model.safetensors"
        _write_checkpoint(ckpt, a.size_mib)
        nbytes = ckpt.stat().st_size
        rng = random.Random(a.seed)
        for server in a.servers.split(","):
            endpoint, proc = start_moto(ckpt) if server == "moto" else start_nginx(ckpt, work / "nginx")
            procs.append(proc)
            url = f"s3://{BUCKET}/{KEY}"
            cal = _calibrate(endpoint, url, str(work / "cache"), a.size_mib)
            print(f"{server}: calibrated {cal}", file=sys.stderr)
            results = []
            for _ in range(a.runs):
                order = arms[:]
                rng.shuffle(order)
                for arm in order:
                    time.sleep(0.5)
                    res = _run(arm, endpoint, url, str(work / "cache"), cal["part_mib"] * MIB)
                    results.append(res)
                    if "error" in res:
                        print(f"{server} {arm}: FAILED {res['error']}", file=sys.stderr)
            report["servers"][server] = {"arms": _summary(results, nbytes), "raw": results, "calibration": cal}
            _print(server, report["servers"][server]["arms"], nbytes)
    finally:
        for p in procs:
            p.terminate()
            p.wait()
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


def _print(server: str, arms: dict[str, dict[str, float]], nbytes: int) -> None:
    floors = {k: v for k, v in arms.items() if k.startswith("floor.")}
    best = max(floors.values(), key=lambda v: v["gbps"])["gbps"] if floors else float("nan")
    print(f"\n{server}: {nbytes / MIB:.0f} MiB object")
    print(f"{'arm':10} {'GB/s':>7} {'min':>7} {'max':>7} {'s':>7} {'extra MiB':>10} {'x floor':>8}")
    for arm, v in arms.items():
        print(
            f"{arm:10} {v['gbps']:7.3f} {v['min']:7.3f} {v['max']:7.3f} {v['seconds']:7.3f} {v['extra_mib']:10.1f} {v['gbps'] / best:8.2f}"
        )
    wls = [v["gbps"] for k, v in arms.items() if k.startswith("wl.")]
    if wls and floors:
        print(f"best wl.N / best floor.N: {max(wls) / best:.2f}x")
    if "wl" in arms and "runai" in arms:
        print(f"wl / runai: {arms['wl']['gbps'] / arms['runai']['gbps']:.2f}x")


if __name__ == "__main__":
    main()
