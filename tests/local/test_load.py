"""The local loader: exact bytes for every dtype, shards and GGUF, cross-checked with the reference packages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import weightlift as wl
from tests.checkpoints import every_dtype, raw_bytes, write, write_sharded
from tests.devices import HAS_TORCH, needs_torch
from weightlift.errors import FileError, FormatError, NotFoundError, OptionError
from weightlift.options import LoadOptions

safetensors_numpy = pytest.importorskip("safetensors.numpy")
FRAMEWORKS = ["numpy", pytest.param("torch", marks=needs_torch)]
FRAMEWORK_NAMES = ("numpy", "torch") if HAS_TORCH else ("numpy",)  # loops inside one test


@pytest.fixture()
def ckpt(tmp_path: Path) -> tuple[Path, list]:
    tensors = every_dtype()
    return write(tmp_path / "m.safetensors", tensors, {"format": "pt"}), tensors


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("engine", ["pread", "mmap"])
def test_every_dtype_exact_bytes(ckpt, framework, copy, engine):
    path, tensors = ckpt
    out = wl.load(path, framework=framework, copy=copy, engine=engine)
    assert list(out) == [t.name for t in wl.open(path)]
    for name, dtype, shape, raw in tensors:
        got = out[name]
        assert raw_bytes(got) == raw, name
        if wl.dtypes.dtype_info(dtype).bits % 8 == 0:  # packed types come back as raw bytes
            assert tuple(got.shape) == shape, name


NP_KNOWN = {"F64", "F32", "F16", "I64", "U64", "I32", "U32", "I16", "U16", "I8", "U8", "BOOL", "C64"}
PT_KNOWN = NP_KNOWN | {"BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}


def test_matches_safetensors_packages(ckpt):
    """Byte for byte what safetensors' own numpy loader reads, for every dtype it knows."""
    path, tensors = ckpt
    sub = [t for t in tensors if t[1] in NP_KNOWN]
    sub_path = write(path.parent / "np.safetensors", sub)
    ref = safetensors_numpy.load_file(str(sub_path))
    ours = wl.load(sub_path)
    assert ref.keys() == ours.keys()
    for name in ref:
        assert raw_bytes(ref[name]) == raw_bytes(ours[name]) and ref[name].dtype == ours[name].dtype, name
        assert ref[name].shape == ours[name].shape


