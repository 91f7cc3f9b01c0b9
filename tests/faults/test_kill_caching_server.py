"""kill -9 of a caching ``weightlift serve`` in the middle of a push, inside a tensor's bytes.

What the cache held at the kill is sound (every entry hashes to its name; the tensor being
written is at most a temporary file, never an entry), a server restarted on the same cache folder
serves from it, and a second push sends only what is missing; every byte that arrives equals the
source file.
"""

from __future__ import annotations

import signal
import threading

import numpy as np
import pytest

from tests.faults.support import (
    ServeProcess,
    Stall,
    StallingBackend,
    assert_entries_sound,
    assert_same_tensors,
    cache_files,
    hex_digest,
    source_bytes,
)
from tests.waiting import wait_for
from weightlift.benchmark.synthetic import write_checkpoint
from weightlift.errors import WeightliftError
from weightlift.remote.client.client import Client

TENSORS = 12
TENSOR_BYTES = 2 << 20  # above the client's hash threshold: every tensor is named by its digest

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")


def test_caching_server_killed_mid_push_restarts_and_receives_only_what_is_missing(tmp_path):
    ckpt = tmp_path / "model.safetensors"
    write_checkpoint(ckpt, [(f"t{i:02d}", "U8", (TENSOR_BYTES,)) for i in range(TENSORS)])
    want = source_bytes(ckpt)
    cache = tmp_path / "cache"
    # about half the tensors' bytes, and not on a tensor boundary
    stall = Stall(TENSORS // 2 * TENSOR_BYTES + TENSOR_BYTES // 3)
    failure: list[BaseException] = []

    with ServeProcess("--cache-dir", str(cache), log=tmp_path / "serve1.log") as first:
        client = Client(first.address, backend=StallingBackend(stall), timeout=30)

        def push() -> None:
            try:
                client.push(ckpt)
            except BaseException as e:  # noqa: BLE001 - examined by the test
                failure.append(e)

        pusher = threading.Thread(target=push)
        pusher.start()
        try:
            wait_for(stall.stalled.is_set, 60)
            # the tensors whose bytes all went out before the stall are committed as they complete
            wait_for(lambda: len(cache_files(cache)[0]) >= TENSORS // 2 - 1, 30)
            assert first.kill() == -signal.SIGKILL
        finally:
            stall.release()
            pusher.join(60)
            client.close()
    assert not pusher.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], WeightliftError), failure

    entries = {e.name for e in assert_entries_sound(cache)}
    _, others = cache_files(cache)
    # at most the temporary file of the tensor the kill cut short: never an entry
    assert len(others) <= 1 and all(p.name.startswith(".tmp-") for p in others), others
    assert entries <= {hex_digest(raw) for raw in want.values()}
    assert len(entries) >= TENSORS // 2 - 1

    with ServeProcess("--cache-dir", str(cache), log=tmp_path / "serve2.log") as second:
        with Client(second.address) as again:
            result = again.push(ckpt)
            assert result.tensors == TENSORS
            assert result.cached == len(entries)
            assert result.bytes_sent == (TENSORS - len(entries)) * TENSOR_BYTES  # only what was missing travelled
            pulled = tmp_path / "pulled.safetensors"
            again.pull(pulled)
    assert_same_tensors({k: np.frombuffer(v, dtype=np.uint8) for k, v in source_bytes(pulled).items()}, want)
    assert len(assert_entries_sound(cache)) == TENSORS
