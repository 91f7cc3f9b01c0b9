"""Network namespaces joined by links, for tests and benchmarks that cross a network.

:class:`Net` makes namespaces (``ip netns add``), joins them and runs processes inside them
(``ip netns exec NAME ...``); :meth:`Net.close` kills those processes and deletes the
namespaces, which removes every device in them, so nothing outlives a test, failed or not.
Names carry the owning process id (``wl<pid>n<k>``), and a new :class:`Net` first deletes
namespaces whose owner is gone (a run killed with ``kill -9`` leaves them behind).

Three shapes:

* :meth:`Net.pair`: two namespaces on one veth pair.
* :meth:`Net.star`: ``count`` namespaces, each with a veth into a bridge in a hub namespace:
  one subnet, every member reaching every other (a switch).
* :meth:`Net.impaired_pair`: two namespaces on a slow, lossy, reordering link. With ``tc netem``
  in the kernel, a veth pair with netem on the first end's egress; without it (many VM and
  container kernels are built without ``sch_netem``), two TUN devices and the user-space link
  of :mod:`tests.net.impair`, which does the same to the packets (see there).

:func:`unavailable` says why none of this can run here (not Linux, not root, no ``ip``, no
namespaces), or None.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PREFIX = "wl"
ROOT = Path(__file__).resolve().parents[2]
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


@functools.cache
def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    name = f"{PREFIX}{os.getpid()}probe"
    r = _ip("netns", "add", name, check=False)
    if r.returncode:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@functools.cache
def has_netem() -> bool:
    """Whether this kernel has ``tc netem`` (probed on a namespace's loopback)."""
    if shutil.which("tc") is None or unavailable():
        return False
    name = f"{PREFIX}{os.getpid()}netem"
    _ip("netns", "add", name)
    try:
        r = subprocess.run(
            ["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
            capture_output=True,
            timeout=30,
        )
        return r.returncode == 0
    finally:
        _ip("netns", "del", name, check=False)


def impair_unavailable() -> str | None:
    """Why :meth:`Net.impaired_pair` cannot run here, or None when it can."""
    reason = unavailable()
    if reason or has_netem() or os.path.exists("/dev/net/tun"):
        return reason
    return "neither tc netem nor /dev/net/tun is available"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> None:
    """Delete namespaces left by processes that no longer run."""
    r = _ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        rest = name[len(PREFIX) :]
        if not name.startswith(PREFIX) or "n" not in rest:
            continue
        pid = rest.split("n", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            _ip("netns", "del", name, check=False)


class Net:
    """Namespaces, links and processes, all removed by :meth:`close` (or the ``with`` block)."""

    def __init__(self) -> None:
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        sweep()
        self.names: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.links: list[subprocess.Popen] = []  # the user-space links, in the order made

    def __enter__(self) -> Net:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- namespaces and links ---------------------------------------------------------------------

    def namespace(self) -> str:
        name = f"{PREFIX}{os.getpid()}n{next(_counter)}"
        _ip("netns", "add", name)
        self.names.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def _veth(self, ns_a: str, ns_b: str) -> tuple[str, str]:
        k = next(_counter)
        a, b = f"wlv{os.getpid() % 100000}a{k}", f"wlv{os.getpid() % 100000}b{k}"  # under 16 characters
        _ip("link", "add", a, "netns", ns_a, "type", "veth", "peer", "name", b, "netns", ns_b)
        return a, b

    @staticmethod
    def _address(ns: str, dev: str, addr: str, prefix: int = 24) -> None:
        _ip("-n", ns, "addr", "add", f"{addr}/{prefix}", "dev", dev)
        _ip("-n", ns, "link", "set", dev, "up")

    def pair(self, subnet: str = "10.231.0", *, rate: str | None = None) -> list[tuple[str, str, str]]:
        """Two namespaces on a veth pair: ``[(namespace, device, address), ...]``. ``rate`` (tc's
        notation, e.g. ``"4gbit"``) caps what the first sends to the second with a token bucket
        (``tc tbf``, in most kernels, unlike netem)."""
        na, nb = self.namespace(), self.namespace()
        a, b = self._veth(na, nb)
        self._address(na, a, f"{subnet}.1")
        self._address(nb, b, f"{subnet}.2")
        if rate:
            cmd = [
                "tc",
                "-n",
                na,
                "qdisc",
                "add",
                "dev",
                a,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "4mb",
                "latency",
                "50ms",
            ]
            subprocess.run(cmd, check=True, capture_output=True, timeout=30)
        return [(na, a, f"{subnet}.1"), (nb, b, f"{subnet}.2")]

    def star(self, count: int, subnet: str = "10.232.0") -> list[tuple[str, str, str]]:
        """``count`` namespaces, each on a veth into one bridge: ``[(namespace, device, address)]``."""
        hub = self.namespace()
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        out = []
        for i in range(count):
            ns = self.namespace()
            inner, outer = self._veth(ns, hub)
            _ip("-n", hub, "link", "set", outer, "master", "br0")
            _ip("-n", hub, "link", "set", outer, "up")
            self._address(ns, inner, f"{subnet}.{i + 1}")
            out.append((ns, inner, f"{subnet}.{i + 1}"))
        return out

    def impaired_pair(
        self,
        *,
        delay_ms: float = 0.0,
        loss: float = 0.0,
        reorder: float = 0.0,
        seed: int = 0,
        subnet: str = "10.233.0",
        userspace: bool | None = None,
    ) -> list[tuple[str, str, str]]:
        """Two namespaces on a link that delays, drops and reorders packets from the first to the
        second (``tc netem`` where the kernel has it, else :mod:`tests.net.impair`; ``userspace``
        forces the choice). Returns ``[(namespace, device, address), ...]`` like :meth:`pair`."""
        if userspace is None:
            userspace = not has_netem()
        if not userspace:
            ends = self.pair(subnet)
            if delay_ms or loss or reorder:
                cmd = ["tc", "-n", ends[0][0], "qdisc", "add", "dev", ends[0][1], "root", "netem"]
                cmd += ["delay", f"{delay_ms}ms", "loss", f"{loss * 100}%"]
                if reorder and delay_ms:
                    cmd += ["reorder", f"{reorder * 100}%"]
                subprocess.run(cmd, check=True, capture_output=True, timeout=30)
            return ends
        if not os.path.exists("/dev/net/tun"):
            raise RuntimeError("neither tc netem nor /dev/net/tun is available")
        na, nb = self.namespace(), self.namespace()
        ends = []
        for ns, me, peer in ((na, f"{subnet}.1", f"{subnet}.2"), (nb, f"{subnet}.2", f"{subnet}.1")):
            dev = f"wlt{next(_counter)}"
            _ip("-n", ns, "tuntap", "add", "dev", dev, "mode", "tun")
            _ip("-n", ns, "link", "set", dev, "mtu", "9000")  # a jumbo-frame link: fewer packets through Python
            _ip("-n", ns, "addr", "add", me, "peer", peer, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            ends.append((ns, dev, me))
        args = [sys.executable, "-m", "tests.net.impair", na, ends[0][1], nb, ends[1][1]]
        args += ["--delay-ms", str(delay_ms), "--loss", str(loss), "--reorder", str(reorder), "--seed", str(seed)]
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        self.links.append(proc)
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if line.strip() != "READY":
            raise RuntimeError(f"the user-space link did not start: {line!r} {proc.stderr.read()}")  # type: ignore[union-attr]
        return ends

    def impairment(self, k: int = -1) -> dict[str, int] | None:
        """What user-space link ``k`` has done so far (packets forwarded, dropped, sent ahead of
        held ones); None when the link is ``tc netem``'s."""
        if not self.links:
            return None
        proc = self.links[k]
        proc.send_signal(signal.SIGUSR1)
        return json.loads(proc.stdout.readline())  # type: ignore[union-attr]

    # -- processes ------------------------------------------------------------------------------------

    def popen(self, ns: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside namespace ``ns``; killed by :meth:`close` if still running."""
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kw)
        self.procs.append(proc)
        return proc

    def serve(self, ns: str, addr: str, *options: str) -> tuple[subprocess.Popen, str]:
        """``weightlift serve --host addr --port 0 [options]`` in ``ns``: the process and the
        ``host:port`` it serves on. RuntimeError with its output if it does not start."""
        cli = [sys.executable, "-m", "weightlift.cli"]
        proc = self.popen(
            ns,
            [*cli, "serve", "--host", addr, "--port", "0", *options],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith(f"weightlift: serving on {addr}:"):
            raise RuntimeError(f"the server did not start: {line!r} {proc.stderr.read()}")  # type: ignore[union-attr]
        return proc, line.split()[3]

    def run(self, ns: str, argv: Sequence[str], *, timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``ns`` to completion (text output captured)."""
        return subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=timeout, **kw)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        for name in reversed(self.names):
            for _ in range(50):  # a process still dying can hold the namespace a moment
                if _ip("netns", "del", name, check=False).returncode == 0:
                    break
                time.sleep(0.1)
        self.names.clear()