@needs_torch
def test_matches_safetensors_torch(ckpt):
    """Byte for byte what safetensors' own torch loader reads, for every dtype it knows."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path, tensors = ckpt
    sub = [t for t in tensors if t[1] in PT_KNOWN]
    sub_path = write(path.parent / "pt.safetensors", sub)
    ref = safetensors_torch.load_file(str(sub_path))
    ours = wl.load(sub_path, framework="torch")
    assert ref.keys() == ours.keys()
    for name in ref:
        assert raw_bytes(ref[name]) == raw_bytes(ours[name]) and ref[name].dtype == ours[name].dtype, name
        assert ref[name].shape == ours[name].shape


def test_metadata_kept(ckpt):
    path, _ = ckpt
    assert wl.open(path).metadata == {"format": "pt"}


def test_copy_false_is_readonly_view(ckpt):
    path, tensors = ckpt
    out = wl.load(path, copy=False)
    a = out["t.f32"]
    assert not a.flags.writeable
    with pytest.raises(ValueError):
        a[0, 0] = 1


@pytest.mark.parametrize("warm", [None, True, False])
def test_copy_false_prefetches_a_cold_file(ckpt, warm):
    from weightlift.disk import source

    path, tensors = ckpt
    source.evict(path)
    cold = source.resident_fraction(path, refresh=True) < source.RESIDENT_THRESHOLD
    rep: dict = {}
    out = wl.load(path, copy=False, warm=warm, profile=True, report=rep)
    read = rep["profile"]["phase_bytes"]["read"]
    nbytes = sum(len(raw) for *_, raw in tensors)
    if warm is False or (warm is None and not cold):
        assert read == 0  # bare views: nothing read before they are handed out
    else:
        assert read >= nbytes  # the selected bytes (and the padding between them), once
    for name, _, _, raw in tensors:
        assert raw_bytes(out[name]) == raw, name


def test_sharded_index_and_folder(tmp_path):
    tensors = every_dtype(seed=3)
    idx = write_sharded(tmp_path / "sh", tensors, shards=3)
    for p in (idx, idx.parent):
        ck = wl.open(p)
        assert len(ck.files) == 3
        for fw in FRAMEWORK_NAMES:
            out = wl.load(p, framework=fw)
            for name, _, _, raw in tensors:
                assert raw_bytes(out[name]) == raw


def test_sharded_missing_shard_names_it(tmp_path):
    idx = write_sharded(tmp_path / "sh", every_dtype(), shards=2)
    (idx.parent / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(NotFoundError, match="model-00002-of-00002"):
        wl.open(idx)


def test_sharded_index_names_absent_tensor(tmp_path):
    import json

    idx = write_sharded(tmp_path / "sh", every_dtype(), shards=2)
    obj = json.loads(idx.read_text())
    obj["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    idx.write_text(json.dumps(obj))
    with pytest.raises(FormatError, match="ghost"):
        wl.open(idx)


def test_index_escaping_folder_refused(tmp_path):
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text('{"weight_map": {"a": "../../etc/passwd"}}')
    with pytest.raises(FormatError, match="not a file beside the index"):
        wl.open(idx)


@pytest.mark.parametrize(
    "select,expect",
    [
        (
            "t.f*",
            {
                "t.f8_e5m2",
                "t.f8_e4m3",
                "t.f16",
                "t.f32",
                "t.f64",
                "t.f8_e4m3fnuz",
                "t.f8_e5m2fnuz",
                "t.f8_e8m0",
                "t.f4",
                "t.f6_e2m3",
                "t.f6_e3m2",
            },
        ),
        (["t.u8", "t.i64"], {"t.u8", "t.i64"}),
        ("re:^t\\.[ui]16$", {"t.u16", "t.i16"}),
    ],
)
def test_select(ckpt, select, expect):
    path, _ = ckpt
    assert set(wl.load(path, select=select)) == expect


def test_select_matching_nothing_is_an_error(ckpt):
    with pytest.raises(NotFoundError, match="matches no tensor"):
        wl.load(ckpt[0], select="nope.*")


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_dtype_cast_on_load(ckpt):
    path, tensors = ckpt
    ref = wl.load(path, select=["t.f32", "t.bf16", "t.i32"])
    out = wl.load(path, select=["t.f32", "t.bf16", "t.i32"], dtype="F16")
    assert out["t.f32"].dtype == np.float16
    np.testing.assert_array_equal(out["t.f32"], ref["t.f32"].astype(np.float16))
    np.testing.assert_array_equal(out["t.bf16"], ref["t.bf16"].astype(np.float16))
    assert raw_bytes(out["t.i32"]) == raw_bytes(ref["t.i32"])  # integers are never cast


@needs_torch
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_dtype_cast_on_load_torch(ckpt):
    import torch

    path, _ = ckpt
    ref = wl.load(path, select=["t.f32"])
    out_t = wl.load(path, select=["t.f32"], dtype=torch.bfloat16, framework="torch")
    assert out_t["t.f32"].dtype == torch.bfloat16
    assert torch.equal(out_t["t.f32"], torch.from_numpy(ref["t.f32"]).to(torch.bfloat16))


def test_bad_options(ckpt):
    path, _ = ckpt
    with pytest.raises(OptionError):
        wl.load(path, framework="jax")
    with pytest.raises(OptionError):
        wl.load(path, device="tpu")
    with pytest.raises(OptionError):
        wl.load(path, device="cuda", framework="numpy")
    with pytest.raises(OptionError):
        wl.load(path, copy=False, dtype="F16")
    with pytest.raises(OptionError):
        wl.load(path, page_cache="sometimes")
    with pytest.raises(OptionError):
        wl.load(path, dtype="float77")


def test_coalesced_runs_same_bytes_as_per_tensor(tmp_path):
    rng = np.random.default_rng(5)
    tensors = [
        (f"experts.{i}.w", "F32", (64, 33), rng.integers(0, 256, 64 * 33 * 4, dtype=np.uint8).tobytes())
        for i in range(40)
    ]
    path = write(tmp_path / "moe.safetensors", tensors)
    from weightlift.plan import make_runs

    runs = make_runs(wl.open(path).tensors)
    assert len(runs) == 1 and len(runs[0].tensors) == 40
    out = wl.load(path, threads=3)
    for name, _, _, raw in tensors:
        assert raw_bytes(out[name]) == raw
        assert out[name].flags.aligned


def test_page_cache_evict_and_warm_paths_same_bytes(ckpt, monkeypatch):
    path, tensors = ckpt
    for kw in ({"page_cache": "evict"}, {"warm": True}, {"warm": False}, {"threads": 1}):
        out = wl.load(path, **kw)
        for name, _, _, raw in tensors:
            assert raw_bytes(out[name]) == raw
    monkeypatch.setenv("WEIGHTLIFT_PAGE_EVICTION", "maybe")
    with pytest.raises(OptionError):
        wl.load(path)


def test_cold_path_readers_same_bytes(tmp_path, monkeypatch):
    """A cold file is read by preadv readers gated per device; no chunk lost or repeated."""
    import importlib
    import json

    load_mod = importlib.import_module("weightlift.local.loader")  # the package's `load` is the function
    from weightlift.disk import storage
    from weightlift.local import mover

    rng = np.random.default_rng(9)
    tensors = [
        (f"w{i}", "U8", (3 * 2**20 + i,), rng.integers(0, 256, 3 * 2**20 + i, dtype=np.uint8).tobytes())
        for i in range(12)
    ]
    path = write(tmp_path / "cold.safetensors", tensors)
    monkeypatch.setattr(load_mod, "resident_fraction", lambda f: 0.0)
    monkeypatch.setattr(mover, "CHUNK", 2**20)
    monkeypatch.setenv("WEIGHTLIFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("WEIGHTLIFT_COLD_READERS", raising=False)
    monkeypatch.setattr(storage, "_memo", {})
    dev = os.stat(path).st_dev
    for known in (None, 1, 3):
        if known is not None:
            storage.remember_readers(dev, known, one_gbps=1.0)
        for threads in (1, 2, 4):
            out = wl.load(path, threads=threads)
            for name, _, _, raw in tensors:
                assert raw_bytes(out[name]) == raw
    assert json.loads((tmp_path / "cache" / "storage.json").read_text())[str(dev)]["readers"] == 3
    monkeypatch.setattr(storage, "_memo", {})
    assert storage.readers_for(dev) == 3
    monkeypatch.setenv("WEIGHTLIFT_COLD_READERS", "2")
    assert storage.readers_for(dev) == 2


def test_report_figures(ckpt):
    path, tensors = ckpt
    rep: dict = {}
    wl.load(path, report=rep, profile=True)
    assert rep["tensors"] == len(tensors)
    assert rep["bytes"] == sum(len(t[3]) for t in tensors)
    assert 0.0 <= rep["resident_before"] <= 1.0
    assert rep["profile"]["bytes"] == rep["bytes"]
    assert rep["profile"]["tensors"] == len(tensors)


def test_truncated_file_is_a_format_error(ckpt, tmp_path):
    path, _ = ckpt
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-5])
    with pytest.raises(FormatError, match="cut.safetensors"):
        wl.load(cut)


# -- GGUF ----------------------------------------------------------------------------------


def test_gguf_matches_reader(tmp_path):
    from gguf import GGUFReader

    from tests.gguf_files import write_sample

    path = tmp_path / "m.gguf"
    write_sample(path)
    reader = GGUFReader(str(path))
    for fw in FRAMEWORK_NAMES:
        for copy in (True, False):
            out = wl.load(path, framework=fw, copy=copy)
            assert len(out) == len(reader.tensors)
            for rt in reader.tensors:
                assert raw_bytes(out[rt.name]) == np.ascontiguousarray(rt.data).tobytes(), rt.name
    ck = wl.open(path)
    assert ck.format == "gguf"
    q = [t for t in ck if t.quantized]
    assert q and all(t.alignment for t in q)
    deq = wl.load(path, select=[t.name for t in q], dequantize=True)
    from gguf.quants import dequantize

    for rt in reader.tensors:
        if rt.name in deq:
            np.testing.assert_array_equal(deq[rt.name], dequantize(rt.data, rt.tensor_type))


# -- memory --------------------------------------------------------------------------------

_RSS = """
import resource, sys, weightlift as wl
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = wl.load(sys.argv[1], copy=sys.argv[2] == "1", progress=False)
if sys.argv[2] == "0":
    pass  # views only: nothing touched
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(before * 1024, after * 1024)
"""


@pytest.mark.parametrize("copy", [True, False])
def test_peak_rss(tmp_path, copy):
    size = 192 * 2**20
    rng = np.random.default_rng(1)
    tensors = [
        (f"w{i}", "U8", (size // 8,), rng.integers(0, 256, size // 8, dtype=np.uint8).tobytes()) for i in range(8)
    ]
    path = write(tmp_path / "big.safetensors", tensors)
    del tensors
    res = subprocess.run(
        [sys.executable, "-c", _RSS, str(path), "1" if copy else "0"], capture_output=True, text=True, check=True
    )
    before, after = map(int, res.stdout.split())
    grown = after - before
    if copy:
        assert grown <= size * 1.10, f"peak RSS grew {grown / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB checkpoint"
    else:
        assert grown <= 16 * 2**20, f"copy=False grew RSS by {grown / 2**20:.0f} MiB"


def test_file_replaced_after_open_is_refused(tmp_path):
    tensors = every_dtype()
    path = write(tmp_path / "m.safetensors", tensors)
    ck = wl.open(path)
    write(tmp_path / "new.safetensors", every_dtype(seed=7))
    os.replace(tmp_path / "new.safetensors", path)
    with pytest.raises(FormatError, match="changed on disk"):
        wl.load(ck)
    out = wl.load(path)  # opened afresh: the new bytes
    assert raw_bytes(out["t.f32"]) == [t for t in every_dtype(seed=7) if t[0] == "t.f32"][0][3]


def test_deep_json_and_special_files_are_format_errors(tmp_path):
    import socket

    deep = tmp_path / "deep.safetensors"
    body = b"[" * 200_000
    deep.write_bytes(len(body).to_bytes(8, "little") + body)
    with pytest.raises(FormatError, match="not valid JSON"):
        wl.open(deep)
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_bytes(b"[" * 200_000)
    with pytest.raises(FormatError, match="not valid JSON"):
        wl.open(idx)
    sock_path = tmp_path / "s.safetensors"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock_path))
    try:
        with pytest.raises(FormatError, match="not a regular file"):
            wl.open(sock_path)
    finally:
        s.close()


def test_file_changed_after_open_is_refused(tmp_path):
    rng = np.random.default_rng(5)
    tensors = [(f"t{i}", "F32", (256, 1024), rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()) for i in range(4)]
    path = write(tmp_path / "m.safetensors", tensors)
    ck = wl.open(path)
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(FormatError, match="changed on disk"):
        wl.load(ck)


@pytest.mark.parametrize("framework", ["numpy", pytest.param("torch", marks=needs_torch)])
def test_file_truncated_under_the_load_is_a_file_error_not_sigbus(tmp_path, framework, monkeypatch):
    """Owned copies are read with preadv: a checkpoint truncated while it loads ends in a short
    read, a FileError naming the file; a copy out of the mapping would have taken the process
    down with SIGBUS at the first missing page. The file is cut as soon as the first chunk has
    landed (one worker, 1 MiB chunks), so the next read runs past its end."""
    from weightlift.local import loader, mover

    monkeypatch.setattr(mover, "CHUNK", 1 << 20)
    rng = np.random.default_rng(5)
    tensors = [(f"t{i}", "F32", (256, 1024), rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()) for i in range(4)]
    path = write(tmp_path / "m.safetensors", tensors)
    cut = []

    def landed(file, offset, data, stable=True):
        if not cut:
            os.truncate(path, offset + len(data))
            cut.append(offset)

    with pytest.raises(FileError) as e:
        loader.load_local(path, LoadOptions(framework=framework, threads=1), on_landed=landed)
    assert cut and e.value.file == str(path)
    assert "ended" in str(e.value)


@pytest.mark.parametrize("helpers", ["0", "2"])
def test_cold_load_with_and_without_fault_helpers_same_bytes(tmp_path, monkeypatch, helpers):
    """Cold readers get helper threads faulting the arena in ahead of them (the fill policy's
    helper count; 0 turns them off): every chunk asks for its range first, and the bytes are the
    file's either way."""
    from weightlift.local import loader, mover
    from weightlift.memory import fresh

    asked: list[tuple[int, int]] = []

    class Counting(mover.Faulter):
        def ready(self, key, begin, end):
            asked.append((begin, end))
            return super().ready(key, begin, end)

    monkeypatch.setenv("WEIGHTLIFT_FAULT_HELPERS", helpers)
    fresh.reset_policy()
    monkeypatch.setattr(mover, "Faulter", Counting)
    monkeypatch.setattr(loader, "resident_fraction", lambda f: 0.0)
    monkeypatch.setattr(mover, "CHUNK", 1 << 20)
    rng = np.random.default_rng(4)
    tensors = [
        (f"w{i}", "U8", (5 * 2**19 + i,), rng.integers(0, 256, 5 * 2**19 + i, dtype=np.uint8).tobytes())
        for i in range(6)
    ]
    path = write(tmp_path / "cold.safetensors", tensors)
    try:
        out = wl.load(path, threads=2)
    finally:
        fresh.reset_policy()
    for name, _, _, raw in tensors:
        assert raw_bytes(out[name]) == raw
    total = sum(len(t[3]) for t in tensors)
    if helpers == "0":
        assert asked == []
    else:
        assert sum(e - b for b, e in asked) >= total  # every chunk asked for its range first


