"""Calibration per endpoint: measured once, remembered in the cache folder, used by later loads."""

from __future__ import annotations

import numpy as np

import weightlift as wl
from tests.checkpoints import write
from tests.sources.conftest import BUCKET
from weightlift.sources import tuning


def test_calibrate_remembers_per_endpoint(s3, tmp_path, private_cache, aws_env):
    client, proxy = s3
    aws_env.delenv("WEIGHTLIFT_SOURCE_PART")
    local = write(tmp_path / "m.safetensors", [("w", "U8", (4 << 20,), np.ones(4 << 20, np.uint8).tobytes())])
    client.upload_file(str(local), BUCKET, "tuning/model.safetensors")
    url = f"s3://{BUCKET}/tuning/model.safetensors"
    tuning.forget()
    best, rates = tuning.calibrate(url, connections=(1, 2), parts=(1 << 20,), nbytes=4 << 20)
    assert {"1x8MiB", "2x8MiB", f"{best.connections}x{best.part >> 20}MiB"} <= set(rates)
    assert (private_cache / "sources.json").exists()
    tuning.forget()  # a fresh process: read back from the file
    assert tuning.tuning_for(proxy.url) == best
    rep: dict = {}
    wl.load(url, report=rep)
    assert rep["source"]["part"] == best.part
