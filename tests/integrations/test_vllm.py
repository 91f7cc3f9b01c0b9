"""weightlift in a real vLLM: the ``weightlift`` load format and weight-transfer engine.

These run where vLLM is importable (CI gives them an environment of their own with vLLM's CPU
build, see .ci/run); elsewhere they skip with the reason. Every model is a tiny one written by
transformers' ``save_pretrained`` here: a Llama-style decoder with tied embeddings, a Mixtral
mixture-of-experts decoder and a Qwen2 decoder (biased QKV, untied head). An engine start takes
seconds, so each test starts as few as it can.

The engines run their engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a core
of its own process, vLLM's default, costs a spawn and vLLM's imports again at every start (about
40 of the 45 s a start takes on two cores, against a few seconds here). The weight-transfer
engine and one start on a corrupted checkpoint keep the default, so that updates cross into an
engine process, and a loader's error reaches the user, as they do in service.
"""

from __future__ import annotations

import gc
import os
import socket

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI runs these in its vLLM environment)")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from weightlift import AuthError, Client, IntegrityError, OptionError, Server  # noqa: E402
from weightlift.digest.published import make_manifest  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: the models are tiny
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

try:
    from vllm.v1.engine.exceptions import EngineDeadError
except ImportError:  # another vLLM layout: no such exception to expect

    class EngineDeadError(Exception):  # type: ignore[no-redef]
        pass


PROMPTS = [[1, 5, 9, 22], [7, 7, 3], [100, 42, 17, 8, 250]]
TOKEN = "a token long enough for the weightlift server 0123456789"
ENGINE = dict(skip_tokenizer_init=True, enforce_eager=True, gpu_memory_utilization=0.05, max_model_len=128)


def _write(folder, arch: str, seed: int, **sizes) -> str:
    torch.manual_seed(seed)
    common = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        initializer_range=0.2,
    )
    common.update(sizes)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=True, **common))
    elif arch == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        model = transformers.MixtralForCausalLM(cfg)
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=False, **common))
    path = os.path.join(folder, f"{arch}-{seed}" + "".join(f"-{k}{v}" for k, v in sorted(sizes.items())))
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm-models")
    return {
        (arch, seed): _write(str(folder), arch, seed)
        for arch, seed in [("llama", 0), ("llama", 1), ("mixtral", 0), ("qwen2", 0)]
    }


def _start(model: str, *, own_process: bool = False, **kw):
    """An engine on ``model``; its engine core in a process of its own with ``own_process``."""
    vllm.envs.disable_envs_cache()  # an engine started here caches the environment it saw
    before = os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if own_process else before
    try:
        return vllm.LLM(model=model, **ENGINE, **kw)
    except BaseException:
        # a start that failed in this process leaves vLLM's process groups behind (a stopped
        # engine takes its own down), and the next engine would take them over
        from vllm.distributed import parallel_state

        parallel_state.cleanup_dist_env_and_memory()
        raise
    finally:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before


