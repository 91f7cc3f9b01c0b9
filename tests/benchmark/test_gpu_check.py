"""bench/gpu_check.sh, the one script a machine with a CUDA GPU runs first: every path it names
exists, every CUDA test is one it runs (marked ``gpu``), and without a device it fails loudly
instead of looking finished."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.devices import has_cuda

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"

#: tests that only run on a CUDA device: ``pytest -m gpu`` must collect every one
CUDA_TESTS = [
    "tests/faults/test_cuda_abandon.py::test_on_a_device_a_tensor_dropped_mid_copy_does_not_write_into_the_next_one",
    "tests/remote/test_update.py::test_a_cuda_tensor_goes_through_a_staging_copy",
    "tests/remote/test_server.py::test_cuda_server_round_trip",
    "tests/remote/test_server.py::test_cuda_target_is_made_at_the_first_alloc_not_at_connect",
    "tests/memory/test_targets.py::test_cuda_target_double_buffered_writes",
    "tests/local/test_load_gpu.py::test_cuda_every_dtype",
    "tests/test_hf.py::test_cuda_load_and_check",
    "tests/local/test_load_gpu.py::test_cuda_tensors_start_on_device_align",
    "tests/local/test_load_gpu.py::test_a_verified_cuda_load_proves_the_device_bytes",
    "tests/local/test_load_gpu.py::test_a_kernel_queued_on_recycled_memory_does_not_overwrite_a_load",
    "tests/remote/test_server.py::test_trim_gives_a_cuda_servers_dropped_tensors_back",
    "tests/remote/test_server.py::test_a_memory_push_to_a_cuda_server_commits_and_states_its_set_digest",
    "tests/remote/test_update.py::test_a_cuda_tensor_written_on_a_side_stream_is_pushed_as_written",
]


def test_every_path_the_script_names_exists():
    text = SCRIPT.read_text()
    named = set(re.findall(r"\b(?:tests|bench|weightlift|docs)/[\w./-]*\w", text))
    assert "bench/gpu_findings.py" in named and "bench/gpu_variants.py" in named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"bench/gpu_check.sh names paths that do not exist: {missing}"


def test_the_script_fails_on_any_error():
    text = SCRIPT.read_text()
    assert "set -euo pipefail" in text
    (run,) = [line for line in text.splitlines() if line.startswith("stage gpu_tests")]
    assert "-m gpu" in run and ".py" not in run  # every gpu-marked test, and only those


def test_gpu_collects_every_cuda_test():
    pytest.importorskip("torch", reason="without torch the CUDA test modules skip at import, uncollected")
    files = sorted({t.split("::")[0] for t in CUDA_TESTS})
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    collected = {line.strip() for line in r.stdout.splitlines() if "::" in line}
    missing = [t for t in CUDA_TESTS if t not in collected]
    assert not missing, f"not collected by -m gpu: {missing}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"


@pytest.mark.skipif(has_cuda(), reason="checks the script's failure without a CUDA device")
def test_without_a_device_or_gpu_tests_the_script_fails_loudly(tmp_path):
    tests = tmp_path / "no_gpu_tests"
    tests.mkdir()
    (tests / "test_cpu_only.py").write_text("def test_nothing():\n    pass\n")
    out = tmp_path / "out"
    r = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "OUT": str(out), "WL_GPU_TESTS": str(tests), "PYTHON": sys.executable},
        timeout=300,
    )
    assert r.returncode != 0, r.stdout + r.stderr
    if importlib.util.find_spec("torch") is None:  # the numpy-only install: refused before the preflight
        assert "FAIL: torch (a CUDA build) and pytest are needed" in r.stdout
        return
    assert "no CUDA device" in r.stdout
    assert "0 gpu tests collected" in r.stdout
    summary = (out / "gpu_summary.md").read_text()
    assert "| preflight | FAIL |" in summary and "gpu_check FAILED: preflight" in summary
    assert "NCCL between two GPUs" in summary  # what one GPU cannot test is said, not skipped quietly
