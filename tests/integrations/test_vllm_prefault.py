"""The parameters' memory faulted in while vLLM starts: the parts that need torch, not vLLM
(the engine's tokens with it: test_vllm.py)."""

from __future__ import annotations

import errno
import gc
import math
import multiprocessing
import os
import threading
from types import SimpleNamespace

import pytest

from tests.checkpoints import raw_bytes, write
from tests.waiting import wait_for
from weightlift import libc
from weightlift.integrations.vllm import prefault

torch = pytest.importorskip("torch")

BIG = 1 << 20  # over prefault.MIN_PARAMETER


@pytest.fixture(autouse=True)
def no_memory(monkeypatch):
    monkeypatch.delenv(prefault.ENV, raising=False)
    yield
    with prefault._lock:
        memory, prefault._memory = prefault._memory, None
    if memory is not None:
        memory.close()


def _checkpoint(tmp_path, nbytes: int):
    write(tmp_path / "model.safetensors", [("w", "U8", (nbytes,), bytes(nbytes))])
    return str(tmp_path)


def _faulted_in(tmp_path, nbytes: int):
    prefault.begin(_checkpoint(tmp_path, nbytes)).join()
    memory = prefault._memory
    assert memory is not None
    wait_for(lambda: memory.ready == memory.nbytes)
    return memory


