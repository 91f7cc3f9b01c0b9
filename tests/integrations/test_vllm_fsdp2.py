"""examples/fsdp2_to_vllm.py, run small: two FSDP2 trainer processes (gloo) sync into a running
vLLM engine after each step through the weight-transfer engine's sharded receiver, each rank
sending only the bytes it owns; the updated engine's greedy tokens equal a fresh engine's on
the trainer's saved weights. Skips where vLLM is not installed (CI runs it in its vLLM
environment), and like TestWeightTransfer where vLLM's worker dies at its first forward pass."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI runs these in its vLLM environment)")
pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from weightlift import OptionError  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

try:
    from vllm.v1.engine.exceptions import EngineDeadError
except ImportError:  # another vLLM layout: no such exception to expect

    class EngineDeadError(Exception):  # type: ignore[no-redef]
        pass


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(EXAMPLES))  # the trainers are spawned: they import it by name too
    try:
        import fsdp2_to_vllm

        yield fsdp2_to_vllm
    finally:
        sys.path.remove(str(EXAMPLES))


def test_two_fsdp2_ranks_sync_into_a_running_engine_as_a_fresh_one_loads(example, tmp_path):
    model = example.write_tiny_llama(str(tmp_path / "llama"))
    try:
        r = example.run(model, str(tmp_path / "trained"), steps=2, ranks=2, freeze=1)
    except EngineDeadError:
        pytest.skip("vLLM's worker died at its first forward pass (SIGILL on this CPU, without weightlift too)")
    assert r.updated != r.before  # the steps changed what the engine serves
    assert r.updated == r.fresh
    assert [s["rank"] for s in r.ranks] == [0, 1]
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "trained" / "model.safetensors"))
    before = load_file(str(tmp_path / "llama" / "model.safetensors"))
    frozen = {k for k in saved if k.startswith("model.layers.0.")}
    assert frozen and all(torch.equal(saved[k], before[k]) for k in frozen)
    changed = sum(t.nbytes for k, t in saved.items() if k not in frozen)
    assert changed == r.model_bytes - sum(saved[k].nbytes for k in frozen)
    for step in range(2):
        # every byte of every changed tensor once, none of the frozen layer's; each rank exactly
        # the bytes of its own shards of them (FSDP2's dim-0 halves)
        assert sum(s["bytes_sent"][step] for s in r.ranks) == changed
        for s in r.ranks:
            assert s["tensors"][step] == len(saved) - len(frozen)
            assert s["bytes_sent"][step] == s["owned"][step] < changed


@pytest.mark.skipif(
    os.environ.get("WEIGHTLIFT_VLLM_TP2") != "1",
    reason="an engine of tensor parallel 2 takes about a minute here: WEIGHTLIFT_VLLM_TP2=1 runs it",
)
def test_each_worker_of_tensor_parallel_2_gets_its_slices_from_every_rank(example, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # the example binds it: unset again after
    model = example.write_tiny_llama(str(tmp_path / "llama"))
    try:
        r = example.run(model, str(tmp_path / "trained"), steps=1, ranks=2, freeze=0, tp=2)
    except EngineDeadError:
        pytest.skip("vLLM's worker died at its first forward pass (SIGILL on this CPU, without weightlift too)")
    assert r.updated != r.before and r.updated == r.fresh
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "trained" / "model.safetensors"))
    # split tensors reach the worker holding each slice once; the norms and the one KV head
    # (vLLM replicates it over both workers) reach both
    both = sum(t.nbytes for k, t in saved.items() if k.endswith("norm.weight") or ".k_proj." in k or ".v_proj." in k)
    assert sum(s["bytes_sent"][0] for s in r.ranks) == r.model_bytes + both


def test_the_engines_sharded_receiver_is_opt_in_and_refuses_pipeline_parallelism():
    from weightlift.integrations.vllm.engine import WeightliftInitInfo
    from weightlift.integrations.vllm.sharded import receiver_shard

    assert WeightliftInitInfo().sharded is False  # today's unsharded server unless asked
    one = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    shard = receiver_shard(one, model=None)
    assert (shard.rank, shard.world) == (0, 1)
    pp = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=2))
    with pytest.raises(OptionError, match="pipeline parallelism"):
        receiver_shard(pp, model=None)


def test_a_held_slice_is_staged_at_its_place_in_the_checkpoints_shape():
    from weightlift import Shard
    from weightlift.integrations.vllm.sharded import staged

    shard = Shard({"*.q_proj.*": 0, "*.o_proj.*": 1}, rank=1, world=2)
    q, o, norm = torch.arange(12.0).reshape(2, 6), torch.arange(12.0).reshape(4, 3), torch.ones(6)
    shapes = {"l.q_proj.weight": (4, 6), "l.o_proj.weight": (4, 6), "l.norm.weight": (6,)}
    out = staged({"l.q_proj.weight": q, "l.o_proj.weight": o, "l.norm.weight": norm}, shard, shapes)
    assert torch.equal(out["l.q_proj.weight"][2:], q) and not out["l.q_proj.weight"][:2].any()
    assert torch.equal(out["l.o_proj.weight"][:, 3:], o) and not out["l.o_proj.weight"][:, :3].any()
    assert out["l.norm.weight"] is norm  # held whole: as it is
    whole = {"l.q_proj.weight": torch.zeros(4, 6)}
    assert staged(whole, Shard((), rank=0, world=1), shapes) is whole  # tensor parallel 1: untouched
