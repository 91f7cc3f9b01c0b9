"""examples/fsdp2_reshard.py, small: 2 FSDP2 trainers into 2 TP-2 engines over gloo, deltas after
the first step, and the engines' tensors equal to a sharded load of the trainers' saved weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the example trains with torch")
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is unavailable", allow_module_level=True)

pytest.importorskip("zstandard", reason="a dense step's delta is compressed with zstandard")
ROOT = Path(__file__).resolve().parents[2]


def test_trainer_syncs_deltas_into_engines(tmp_path):
    """Only the MLPs train, so a step's delta is at most the MLP weights' share of the model; every
    step is proven on every rank, the last against the saved checkpoint's manifest."""
    cmd = [sys.executable, str(ROOT / "examples" / "fsdp2_reshard.py"), "--steps", "3", "--layers", "1"]
    cmd += ["--hidden", "64", "--vocab", "128", "--train", "re:mlp", "--json", "--out", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    steps = out["steps"]
    assert out["equal_to_saved"] is True
    assert out["tensors_per_engine"] == [12, 12]  # embed, 4 attention, 3 MLP, 2 norms, final norm, head
    assert [s["version"] for s in steps] == [1, 2, 3]
    assert [s["delta"] for s in steps] == [False, True, True]
    assert all(s["verified"] == 12 for s in steps)
    assert steps[0]["sent"] == steps[0]["full"] > 0  # the first update: every byte the engines need, once
    mlp = 3 * 64 * 128 * 4  # gate, up, down: 64 x 128 float32 each
    for s in steps[1:]:
        # Adam moves every element of the MLP weights, a little: their planes compress (zstd), and
        # nothing else is sent but one table entry per piece
        assert mlp // 4 < s["sent"] < mlp, s