def test_prefetch_reads_cold_files_in_the_background_and_the_load_waits_for_it(tmp_path, monkeypatch):
    """prefetch() returns at once with a thread reading the cold files in; a load of them waits
    for it and reads nothing twice; a resident file is left alone; a bad path raises at once."""
    from weightlift.local import loader, prefetch

    rng = np.random.default_rng(6)
    tensors = [(f"t{i}", "U8", (1 << 20,), rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()) for i in range(4)]
    path = write(tmp_path / "m.safetensors", tensors)
    assert wl.prefetch(path).files == [] and wl.prefetch(path).done  # just written: resident
    read: list[list[str]] = []
    gate = __import__("threading").Event()
    real = prefetch.map_in

    def slow(regions, *, threads):
        gate.wait(10)  # held until the load has started, so it must wait
        read.append(sorted({f for _, _, f in regions}))
        assert sum(n for _, n, _ in regions) == 4 << 20  # the tensors' bytes, once
        return real(regions, threads=threads)

    monkeypatch.setattr(prefetch, "map_in", slow)
    monkeypatch.setattr(prefetch, "resident_fraction", lambda f, refresh=False: 0.0)
    monkeypatch.setattr(loader, "resident_fraction", lambda f, refresh=False: 0.0)
    job = wl.prefetch(path)
    assert job.files == [str(path)] and not job.done
    waited = []
    real_await = loader.await_prefetches
    monkeypatch.setattr(
        loader, "await_prefetches", lambda files: (waited.append(not job.done), gate.set(), real_await(files))
    )
    out = wl.load(path)
    assert waited == [True] and job.done and read == [[str(path)]]
    for name, _, _, raw in tensors:
        assert raw_bytes(out[name]) == raw
    job.wait()
    with pytest.raises(NotFoundError):
        wl.prefetch(tmp_path / "missing.safetensors")


