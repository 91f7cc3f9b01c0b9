"""Host memory stays within the budget while a checkpoint several times larger lands outside the heap.

The destination is a memory-mapped file standing in for device memory: a target a memcpy cannot
fill (``memcpy_ok`` False), so every byte passes through the workers' staging, which the budget
bounds. What is measured is the process's anonymous memory (``RssAnon``): the mapped file's
pages are the destination's, not the host's.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import weightlift as wl
from tests.checkpoints import write
from tests.sources.conftest import BUCKET
from weightlift.memory.targets import Target, tensor_view
from weightlift.options import LoadOptions
from weightlift.sources.load import load_objects

MiB = 1024 * 1024


class MappedFileTarget(Target):
    """Tensors land in a file's shared mapping, written through the stager, as into a device."""

    memcpy_ok = False

    def __init__(self, path):
        self.path = path

    def arena(self, nbytes: int):
        return np.memmap(self.path, dtype=np.uint8, mode="w+", shape=(max(1, nbytes),))

    def write(self, dest, offset: int, data) -> None:
        dest[offset : offset + len(data)] = data

    def view(self, arena, offset: int, t):
        return tensor_view(arena[offset : offset + t.length], t, "numpy")


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


class _Peak:
    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_anon())
            time.sleep(0.002)

    def __enter__(self) -> _Peak:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def test_rss_within_budget_for_a_checkpoint_eight_times_larger(s3, tmp_path, aws_env):
    client, _ = s3
    budget = 12 * MiB
    aws_env.setenv("WEIGHTLIFT_SOURCE_PART", str(1 * MiB))
    rng = np.random.default_rng(5)
    tensors = [(f"w{i}", "U8", (8 * MiB,), rng.integers(0, 256, 8 * MiB, dtype=np.uint8).tobytes()) for i in range(12)]
    local = write(tmp_path / "big.safetensors", tensors)
    client.upload_file(str(local), BUCKET, "budget/big.safetensors")
    del tensors
    ck = wl.open(f"s3://{BUCKET}/budget/big.safetensors")
    assert ck.nbytes >= 8 * budget
    opts = LoadOptions(threads=4)
    # a first small load starts obstore's runtime and the worker threads' arenas
    load_objects(ck.source, ck.tensors[:1], opts, target=MappedFileTarget(tmp_path / "warm.bin"), budget=budget)
    base = _rss_anon()
    with _Peak() as p:
        out = load_objects(ck.source, ck.tensors, opts, target=MappedFileTarget(tmp_path / "dest.bin"), budget=budget)
    grew = p.peak - base
    # the budget, plus what Python and the allocator keep around it (not the checkpoint's size)
    assert grew <= budget + 16 * MiB, f"anonymous memory grew {grew / MiB:.1f} MiB for a {budget / MiB:.0f} MiB budget"
    mapped = np.memmap(local, dtype=np.uint8, mode="r")
    for t in ck.tensors:
        assert np.array_equal(out[t.name], mapped[t.offset : t.end]), t.name


def test_budget_bounds_connections():
    from weightlift.sources.engine import Budget
    from weightlift.sources.store import PIECE

    b = Budget.fit(12 * MiB, part=MiB, connections=16, staged=True)
    assert b.connections == 12 * MiB // (2 * MiB + PIECE)
    assert b.connections * (2 * b.part + PIECE) <= 12 * MiB
    small = Budget.fit(2 * MiB, part=8 * MiB, connections=16, staged=True)
    assert small.connections == 1 and 2 * small.part + PIECE <= 2 * MiB
    host = Budget.fit(None, part=8 * MiB, connections=16, staged=False)
    assert host.connections == 16 and host.nbytes == 16 * PIECE
    with pytest.raises(wl.OptionError):
        Budget.fit(1000, part=MiB, connections=4, staged=True)


def test_a_staged_load_is_verified_as_it_lands(s3, tmp_path):
    from weightlift.digest.landed import LandedHasher
    from weightlift.digest.published import make_manifest

    client, _ = s3
    rng = np.random.default_rng(6)
    tensors = [(f"w{i}", "U8", (1 * MiB,), rng.integers(0, 256, MiB, dtype=np.uint8).tobytes()) for i in range(4)]
    local = write(tmp_path / "m.safetensors", tensors)
    client.upload_file(str(local), BUCKET, "budget/verified.safetensors")
    ck = wl.open(f"s3://{BUCKET}/budget/verified.safetensors")
    expected = {e.name: bytes.fromhex(e.blake3) for e in make_manifest(local).entries}
    hasher = LandedHasher(ck.tensors, expected)
    target = MappedFileTarget(tmp_path / "dest.bin")
    load_objects(ck.source, ck.tensors, LoadOptions(threads=3), target=target, on_landed=hasher.landed)
    hasher.check()
    wrong = LandedHasher(ck.tensors, {**expected, "w2": bytes(32)})
    load_objects(ck.source, ck.tensors, LoadOptions(threads=3), target=target, on_landed=wrong.landed)
    with pytest.raises(wl.IntegrityError, match="w2"):
        wrong.check()


def test_a_staged_load_proves_what_landed_not_its_staging(s3, tmp_path):
    """A target a memcpy cannot fill (a device) where a copy lands wrong after its staging was
    right (a race on the device): the bytes proven are read back from the target, so it fails."""
    from weightlift.digest.landed import LandedHasher
    from weightlift.digest.published import make_manifest

    class Racy(MappedFileTarget):
        def write(self, dest, offset: int, data) -> None:
            super().write(dest, offset, data)
            dest[offset] ^= 1  # one byte of what landed is not what was staged

    client, _ = s3
    rng = np.random.default_rng(7)
    tensors = [(f"w{i}", "U8", (MiB,), rng.integers(0, 256, MiB, dtype=np.uint8).tobytes()) for i in range(3)]
    local = write(tmp_path / "m.safetensors", tensors)
    client.upload_file(str(local), BUCKET, "budget/racy.safetensors")
    ck = wl.open(f"s3://{BUCKET}/budget/racy.safetensors")
    expected = {e.name: bytes.fromhex(e.blake3) for e in make_manifest(local).entries}
    hasher = LandedHasher(ck.tensors, expected)
    load_objects(
        ck.source, ck.tensors, LoadOptions(threads=2), target=Racy(tmp_path / "d.bin"), on_landed=hasher.landed
    )
    with pytest.raises(wl.IntegrityError):
        hasher.check()
