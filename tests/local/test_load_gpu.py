"""Loads into CUDA memory: the same bytes as a host load (skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import weightlift as wl
from tests.checkpoints import every_dtype, raw_bytes, write

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def test_cuda_every_dtype(tmp_path):
    tensors = every_dtype()
    path = write(tmp_path / "m.safetensors", tensors)
    out = wl.load(path, device="cuda", framework="torch")
    for name, _dtype, _shape, raw in tensors:
        assert out[name].device.type == "cuda"
        assert raw_bytes(out[name]) == raw, name


def test_cuda_large_multi_chunk_and_cast(tmp_path):
    rng = np.random.default_rng(2)
    tensors = [
        (f"w{i}", "F32", (1024, 1024 + i), rng.standard_normal((1024, 1024 + i), dtype=np.float32).tobytes())
        for i in range(24)
    ]
    path = write(tmp_path / "big.safetensors", tensors)
    out = wl.load(path, device="cuda:0", framework="torch", threads=4)
    for name, _, _, raw in tensors:
        assert raw_bytes(out[name]) == raw
    half = wl.load(path, device="cuda", framework="torch", dtype="BF16", select=["w0", "w5"])
    for name in ("w0", "w5"):
        ref = torch.from_numpy(np.frombuffer(dict((t[0], t[3]) for t in tensors)[name], np.float32).copy())
        assert torch.equal(half[name].cpu().reshape(-1), ref.to(torch.bfloat16))
    rep: dict = {}
    wl.load(path, device="cuda", framework="torch", profile=True, report=rep)
    assert rep["profile"]["phases_s"]["device"] > 0


def test_cuda_tensors_start_on_device_align(tmp_path):
    """every_dtype's file packs tensors at odd offsets: on the device each starts on DEVICE_ALIGN."""
    from weightlift.memory.targets import DEVICE_ALIGN

    tensors = every_dtype()
    path = write(tmp_path / "m.safetensors", tensors)
    out = wl.load(path, device="cuda", framework="torch")
    for name, _dtype, _shape, raw in tensors:
        assert out[name].data_ptr() % DEVICE_ALIGN == 0, name
        assert raw_bytes(out[name]) == raw, name


def test_a_verified_cuda_load_proves_the_device_bytes(tmp_path, monkeypatch):
    """A byte changed on the device after its copy (a race there), the host staging right: the
    verified load hashes what is on the device, so it is caught."""
    from weightlift.errors import IntegrityError
    from weightlift.memory import targets

    tensors = every_dtype()
    path = write(tmp_path / "m.safetensors", tensors)
    out = wl.load(path, device="cuda", framework="torch", verify=True)
    for name, _dtype, _shape, raw in tensors:
        assert raw_bytes(out[name]) == raw, name
    real = targets._PinnedStager.land

    def land_then_race(self, dest, offset):
        real(self, dest, offset)
        with torch.cuda.stream(self.slots.stream):  # after the copy, on the device only
            dest.reshape(-1).view(torch.uint8)[offset] += 1

    monkeypatch.setattr(targets._PinnedStager, "land", land_then_race)
    with pytest.raises(IntegrityError):
        wl.load(path, device="cuda", framework="torch", verify=True)


def test_a_kernel_queued_on_recycled_memory_does_not_overwrite_a_load(tmp_path):
    """Memory freed with a kernel still queued on the current stream is reused by the load's
    arena; the workers' copy streams are ordered after that kernel, so the load's bytes stay."""
    n = 64 << 20
    path = write(tmp_path / "ones.safetensors", [("w", "U8", (n,), b"\x01" * n)])
    for _ in range(3):
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(400_000_000)  # the current stream is busy ...
        x.fill_(7)  # ... and this write into memory about to be freed waits behind it
        del x
        out = wl.load(path, device="cuda", framework="torch", threads=4)
        torch.cuda.synchronize()
        assert int((out["w"] != 1).sum()) == 0
