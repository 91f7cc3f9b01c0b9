from __future__ import annotations

import pytest

from weightlift.benchmark.harness import make_checkpoint


@pytest.fixture(autouse=True)
def _bench_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WEIGHTLIFT_BENCH_DIR", str(tmp_path / "bench"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ck") / "tiny.safetensors")
    return make_checkpoint(path, 2 * 1024 * 1024, seed=3)
