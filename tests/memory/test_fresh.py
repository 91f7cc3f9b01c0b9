from __future__ import annotations

import json
import mmap
import os

import numpy as np
import pytest

import weightlift.memory.fresh as fresh
from weightlift.errors import FileError
from weightlift.memory.fresh import DEFAULT, FillPolicy


@pytest.fixture(autouse=True)
def clean_policy(monkeypatch, private_cache):
    for k in ("WEIGHTLIFT_HUGEPAGES", "WEIGHTLIFT_FAULT_AHEAD", "WEIGHTLIFT_FAULT_METHOD", "WEIGHTLIFT_FAULT_HELPERS"):
        monkeypatch.delenv(k, raising=False)
    fresh.reset_policy()
    yield
    fresh.reset_policy()


def _smaps_flags(addr: int) -> str:
    """The VmFlags line of the mapping that holds ``addr``."""
    with open("/proc/self/smaps", encoding="ascii") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line
    raise AssertionError("mapping not found")


def test_default_policy_without_environment_or_calibration():
    p = fresh.policy()
    assert (p.huge, p.ahead, p.method, p.helpers, p.source) == (
        DEFAULT.huge,
        DEFAULT.ahead,
        DEFAULT.method,
        DEFAULT.helpers,
        "default",
    )


def test_environment_overrides_each_choice_on_its_own(monkeypatch):
    monkeypatch.setenv("WEIGHTLIFT_HUGEPAGES", "1")
    monkeypatch.setenv("WEIGHTLIFT_FAULT_HELPERS", "0")
    p = fresh.policy()
    assert p.huge is True and p.helpers == 0 and p.source == "environment"
    assert p.ahead == DEFAULT.ahead and p.method == DEFAULT.method
    other = "touch" if DEFAULT.method == "populate" else "populate"
    monkeypatch.setenv("WEIGHTLIFT_FAULT_AHEAD", "0" if DEFAULT.ahead else "1")
    monkeypatch.setenv("WEIGHTLIFT_FAULT_METHOD", other)
    assert fresh.policy().ahead == DEFAULT.ahead  # read once per process ...
    fresh.reset_policy()
    assert fresh.policy().ahead is not DEFAULT.ahead and fresh.policy().method == other  # ... until reset


def test_a_calibration_recorded_for_this_machine_is_used_and_others_are_not(tmp_path):
    path = fresh.memory_file()
    import os

    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump(
            {
                "another machine": {"huge": False, "ahead": False, "method": "touch"},
                fresh.machine_key(): {"huge": True, "ahead": True, "method": "populate"},
            },
            f,
        )
    p = fresh.policy()
    assert (p.huge, p.ahead, p.method, p.source) == (True, True, "populate", "calibrated")


def test_a_broken_memory_file_is_not_an_error():
    import os

    path = fresh.memory_file()
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write("{not json")
    assert fresh.policy().source == "default"


def test_policy_rejects_an_unknown_method():
    with pytest.raises(ValueError):
        FillPolicy(method="prefetch")


@pytest.mark.parametrize("huge", [False, True])
def test_mappings_carry_the_advice_the_policy_asks_for(huge):
    m = fresh.new_mapping(4 << 20, huge=huge)
    a = np.frombuffer(m, dtype=np.uint8)
    flags = _smaps_flags(a.ctypes.data).split()
    assert ("hg" in flags) is huge and ("nh" in flags) is (not huge)
    del a
    m.close()


def test_fresh_host_is_writable_and_sized_small_and_large():
    for n in (0, 1, 4096, (2 << 20) + 5):
        a = fresh.fresh_host(n)
        assert a.dtype == np.uint8 and a.size == n and a.flags.writeable
        a[:] = 7
        assert a.sum() == 7 * n


