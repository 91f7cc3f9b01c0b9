"""``weightlift.hf.from_pretrained`` of a model folder in S3 (moto) or behind HTTP (nginx): the
same model, bit for bit, as from the local folder."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="weightlift.hf needs transformers (pip install -e '.[hf]')")

from tests.sources.conftest import BUCKET  # noqa: E402
from tests.test_hf import one_thread  # noqa: E402, F401  (autouse here too: one intra-op thread)
from weightlift import hf  # noqa: E402
from weightlift.errors import NotFoundError  # noqa: E402

PROMPT = torch.tensor([[1, 8, 15, 22, 29, 36, 43, 50]])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama saved by transformers in shards, with a generation config of its own."""
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        initializer_range=0.3,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.generation_config.max_new_tokens = 7
    model.generation_config.temperature = 0.5
    model.generation_config.do_sample = True
    root = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(root, max_shard_size="20KB")
    assert (root / "model.safetensors.index.json").exists() and (root / "generation_config.json").exists()
    return root


def _upload(client, folder, prefix: str) -> str:
    for p in folder.iterdir():
        client.upload_file(str(p), BUCKET, f"{prefix}/{p.name}")
    return f"s3://{BUCKET}/{prefix}/"


def _logits(model):
    with torch.inference_mode():
        return model(input_ids=PROMPT).logits


def _same_model(got, want) -> None:
    assert type(got) is type(want) and not got.training
    mine, theirs = got.state_dict(), want.state_dict()
    assert mine.keys() == theirs.keys()
    for k in theirs:
        assert mine[k].dtype == theirs[k].dtype, k
        assert torch.equal(mine[k].view(torch.uint8), theirs[k].view(torch.uint8)), k
    assert torch.equal(_logits(got), _logits(want))
    assert got.config.to_diff_dict() | {"_name_or_path": ""} == want.config.to_diff_dict() | {"_name_or_path": ""}
    assert got.generation_config.to_dict() == want.generation_config.to_dict()


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_from_s3_equals_the_local_folder(s3, folder, dtype):
    client, _ = s3
    url = _upload(client, folder, f"hf-{dtype}")
    model, info = hf.from_pretrained(url, dtype=dtype, output_loading_info=True)
    _same_model(model, hf.from_pretrained(folder, dtype=dtype))
    assert model.generation_config.max_new_tokens == 7
    assert info["weightlift"]["storage"] == "copies"
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert model.config.name_or_path == url
    # the shard index, named, is the same folder
    _same_model(hf.from_pretrained(url + "model.safetensors.index.json", dtype=dtype), model)


def test_from_s3_with_a_given_config_and_without_a_generation_config(s3, folder):
    client, _ = s3
    url = _upload(client, folder, "hf-noconfig")
    client.delete_object(Bucket=BUCKET, Key="hf-noconfig/config.json")
    client.delete_object(Bucket=BUCKET, Key="hf-noconfig/generation_config.json")
    with pytest.raises(NotFoundError, match="config.json"):
        hf.from_pretrained(url)
    model = hf.from_pretrained(url, config=folder)
    ref = hf.from_pretrained(folder)
    assert torch.equal(_logits(model), _logits(ref))
    assert model.generation_config.max_new_tokens != 7  # the folder's defaults: there was none to read


def test_from_s3_without_list_permission_a_missing_generation_config_is_absent(s3, folder, caplog):
    """S3 answers 403 for a missing key to a caller that may not list the bucket: the optional
    generation config is then taken as absent (logged at debug), a required file's 403 stays an
    error naming the object."""
    import logging

    from weightlift.errors import FileError

    client, proxy = s3
    url = _upload(client, folder, "hf-nolist")
    client.delete_object(Bucket=BUCKET, Key="hf-nolist/generation_config.json")
    proxy.faults.deny_missing = True
    with caplog.at_level(logging.DEBUG, logger="weightlift"):
        model = hf.from_pretrained(url)
    assert torch.equal(_logits(model), _logits(hf.from_pretrained(folder)))
    assert model.generation_config.max_new_tokens != 7  # none was read
    assert any("generation_config.json" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    client.delete_object(Bucket=BUCKET, Key="hf-nolist/config.json")
    with pytest.raises(FileError, match="access denied") as e:
        hf.from_pretrained(url)
    assert "hf-nolist/config.json" in str(e.value)


def test_verified_from_s3(s3, folder):
    from weightlift.digest.published import make_manifest

    client, _ = s3
    url = _upload(client, folder, "hf-verified")
    manifest = make_manifest(url)
    client.put_object(Bucket=BUCKET, Key="hf-verified/weightlift.manifest.json", Body=manifest.to_json().encode())
    _same_model(hf.from_pretrained(url, verify=True), hf.from_pretrained(folder))
    # a shard replaced by one with a damaged tensor: the load names it, no model comes back
    import weightlift as wl
    from weightlift.errors import IntegrityError

    t = wl.open(folder)["model.layers.1.mlp.up_proj.weight"]
    raw = bytearray(open(t.file, "rb").read())
    raw[t.offset : t.offset + 16] = bytes(b ^ 0xFF for b in raw[t.offset : t.offset + 16])
    client.put_object(Bucket=BUCKET, Key=f"hf-verified/{t.file.rsplit('/', 1)[-1]}", Body=bytes(raw))
    with pytest.raises(IntegrityError, match="model.layers.1.mlp.up_proj.weight"):
        hf.from_pretrained(url, verify=True)


def test_from_http_equals_the_local_folder(nginx, folder, monkeypatch):
    from weightlift.sources.store import forget_stores

    server, root = nginx
    monkeypatch.setenv("WEIGHTLIFT_SOURCE_PART", str(128 * 1024))
    forget_stores()
    shutil.copytree(folder, root / "hf-llama")
    for dtype in (None, torch.float16):
        _same_model(hf.from_pretrained(f"{server.url}/hf-llama/", dtype=dtype), hf.from_pretrained(folder, dtype=dtype))
