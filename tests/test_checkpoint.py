"""Opening checkpoints: how a folder and a shard index resolve, cross-checked with transformers'
``from_pretrained`` on the same folders where transformers and torch are installed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import weightlift as wl
from weightlift.checkpoint import open_checkpoint
from weightlift.errors import FormatError, NotFoundError

from .checkpoints import write

# -- a tiny model transformers can build offline ------------------------------------------------


def _gpt2_config():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    return transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8, tie_word_embeddings=False
    )


def _weights(cfg, shift: float = 0.0) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    return {k: v.detach().float().numpy().copy() + np.float32(shift) for k, v in model.state_dict().items()}


def _save(path: Path, weights: dict[str, np.ndarray]) -> None:
    write(path, [(k, "F32", v.shape, v.astype(np.float32).tobytes()) for k, v in weights.items()])


def _folder(tmp_path: Path, cfg, weights, *, shards: dict[str, list[str]], index: object) -> Path:  # type: ignore[no-untyped-def]
    d = tmp_path / "model"
    d.mkdir()
    cfg.save_pretrained(d)
    for file, names in shards.items():
        _save(d / file, {n: weights[n] for n in names})
    raw = index if isinstance(index, bytes) else json.dumps(index).encode()
    (d / "model.safetensors.index.json").write_bytes(raw)
    return d


def _halves(weights) -> tuple[dict[str, list[str]], dict[str, str]]:  # type: ignore[no-untyped-def]
    keys = list(weights)
    shards = {"a.safetensors": keys[: len(keys) // 2], "b.safetensors": keys[len(keys) // 2 :]}
    return shards, {k: f for f, ks in shards.items() for k in ks}


def _transformers(folder: Path) -> dict[str, np.ndarray]:
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def _same_as_transformers(folder: Path) -> dict[str, np.ndarray]:
    ours = wl.load(folder)
    theirs = _transformers(folder)
    assert set(ours) == set(theirs)
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    return ours


def test_sharded_folder_loads_as_transformers_does(tmp_path):
    cfg = _gpt2_config()
    w = _weights(cfg)
    shards, wm = _halves(w)
    d = _folder(tmp_path, cfg, w, shards=shards, index={"metadata": {}, "weight_map": wm})
    _same_as_transformers(d)


def test_tensor_missing_from_weight_map_is_loaded_as_transformers_does(tmp_path):
    cfg = _gpt2_config()
    w = _weights(cfg)
    shards, wm = _halves(w)
    omitted = shards["a.safetensors"][0]
    del wm[omitted]
    d = _folder(tmp_path, cfg, w, shards=shards, index={"metadata": {}, "weight_map": wm})
    ours = _same_as_transformers(d)
    np.testing.assert_array_equal(ours[omitted], w[omitted])
    assert omitted in open_checkpoint(d / "model.safetensors.index.json")


def test_single_file_beside_index_wins_as_in_transformers(tmp_path):
    cfg = _gpt2_config()
    w = _weights(cfg)
    shards, wm = _halves(w)
    d = _folder(tmp_path, cfg, w, shards=shards, index={"metadata": {}, "weight_map": wm})
    _save(d / "model.safetensors", _weights(cfg, shift=1.0))
    ours = _same_as_transformers(d)
    assert open_checkpoint(d).files == [str(d / "model.safetensors")]
    k = next(iter(w))
    np.testing.assert_array_equal(ours[k], w[k] + np.float32(1.0))


def test_tensor_in_two_shards_is_refused(tmp_path):
    cfg = _gpt2_config()
    w = _weights(cfg)
    shards, wm = _halves(w)
    dup = shards["a.safetensors"][0]
    shards["b.safetensors"].append(dup)
    d = _folder(tmp_path, cfg, w, shards=shards, index={"metadata": {}, "weight_map": wm})
    # a different copy in the later shard: transformers takes it, with no word
    _save(d / "b.safetensors", {**{n: w[n] for n in shards["b.safetensors"]}, dup: w[dup] + 100})
    np.testing.assert_array_equal(_transformers(d)[dup], w[dup] + 100)
    with pytest.raises(FormatError, match="two shards, 'a.safetensors' and 'b.safetensors'") as e:
        wl.open(d)
    assert dup in str(e.value) and "model.safetensors.index.json" in str(e.value)


def _refused_by_both(d: Path, match: str) -> None:
    with pytest.raises(Exception):  # noqa: B017 - transformers raises what json or dict access raise
        _transformers(d)
    with pytest.raises(FormatError, match=match) as e:
        wl.open(d)
    assert "model.safetensors.index.json" in str(e.value)


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16"])
def test_index_with_byte_order_mark_or_utf16_is_refused(tmp_path, encoding):
    cfg = _gpt2_config()
    w = _weights(cfg)
    shards, wm = _halves(w)
    raw = json.dumps({"metadata": {}, "weight_map": wm}).encode(encoding)
    d = _folder(tmp_path, cfg, w, shards=shards, index=raw)
    _refused_by_both(d, "byte-order mark")


@pytest.mark.parametrize("metadata", ["absent", None, [], "text", 3])
def test_index_without_metadata_object_is_refused(tmp_path, metadata):
    cfg = _gpt2_config()
    w = _weights(cfg)
    shards, wm = _halves(w)
    index: dict[str, object] = {"weight_map": wm}
    if metadata != "absent":
        index["metadata"] = metadata
    d = _folder(tmp_path, cfg, w, shards=shards, index=index)
    _refused_by_both(d, "metadata")


def test_index_with_empty_weight_map_is_refused(tmp_path):
    cfg = _gpt2_config()
    w = _weights(cfg)
    shards, _ = _halves(w)
    d = _folder(tmp_path, cfg, w, shards=shards, index={"metadata": {}, "weight_map": {}})
    _refused_by_both(d, "weight_map is empty")


# -- the same rules without transformers -------------------------------------------------------


def _tiny(path: Path, names: list[str]) -> None:
    write(path, [(n, "U8", (4,), bytes([i] * 4)) for i, n in enumerate(names)])


def _index(folder: Path, raw: object) -> Path:
    p = folder / "model.safetensors.index.json"
    p.write_bytes(raw if isinstance(raw, bytes) else json.dumps(raw).encode())
    return p


def test_index_rules_without_transformers(tmp_path):
    _tiny(tmp_path / "a.safetensors", ["x", "y"])
    _tiny(tmp_path / "b.safetensors", ["z"])
    good = {"metadata": {}, "weight_map": {"x": "a.safetensors", "z": "b.safetensors"}}
    ck = wl.open(_index(tmp_path, good))
    assert [t.name for t in ck] == ["x", "y", "z"]  # y is in a listed shard
    for bad, match in [
        (b"\xef\xbb\xbf" + json.dumps(good).encode(), "byte-order mark"),
        (json.dumps(good).encode("utf-16"), "byte-order mark"),
        (json.dumps(good).encode("utf-16-le"), "not valid JSON"),
        (b'{"metadata": {}, "weight_map": {"x": "a.safetensors"}, "k": "\xff"}', "not UTF-8"),
        ({"weight_map": good["weight_map"]}, "no metadata"),
        ({"metadata": None, "weight_map": good["weight_map"]}, "metadata that is NoneType"),
        ({"metadata": {}, "weight_map": {}}, "weight_map is empty"),
        ({"metadata": {}, "weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}, "it is in 'a.safetensors'"),
    ]:
        with pytest.raises(FormatError, match=match):
            wl.open(_index(tmp_path, bad))
    _tiny(tmp_path / "b.safetensors", ["z", "x"])
    with pytest.raises(FormatError, match="two shards") as e:
        wl.open(_index(tmp_path, good))
    assert "tensor 'x'" in str(e.value)


def test_folder_resolution(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    with pytest.raises(NotFoundError, match="holds no"):
        wl.open(d)
    _tiny(d / "one.safetensors", ["a"])
    assert wl.open(d).files == [str(d / "one.safetensors")]
    _tiny(d / "two.safetensors", ["b"])
    with pytest.raises(FormatError, match="one.safetensors, two.safetensors"):
        wl.open(d)
    _index(d, {"metadata": {}, "weight_map": {"a": "one.safetensors"}})
    assert wl.open(d).path == str(d / "model.safetensors.index.json")
    (d / "other.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"b": "two.safetensors"}})
    )
    assert wl.open(d).path == str(d / "model.safetensors.index.json")  # transformers' name first
    (d / "model.safetensors.index.json").unlink()
    assert wl.open(d).path == str(d / "other.safetensors.index.json")
    (d / "third.safetensors.index.json").write_text("{}")
    with pytest.raises(FormatError, match="other.safetensors.index.json, third.safetensors.index.json"):
        wl.open(d)


# -- split GGUF models, cross-checked with gguf's reader over every split -------------------------


def _reader_tensors(files: list[Path]) -> list[tuple[str, int, tuple[int, ...], bytes]]:
    from gguf import GGUFReader

    out = []
    for f in files:
        for rt in GGUFReader(f).tensors:
            shape = tuple(reversed(rt.shape.tolist()))
            out.append((rt.name, int(rt.tensor_type), shape, np.ascontiguousarray(rt.data).tobytes()))
    return out


def test_split_gguf_loads_as_one_model_from_its_first_file_or_folder(tmp_path, capsys):
    pytest.importorskip("gguf")
    from tests.checkpoints import raw_bytes
    from tests.gguf_files import SAMPLE_NAMES, write_split_sample
    from weightlift.cli import main
    from weightlift.digest.published import make_manifest, verify_checkpoint

    d = tmp_path / "model"
    d.mkdir()
    files = write_split_sample(d / "m.gguf", max_tensors=4)
    assert [f.name for f in files] == [f"m-0000{i}-of-00004.gguf" for i in range(1, 5)]
    expected = _reader_tensors(files)
    assert sorted(n for n, *_ in expected) == sorted(SAMPLE_NAMES)
    for path in (files[0], d):
        ck = wl.open(path)
        assert ck.path == str(files[0]) and ck.files == [str(f) for f in files]
        assert [(t.name, t.ggml_type, t.shape) for t in ck] == [e[:3] for e in expected]
        assert ck.metadata["test.string"] == "héllo"
        got = wl.load(path)
        assert list(got) == [e[0] for e in expected]
        for name, _type, _shape, raw in expected:
            assert raw_bytes(got[name]) == raw, name
    assert main(["inspect", str(d), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in shown["tensors"]] == [e[0] for e in expected]
    manifest = make_manifest(files[0])
    assert [e.name for e in manifest.entries] == [e[0] for e in expected]
    assert verify_checkpoint(d, manifest) == []
    last = wl.open(files[0]).tensors[-1]
    with open(last.file, "r+b") as f:  # a byte of the last split changes: verify sees it
        f.seek(last.offset)
        b = f.read(1)
        f.seek(last.offset)
        f.write(bytes([b[0] ^ 1]))
    assert verify_checkpoint(files[0], manifest) == [f"{last.name} (BLAKE3 differs)"]


def _broken_set(d: Path, *, count: int = 3, nos: tuple[int, ...] = (0, 1, 2), total: int | None = None,
                counts: tuple[int, ...] | None = None, extra: str | None = None) -> list[Path]:  # fmt: skip
    """``count`` splits of the sample model written by hand, their split keys as given."""
    from tests.gguf_files import SAMPLE_NAMES, write_split_file

    groups = [SAMPLE_NAMES[i::count] for i in range(count)]
    if extra is not None:
        groups[-1] = [*groups[-1], extra]
    files = []
    for i, names in enumerate(groups):
        keys = {
            "split.no": nos[i],
            "split.count": count if counts is None else counts[i],
            "split.tensors.count": len(SAMPLE_NAMES) if total is None else total,
        }
        files.append(d / f"m-{i + 1:05d}-of-{count:05d}.gguf")
        write_split_file(files[-1], names, keys)
    return files


def test_a_split_gguf_set_written_by_hand_loads_whole(tmp_path):
    pytest.importorskip("gguf")
    files = _broken_set(tmp_path)
    assert [t.name for t in wl.open(files[0])] == [e[0] for e in _reader_tensors(files)]


@pytest.mark.parametrize(
    "broken, error, match, culprit",
    [
        ({"counts": (3, 4, 3)}, FormatError, "split.count is 4, but m-00001-of-00003.gguf says 3", 1),
        ({"nos": (0, 2, 2)}, FormatError, "split.no is 2, but its name makes it split 1", 1),
        ({"total": 13}, FormatError, "split.tensors.count is 13, but its 3 splits hold 14 tensors", 0),
        ({"extra": "token_embd.weight"}, FormatError, "in two splits, m-00001-of-00003.gguf and m-00003", 2),
    ],
)
def test_a_broken_split_gguf_set_is_refused(tmp_path, broken, error, match, culprit):
    pytest.importorskip("gguf")
    files = _broken_set(tmp_path, **broken)
    for path in (files[0], tmp_path):
        with pytest.raises(error, match=match) as e:
            wl.open(path)
        assert e.value.file == str(files[culprit])
        with pytest.raises(error, match=match):
            wl.load(path)


def test_a_split_gguf_set_missing_a_split_is_refused(tmp_path):
    pytest.importorskip("gguf")
    files = _broken_set(tmp_path)
    files[1].unlink()
    for path in (files[0], tmp_path):
        with pytest.raises(NotFoundError, match="split 2 of 3, m-00002-of-00003.gguf, does not exist") as e:
            wl.open(path)
        assert e.value.file == str(files[0])
    other = tmp_path / "other"
    other.mkdir()
    _broken_set(other)[0].unlink()
    with pytest.raises(NotFoundError, match="not its first split, m-00001-of-00003.gguf"):
        wl.open(other)


def test_a_later_split_names_the_first(tmp_path):
    pytest.importorskip("gguf")
    files = _broken_set(tmp_path)
    with pytest.raises(FormatError, match=r"split 2 of 3 .* open its first split \(here m-00001-of-00003.gguf\)"):
        wl.open(files[1])
    renamed = tmp_path / "first.gguf"
    files[0].rename(renamed)
    with pytest.raises(FormatError, match="not named <prefix>-00001-of-00003.gguf"):
        wl.open(renamed)


@pytest.mark.parametrize("select", [3, 2.5, b"w.*", {"a": 1}])
def test_a_select_of_the_wrong_type_is_an_option_error(tmp_path, select):
    from tests.checkpoints import every_dtype, write
    from weightlift.checkpoint import open_checkpoint
    from weightlift.errors import OptionError

    ck = open_checkpoint(write(tmp_path / "m.safetensors", every_dtype()))
    with pytest.raises(OptionError, match="select: expected"):
        ck.select(select)


def test_a_file_named_as_a_split_without_split_keys_is_refused(tmp_path):
    # the first split lost its split keys (rewritten by a tool that drops them): alone, it is a
    # third of the model, which loads "fine" from it or from its folder unless refused
    pytest.importorskip("gguf")
    from tests.gguf_files import SAMPLE_NAMES, write_split_file

    files = _broken_set(tmp_path)
    write_split_file(files[0], SAMPLE_NAMES[0::3], {})
    for path in (files[0], tmp_path):
        with pytest.raises(FormatError, match="named as split 1 of 3 of a GGUF model, but its metadata") as e:
            wl.open(path)
        assert e.value.file == str(files[0])
    whole = tmp_path / "whole"
    whole.mkdir()
    write_split_file(whole / "m-00001-of-00001.gguf", SAMPLE_NAMES, {})  # one of one: a whole model
    assert len(wl.open(whole)) == len(SAMPLE_NAMES)
