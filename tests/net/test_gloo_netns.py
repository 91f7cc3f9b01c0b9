"""gloo groups whose ranks sit in different network namespaces, one rank per namespace.

The loopback groups of ``tests/distributed/test_distributed.py`` again, each rank now behind its
own veth link on a bridge (``GLOO_SOCKET_IFNAME`` and the rendezvous address are the link's), so
every byte of the group loads and the broadcast crosses a network device: shards byte for byte
equal to slices of the whole tensors, each byte of storage read once by the group, broadcast
results equal to the source on every rank. A rank that dies mid-broadcast fails the others
with weightlift's error; so does a rank whose link goes down while it stays alive (no
connection is closed: the others' timeout is what ends it). Every group is held to a deadline,
so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the distributed loads need torch")
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is unavailable", allow_module_level=True)

from tests.distributed.test_distributed import LAYOUT, _tensors, _write_all  # noqa: E402
from tests.net.netns import ROOT  # noqa: E402

PORT = 29500  # each group has fresh namespaces: nothing else listens there
DEADLINE = 90.0  # seconds a whole group may take (four torch start-ups on two cores included)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _write_all(tmp_path_factory.mktemp("netns-dist"))


def run_group(
    net, world: int, scenario: str, tmp: Path, paths: dict[str, str], *, silent: tuple[int, ...] = ()
) -> list[dict | None]:
    """``scenario`` on ``world`` ranks, one per namespace on a bridge; each rank's report (None
    for a rank in ``silent``: it may die, or be killed once every other rank has reported)."""
    members = net.star(world)
    master = members[0][2]
    procs = []
    for rank, (ns, dev, _) in enumerate(members):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=dev, OMP_NUM_THREADS="1")
        args = [sys.executable, "-m", "tests.net.gloo_worker", scenario, str(rank), str(world), master, str(PORT)]
        args += [str(tmp), json.dumps(paths), dev]
        procs.append(net.popen(ns, args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    end = time.monotonic() + DEADLINE
    logs: dict[int, str] = {}
    for rank, p in enumerate(procs):
        if rank in silent:
            continue
        try:
            out, _ = p.communicate(timeout=max(0.1, end - time.monotonic()))
            logs[rank] = out.decode(errors="replace")
        except subprocess.TimeoutExpired:
            logs[rank] = "(killed at the deadline)"
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    hung = [r for r, log in logs.items() if log == "(killed at the deadline)"]
    assert not hung, f"ranks {hung} of {scenario} still ran after {DEADLINE} s: a hang"
    reports = []
    for rank in range(world):
        f = tmp / f"{scenario}.{rank}.json"
        reports.append(json.loads(f.read_text()) if f.exists() else None)
    for rank, r in enumerate(reports):
        if r is None and rank not in silent:
            pytest.fail(f"{scenario} rank {rank} left no report\n{logs.get(rank, '')[-3000:]}")
        if r is not None and r.get("failures"):
            pytest.fail(f"{scenario} rank {rank}: {r['failures']}\n{logs.get(rank, '')[-3000:]}")
    return reports


@pytest.mark.parametrize("world", [2, 4])
def test_group_loads_and_broadcast_across_namespaces(net, ckpts, world, tmp_path):
    reports = run_group(net, world, "main", tmp_path, ckpts)
    total = sum(len(raw) for *_, raw in _tensors())
    for key in ("full", "index", "shard", "shard_rows", "shard_pread"):
        reads = [r["bytes_read"][key] for r in reports]
        assert sum(reads) == total, (key, reads)  # the group read each byte once
        if key in ("full", "index"):
            for b in reads:
                assert abs(b - total / world) <= 64 * len(LAYOUT) + world, (key, reads)
    assert reports[0]["bytes_read"]["broadcast"] == total
    assert all(r["bytes_read"]["broadcast"] == 0 for r in reports[1:])


def test_a_receiver_dying_mid_broadcast_fails_the_others(net, ckpts, tmp_path):
    # a dying source is the loopback file's case: across namespaces it adds nothing but time
    world = 3
    dead = world - 1
    reports = run_group(net, world, "die_receiver", tmp_path, ckpts, silent=(dead,))
    assert reports[dead] is None  # it left with os._exit
    for rank, r in enumerate(reports):
        if rank != dead:
            assert r is not None and r["error"] == "TransportError", r
            assert "peer rank left" in r["message"], r
            assert r["seconds"] < 30, r


def test_a_rank_cut_off_mid_broadcast_fails_the_others(net, ckpts, tmp_path):
    world = 3
    reports = run_group(net, world, "cut_receiver", tmp_path, ckpts, silent=(world - 1,))
    for r in reports[:-1]:
        assert r is not None and r["error"] == "TransportError", r
        assert "timed out" in r["message"] or "peer rank left" in r["message"], r
        assert r["seconds"] < 60, r
