"""weightlift.hf and ``weightlift check``: transformers models whose weights weightlift loaded.

Tiny random models written by transformers' own ``save_pretrained`` (sharded) are loaded both
ways; the logits must be bit-identical to transformers' own ``from_pretrained``, and the
parameters must be weightlift's tensors themselves, not copies of them.
"""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="weightlift.hf needs transformers (pip install -e '.[hf]')")

import weightlift as wl  # noqa: E402
from weightlift import hf  # noqa: E402
from weightlift.check import generate, run_check  # noqa: E402
from weightlift.cli import main  # noqa: E402
from weightlift.hf import conversions  # noqa: E402

SMALL = dict(vocab_size=256, max_position_embeddings=128, initializer_range=0.3)
LAYERS = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **SMALL)  # llama, mixtral and bert alike
PROMPT = torch.tensor([[1, 8, 15, 22, 29, 36, 43, 50]])


def _configs() -> dict:
    t = transformers
    return {
        # tied embeddings: lm_head.weight is not in the checkpoint
        "llama": (
            t.LlamaForCausalLM,
            t.LlamaConfig(intermediate_size=64, num_key_value_heads=2, tie_word_embeddings=True, **LAYERS),
        ),
        # experts saved one tensor each, merged into one tensor per layer on load
        "mixtral": (
            t.MixtralForCausalLM,
            t.MixtralConfig(
                intermediate_size=48, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **LAYERS
            ),
        ),
        "gpt2": (
            t.GPT2LMHeadModel,
            t.GPT2Config(
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=128,
                vocab_size=256,
                bos_token_id=0,
                eos_token_id=0,
                initializer_range=0.3,
            ),
        ),
        "bert": (
            t.BertForMaskedLM,
            t.BertConfig(intermediate_size=64, **LAYERS),
        ),
    }