def test_the_mover_stages_through_the_target_seam(tmp_path):
    """A target a memcpy cannot fill (a device, here a host stand-in) is filled only through its
    stager: each worker takes a private one, lands every chunk through it, and closes it."""
    from weightlift.local.mover import Mover
    from weightlift.memory.targets import WORKER_SLOT, HostTarget, Stager
    from weightlift.profile import Profiler

    stagers: list[Counting] = []

    class Counting(Stager):
        def __init__(self, target):
            super().__init__(target)
            self.landed = 0
            self.closed = False

        def land(self, dest, offset):
            self.landed += 1
            super().land(dest, offset)

        def close(self):
            self.closed = True

    class Staged(HostTarget):
        memcpy_ok = False

        def stager(self, spare=None, *, private=False):
            assert private  # one per worker
            stagers.append(Counting(self))
            return stagers[-1]

    rng = np.random.default_rng(8)
    tensors = [
        (f"w{i}", "U8", (WORKER_SLOT + 7 * i,), rng.integers(0, 256, WORKER_SLOT + 7 * i, dtype=np.uint8).tobytes())
        for i in range(3)
    ]
    path = write(tmp_path / "m.safetensors", tensors)
    ck = wl.open(path)
    seen = []
    mover = Mover(
        ck.tensors,
        Staged("numpy"),
        maps={f: ck.mapped(f) for f in ck.files},
        cast=None,
        threads=2,
        engine="auto",
        evict=False,
        cold={f: False for f in ck.files},
        warm=None,
        prof=Profiler(enabled=False),
        progress=None,
        on_landed=lambda f, o, d, stable=True: seen.append(stable),
    )
    out = mover.run()
    for name, _, _, raw in tensors:
        assert raw_bytes(out[name]) == raw
    assert stagers and all(s.closed for s in stagers)
    assert sum(s.landed for s in stagers) == len(seen) >= 3 and not any(seen)


