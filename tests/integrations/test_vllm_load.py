"""The load format's file path without vLLM: the tensors it hands the weight loaders, in which
order, and which parts of the files it reads ahead (warm, cold, or per rank with ``touch=False``)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import save_file  # noqa: E402

from weightlift.checkpoint import open_checkpoint  # noqa: E402
from weightlift.integrations.vllm import streamed  # noqa: E402
from weightlift.integrations.vllm.streamed import RESIDENT, file_order, streamed_tensors  # noqa: E402


def _model(tmp_path):
    g = torch.Generator().manual_seed(0)
    shards = {
        "model-00001-of-00002.safetensors": {
            "model.embed_tokens.weight": torch.randn(64, 48, generator=g).to(torch.bfloat16),
            "model.layers.0.mlp.down_proj.weight": torch.randn(48, 96, generator=g).to(torch.bfloat16),
            "model.layers.0.input_layernorm.weight": torch.randn(48, generator=g),
        },
        "model-00002-of-00002.safetensors": {
            "model.layers.1.self_attn.q_proj.weight": torch.randn(48, 48, generator=g).to(torch.float16),
            "model.norm.weight": torch.randn(48, generator=g),
            "lm_head.empty": torch.zeros(0, 48),
        },
    }
    for name, tensors in shards.items():
        save_file(tensors, str(tmp_path / name))
    index = {"metadata": {}, "weight_map": {k: f for f, t in shards.items() for k in t}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return {k: v for t in shards.values() for k, v in t.items()}


def _equal(got, want):
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)
    assert got.view(torch.uint8).numpy().tobytes() == want.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("touch", [True, False])
@pytest.mark.parametrize("resident", [0.0, 1.0])
def test_every_tensor_exact_in_file_order(tmp_path, monkeypatch, touch, resident):
    want = _model(tmp_path)
    monkeypatch.setattr(streamed, "mapping_fraction", lambda addr, n: resident)
    ck = open_checkpoint(str(tmp_path))
    got = list(streamed_tensors(ck, threads=2, touch=touch))
    assert [n for n, _ in got] == file_order(ck)
    assert sorted(n for n, _ in got) == sorted(want)
    for name, t in got:
        _equal(t, want[name])
    # file order: the files in the checkpoint's order, each tensor by its offset in its file
    by = {t.name: t for t in ck.tensors}
    keys = [(ck.files.index(by[n].file), by[n].offset) for n, _ in got]
    assert keys == sorted(keys)


def _recorded(tmp_path, monkeypatch, fraction, *, touch=True):
    _model(tmp_path)
    mapped, advised = [], []
    real = streamed.map_in
    monkeypatch.setattr(streamed, "mapping_fraction", fraction)
    monkeypatch.setattr(
        streamed, "map_in", lambda regions, threads: mapped.extend(regions) or real(regions, threads=threads)
    )
    monkeypatch.setattr(streamed, "_read_ahead", lambda fd, offset, n: advised.append((offset, n)))
    ck = open_checkpoint(str(tmp_path))
    got = dict(streamed_tensors(ck, threads=2, touch=touch))
    assert len(got) == len(ck.tensors)
    return ck, mapped, advised


def test_a_cold_file_is_mapped_in_whole(tmp_path, monkeypatch):
    ck, mapped, advised = _recorded(tmp_path, monkeypatch, lambda addr, n: 0.0)
    assert sorted(f for _, _, f in mapped) == sorted(ck.files)
    assert sum(n for _, n, _ in mapped) == sum(ck.mapped(f).size for f in ck.files)
    assert advised == []


def test_a_mostly_resident_file_gets_no_pass_only_read_ahead(tmp_path, monkeypatch):
    ck, mapped, advised = _recorded(tmp_path, monkeypatch, lambda addr, n: RESIDENT)
    assert mapped == []
    assert sorted(advised) == sorted((0, ck.mapped(f).size) for f in ck.files)


def test_without_touch_nothing_is_read_ahead(tmp_path, monkeypatch):
    asked = []
    _, mapped, advised = _recorded(tmp_path, monkeypatch, lambda addr, n: asked.append(n) or 0.0, touch=False)
    assert (mapped, advised, asked) == ([], [], [])


def test_the_loaders_copies_see_the_files_bytes_and_leave_them_alone(tmp_path):
    want = _model(tmp_path)
    ck = open_checkpoint(str(tmp_path))
    before = {f: open(f, "rb").read() for f in ck.files}
    for name, t in streamed_tensors(ck, threads=1):
        dst = torch.empty_like(t)
        dst.copy_(t)
        _equal(dst, want[name])
        if t.numel():
            t.view(torch.uint8).fill_(0)  # a private mapping: the file is not written
    assert {f: open(f, "rb").read() for f in ck.files} == before


def test_a_large_mappings_residency_is_judged_from_windows_spread_over_it(monkeypatch):
    asked = []
    base, n = 1 << 30, 1000 * streamed.PROBES * streamed.PROBE + 12345
    half = base + n // 2

    def fraction(addr, size):
        asked.append((addr, size))
        return 1.0 if addr < half else 0.0  # read in up to the middle

    monkeypatch.setattr(streamed, "mapping_fraction", fraction)
    assert abs(streamed.resident_fraction(base, n) - 0.5) <= 1 / streamed.PROBES  # within one window
    assert len(asked) == streamed.PROBES
    assert all(size == streamed.PROBE and (addr - base) % streamed.PAGE == 0 for addr, size in asked)
    assert asked[0][0] == base and asked[-1][0] + streamed.PROBE <= base + n
    gaps = {b - a for (a, _), (b, _) in zip(asked[:-1], asked[1:], strict=True)}
    assert len(gaps) == 1 and gaps.pop() >= n // streamed.PROBES - streamed.PAGE


def test_a_small_mapping_is_asked_about_every_page(monkeypatch):
    asked = []
    monkeypatch.setattr(streamed, "mapping_fraction", lambda addr, size: asked.append((addr, size)) or 0.25)
    assert streamed.resident_fraction(4096, streamed.PROBES * streamed.PROBE) == 0.25
    assert asked == [(4096, streamed.PROBES * streamed.PROBE)]


def test_a_file_just_written_is_judged_resident(tmp_path):
    path = tmp_path / "blob"
    n = 3 * streamed.PROBES * streamed.PROBE + 100
    path.write_bytes(bytes(range(256)) * (n // 256) + b"x" * (n % 256))
    st = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=n)
    assert streamed.resident_fraction(st.data_ptr(), n) == 1.0
