"""A checkpoint truncated while a process loads it: a clear FileError or FormatError naming the
file, never a SIGBUS.

Each load runs in a subprocess, so that a SIGBUS shows as the child's exit status instead of
killing the test run. The deterministic tests truncate the file from inside the loading process,
at the first chunk its loader reports done (the loader's progress hook), so the truncation always
lands mid-load; the last test truncates it from another process at a moment it does not choose.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.waiting import wait_for
from weightlift.benchmark.synthetic import write_checkpoint

TENSORS = 16
TENSOR_BYTES = 4 << 20  # 64 MiB in all, loaded in several chunks by one reader
KEEP = 1 << 20  # what is left of the file: its header and the first part of the first tensor

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGBUS"), reason="SIGBUS is a POSIX signal")

# Truncates the file when the loader reports its first chunk done, then prints the outcome.
_LOAD = """
import os, sys
import weightlift
import weightlift.local.loader as loader
from weightlift.errors import FileError, FormatError

path, kw = sys.argv[1], eval(sys.argv[2])
weightlift.load(path, select="t0")  # the file is resident: "auto" takes its warm path
cut = []

def on_chunk(n):
    if not cut:
        cut.append(n)
        os.truncate(path, {keep})

loader._progress = lambda progress, total: on_chunk
try:
    out = weightlift.load(path, threads=1, **kw)
except (FileError, FormatError) as e:
    print("ERROR", type(e).__name__, getattr(e, "file", None) == path, e, flush=True)
else:
    print("LOADED", len(out), bool(cut), flush=True)
"""


def _checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    write_checkpoint(path, [(f"t{i}", "U8", (TENSOR_BYTES,)) for i in range(TENSORS)])
    return path


def _load_while_truncating(path: Path, kw: str) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent(_LOAD).replace("{keep}", str(KEEP))
    return subprocess.run([sys.executable, "-c", script, str(path), kw], capture_output=True, text=True, timeout=120)


def _assert_clear_error(proc: subprocess.CompletedProcess[str], path: Path) -> None:
    assert proc.returncode != -signal.SIGBUS, f"the loader died of SIGBUS: {proc.stderr[-2000:]}"
    assert proc.returncode == 0, proc.stderr[-2000:]
    words = proc.stdout.split()
    assert words[:1] == ["ERROR"], proc.stdout  # the file shrank under the load: it must not succeed
    assert words[1] in ("FileError", "FormatError") and words[2] == "True", proc.stdout
    assert str(path) in proc.stdout, proc.stdout


def test_owned_copies_read_with_pread_raise_file_error(tmp_path):
    path = _checkpoint(tmp_path)
    proc = _load_while_truncating(path, "dict(engine='pread')")
    _assert_clear_error(proc, path)
    assert "FileError" in proc.stdout and "ended" in proc.stdout


def test_owned_copies_of_a_resident_file_raise_file_error(tmp_path):
    # engine="auto" on a resident file: owned copies are read with preadv too, not copied out of
    # the mapping (a truncated mapping is SIGBUS; engine="mmap" still takes that path, by request)
    path = _checkpoint(tmp_path)
    _assert_clear_error(_load_while_truncating(path, "dict()"), path)


def test_views_prefetched_from_a_shrinking_file_raise_file_error(tmp_path):
    # copy=False hands out views of the mapping: once returned, they are the file, and touching
    # bytes truncated away is a SIGBUS, as with safetensors' own mmap. The load call itself
    # reads the selected bytes into the page cache first (warm=True) and must fail cleanly.
    path = _checkpoint(tmp_path)
    _assert_clear_error(_load_while_truncating(path, "dict(copy=False, warm=True)"), path)


@pytest.mark.parametrize("kw", ["dict(engine='pread')", "dict(copy=False)", "dict()"])
def test_a_file_shorter_than_its_header_says_is_a_format_error(tmp_path, kw):
    path = _checkpoint(tmp_path)
    os.truncate(path, KEEP)
    script = "import sys, weightlift\nfrom weightlift.errors import FormatError\n" + (
        "try:\n    weightlift.load(sys.argv[1], **eval(sys.argv[2]))\n"
        "except FormatError as e:\n    print('ERROR FormatError', e.file == sys.argv[1], e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(path), kw], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ERROR FormatError True"), proc.stdout
    assert str(path) in proc.stdout


_LOOP = """
import sys
import weightlift
from weightlift.errors import FileError, FormatError

path = sys.argv[1]
print("loading", flush=True)
while True:
    try:
        weightlift.load(path, engine="pread", threads=1)
    except (FileError, FormatError) as e:
        print("ERROR", type(e).__name__, e.file == path, e, flush=True)
        break
"""


def test_truncated_by_another_process_while_loading_in_a_loop(tmp_path):
    """The truncation comes at any moment: between loads (FormatError at open) or inside one
    (FileError from a short read); either names the file, and the loader never crashes."""
    path = _checkpoint(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", _LOOP, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "loading"
        os.truncate(path, KEEP)
        out = proc.stdout.read()
        wait_for(lambda: proc.poll() is not None, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"exit status {proc.returncode}"
    _assert_clear_error(subprocess.CompletedProcess([], 0, out, ""), path)
