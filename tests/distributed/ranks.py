"""Running a test's scenario on several gloo ranks, each a fresh process on loopback.

Every multi-process test of this folder starts its ranks the same way: ``python -m <test module>
--worker ...`` per rank, gloo bound to ``lo``, one OpenMP thread each, and one deadline for the
whole group, after which a rank still running is killed (a hang, not a slow test).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: What :func:`run_ranks` gives as the output of a rank it had to kill.
KILLED = "(killed at the deadline)"


def free_port() -> int:
    """A loopback port nothing listens on now (the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(module: str, argvs: Sequence[Sequence[str]], deadline: float) -> list[str]:
    """Run ``python -m module --worker *argv`` once per argv, all at once; each one's output, or
    :data:`KILLED` for one still running ``deadline`` seconds after the start."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, "--worker", *argv],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for argv in argvs
    ]
    end = time.monotonic() + deadline
    logs = []
    try:
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(0.1, end - time.monotonic()))[0].decode(errors="replace"))
            except subprocess.TimeoutExpired:
                logs.append(KILLED)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return logs
