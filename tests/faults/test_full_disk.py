"""A full disk under a caching server's cache: an 8 MiB tmpfs, and a push larger than it.

The push completes with every byte right (the tensors are in memory; only the cache write fails),
the failure is logged once, it leaves no temporary file and no broken entry, and the server goes
on serving. Those tests set a cap past the disk's size; under the default cap (half the space the
cache could use) the same disk never fills, eviction comes first. Needs root to mount the tmpfs;
skips with the reason elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import blake3
import numpy as np
import pytest

from tests.faults.support import (
    ServeProcess,
    assert_entries_sound,
    assert_same_tensors,
    cache_files,
    fd_count,
    source_bytes,
)
from tests.waiting import wait_for
from weightlift.benchmark.synthetic import write_checkpoint
from weightlift.remote.client.client import Client
from weightlift.remote.server.cache import TensorCache

DISK = 8 << 20
TENSORS = 8
TENSOR_BYTES = 2 << 20  # twice the disk in all: about three entries fit, the fourth fails part-written
CAP = "1G"  # a cap past the disk's size, so that the disk fills before eviction would start


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    where = tmp_path / "cache"
    where.mkdir()  # mounted 0700: a cache folder others could write in is refused
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK},mode=0700", "tmpfs", str(where)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs refused: {done.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _pulled(client: Client, path: Path) -> dict[str, np.ndarray]:
    client.pull(path)
    return {k: np.frombuffer(v, dtype=np.uint8) for k, v in source_bytes(path).items()}


def test_push_larger_than_the_cache_disk_completes_and_the_server_keeps_serving(tmp_path, small_disk):
    ckpt = tmp_path / "model.safetensors"
    write_checkpoint(ckpt, [(f"t{i}", "U8", (TENSOR_BYTES,)) for i in range(TENSORS)])
    want = source_bytes(ckpt)
    log = tmp_path / "serve.log"
    with ServeProcess("--cache-dir", str(small_disk), "--cache-max", CAP, log=log) as server:
        fds = fd_count(server.pid)
        with Client(server.address) as client:
            result = client.push(ckpt)
            assert result.tensors == TENSORS and result.bytes == TENSORS * TENSOR_BYTES
            assert_same_tensors(_pulled(client, tmp_path / "first.safetensors"), want)

        wait_for(lambda: "tensor cache disabled" in server.log(), 30)
        text = server.log()
        assert (
            f"cache write failed in {small_disk}: No space left on device" in text
            and text.count("tensor cache disabled") == 1
        ), text
        entries, others = cache_files(small_disk)
        assert not others, others  # the entry the disk could not hold left no temporary file
        assert 0 < len(assert_entries_sound(small_disk)) < TENSORS
        wait_for(
            lambda: fd_count(server.pid) == fds, 10
        )  # no temporary file still open (the closed connection's socket may take a moment)

        # it goes on serving: the same tensors again, and others, each byte right
        other = tmp_path / "other.safetensors"
        write_checkpoint(other, [(f"u{i}", "U8", (TENSOR_BYTES,)) for i in range(2)], seed=1)
        with Client(server.address) as client:
            assert client.push(ckpt).tensors == TENSORS
            assert client.push(other).tensors == 2
            assert_same_tensors(_pulled(client, tmp_path / "second.safetensors"), {**want, **source_bytes(other)})
        assert not cache_files(small_disk)[1]
        assert len(assert_entries_sound(small_disk)) == len(entries)


def test_a_server_started_on_a_full_cache_serves_from_it(tmp_path, small_disk):
    ckpt = tmp_path / "model.safetensors"
    write_checkpoint(ckpt, [(f"t{i}", "U8", (TENSOR_BYTES,)) for i in range(TENSORS)])
    want = source_bytes(ckpt)
    with ServeProcess("--cache-dir", str(small_disk), "--cache-max", CAP, log=tmp_path / "first.log") as first:
        with Client(first.address) as client:
            client.push(ckpt)
    held = len(assert_entries_sound(small_disk))
    with ServeProcess("--cache-dir", str(small_disk), "--cache-max", CAP, log=tmp_path / "second.log") as second:
        with Client(second.address) as client:
            result = client.push(ckpt)
            assert result.cached == held and result.bytes_sent == (TENSORS - held) * TENSOR_BYTES
            assert_same_tensors(_pulled(client, tmp_path / "pulled.safetensors"), want)
    assert not cache_files(small_disk)[1]


def test_the_default_cap_keeps_a_small_disk_from_filling(small_disk):
    cache = TensorCache(small_disk)  # the default cap: half of what the 8 MiB disk leaves free
    assert cache.max_bytes is not None and DISK // 2 - (1 << 20) <= cache.max_bytes <= DISK // 2
    for i in range(2 * DISK // TENSOR_BYTES):  # twice the disk: it would fill without the cap
        data = np.random.default_rng(i).integers(0, 256, TENSOR_BYTES, dtype=np.uint8).tobytes()
        digest = blake3.blake3(data).digest()
        with cache.writer(digest, len(data)) as w:
            w.write(data)
            w.commit()
        assert cache.has(digest, len(data))
    held = sum(p.stat().st_blocks * 512 for p in small_disk.rglob("*") if p.is_file())
    assert cache.total_bytes <= cache.max_bytes and held <= cache.max_bytes
    assert cache.stats()["evicted"] > 0