def _tokens(llm) -> list[list[int]]:
    params = vllm.SamplingParams(max_tokens=8, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _stop(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _run(model: str, *, own_process: bool = False, **kw) -> list[list[int]]:
    """Greedy tokens from a fresh engine on ``model``, the engine stopped again."""
    llm = _start(model, own_process=own_process, **kw)
    try:
        return _tokens(llm)
    finally:
        _stop(llm)


@pytest.fixture(scope="module")
def default_tokens(models):
    """vLLM's default loader's tokens, per model, each computed once."""
    cache: dict[tuple[str, int], list[list[int]]] = {}

    def get(key):
        if key not in cache:
            cache[key] = _run(models[key])
        return cache[key]

    return get


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen2"])
def test_load_format_gives_the_default_loaders_tokens(models, default_tokens, arch):
    assert _run(models[(arch, 0)], load_format="weightlift") == default_tokens((arch, 0))


class _Logged:
    """The lines vLLM's ``vllm.weightlift`` logger writes while in use: vLLM's loggers write to
    the stdout object they found at import and do not propagate, so neither capfd nor caplog
    sees what an engine in this process logs."""

    def __enter__(self) -> list[str]:
        import logging

        self.lines: list[str] = []
        self.handler = logging.Handler()
        self.handler.emit = lambda r: self.lines.append(r.getMessage())  # type: ignore[method-assign]
        logging.getLogger("vllm.weightlift").addHandler(self.handler)
        return self.lines

    def __exit__(self, *exc) -> None:
        import logging

        logging.getLogger("vllm.weightlift").removeHandler(self.handler)


def test_load_format_from_a_tensor_server(models, default_tokens, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    with Server(token=TOKEN) as server:
        server.start()
        host, port = server.address
        with Client((host, port), token=TOKEN) as c:
            c.push(os.path.join(models[("llama", 0)], "model.safetensors"), verify=True)
        extra = {"server": f"{host}:{port}", "token_file": str(token_file), "verify": True}
        got = _run(models[("llama", 0)], load_format="weightlift", model_loader_extra_config=extra)
    assert got == default_tokens(("llama", 0))


def _tensor_parallel(monkeypatch, ranks: int) -> dict:
    """The engine arguments for ``ranks`` tensor-parallel ranks, or a skip where this machine has
    too few cores (or devices). vLLM's CPU build binds each rank's OpenMP threads to cores of its
    own, and its automatic binding wants a NUMA node per rank: on a machine of one node the cores
    are given here, split in ``ranks`` contiguous groups."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < ranks:
            pytest.skip(f"{ranks} tensor-parallel ranks need {ranks} cores; this process may use {len(cpus)}")
        groups = [cpus[i * len(cpus) // ranks : (i + 1) * len(cpus) // ranks] for i in range(ranks)]
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, g)) for g in groups))
    elif torch.cuda.device_count() < ranks:
        pytest.skip(f"{ranks} tensor-parallel ranks need {ranks} devices; there are {torch.cuda.device_count()}")
    return dict(tensor_parallel_size=ranks, distributed_executor_backend="mp")


def test_tensor_parallel_load_gives_the_default_loaders_tokens(models, default_tokens, monkeypatch, capfd):
    # two ranks, each loading the whole checkpoint through its own weight loaders and keeping its
    # slices (the rows of the fused QKV and gate-up, the columns of o_proj and down_proj; the one
    # KV head replicated), from views of the files that nothing reads ahead
    tp = _tensor_parallel(monkeypatch, 2)
    path = models[("llama", 0)]
    try:
        want = _run(path, **tp)
    except Exception as e:  # RuntimeError from an engine process, a bare Exception from workers started here
        if "initialization failed" not in str(e):
            raise
        errors = [ln for ln in "".join(capfd.readouterr()).splitlines() if "Error" in ln]
        pytest.skip(f"vLLM here cannot run two tensor-parallel ranks: {errors[-1] if errors else 'no reason logged'}")
    assert _run(path, load_format="weightlift", **tp) == want
    assert want == default_tokens(("llama", 0))  # and the tokens of one rank


def test_verify_stops_the_engine_naming_the_corrupted_tensor(models, tmp_path, capfd):
    src = models[("qwen2", 0)]
    bad = tmp_path / "qwen2-bad"
    bad.mkdir()
    for name in os.listdir(src):
        (bad / name).write_bytes(open(os.path.join(src, name), "rb").read())
    manifest = tmp_path / "manifest.json"
    manifest.write_text(make_manifest(str(bad / "model.safetensors")).to_json())
    from weightlift.checkpoint import open_checkpoint

    victim = open_checkpoint(str(bad))["model.layers.1.mlp.down_proj.weight"]
    with open(bad / "model.safetensors", "r+b") as f:
        f.seek(victim.offset + 10)
        byte = f.read(1)
        f.seek(victim.offset + 10)
        f.write(bytes([byte[0] ^ 0x40]))
    extra = {"verify": True, "manifest": str(manifest)}
    with pytest.raises(IntegrityError, match="model.layers.1.mlp.down_proj.weight") as e:
        _run(str(bad), load_format="weightlift", model_loader_extra_config=extra)
    assert str(bad / "model.safetensors") in str(e.value) and "the engine does not start" in str(e.value)
    capfd.readouterr()
    # as vLLM runs by default, the engine core and its worker in processes of their own: the
    # engine fails to start, and the root cause its processes log to the stdout they share with
    # this one names the tensor and the file
    with pytest.raises(RuntimeError, match="initialization failed"):
        _run(str(bad), own_process=True, load_format="weightlift", model_loader_extra_config=extra)
    err = "".join(capfd.readouterr())
    assert "IntegrityError" in err and "model.layers.1.mlp.down_proj.weight" in err
    assert str(bad / "model.safetensors") in err


def test_verify_checks_against_the_manifest_published_beside_the_checkpoint(models, default_tokens, tmp_path):
    """A byte flipped after ``weightlift manifest``: the files' own digests would follow it; the
    published manifest beside them stops the engine, and the log names what was checked against."""
    from weightlift.checkpoint import open_checkpoint
    from weightlift.cli.main import main as cli

    src = models[("llama", 0)]
    folder = tmp_path / "llama-published"
    folder.mkdir()
    for name in os.listdir(src):
        (folder / name).write_bytes(open(os.path.join(src, name), "rb").read())
    assert cli(["manifest", str(folder)]) == 0
    published = str(folder / "weightlift.manifest.json")
    extra = {"verify": True}
    with _Logged() as lines:
        tokens = _run(str(folder), load_format="weightlift", model_loader_extra_config=extra)
    assert tokens == default_tokens(("llama", 0))
    out = "\n".join(lines)
    assert f"tensors against the published manifest {published}: every landed byte matches" in out
    victim = open_checkpoint(str(folder))["model.layers.1.mlp.down_proj.weight"]
    with open(folder / "model.safetensors", "r+b") as f:
        f.seek(victim.offset + 10)
        byte = f.read(1)
        f.seek(victim.offset + 10)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(IntegrityError, match="model.layers.1.mlp.down_proj.weight") as e:
        _run(str(folder), load_format="weightlift", model_loader_extra_config=extra)
    assert published in str(e.value) and "the engine does not start" in str(e.value)


def test_verify_without_a_published_manifest_says_so_in_the_log(models, default_tokens):
    path = models[("llama", 0)]
    with _Logged() as lines:
        tokens = _run(path, load_format="weightlift", model_loader_extra_config={"verify": True})
    assert tokens == default_tokens(("llama", 0))
    out = "\n".join(lines)
    assert "weightlift: no published manifest at " in out and "equal to the files as they are now" in out
    assert "every landed byte matches" not in out


def test_verify_passes_an_intact_checkpoint(models, default_tokens, tmp_path):
    path = models[("mixtral", 0)]
    manifest = tmp_path / "manifest.json"
    manifest.write_text(make_manifest(path).to_json())
    extra = {"verify": True, "manifest": str(manifest), "prefetch": True}
    assert _run(path, load_format="weightlift", model_loader_extra_config=extra) == default_tokens(("mixtral", 0))


def test_an_unknown_option_is_refused_naming_it(models):
    with pytest.raises(OptionError, match="no option 'prefetch_all'"):
        _start(models[("llama", 0)], load_format="weightlift", model_loader_extra_config={"prefetch_all": True})


def _evicted_copy(model: str, folder) -> str:
    """A copy of ``model``'s folder whose safetensors are out of the page cache (skips where the
    file system keeps them)."""
    import shutil

    from weightlift.disk import source

    path = shutil.copytree(model, folder / "cold")
    for n in os.listdir(path):
        if n.endswith(".safetensors"):
            f = os.path.join(path, n)
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
            source.evict(f)
            if source._probe(source.MappedFile(f)) > 0.5:
                pytest.skip("this file system keeps files in the page cache after POSIX_FADV_DONTNEED")
    return str(path)


def _resident(path: str) -> float:
    from weightlift.disk import source

    files = [os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors")]
    return min(source._probe(source.MappedFile(f)) for f in files)


def test_vllms_prefetch_strategy_reads_a_cold_checkpoint_ahead(models, default_tokens, tmp_path, monkeypatch):
    """vLLM's documented ``safetensors_load_strategy="prefetch"`` makes the load format start
    reading the cold files into the page cache before vLLM builds the model, and the load wait
    for it; without it nothing is read ahead; either way the tokens are the default loader's."""
    from weightlift.integrations.vllm import loader

    events: list[str] = []
    real_prefetch, real_load = loader.prefetch, loader.WeightliftModelLoader.load_weights

    def prefetch(ck, **kw):
        events.append(f"prefetch keep={kw.get('keep')}")
        return real_prefetch(ck, **kw)

    def load_weights(self, model, model_config):
        events.append("load_weights")
        return real_load(self, model, model_config)

    monkeypatch.setattr(loader, "prefetch", prefetch)
    monkeypatch.setattr(loader.WeightliftModelLoader, "load_weights", load_weights)
    path = _evicted_copy(models[("llama", 0)], tmp_path)
    assert _run(path, load_format="weightlift") == default_tokens(("llama", 0))
    assert events == ["load_weights"]
    events.clear()
    path = _evicted_copy(models[("llama", 0)], tmp_path / "again")
    tokens = _run(path, load_format="weightlift", safetensors_load_strategy="prefetch")
    assert tokens == default_tokens(("llama", 0))
    assert events == ["prefetch keep=False", "load_weights"] and _resident(path) >= 0.9


def _step(weights: dict, seed: int) -> dict:
    """A sparse training step on ``weights``: about 1 % of the elements of each matrix moved, and
    the final norm negated (so that greedy tokens surely change); the rest the same bytes."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in weights.items():
        w = w.clone()
        if name == "model.norm.weight":
            w = -w
        elif w.ndim == 2:
            flat = w.view(-1)
            hit = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=gen)
            flat[hit] += 0.05
        out[name] = w
    return out


@pytest.fixture(scope="module")
def trained(models, tmp_path_factory):
    """The trainer's weights in memory: llama-1's tensors and one sparse step on from them (also
    written as a checkpoint, for a fresh engine to compare with)."""
    from safetensors.torch import load_file, save_file

    first = load_file(os.path.join(models[("llama", 1)], "model.safetensors"))
    second = _step(first, 7)
    folder = tmp_path_factory.mktemp("vllm-step") / "llama-1-step"
    folder.mkdir()
    for name in os.listdir(models[("llama", 1)]):
        if name != "model.safetensors":
            (folder / name).write_bytes(open(os.path.join(models[("llama", 1)], name), "rb").read())
    save_file(second, str(folder / "model.safetensors"), metadata={"format": "pt"})
    models[("llama", "step")] = str(folder)
    return first, second


@pytest.fixture(scope="class")
def engine(models):
    """A running engine with the weightlift load format and weight-transfer backend."""
    port = _free_port()
    wt = {"backend": "weightlift"}
    llm = _start(models[("llama", 0)], own_process=True, load_format="weightlift", weight_transfer_config=wt)
    try:
        _tokens(llm)  # the first forward pass, in vLLM's own worker process
    except EngineDeadError:
        # On the AMX development VM vLLM 0.32's CPU worker process dies with SIGILL at its first
        # forward pass, the default loader and VLLM_PLUGINS=none included: the weights had loaded
        pytest.skip("vLLM's worker process died at its first forward pass (SIGILL on this CPU, without weightlift too)")
    llm.init_weight_transfer_engine({"init_info": {"port": port, "token": TOKEN}})
    yield llm, ("127.0.0.1", port)
    _stop(llm)


@pytest.fixture(scope="class")
def trainer(engine):
    """The trainer's client of the engine's server, keeping what it pushed as the next base."""
    with Client(engine[1], token=TOKEN, keep_base=True) as c:
        yield c


class TestWeightTransfer:
    """One engine, started with the ``weightlift`` load format and weight-transfer backend,
    taken through refused updates and real ones pushed from the trainer's memory, in order."""

    def _update(self, llm, **info) -> None:
        llm.start_weight_update()
        llm.update_weights({"update_info": info})
        llm.finish_weight_update()

    def test_loads_as_the_default_loader(self, engine, default_tokens):
        llm, _ = engine
        assert _tokens(llm) == default_tokens(("llama", 0))

    def test_a_push_with_a_wrong_token_is_refused_and_the_engine_serves_on(self, engine, trained, default_tokens):
        llm, address = engine
        with pytest.raises(AuthError):
            with Client(address, token="not the token, and long enough to be one 0123456789") as c:
                c.push(trained[0])
        assert _tokens(llm) == default_tokens(("llama", 0))

    def test_an_update_of_other_shapes_is_refused_and_the_engine_serves_on(self, engine, default_tokens):
        llm, address = engine
        with Client(address, token=TOKEN) as c:
            c.push({"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)})
            llm.start_weight_update()
            with pytest.raises(Exception, match="shapes differ|model.norm.weight"):
                llm.update_weights({"update_info": {}})
            c.free(["model.norm.weight"])
        assert _tokens(llm) == default_tokens(("llama", 0))

    def test_part_of_a_layer_is_refused_and_the_engine_serves_on(self, engine, trained, default_tokens):
        llm, address = engine
        name = "model.layers.0.self_attn.q_proj.weight"  # fused with k and v, which are not there
        with Client(address, token=TOKEN) as c:
            c.push({name: trained[0][name]})
            llm.start_weight_update()
            with pytest.raises(Exception, match="reloaded whole.*k_proj"):
                llm.update_weights({"update_info": {}})
            c.free([name])
        assert _tokens(llm) == default_tokens(("llama", 0))

    def test_an_update_from_memory_gives_a_fresh_engines_tokens(self, engine, trainer, trained, default_tokens):
        llm, _ = engine
        first = trainer.push(trained[0])
        self._update(llm)
        assert first.bytes_sent == sum(t.nbytes for t in trained[0].values()) and first.deltas == 0
        assert first.set_digest is not None  # the server's digest over the set, matched by the client
        fresh = default_tokens(("llama", 1))
        assert fresh != default_tokens(("llama", 0))
        assert _tokens(llm) == fresh

    def test_the_next_update_sends_what_changed(self, engine, trainer, trained, default_tokens):
        llm, _ = engine
        second = trained[1]
        step = trainer.push(second, in_place=True)  # the changes applied into the server's copy
        self._update(llm)
        assert step.deltas == len(second)  # every tensor against the version the server holds
        assert 0 < step.bytes_sent < sum(t.nbytes for t in second.values()) / 10
        fresh = default_tokens(("llama", "step"))
        assert fresh != default_tokens(("llama", 1))
        assert _tokens(llm) == fresh

    def test_a_released_copy_is_refilled_from_the_servers_cache(self, engine, trained, default_tokens):
        llm, address = engine
        second = trained[1]
        self._update(llm, release=True)  # the same weights again, then the server lets go of them
        with Client(address, token=TOKEN) as c:
            assert c.list() == []
            again = c.push(second, hash_threshold=0)  # a client without bases: each named by digest
        assert again.bytes_sent == 0 and again.cached == len(second)
        self._update(llm)
        assert _tokens(llm) == default_tokens(("llama", "step"))


def test_the_engines_init_info_keeps_its_token_out_of_its_repr():
    from weightlift.integrations.vllm.engine import WeightliftInitInfo

    info = WeightliftInitInfo(port=7, token=TOKEN)
    assert TOKEN not in repr(info) and TOKEN not in str(info) and "port=7" in repr(info)
    assert info.token == TOKEN
