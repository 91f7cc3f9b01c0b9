"""A soak: four clients pushing, pulling, listing and freeing at once for ten seconds against a
caching server under max_memory (bench/soak.py, which runs longer from the command line).

Every byte pulled is a version some client pushed (a client's own tensors exactly what it last
pushed), the server's resident memory stays within max_memory plus SECURITY.md's constant, and
its descriptors and threads come back to their count before the first client.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the server's /proc")


def _soak_module():
    spec = importlib.util.spec_from_file_location("wl_bench_soak", SOAK)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_soak_of_concurrent_clients_under_max_memory(tmp_path):
    soak = _soak_module()
    r = soak.soak(10.0, clients=4, max_memory=48 << 20, folder=tmp_path)
    print({k: r[k] for k in ("ops", "refused", "pull_conflicts", "torn_pulls", "rss_growth", "fds", "threads")})
    assert r["errors"] == []
    assert r["bytes_lost"] == 0, r["lost"]
    assert r["ops"]["push"] > 0 and r["ops"]["pull"] > 0 and r["ops"]["list"] > 0 and r["ops"]["free"] > 0
    assert r["rss_growth"] <= r["rss_allowed"], f"resident memory grew {r['rss_growth'] >> 20} MiB"
    assert r["fds"][0] == r["fds"][1], r["fds"]
    assert r["threads"][0] == r["threads"][1], r["threads"]
    assert soak.ok(r)