def test_a_target_that_asks_for_alignment_gets_every_tensor_on_it(tmp_path, monkeypatch):
    """A device target asks that every tensor start on DEVICE_ALIGN, where the file (data at 8
    mod 16, as safetensors makes half of its files) would put them at 8 mod 16. The loader's
    real path, with a host target asking what a CUDA target asks."""
    from safetensors.numpy import load_file, save_file

    import weightlift.local.loader as loader_mod
    from weightlift.memory.targets import DEVICE_ALIGN, HostTarget

    rng = np.random.default_rng(0)
    tensors = {"w": rng.random((64, 64), dtype=np.float32), "b": rng.random(6, dtype=np.float32)}
    tensors["n"] = np.arange(1000, dtype=np.float16)
    for k in range(1, 40):
        path = tmp_path / "odd.safetensors"
        save_file({**tensors, "x" * k: np.ones(3, np.float64)}, str(path))
        if (8 + int.from_bytes(path.read_bytes()[:8], "little")) % 16 == 8:
            break

    class Aligned(HostTarget):
        align = DEVICE_ALIGN

        def arena(self, nbytes: int) -> np.ndarray:  # on DEVICE_ALIGN, as torch's allocator gives
            raw = super().arena(nbytes + DEVICE_ALIGN)
            skip = -raw.ctypes.data % DEVICE_ALIGN
            return raw[skip : skip + nbytes]

    monkeypatch.setattr(loader_mod, "target_for", lambda place: Aligned(place.framework))
    got = wl.load(path)
    want = load_file(str(path))
    assert sorted(got) == sorted(want)
    for name, arr in got.items():
        assert arr.ctypes.data % DEVICE_ALIGN == 0, (name, arr.ctypes.data % DEVICE_ALIGN)
        assert arr.tobytes() == want[name].tobytes(), name