def _mapped(addr: int) -> bool:
    try:
        libc.mincore(addr // 4096 * 4096, 4096)
    except OSError as e:
        assert e.errno == errno.ENOMEM
        return False
    return True


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.empty = torch.nn.Parameter(torch.empty(BIG // 2, dtype=torch.bfloat16), requires_grad=False)
        self.ones = torch.nn.Parameter(torch.ones(256, 1024), requires_grad=False)  # written at construction
        self.small = torch.nn.Parameter(torch.full((8,), 3.0), requires_grad=False)
        self.tied = self.ones  # one parameter under two names
        whole = torch.arange(2 * BIG // 4, dtype=torch.float32)
        self.part = torch.nn.Parameter(whole[BIG // 4 :], requires_grad=False)  # a view into a larger storage
        self.transposed = torch.nn.Parameter(torch.zeros(512, 1024).t(), requires_grad=False)


def test_parameters_move_into_the_faulted_memory_with_their_contents(tmp_path):
    memory = _faulted_in(tmp_path, 4 * BIG)
    lo, hi = memory._addr, memory._addr + memory.nbytes
    model = _Model()
    model.empty.data[100:200] = 7  # the rest of it never written
    before = {n: (raw_bytes(p.detach()), p.dtype, p.shape) for n, p in model.named_parameters()}
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}

    placed = prefault.place(model)

    assert placed == model.empty.nbytes + model.ones.nbytes
    for n, p in model.named_parameters():
        assert (raw_bytes(p.detach()), p.dtype, p.shape) == before[n], n  # byte for byte: garbage has NaNs
        inside = lo <= p.data_ptr() < hi
        assert inside == (n in ("empty", "ones")), n
        assert (p.data_ptr() == ptrs[n]) != inside, n
    assert model.tied is model.ones
    assert prefault._memory is None
    assert not _mapped(model.ones.data_ptr() + model.ones.nbytes + 4096)  # the rest given back
    model.ones.data.mul_(2)  # still a parameter's memory: writable
    assert float(model.tied.sum()) == 2 * 256 * 1024


def test_a_parameters_piece_goes_back_when_its_tensor_dies(tmp_path):
    _faulted_in(tmp_path, 4 * BIG)
    model = _Model()
    prefault.place(model)
    addr = model.ones.data_ptr()
    model.ones.data = torch.empty(0)  # as vLLM's CPU build does to a linear weight it repacked
    del model.tied
    gc.collect()
    assert not _mapped(addr)
    assert _mapped(model.empty.data_ptr())


def test_parameters_past_what_was_faulted_in_stay_where_they_were(tmp_path):
    memory = _faulted_in(tmp_path, BIG)  # room for `empty` (1 MiB), not `ones` after it
    model = _Model()
    ones = model.ones.data_ptr()
    assert prefault.place(model) == model.empty.nbytes
    assert memory._addr <= model.empty.data_ptr() < memory._addr + memory.nbytes
    assert model.ones.data_ptr() == ones and bool((model.ones == 1).all())


def test_without_faulted_memory_nothing_moves():
    model = _Model()
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert prefault.place(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_a_checkpoint_too_large_for_the_memory_available_gets_none(tmp_path, monkeypatch):
    monkeypatch.setattr(prefault.env, "available_memory", lambda field="MemAvailable": 1000)
    prefault.begin(_checkpoint(tmp_path, 4096)).join()
    assert prefault._memory is None


def test_the_memory_vllms_cpu_worker_wants_available_at_its_start_is_left_alone(tmp_path, monkeypatch):
    """Without a KV cache size, the CPU worker refuses to start where less than
    gpu_memory_utilization of the memory is available, before any parameter exists: memory
    faulted in ahead must leave that much."""
    folder = _checkpoint(tmp_path, BIG)
    sizes = {"MemAvailable": 100 * BIG, "MemTotal": 200 * BIG}
    monkeypatch.setattr(prefault.env, "available_memory", lambda field="MemAvailable": sizes[field])
    monkeypatch.setattr(prefault, "_one_memory_node", lambda: True)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    config = _config(backend="mp")
    config.cache_config = SimpleNamespace(kv_cache_memory_bytes=None, gpu_memory_utilization=0.495)
    prefault.arrange(config, folder, None)
    reserve = int(os.environ[prefault.ENV].split(":")[2])
    assert reserve == math.ceil(0.495 * 200 * BIG)
    prefault.begin(folder, 0, reserve).join()
    assert prefault._memory is None  # 100 BIG available, 99 BIG wanted: a model of 1.3 BIG won't fit
    prefault.begin(folder, 0, 90 * BIG).join()
    assert prefault._memory is not None
    config.cache_config.kv_cache_memory_bytes = 1 << 30  # the size given: no check at the start
    prefault.arrange(config, folder, None)
    assert os.environ[prefault.ENV].split(":")[2] == "0"


def _config(device="cpu", tp=1, pp=1, backend="uni", dtype=None):
    return SimpleNamespace(
        device_config=SimpleNamespace(device_type=device),
        model_config=SimpleNamespace(dtype=dtype),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend=backend
        ),
    )


@pytest.mark.parametrize(
    ("config", "option", "wanted"),
    [
        (_config(), None, True),
        (_config(), True, True),
        (_config(), False, False),
        (_config(device="cuda"), None, False),  # the parameters are not in host memory
        (_config(backend="mp"), None, True),  # one worker, in a process of its own
        (_config(tp=2, backend="mp"), None, False),  # each rank keeps slices
        (_config(pp=2, backend="mp"), None, False),
        (_config(backend="ray"), None, False),
    ],
)
def test_wanted_where_one_process_builds_the_whole_model_in_host_memory(config, option, wanted, monkeypatch):
    monkeypatch.setattr(prefault, "_one_memory_node", lambda: True)
    assert prefault.wanted(config, option) is wanted


def test_memory_on_several_nodes_is_not_faulted_in_ahead(monkeypatch):
    monkeypatch.setattr(prefault, "_one_memory_node", lambda: False)
    assert not prefault.wanted(_config(), None)


@pytest.mark.parametrize(
    ("backend", "builder"), [("uni", "EngineCore"), ("uni", "EngineCore_DP1"), ("mp", "VllmWorker-0")]
)
def test_the_process_that_builds_the_model_faults_in_what_was_arranged(tmp_path, monkeypatch, backend, builder):
    folder = _checkpoint(tmp_path, BIG)
    monkeypatch.setattr(prefault, "_one_memory_node", lambda: True)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    prefault.arrange(_config(backend=backend), folder, None)
    assert prefault._memory is None  # not in the process that built the configuration
    assert os.environ[prefault.ENV] == f"{builder.split('_')[0]}:0:0:{folder}"
    me = multiprocessing.current_process()
    for other in ("MainProcess", "ApiServer_0", "EngineCore" if backend == "mp" else "VllmWorker-0"):
        monkeypatch.setattr(me, "name", other)
        assert prefault.from_environment() is None  # left for the process it is for
        assert prefault.ENV in os.environ
    monkeypatch.setattr(me, "name", builder)
    thread = prefault.from_environment()
    assert thread is not None
    thread.join()
    assert prefault._memory is not None and prefault.ENV not in os.environ
    monkeypatch.setenv(prefault.ENV, f"{prefault.ENGINE_CORE}:0:0:{folder}")
    prefault.arrange(_config(tp=2, backend="mp"), folder, None)  # a later configuration clears it
    assert prefault.ENV not in os.environ


LLM_CLASS = SimpleNamespace(name="LLM_CLASS")  # vLLM's UsageContext.LLM_CLASS, as LLM(...) passes it


def test_an_engine_in_this_process_has_the_memory_faulted_in_here(tmp_path, monkeypatch):
    monkeypatch.setattr(prefault, "_one_memory_node", lambda: True)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    prefault.arrange(_config(), _checkpoint(tmp_path, BIG), None, LLM_CLASS)
    wait_for(lambda: prefault._memory is not None)
    assert prefault.ENV not in os.environ


def test_a_server_without_multiprocessing_still_has_its_engine_core_apart(tmp_path, monkeypatch):
    """vllm serve (AsyncLLM) runs its engine core in a process of its own whatever
    VLLM_ENABLE_V1_MULTIPROCESSING says: the memory is not faulted in by the server."""
    monkeypatch.setattr(prefault, "_one_memory_node", lambda: True)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    folder = _checkpoint(tmp_path, BIG)
    for context in (None, SimpleNamespace(name="OPENAI_API_SERVER"), SimpleNamespace(name="ENGINE_CONTEXT")):
        prefault.arrange(_config(), folder, None, context)
        assert os.environ[prefault.ENV] == f"{prefault.ENGINE_CORE}:0:0:{folder}"
    assert prefault._memory is None


def test_floating_point_tensors_are_sized_at_the_models_dtype(tmp_path, monkeypatch):
    """An F32 checkpoint loaded as bfloat16 needs half its size; integer tensors keep theirs."""
    n = 1 << 18
    write(tmp_path / "model.safetensors", [("f", "F32", (n,), bytes(4 * n)), ("q", "I32", (n,), bytes(4 * n))])
    prefault.begin(str(tmp_path), 2).join()
    memory = prefault._memory
    assert memory is not None
    assert 6 * n <= memory.nbytes <= 6 * n * 1.03 + 4096 * 70
    monkeypatch.setattr(prefault, "_one_memory_node", lambda: True)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    prefault.arrange(_config(backend="mp", dtype=torch.bfloat16), str(tmp_path), None)
    assert os.environ[prefault.ENV] == f"{prefault.WORKER}:2:0:{tmp_path}"


class _Aliased(torch.nn.Module):
    def __init__(self):
        super().__init__()
        w = torch.empty(BIG // 4)
        self.a = torch.nn.Parameter(w, requires_grad=False)
        self.b = torch.nn.Parameter(w, requires_grad=False)  # a second parameter on a's storage
        self.c = torch.nn.Parameter(torch.empty(BIG // 4), requires_grad=False)
        self.c_t = self.c.data.view(256, 1024).t()  # a plain tensor viewing c


def test_a_parameter_that_shares_its_storage_stays_where_it_is(tmp_path):
    _faulted_in(tmp_path, 4 * BIG)
    m = _Aliased()
    ptrs = (m.a.data_ptr(), m.c.data_ptr())
    assert prefault.place(m) == 0
    assert (m.a.data_ptr(), m.b.data_ptr(), m.c.data_ptr()) == (ptrs[0], ptrs[0], ptrs[1])
    m.c.data.fill_(2.0)
    assert bool((m.c_t == 2.0).all())


def test_memory_faulted_in_after_the_load_began_is_not_held(tmp_path, monkeypatch):
    folder = _checkpoint(tmp_path, 4 * BIG)
    real = prefault.open_checkpoint
    opened = threading.Event()
    go = threading.Event()

    def slow(f):
        opened.set()
        go.wait(10)
        return real(f)

    monkeypatch.setattr(prefault, "open_checkpoint", slow)
    thread = prefault.begin(folder)
    opened.wait(10)
    assert prefault.place(_Model()) == 0  # the load begins before the memory exists
    go.set()
    thread.join()
    assert prefault._memory is None


def test_with_the_option_off_the_memory_goes_back_unused(tmp_path):
    memory = _faulted_in(tmp_path, 4 * BIG)
    model = _Model()
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert prefault.place(model, use=False) == 0
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert not _mapped(memory._addr) and prefault._memory is None


def test_a_parameter_whose_memory_cannot_be_read_stays(tmp_path, monkeypatch):
    _faulted_in(tmp_path, 4 * BIG)

    def refuse(*a):
        raise OSError(11, "try again")

    monkeypatch.setattr(prefault.PageMap, "move_into", refuse)
    model = _Model()
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert prefault.place(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert bool((model.ones == 1).all())


def test_the_report_says_when_the_faulting_ran(tmp_path):
    _faulted_in(tmp_path, 4 * BIG)
    report: dict = {}
    prefault.place(_Model(), report)
    assert report["prefault_s"] >= 0 and report["prefault_lead_s"] >= 0
