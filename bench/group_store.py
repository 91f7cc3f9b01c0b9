#!/usr/bin/env python3
"""Group loads from a store: ``weightlift.load(url, group=pg)`` with N ranks, time and egress.

One synthetic safetensors checkpoint is served by moto's S3 server and by nginx on loopback. For
each server and each N, N fresh processes form a gloo group and load the checkpoint from the
URL together (each byte read once across the group, the rest delivered by ``all_gather``); the
time is from a barrier before the load to a barrier after it (the slowest rank). The store's
egress is counted on the server's side: the bytes moto sent (through a TCP relay in front of
it: HTTP headers included) and nginx's access log of body bytes sent. Each rank also reports the
peak of its anonymous memory during the load above what it held before, less the result's
bytes: what the load held besides its destination (the largest over the ranks is printed). The goal of
the group load: egress at most 1.05 times the checkpoint for every N.

    python bench/group_store.py --size-mib 256 --worlds 1,2,4 --json group_store.json
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MIB, ROOT, parser, write_json  # noqa: E402

BUCKET = "wl-bench"
KEY = "model/model.safetensors"
KEYS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_DEFAULT_REGION": "us-east-1"}


# -- a rank ----------------------------------------------------------------------------------------


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def rank_main(rank: int, world: int, port: int, url: str) -> None:
    import datetime

    import torch.distributed as dist

    import weightlift as wl

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    dist.barrier()
    before = _rss_anon()
    peak = [before]
    stop = threading.Event()

    def sample() -> None:  # the peak of anonymous memory while the load runs
        while not stop.wait(0.005):
            peak[0] = max(peak[0], _rss_anon())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    rep: dict[str, Any] = {}
    out = wl.load(url, group=dist.group.WORLD, report=rep)
    dist.barrier()
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    nbytes = sum(v.nbytes for v in out.values())
    extra = max(peak[0], _rss_anon()) - before - nbytes  # held besides the result
    print(
        "RESULT "
        + json.dumps(
            {"rank": rank, "seconds": seconds, "bytes": nbytes, "bytes_read": rep["bytes_read"], "extra": extra}
        )
    )
    sys.stdout.flush()
    os._exit(0)


# -- servers ---------------------------------------------------------------------------------------


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


class Relay:
    """A TCP relay in front of a server, counting the bytes the server sent through it: a
    server's egress where the server itself keeps no count (moto)."""

    def __init__(self, upstream: int):
        self.upstream = upstream
        self.sent = 0
        self._lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(1 << 20):
                dst.sendall(data)
                if count:
                    with self._lock:
                        self.sent += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


class Moto:
    """moto's S3 server behind a :class:`Relay`; egress: the bytes moto sent through it."""

    def __init__(self, ckpt: Path):
        port = _port()
        env = dict(os.environ, **KEYS)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        _wait(port, self.proc)
        self.relay = Relay(port)
        self.port = self.relay.port
        import boto3

        c = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"],
        )
        c.create_bucket(Bucket=BUCKET)
        c.upload_file(str(ckpt), BUCKET, KEY)
        self.url = f"s3://{BUCKET}/{KEY}"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def sent(self) -> int:
        return self.relay.sent

    def stop(self) -> None:
        self.relay.close()
        self.proc.terminate()
        self.proc.wait()


