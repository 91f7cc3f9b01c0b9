"""The cache covers a mixture-of-experts checkpoint: experts of 1-2 MiB are hashed and asked
about by default, so a second push sends almost nothing, to the same server or to a restarted
one filling from its disk cache."""

from __future__ import annotations

import numpy as np

from tests.checkpoints import write
from weightlift.digest.blake import HASH_THRESHOLD
from weightlift.remote.client.client import Client
from weightlift.remote.server.server import Server

MIB = 1 << 20


def moe(tmp_path) -> tuple[str, dict[str, bytes]]:
    """16 experts of 1 or 1.5 MiB between small norms and a router, as MoE layers lie in a file."""
    rng = np.random.default_rng(11)
    tensors: list[tuple[str, str, tuple[int, ...], bytes]] = []
    for layer in range(2):
        tensors.append((f"l{layer}.norm", "F32", (1024,), rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()))
        tensors.append((f"l{layer}.router", "BF16", (8, 512), rng.integers(0, 256, 8192, dtype=np.uint8).tobytes()))
        for e in range(8):
            n = MIB if e % 2 else 3 * MIB // 2
            raw = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
            tensors.append((f"l{layer}.experts.{e}", "BF16", (n // 2,), raw))
    path = write(tmp_path / "moe.safetensors", tensors)
    return str(path), {n: raw for n, _, _, raw in tensors}


def _holds(server: Server, tensors: dict[str, bytes]) -> None:
    got = server.tensors()
    assert sorted(got) == sorted(tensors)
    for name, raw in tensors.items():
        assert np.ascontiguousarray(got[name]).reshape(-1).view(np.uint8).tobytes() == raw


def test_second_push_of_moe_checkpoint_sends_at_most_a_tenth(tmp_path):
    assert HASH_THRESHOLD <= MIB
    path, tensors = moe(tmp_path)
    total = sum(len(b) for b in tensors.values())
    small = sum(len(b) for b in tensors.values() if len(b) < HASH_THRESHOLD)
    with Server(cache_dir=tmp_path / "cache") as s, Client(s.address) as c:
        first = c.push(path)
        assert first.bytes_sent == total and first.cached == 0 and first.bytes_hashed == total - small
        c.free(list(tensors))
        second = c.push(path)
        assert second.bytes_hashed == 0  # digests from the sidecar
        assert second.cached == 16 and second.bytes_sent == small
        assert second.bytes_sent <= total // 10
        _holds(s, tensors)
    # a restarted server fills from its disk cache: as little goes over the wire
    with Server(cache_dir=tmp_path / "cache") as s, Client(s.address) as c:
        third = c.push(path)
        assert third.cached == 16 and third.bytes_sent == small and s.stats()["bytes_received"] == small
        _holds(s, tensors)
