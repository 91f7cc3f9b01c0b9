"""kill -9 of a client process in the middle of a tensor's bytes, against a caching server.

Nothing the killed client pushed becomes visible (a checkpoint's push is one unit), its charge
and its cache temporary file go, the cache entries of the tensors it completed are whole, and
the server goes on serving: a new push sends only what the server's cache does not hold, every
byte equal to the source. The server's descriptors and
threads come back to where they started.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.support import (
    assert_entries_sound,
    assert_same_tensors,
    cache_files,
    fd_count,
    source_bytes,
    thread_count,
    warm_up_hashing,
)
from tests.waiting import wait_for
from weightlift.benchmark.synthetic import write_checkpoint
from weightlift.remote.client.client import Client
from weightlift.remote.server.server import Server

TENSORS = 8
TENSOR_BYTES = 2 << 20
ROOT = Path(__file__).resolve().parents[2]

# A client that pushes until its stream has sent about half the bytes, says so, and waits to die.
_CLIENT = """
import sys, threading
from tests.faults.support import Stall, StallingBackend
from weightlift.remote.client.client import Client

host, port, path, limit = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
stall = Stall(limit)
client = Client((host, port), backend=StallingBackend(stall))
threading.Thread(target=client.push, args=(path,), daemon=True).start()
stall.stalled.wait()
print("stalled", flush=True)
threading.Event().wait()
"""

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")


def test_client_killed_mid_tensor_leaves_nothing_half_done(tmp_path):
    ckpt = tmp_path / "model.safetensors"
    write_checkpoint(ckpt, [(f"t{i}", "U8", (TENSOR_BYTES,)) for i in range(TENSORS)])
    want = source_bytes(ckpt)
    cache = tmp_path / "cache"
    warm_up_hashing()
    with Server(cache_dir=cache) as server:
        fds, threads = fd_count(besides=ckpt), thread_count()
        limit = TENSORS // 2 * TENSOR_BYTES + TENSOR_BYTES // 2
        child = subprocess.Popen(
            [sys.executable, "-c", _CLIENT, *map(str, server.address), str(ckpt), str(limit)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "stalled"
            # the server is inside the cut tensor: the ones before it are complete, held back by
            # the open push (their entries are written behind, from memory)
            wait_for(lambda: server.stats()["bytes_received"] >= TENSORS // 2 * TENSOR_BYTES, 30)
            assert server.tensors() == {}
            child.kill()
            assert child.wait(30) == -signal.SIGKILL
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            if child.stdout is not None:
                child.stdout.close()

        assert server.cache is not None and server.cache.flush(30)
        wait_for(lambda: not cache_files(cache)[1], 30)  # no temporary file stays behind
        import time

        time.sleep(3)
        wait_for(lambda: fd_count(besides=ckpt) == fds and thread_count() == threads, 30)
        assert server.tensors() == {}  # nothing of the killed push, not even what completed
        done = len(assert_entries_sound(cache))  # what completed may be in the cache, each entry whole
        assert done <= TENSORS // 2

        with Client(server.address) as again:
            result = again.push(ckpt)
        assert result.tensors == TENSORS and result.cached == done
        assert result.bytes_sent == (TENSORS - done) * TENSOR_BYTES
        assert_same_tensors(server.tensors(), want)
        with Client(server.address) as c:
            assert c.free(list(want)) == TENSORS
        wait_for(lambda: server.memory_used == 0, 30)  # every charge, the killed client's too, came back
        wait_for(lambda: fd_count(besides=ckpt) == fds and thread_count() == threads, 30)
