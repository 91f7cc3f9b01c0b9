"""Loads from a web server that honours Range (nginx) equal the local load byte for byte."""

from __future__ import annotations

import shutil
from urllib.parse import quote

import numpy as np
import pytest

import weightlift as wl
from tests.checkpoints import every_dtype, raw_bytes, write, write_sharded
from weightlift.errors import NotFoundError


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in b:
        assert raw_bytes(a[k]) == raw_bytes(b[k]), k


def _big(n: int) -> list:
    rng = np.random.default_rng(2)
    return [(f"layer.{i}.w", "F32", (64, 512), rng.random((64, 512), dtype=np.float32).tobytes()) for i in range(n)]


@pytest.fixture
def www(nginx, monkeypatch):
    from weightlift.sources.store import forget_stores

    monkeypatch.setenv("WEIGHTLIFT_SOURCE_PART", str(128 * 1024))
    forget_stores()
    return nginx


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_single_file(www, tmp_path, framework):
    if framework == "torch":
        pytest.importorskip("torch")
    server, root = www
    local = write(tmp_path / "m.safetensors", every_dtype() + _big(5))
    shutil.copy(local, root / f"single-{framework}.safetensors")
    _same(
        wl.load(f"{server.url}/single-{framework}.safetensors", framework=framework),
        wl.load(local, framework=framework),
    )


def test_a_name_with_a_space_is_encoded_once(www, tmp_path):
    """``%20`` in the URL is the space in the file's name (it was sent as ``%2520``: a 404)."""
    server, root = www
    local = write(tmp_path / "m.safetensors", _big(2))
    (root / "with space").mkdir()
    shutil.copy(local, root / "with space" / "a b+c.safetensors")
    _same(wl.load(f"{server.url}/with%20space/a%20b+c.safetensors"), wl.load(local))


def test_sharded_folder_and_selection(www, tmp_path):
    server, root = www
    idx = write_sharded(tmp_path / "sh", every_dtype() + _big(6), 2)
    shutil.copytree(tmp_path / "sh", root / "sharded")
    local = wl.load(idx)
    _same(wl.load(f"{server.url}/sharded/"), local)  # found as transformers would look for it
    _same(
        wl.load(f"{server.url}/sharded/model.safetensors.index.json", select="layer.*"),
        {k: v for k, v in local.items() if k.startswith("layer.")},
    )


def test_gguf(www, tmp_path):
    pytest.importorskip("gguf")
    from tests.gguf_files import write_sample

    server, root = www
    write_sample(root / "m.gguf")
    _same(wl.load(f"{server.url}/m.gguf"), wl.load(root / "m.gguf"))


def test_split_gguf(www, tmp_path):
    pytest.importorskip("gguf")
    from tests.gguf_files import write_split_sample

    server, root = www
    files = write_split_sample(tmp_path / "m.gguf", max_tensors=5)
    (root / "split").mkdir()
    for f in files:
        shutil.copy(f, root / "split" / f.name)
    ck = wl.open(f"{server.url}/split/{files[0].name}")
    assert ck.files == [f"{server.url}/split/{f.name}" for f in files]
    _same(wl.load(ck), wl.load(files[0]))


class _Ranges:
    """A proxy before the web server that adds up the bytes each ranged GET asks for."""

    def __init__(self, port: int):
        from tests.sources.servers import FaultProxy

        ranges = self.ranges = []

        class Counting(FaultProxy):
            def _decide(self, h, method):  # type: ignore[no-untyped-def]
                if method == "GET" and "Range" in h.headers:
                    first, last = h.headers["Range"].removeprefix("bytes=").split("-")
                    ranges.append(int(last) - int(first) + 1)
                return super()._decide(h, method)

        self.proxy = Counting(port)
        self.url = self.proxy.url

    def close(self) -> None:
        self.proxy.close()


def _sparse_gguf(path, head: bytes, size: int) -> None:
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)  # the rest reads as zeros and takes no disk


@pytest.mark.parametrize(
    ("head", "size", "match"),
    [
        # an unknown value type 70 bytes in: the file's fault, whatever follows it
        ("bad_type", 64 << 20, "unknown value type 99"),
        # an array of 400 MiB inside a 450 MiB object: more than a header may take here
        ("huge_array", 450 << 20, "needs more than"),
    ],
)
def test_a_broken_gguf_header_fails_after_a_small_prefix(www, tmp_path, head, size, match):
    pytest.importorskip("gguf")
    import struct

    from gguf.constants import GGUFValueType as V

    from tests.gguf_files import kv_str, pack, s
    from weightlift.errors import FormatError
    from weightlift.sources.objects import GGUF_FIRST

    kv = s("k") + (struct.pack("<I", 99) if head == "bad_type" else struct.pack("<IIQ", V.ARRAY, V.UINT64, 50 << 20))
    server, root = www
    _sparse_gguf(root / f"{head}.gguf", pack([kv_str("general.architecture", "x"), kv], []), size)
    counted = _Ranges(server.port)
    try:
        with pytest.raises(FormatError, match=match) as e:
            wl.open(f"{counted.url}/{head}.gguf")
        assert e.value.file == f"{counted.url}/{head}.gguf"
        assert sum(counted.ranges) <= GGUF_FIRST  # not the object, nor a prefix grown to the limit
    finally:
        counted.close()


def test_missing(www):
    server, _ = www
    for name in ("nope.safetensors", "nope"):  # a file: its 404, not an empty folder
        with pytest.raises(NotFoundError, match="no such file \\(the server answered 404") as e:
            wl.open(f"{server.url}/{name}")
        assert f"{server.url}/{name}:" in str(e.value) and "cannot be listed" not in str(e.value)
    with pytest.raises(NotFoundError, match="cannot be listed"):
        wl.open(f"{server.url}/empty-folder/")


def test_split_gguf_whose_name_is_percent_encoded(www, tmp_path):
    # the URL names the first split encoded; its siblings are found by the decoded name
    pytest.importorskip("gguf")
    from tests.gguf_files import write_split_sample

    server, root = www
    files = write_split_sample(tmp_path / "my model#1.gguf", max_tensors=5)
    (root / "spaced").mkdir()
    for f in files:
        shutil.copy(f, root / "spaced" / f.name)
    first = f"{server.url}/spaced/{quote(files[0].name)}"
    ck = wl.open(first)
    assert ck.files == [f"{server.url}/spaced/{quote(f.name)}" for f in files]
    _same(wl.load(ck), wl.load(files[0]))