class Nginx:
    """nginx serving the checkpoint; egress: its access log's body bytes sent."""

    def __init__(self, ckpt: Path, work: Path):
        exe = shutil.which("nginx") or "/usr/sbin/nginx"
        root = work / "www"
        (root / BUCKET / os.path.dirname(KEY)).mkdir(parents=True)
        shutil.copy(ckpt, root / BUCKET / KEY)
        self.port = _port()
        self.log = work / "logs" / "access.log"
        temps = " ".join(f"{k}_temp_path {work / k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        (work / "logs").mkdir()
        (work / "nginx.conf").write_text(
            ("user root;\n" if os.geteuid() == 0 else "")
            + f"daemon off; worker_processes 2; error_log {work / 'logs/error.log'}; pid {work / 'nginx.pid'};\n"
            + "events { worker_connections 512; }\n"
            + f"http {{ log_format sent '$body_bytes_sent'; access_log {self.log} sent; sendfile on; "
            + f"keepalive_requests 100000; {temps}\n"
            + f"  server {{ listen 127.0.0.1:{self.port}; root {root}; location / {{ }} }} }}\n"
        )
        self.proc = subprocess.Popen([exe, "-c", str(work / "nginx.conf"), "-p", str(work)], stderr=subprocess.DEVNULL)
        _wait(self.port, self.proc)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.endpoint}/{BUCKET}/{KEY}"

    def sent(self) -> int:
        return sum(int(x) for x in self.log.read_text().split()) if self.log.exists() else 0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


# -- the parent ------------------------------------------------------------------------------------


def _write_checkpoint(path: Path, size_mib: int) -> int:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    n = max(1, size_mib // 16)  # 16 MiB tensors, as a 7B model's are, and small ones between
    tensors = {f"layers.{i}.w": rng.integers(0, 255, (4 * MIB,), dtype=np.int32).astype(np.float32) for i in range(n)}
    tensors.update({f"layers.{i}.norm": np.ones(4096, np.float32) for i in range(n)})
    save_file(tensors, str(path))
    return path.stat().st_size


def run_group(world: int, url: str, env: dict[str, str]) -> dict[str, Any]:
    port = _port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank", str(r), "--world", str(world), "--port", str(port), "--url", url],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
        )
        for r in range(world)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        got = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
        if not got:
            raise SystemExit(f"a rank failed:\n{out[-2000:]}")
        results.append(got[0])
    return {
        "seconds": max(r["seconds"] for r in results),
        "bytes": results[0]["bytes"],
        "bytes_read": [r["bytes_read"] for r in results],
        "extra": max(r["extra"] for r in results),
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--servers", default="moto,nginx")
    ap.add_argument("--json")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--url")
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.world, args.port, args.url)
        return
    worlds = [int(w) for w in args.worlds.split(",")]
    with tempfile.TemporaryDirectory(prefix="wl-group-store-") as tmp:
        work = Path(tmp)
        ckpt = work / "model.safetensors"
        size = _write_checkpoint(ckpt, args.size_mib)
        print(f"checkpoint: {size / MIB:.1f} MiB, worlds {worlds}")
        rows: list[dict[str, Any]] = []
        for name in args.servers.split(","):
            server: Moto | Nginx = Moto(ckpt) if name == "moto" else Nginx(ckpt, work / "nginx")
            try:
                env = dict(os.environ, **KEYS, AWS_ENDPOINT_URL=server.endpoint, AWS_EC2_METADATA_DISABLED="true")
                env.update(WEIGHTLIFT_CACHE=str(work / "cache"), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
                env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
                for world in worlds:
                    before = server.sent()
                    r = run_group(world, server.url, env)
                    egress = server.sent() - before
                    row = {"server": name, "world": world, "seconds": r["seconds"], "egress": egress, "size": size}
                    row["ratio"] = egress / size
                    row["bytes_read"], row["extra"] = r["bytes_read"], r["extra"]
                    rows.append(row)
                    print(
                        f"{name:6s} N={world}: {r['seconds']:6.2f} s, {size / r['seconds'] / 1e6:7.1f} MB/s per rank, "
                        f"store egress {egress / MIB:8.1f} MiB = {egress / size:.3f} x the checkpoint, "
                        f"peak memory besides the result {r['extra'] / MIB:6.1f} MiB",
                        flush=True,
                    )
            finally:
                server.stop()
    write_json(args.json, {"benchmark": "group_store", "size": size, "rows": rows})


if __name__ == "__main__":
    main()