@pytest.mark.parametrize("method", ["touch", "populate"])
@pytest.mark.parametrize("start,length", [(0, 5 * 4096), (10, 4096), (4000, 200), (0, 1), (4095, 2)])
def test_fault_in_writes_only_where_it_must_and_faults_every_page(method, start, length):
    m = mmap.mmap(-1, 8 * 4096)
    a = np.frombuffer(m, dtype=np.uint8)
    a[:] = 1
    view = a[start : start + length]
    fresh.fault_in(view, method=method)
    pages = set(range(start // 4096, (start + length - 1) // 4096 + 1))
    zeros = np.flatnonzero(a == 0)
    assert zeros.size > 0 if method == "touch" else True
    assert all(start <= z < start + length for z in zeros)  # nothing outside the buffer written
    if method == "touch":
        assert {int(z) // 4096 for z in zeros} == pages  # one write in every page it spans
    del a, view
    m.close()


def test_fault_in_with_populate_keeps_the_bytes_of_memory_already_written():
    # MADV_POPULATE_WRITE faults pages in without changing what they hold
    m = mmap.mmap(-1, 4 * 4096)
    a = np.frombuffer(m, dtype=np.uint8)
    a[:] = 3
    fresh.fault_in(a, method="populate")
    assert a.min() == 3 or (a == 0).sum() <= 2  # at most the unaligned ends written by hand
    del a
    m.close()


def test_before_kernel_copy_follows_the_policy(monkeypatch):
    a = np.ones(3 * 4096, dtype=np.uint8)
    monkeypatch.setenv("WEIGHTLIFT_FAULT_METHOD", "touch")  # writes a zero into each page it faults
    monkeypatch.setenv("WEIGHTLIFT_FAULT_AHEAD", "0")
    fresh.reset_policy()
    fresh.before_kernel_copy(a)
    assert a.min() == 1
    monkeypatch.setenv("WEIGHTLIFT_FAULT_AHEAD", "1")
    fresh.reset_policy()
    fresh.before_kernel_copy(a)
    assert a.min() == 0


def test_calibrate_times_every_trial_in_child_processes_and_remembers_its_choice():
    res = fresh.calibrate(8 << 20, rounds=1, pause=0.0)
    assert set(res["medians_s"]) == {f"{'huge' if h else '4k'} {k}" for h, k in fresh.TRIALS}
    assert all(v > 0 for v in res["medians_s"].values())
    with open(fresh.memory_file()) as f:
        entry = json.load(f)[fresh.machine_key()]
    assert {k: entry[k] for k in ("huge", "ahead", "method")} == res["policy"]
    p = fresh.policy()
    assert p.source == "calibrated" and (p.huge, p.ahead, p.method) == tuple(res["policy"].values())


@pytest.fixture()
def blob(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(8 * 2**20 + 123))
    return p


def _mapping(path, size=None):
    import mmap

    import numpy as np

    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size or os.path.getsize(path), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    return m, int(np.frombuffer(m, dtype=np.uint8).ctypes.data)


def _recording_madvise(monkeypatch, *, refuse: bool) -> list[tuple[int, int]]:
    """Replace map_in's madvise: record each (address, length); refuse it as a kernel before
    5.14 does (EINVAL), or pass it on."""
    import errno

    from weightlift import libc

    calls: list[tuple[int, int]] = []
    real = libc.madvise

    def advise(addr, n, adv):
        calls.append((addr, n))
        if refuse:
            raise OSError(errno.EINVAL, "madvise failed")
        real(addr, n, adv)

    monkeypatch.setattr(libc, "madvise", advise)
    return calls


def _pages(a: int, n: int) -> tuple[int, int]:
    return a - a % fresh.PAGE, -(-(a + n) // fresh.PAGE) * fresh.PAGE


@pytest.mark.parametrize("threads", [1, 3])
def test_map_in_advises_every_piece_page_aligned_and_reads_the_bytes_in(blob, threads, monkeypatch):
    """map_in cuts its regions into MAP_IN_PIECE pieces, advises each once over exactly the
    pages it spans, and leaves every page of the regions resident; returns the bytes covered."""
    from weightlift.disk import residency, source

    calls = _recording_madvise(monkeypatch, refuse=False)
    step = 2**20 + 4096
    monkeypatch.setattr(fresh, "MAP_IN_PIECE", step)  # several pieces, none page-sized
    source.evict(blob)
    m, base = _mapping(blob)
    size = os.path.getsize(blob)
    regions = [(base, 3 * 2**20 + 5, str(blob)), (base + 4 * 2**20 + 7, size - 4 * 2**20 - 7, str(blob))]
    got = fresh.map_in(regions, threads=threads)
    assert got == sum(n for _, n, _ in regions)
    want = [_pages(a + o, min(step, n - o)) for a, n, _ in regions for o in range(0, n, step)]
    assert sorted((lo, lo + n) for lo, n in calls) == sorted(want)
    for a, n, _ in regions:
        lo, hi = _pages(a, n)
        assert residency.mapping_fraction(lo, hi - lo) == 1.0  # mincore over the mapping
    assert m[: 3 * 2**20 + 5] == blob.read_bytes()[: 3 * 2**20 + 5]
    assert fresh.map_in([], threads=2) == 0


@pytest.mark.parametrize("threads", [1, 2])
def test_map_in_without_the_advice_touches_exactly_the_pages_of_its_regions(threads, monkeypatch):
    """Where the kernel refuses MADV_POPULATE_READ, the touch alone must reach every page a
    region spans, its partial first and last pages included, and no page beyond. Checked on
    private anonymous memory, where each page faults on its own (no fault-around): after
    map_in, reading the region's pages again faults nothing; the page after it still faults."""
    import mmap
    import resource

    calls = _recording_madvise(monkeypatch, refuse=True)
    monkeypatch.setattr(fresh, "MAP_IN_PIECE", 3 * fresh.PAGE + 100)
    pages = 64
    m = mmap.mmap(-1, pages * fresh.PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(m, dtype=np.uint8)
    base = arr.ctypes.data
    a, n = base + fresh.PAGE + 7, 20 * fresh.PAGE  # starts inside page 1, ends inside page 21
    assert fresh.map_in([(a, n, "anon")], threads=threads) == n
    assert calls  # advised, refused, then touched

    def faults(lo: int, hi: int) -> int:
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        int(arr[lo * fresh.PAGE : hi * fresh.PAGE : fresh.PAGE].sum())
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

    assert faults(1, 22) == 0  # pages 1..21: every one the region touches was read in
    assert faults(22, 23) >= 1  # page 22 was not: the check can see a missed page
    assert faults(0, 1) >= 1  # nor page 0, before the region


def test_map_in_of_a_file_cut_short_names_the_file(tmp_path):
    """A file shorter than its mapping fails with FileError naming it, not SIGBUS."""
    p = tmp_path / "short.bin"
    p.write_bytes(os.urandom(8 * 2**20))
    m, base = _mapping(p)
    os.truncate(p, 2**20)
    with pytest.raises(FileError, match=r"short\.bin: cannot read its mapped bytes"):
        fresh.map_in([(base, 8 * 2**20, str(p))], threads=2)


def test_map_in_without_the_advice_of_a_file_cut_short_names_the_file_and_the_process_lives(tmp_path):
    """On a kernel without MADV_POPULATE_READ (refused here as one before 5.14 does), a file cut
    short under its mapping fails with FileError naming it: the pieces are read through
    /proc/self/mem, where a page past the end is an I/O error instead of SIGBUS. Run in a child
    process, so that a SIGBUS would fail this test, not end the run."""
    import subprocess
    import sys
    import textwrap

    p = tmp_path / "short.bin"
    p.write_bytes(os.urandom(8 * 2**20))
    code = textwrap.dedent(
        f"""
        import errno, mmap, os, threading
        import numpy as np
        from weightlift import libc
        from weightlift.errors import FileError
        from weightlift.memory import fresh

        def refused(addr, n, adv):
            raise OSError(errno.EINVAL, "madvise failed")

        libc.madvise = refused
        fresh.MAP_IN_PIECE = 2**20  # eight pieces: both threads meet the refusal
        readers, real, both = set(), fresh._kernel_read, threading.Event()

        def counted(*a):  # each reader waits for the other's first piece (a reader left out fails)
            readers.add(threading.get_ident())
            if len(readers) == 2:
                both.set()
            both.wait(10)
            return real(*a)

        fresh._kernel_read = counted
        path = {str(p)!r}
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 8 * 2**20, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        base = int(np.frombuffer(m, dtype=np.uint8).ctypes.data)
        whole = open(path, "rb").read()
        assert fresh.map_in([(base, 8 * 2**20, path)], threads=2) == 8 * 2**20 and len(readers) == 2
        assert m[:] == whole
        os.truncate(path, 2**20 + 5)
        try:
            fresh.map_in([(base + 2**20, 7 * 2**20, path)], threads=2)
        except FileError as e:
            print("FileError:", e)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "FileError:" in out.stdout and "short.bin: cannot read its mapped bytes" in out.stdout
