"""weightlift.local.prefetch: reading a checkpoint into the page cache ahead of its load."""

from __future__ import annotations

import gc
import os
import threading

import numpy as np
import pytest

import weightlift as wl
from tests.checkpoints import raw_bytes, write
from weightlift.disk import source
from weightlift.errors import FormatError
from weightlift.local import prefetch


def _cold_file(tmp_path, name="m.safetensors"):
    rng = np.random.default_rng(11)
    tensors = [(f"t{i}", "U8", (1 << 20,), rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()) for i in range(3)]
    path = write(tmp_path / name, tensors)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    source.evict(path)
    m = source.MappedFile(str(path))
    if source._probe(m) > 0.5:
        pytest.skip("this file system keeps the file in the page cache after POSIX_FADV_DONTNEED")
    return path, tensors


def _mapped_here(path) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(real) for line in f)


class _Held:
    """prefetch's map_in held until ``gate`` is set: ``started`` once a read began, ``calls``
    the files of each read."""

    def __init__(self, monkeypatch):
        self.gate, self.started, self.calls = threading.Event(), threading.Event(), []
        real = prefetch.map_in

        def held(regions, *, threads):
            self.calls.append(sorted({f for _, _, f in regions}))
            self.started.set()
            self.gate.wait(10)
            return real(regions, threads=threads)

        monkeypatch.setattr(prefetch, "map_in", held)


def test_a_prefetch_of_its_own_mappings_fills_the_page_cache_and_keeps_no_mapping(tmp_path):
    """keep=False: the cold file ends up in the page cache, while this process holds no mapping
    of it afterwards (not the process's one either), and a load of it gives its bytes."""
    path, tensors = _cold_file(tmp_path)
    source._maps.pop(os.path.realpath(path), None)
    job = wl.prefetch(path, keep=False)
    assert job.files == [str(path)] and not job.awaited
    job.wait()
    gc.collect()
    assert os.path.realpath(path) not in source._maps
    assert not _mapped_here(path)
    m = source.MappedFile(str(path))
    assert source._probe(m) >= source.RESIDENT_THRESHOLD
    del m
    out = wl.load(path)
    for name, _, _, raw in tensors:
        assert raw_bytes(out[name]) == raw


def test_the_process_mapping_prefetch_is_awaited_the_own_one_is_not(tmp_path, monkeypatch):
    """A load waits for a prefetch through the process's mapping (it reads nothing twice), not
    for one through mappings of its own (it reads what is still cold itself)."""
    path, _ = _cold_file(tmp_path)
    h = _Held(monkeypatch)
    gate, started = h.gate, h.started
    own = wl.prefetch(path, keep=False)
    started.wait(10)
    try:
        waiter = threading.Thread(target=prefetch.await_prefetches, args=([str(path)],))
        waiter.start()
        waiter.join(5)
        assert not waiter.is_alive() and not own.done  # returned while the read is held
    finally:
        gate.set()
    own.wait()
    source.evict(path)
    gate.clear()
    started.clear()
    kept = wl.prefetch(path)
    assert kept.awaited and kept.files == [str(path)]
    started.wait(10)
    waiter = threading.Thread(target=prefetch.await_prefetches, args=([str(path)],))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # held by the read
    gate.set()
    waiter.join(10)
    assert not waiter.is_alive() and kept.done


def test_a_file_another_prefetch_is_reading_is_left_to_it(tmp_path, monkeypatch):
    path, _ = _cold_file(tmp_path)
    h = _Held(monkeypatch)
    gate, calls = h.gate, h.calls
    first = wl.prefetch(path, keep=False)
    try:
        second = wl.prefetch(path)
        assert second.files == []  # read by the first (whose read its wait() waits for)
    finally:
        gate.set()
    first.wait()
    assert calls == [[str(path)]]


def test_a_prefetch_of_its_own_refuses_a_file_changed_since_its_header(tmp_path):
    path, tensors = _cold_file(tmp_path)
    ck = wl.open(path)
    write(path, tensors[:2])  # replaced: another identity
    with pytest.raises(FormatError, match="changed on disk"):
        wl.prefetch(ck, keep=False)


def test_a_prefetch_left_a_file_another_is_reading_waits_for_that_read(tmp_path, monkeypatch):
    """wait() waits until the files are read in, also those another prefetch was reading when
    this one started (left to it): a caller's wait does not return on a cold file."""
    path, _ = _cold_file(tmp_path)
    h = _Held(monkeypatch)
    gate, started = h.gate, h.started
    first = wl.prefetch(path, keep=False)
    started.wait(10)
    try:
        second = wl.prefetch(path)
        assert not second.done
        waiter = threading.Thread(target=second.wait)
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()  # held by the first one's read
    finally:
        gate.set()
    waiter.join(10)
    assert not waiter.is_alive() and first.done and second.done


# Run in a fresh interpreter (a fork of the test process would leave its memory copy-on-write
# for the tests after it): a prefetch of its own held inside its read, then a fork; the child
# says by its exit code what it still has of it.
_FORKED = r"""
import gc, os, sys, threading
from weightlift.local import prefetch

path = sys.argv[1]
gate, started = threading.Event(), threading.Event()
real = prefetch.map_in

def held(regions, *, threads):
    started.set()
    gate.wait(30)
    return real(regions, threads=threads)

def mapped_here():
    real_path = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(real_path) for line in f)

prefetch.map_in = held
first = prefetch.prefetch(path, keep=False)
assert started.wait(30) and mapped_here()
with prefetch._prefetch_lock:  # held at the fork, as the reading thread may hold it
    pid = os.fork()
if pid == 0:
    code = 3
    try:
        gc.collect()
        code = 1 if mapped_here() else 2 if prefetch._prefetches else 0
        if code == 0:
            got = threading.Thread(target=prefetch.await_prefetches, args=([path],), daemon=True)
            got.start()
            got.join(5)
            code = 4 if got.is_alive() else 0
    finally:
        os._exit(code)
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
gate.set()
first.wait()
sys.exit(code)
"""


def test_a_process_forked_during_a_prefetch_of_its_own_keeps_neither_its_mappings_nor_its_jobs(tmp_path):
    """vLLM forks its engine core while the read ahead runs: in the child the reading threads
    are gone, so their mappings are let go there, the prefetch's lock is free and the file is
    no longer taken as being read."""
    import subprocess
    import sys

    path, _ = _cold_file(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    code = subprocess.run([sys.executable, "-c", _FORKED, str(path)], env=env, timeout=120).returncode
    why = {1: "the child still maps the file", 2: "the child holds the job", 4: "the lock is held in the child"}
    assert code == 0, why.get(code, f"exit {code}")