ARCHS = ["llama", "mixtral", "gpt2", "bert"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Ops on models this small take microseconds; a second intra-op thread only waits for the
    first (five to ten times slower on a busy two-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each architecture saved by transformers in shards of at most 20 kB."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, (cls, cfg) in _configs().items():
        torch.manual_seed(0)
        cls(cfg).save_pretrained(root / name, max_shard_size="20KB")
        assert (root / name / "model.safetensors.index.json").exists()
        out[name] = root / name
    return out


def _reference(path, **kw):
    cls = hf.model_class_for(hf.load_config(path))
    return cls.from_pretrained(path, **kw)


def _logits(model, x=PROMPT):
    with torch.inference_mode():
        return model(input_ids=x.to(next(model.parameters()).device)).logits


def _copy(models, name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(models[name], dst)
    return dst


def _flip(path, name):
    """Flip every bit of the first 16 bytes of tensor ``name`` in its shard; returns the shard."""
    t = wl.open(path)[name]
    with open(t.file, "r+b") as f:
        f.seek(t.offset)
        raw = f.read(16)
        f.seek(t.offset)
        f.write(bytes(b ^ 0xFF for b in raw))
    return t.file


# -- from_pretrained -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_equal_transformers(models, arch):
    model, info = hf.from_pretrained(models[arch], output_loading_info=True)
    ref = _reference(models[arch])
    assert type(model) is type(ref)
    assert not model.training
    assert torch.equal(_logits(model), _logits(ref))
    mine, theirs = model.state_dict(), ref.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    # non-persistent buffers (rotary inv_freq, position ids) are materialised as transformers does
    bufs = dict(ref.named_buffers())
    for name, b in model.named_buffers():
        assert b.device.type == "cpu" and torch.equal(b, bufs[name]), name
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    # copies only where a conversion must build a new tensor: stacked experts; BERT's decoder bias,
    # which transformers re-pads when it ties it
    expected = {
        "llama": [],
        "gpt2": [],
        "mixtral": [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")],
        "bert": ["cls.predictions.bias"],
    }[arch]
    assert sorted(info["weightlift"]["copied"]) == sorted(expected)


def test_parameters_are_the_loaded_tensors(models):
    sd = wl.load(models["llama"], framework="torch")
    model = hf.from_state_dict(sd, models["llama"])
    params = dict(model.named_parameters())
    assert set(sd) == set(params)
    for name, t in sd.items():
        assert params[name].data_ptr() == t.data_ptr(), name
    # tied after loading: the head is the embedding, which is weightlift's tensor
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == sd["model.embed_tokens.weight"].data_ptr()


def test_views_of_the_mapping_with_copy_false(models):
    model, info = hf.from_pretrained(models["gpt2"], copy=False, output_loading_info=True)
    assert info["weightlift"]["copied"] == []
    assert torch.equal(_logits(model), _logits(_reference(models["gpt2"])))
    with pytest.raises(wl.OptionError, match="copy=False"):
        hf.from_pretrained(models["gpt2"], copy=False, dtype=torch.float16)  # a cast needs memory of its own


def test_default_is_a_private_mapping_that_writes_do_not_reach(models, tmp_path):
    """As transformers' own loader: parameters view the files copy-on-write, so they can be
    written (a fine-tune, a merged adapter) without touching the checkpoint."""
    path = _copy(models, "gpt2", tmp_path)
    files = sorted(path.glob("*.safetensors"))
    before = [f.read_bytes() for f in files]
    model, info = hf.from_pretrained(path, output_loading_info=True)
    assert info["weightlift"]["storage"] == "private mapping"
    assert info["weightlift"]["copied"] == [] and info["weightlift"]["load"]["tensors"] == len(wl.open(path))
    expected = _logits(_reference(path))
    assert torch.equal(_logits(model), expected)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert not torch.equal(_logits(model), expected)
    assert [f.read_bytes() for f in files] == before
    assert torch.equal(_logits(hf.from_pretrained(path)), expected)


def test_copy_true_parameters_own_their_memory(models, tmp_path):
    path = _copy(models, "llama", tmp_path)
    model, info = hf.from_pretrained(path, copy=True, output_loading_info=True)
    assert info["weightlift"]["storage"] == "copies" and info["weightlift"]["copied"] == []
    expected = _logits(_reference(path))
    _flip(path, "model.embed_tokens.weight")  # the file changes under a loaded model: its memory does not
    assert torch.equal(_logits(model), expected)


def test_a_cast_is_read_into_copies(models):
    _, info = hf.from_pretrained(models["llama"], dtype=torch.bfloat16, output_loading_info=True)
    assert info["weightlift"]["storage"] == "copies"


@pytest.mark.parametrize("copy", [None, True])
def test_the_reads_error_is_raised_from_the_callers_thread(models, copy):
    # the read runs on a thread of its own while the model is built; its errors come back here
    with pytest.raises(wl.OptionError, match="engine"):
        hf.from_pretrained(models["llama"], copy=copy, engine="bogus")


def test_lazy_conversion_table_is_transformers_table(monkeypatch):
    """The table built with re.compile deferred holds the same conversions as transformers' own
    build, each pattern compiled from the same text and flags; a deferred pattern deep-copies
    and pickles as the compiled one, and matches the same."""
    import copy
    import pickle
    import re

    from transformers import conversion_mapping as cm

    monkeypatch.setattr(cm, "_checkpoint_conversion_mapping_cache", None)
    conversions.lazy_conversion_table()
    lazy = cm._checkpoint_conversion_mapping_cache
    eager = cm._build_checkpoint_conversion_mapping()
    assert list(lazy) == list(eager)
    n = 0
    for key in eager:
        assert [type(t) for t in lazy[key]] == [type(t) for t in eager[key]]
        for a, b in zip(lazy[key], eager[key], strict=False):
            assert a.source_patterns == b.source_patterns and a.target_patterns == b.target_patterns
            if hasattr(b, "compiled_sources"):
                assert isinstance(a.compiled_sources, conversions.LazyPattern)
                assert (a.compiled_sources.pattern, a.compiled_sources.flags) == (
                    b.compiled_sources.pattern,
                    b.compiled_sources.flags,
                )
                n += 1
    assert n > 100
    p = next(t.compiled_sources for ts in lazy.values() for t in ts if hasattr(t, "compiled_sources"))
    assert copy.deepcopy(p) is p and isinstance(pickle.loads(pickle.dumps(p)), re.Pattern)
    # built once per process: a second call leaves the table alone
    conversions.lazy_conversion_table()
    assert cm._checkpoint_conversion_mapping_cache is lazy


def test_moe_experts_are_merged_like_transformers(models):
    sd = wl.load(models["mixtral"], framework="torch")
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in sd  # the saved, per-expert layout
    model, info = hf.from_state_dict(sd, models["mixtral"], output_loading_info=True)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[0] == 4
    assert torch.equal(
        experts.gate_up_proj[3, : experts.gate_up_proj.shape[1] // 2],
        sd["model.layers.0.block_sparse_moe.experts.3.w1.weight"],
    )
    assert (
        model.model.layers[0].mlp.gate.weight.data_ptr() == sd["model.layers.0.block_sparse_moe.gate.weight"].data_ptr()
    )
    assert info["unexpected_keys"] == set()


def test_dtype_cast_on_load_matches_transformers(models):
    model = hf.from_pretrained(models["llama"], dtype=torch.bfloat16)
    ref = _reference(models["llama"], dtype=torch.bfloat16)
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert torch.equal(_logits(model), _logits(ref))


def test_base_model_prefix_added_and_removed(tmp_path, models):
    t = transformers
    cfg = _configs()["llama"][1]
    torch.manual_seed(1)
    t.LlamaModel(cfg).save_pretrained(tmp_path / "base")  # keys without the "model." prefix
    for path, cls in ((tmp_path / "base", t.LlamaForCausalLM), (models["llama"], t.LlamaModel)):
        model, info = hf.from_pretrained(path, model_class=cls, output_loading_info=True)
        ref, ref_info = cls.from_pretrained(path, output_loading_info=True)
        for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
            assert info[k] == ref_info[k], k
        with torch.inference_mode():
            a, b = model(input_ids=PROMPT), ref(input_ids=PROMPT)
        key = "logits" if "logits" in a else "last_hidden_state"
        assert torch.equal(a[key], b[key])


def test_missing_and_unexpected_keys_reported_as_transformers_does(models):
    sd = dict(wl.load(models["gpt2"], framework="torch"))
    del sd["transformer.h.1.mlp.c_fc.weight"]
    sd["transformer.h.9.mlp.c_fc.weight"] = torch.zeros(3)
    model, info = hf.from_state_dict(sd, models["gpt2"], output_loading_info=True)
    cls = type(model)
    ref, ref_info = cls.from_pretrained(
        None, config=hf.load_config(models["gpt2"]), state_dict=sd, output_loading_info=True
    )
    assert info["missing_keys"] == {"transformer.h.1.mlp.c_fc.weight"} == ref_info["missing_keys"]
    assert info["unexpected_keys"] == {"transformer.h.9.mlp.c_fc.weight"} == ref_info["unexpected_keys"]
    assert model.transformer.h[1].mlp.c_fc.weight.device.type == "cpu"  # initialised, not left on meta


def test_user_errors(tmp_path, models, monkeypatch):
    with pytest.raises(wl.NotFoundError):
        hf.from_pretrained(tmp_path / "nothing")
    (tmp_path / "noconfig").mkdir()
    shutil.copy(models["llama"] / "model-00001-of-00006.safetensors", tmp_path / "noconfig" / "model.safetensors")
    with pytest.raises(wl.NotFoundError, match="config.json"):
        hf.from_pretrained(tmp_path / "noconfig")
    with pytest.raises(wl.OptionError, match="dtype"):
        hf.from_pretrained(models["llama"], dtype="int3")
    with pytest.raises(wl.OptionError, match="not a torch device"):
        hf.from_pretrained(models["llama"], device="gpu7")
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    with pytest.raises(wl.OptionError, match="weightlift\\[hf\\]"):
        hf.require_transformers()


# -- from_server -------------------------------------------------------------------------------------


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_from_server_shares_the_servers_tensors(models, framework):
    with wl.Server("127.0.0.1", 0, framework=framework) as srv:
        host, port = srv.address
        with wl.Client(f"{host}:{port}") as c:
            c.push(models["mixtral"])
        model, info = hf.from_server(srv, models["mixtral"], output_loading_info=True)
        held = srv.tensors()
        gate = "model.layers.1.block_sparse_moe.gate.weight"
        ptr = held[gate].data_ptr() if framework == "torch" else held[gate].ctypes.data
        assert model.model.layers[1].mlp.gate.weight.data_ptr() == ptr
        assert torch.equal(_logits(model), _logits(_reference(models["mixtral"])))
        remote, rinfo = hf.from_server(f"{host}:{port}", models["mixtral"], output_loading_info=True)
        assert rinfo["weightlift"]["pull"]["tensors"] == len(held)
        assert torch.equal(_logits(remote), _logits(model))
    assert info["unexpected_keys"] == set()


# -- weightlift check ------------------------------------------------------------------------------------


def test_generate_draws_only_from_its_generator(models):
    model = hf.from_pretrained(models["llama"])
    ids = PROMPT[0].tolist()

    def run(seed, global_seed):
        torch.manual_seed(global_seed)  # the process-wide generator must not matter
        g = torch.Generator().manual_seed(seed)
        return generate(model, ids, 8, temperature=1.0, generator=g)

    assert run(1, 0) == run(1, 123)
    assert run(1, 0) != run(2, 0)
    assert generate(model, ids, 8) == generate(_reference(models["llama"]), ids, 8)


@pytest.mark.parametrize("arch", ARCHS)
def test_check_passes_from_disk(models, arch, capsys):
    assert main(["check", str(models[arch]), "--tokens", "6", "--seeds", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "FAIL" not in out
    if arch != "bert":
        assert "6 tokens identical  blake3:" in out


def test_check_json_and_through_a_server(models, capsys):
    with wl.Server("127.0.0.1", 0) as srv:
        host, port = srv.address
        with wl.Client(f"{host}:{port}") as c:
            c.push(models["llama"])
        assert main(["check", str(models["llama"]), "--from", f"{host}:{port}", "--tokens", "5", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] and r["source"] == f"{host}:{port}"
    by = {c["name"]: c for c in r["checks"]}
    assert set(by) >= {"tensors", "logits", "greedy", "seed 1", "seed 2", "seed 3", "seeds"}
    assert by["greedy"]["data"]["tokens"] == by["greedy"]["data"]["reference"]
    assert len(by["greedy"]["data"]["tokens"]) == 5
    assert by["seed 1"]["data"]["tokens"] == by["seed 1"]["data"]["again"] != by["seed 2"]["data"]["tokens"]


def test_check_catches_a_corrupted_tensor_on_the_server(models, tmp_path, capsys):
    """The server holds weights with one tensor corrupted; the reference is the intact folder."""
    bad = _copy(models, "mixtral", tmp_path)
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    _flip(bad, name)
    with wl.Server("127.0.0.1", 0) as srv:
        host, port = srv.address
        with wl.Client(f"{host}:{port}") as c:
            c.push(bad)
        assert main(["check", str(models["mixtral"]), "--from", f"{host}:{port}", "--tokens", "4", "--json"]) == 1
    r = json.loads(capsys.readouterr().out)
    by = {c["name"]: c for c in r["checks"]}
    assert not r["ok"]
    # the merged expert tensor of layer 1 is the one parameter that differs, and the logits show it
    assert by["tensors"]["ok"] is False
    assert by["tensors"]["data"]["differ"] == ["model.layers.1.mlp.experts.down_proj"]
    assert by["logits"]["ok"] is False


def test_check_catches_a_file_corrupted_on_disk_by_its_published_manifest(models, tmp_path, capsys):
    """Both loaders read the same corrupt bytes, so only digests published beforehand can tell."""
    path = _copy(models, "llama", tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    _flip(path, name)
    # nothing published: weightlift and transformers agree on the corrupt bytes, and check cannot know
    assert main(["check", str(path), "--tokens", "2", "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    assert "no published manifest" in out and "nothing published to compare with" in out

    path = _copy(models, "llama", tmp_path / "published")
    assert main(["manifest", str(path)]) == 0  # published while the files are intact
    capsys.readouterr()
    assert main(["check", str(path), "--tokens", "2", "--seeds", "1"]) == 0
    assert "tensors read from the checkpoint against the published manifest" in capsys.readouterr().out
    _flip(path, name)
    # a verified load records the changed file's hashes in weightlift's cache; they are no proof
    with pytest.raises(wl.IntegrityError):
        wl.load(path, verify=True)
    wl.load(path)  # and the cache of hashes follows the file as it is now
    assert main(["check", str(path), "--tokens", "2", "--seeds", "1", "--json"]) == 1
    by = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert by["tensors"]["ok"] is True  # the two loaders agree...
    assert by["digests"]["ok"] is False and by["digests"]["data"]["differ"] == [name]  # ...the manifest does not
    assert by["digests"]["data"]["manifest"] == str(path / "weightlift.manifest.json")
    # a manifest named is checked against instead: one of the corrupt files passes it
    corrupt = str(tmp_path / "corrupt.json")
    assert main(["manifest", str(path), "-o", corrupt]) == 0
    capsys.readouterr()
    assert main(["check", str(path), "--tokens", "2", "--seeds", "1", "--manifest", corrupt]) == 0
    assert f"against the manifest {corrupt}" in capsys.readouterr().out


def test_from_pretrained_with_verify_says_what_it_checked_against(models, tmp_path, caplog):
    path = _copy(models, "llama", tmp_path)
    with caplog.at_level("INFO", logger="weightlift"):
        _, info = hf.from_pretrained(path, verify=True, output_loading_info=True)
    said = info["weightlift"]["load"]["verify"]
    assert said.startswith("no published manifest") and "verified" not in said
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [("weightlift.hf", "WARNING", said)]
    assert main(["manifest", str(path)]) == 0
    caplog.clear()
    with caplog.at_level("INFO", logger="weightlift"):
        _, info = hf.from_pretrained(path, verify=True, output_loading_info=True)
    said = info["weightlift"]["load"]["verify"]
    assert said.startswith(f"verified {info['weightlift']['load']['verified']} tensors against the published manifest")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("INFO", said)]


def test_check_ignores_weightlifts_own_cache_of_hashes(models, tmp_path, capsys):
    """Hashes weightlift recorded of a file after it changed say nothing about what was published."""
    from weightlift.digest.sidecar import hash_tensors

    path = _copy(models, "llama", tmp_path)
    _flip(path, "model.layers.0.mlp.up_proj.weight")
    hash_tensors(list(wl.open(path)), threshold=0)  # the cache of hashes, taken of the corrupt file
    assert main(["check", str(path), "--tokens", "2", "--seeds", "1", "--json"]) == 0
    by = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert by["digests"]["ok"] is None and "no published manifest" in by["digests"]["detail"]


def test_check_with_a_tokenizer(models, tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    path = _copy(models, "llama", tmp_path)
    words = ["[UNK]", "the", "quick", "brown", "fox"] + [f"w{i}" for i in range(251)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    r = run_check(str(path), prompt="the quick brown fox", tokens=4, seeds=(1, 2))
    assert r["ok"] and r["prompt"] == [1, 2, 3, 4]
    greedy = next(c for c in r["checks"] if c["name"] == "greedy")
    assert isinstance(greedy["data"]["text"], str) and greedy["data"]["text"]


def test_check_user_errors_exit_2(models, tmp_path, capsys):
    assert main(["check", str(tmp_path / "missing")]) == 2
    assert main(["check", str(models["llama"]), "--prompt", "hello"]) == 2
    assert "comma-separated token ids" in capsys.readouterr().err
    assert main(["check", str(models["llama"]), "--prompt", "1,999"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["check", str(models["llama"]), "--seeds", "1,x"])
    assert e.value.code == 2
    capsys.readouterr()
    with wl.Server("127.0.0.1", 0) as srv:  # started and closed: nothing listens there now
        port = srv.address[1]
    assert main(["check", str(models["llama"]), "--from", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("weightlift: error:")


# -- GPU ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_load_and_check(models, capsys):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, info = hf.from_pretrained(models["mixtral"], device="cuda", output_loading_info=True)
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert all(b.device.type == "cuda" for b in model.buffers())
    assert info["weightlift"]["shared"] == info["weightlift"]["parameters"] - 4  # all but the merged experts
    ref = _reference(models["mixtral"]).to("cuda")
    assert torch.equal(_logits(model), _logits(ref))
    assert main(["check", str(models["llama"]), "--device", "cuda", "--tokens", "4"]) == 0
    assert "PASS" in capsys.readouterr().out


# -- the demo's last step ---------------------------------------------------------------------------------


def test_demo_ends_with_the_check(tmp_path, monkeypatch, capsys):
    from weightlift.cli import demo

    monkeypatch.setenv("WEIGHTLIFT_CACHE", str(tmp_path))
    results = demo._demo_check(push=True)
    assert set(results) == {"disk", "server"} and all(r["ok"] for r in results.values())
    assert (tmp_path / demo.TINY_NAME / "config.json").exists()
    out = capsys.readouterr().out
    assert out.count("PASS") == 2 and "against the published manifest" in out
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    assert demo._demo_check(push=True) is None
    assert "model check: skipped (this needs transformers" in capsys.readouterr().out
