"""The parameters' memory faulted in while vLLM starts (vLLM's CPU build).

vLLM builds a model's parameters empty (``torch.empty``: memory never touched) a moment before
the load format's ``load_weights``, and every weight loader's copy then pays the first touch of
the pages it writes, about half of a warm load on these machines (bench/RESULTS.md: 2026-12-02).
Both loaders pay it alike, so no load format that feeds vLLM's loaders gets under it by reading
faster. What does: the touch needs no bytes, only the size, so it can run while the engine's
start-up does the rest of its work, seconds before the load (it is still CPU work: the time to
first token gains it where the start-up leaves a core free).

So, where the parameters will be in this host's memory and one process loads the whole model
(tensor and pipeline parallel size 1), on a machine with one memory node (elsewhere the pages
would be faulted on a node the worker may not be bound to):

- :func:`arrange`, when the engine's configuration is built (:mod:`.early`), has the memory
  faulted in (:class:`weightlift.memory.prefaulted.Prefaulted`: the checkpoint's size, with
  floating-point tensors at the model's dtype, and a little more; on the cores the start-up
  leaves, at most 4 threads) in the process that will build the model: this one, where
  ``LLM(...)`` runs the engine core in-process with its worker; else the
  process vLLM spawns for it (the engine core, or on the CPU build, whose executor runs even
  one worker in a process of its own, that worker), which :func:`from_environment` (the
  plugin's ``register``, run there as it starts) recognises by its name and by :data:`ENV`,
  which the process that built the configuration set for its children;
- :func:`place`, at the start of ``load_weights``, moves each parameter alone on its storage
  (no other tensor views it) into a piece of that memory, its contents kept (the pages the
  model touched at construction, the norms' ones among them, are copied over; memory never
  touched reads as zeros in both), in order, as far as what is faulted in by then reaches; the
  rest stay where they were, and whatever is left of the memory is given back. Each piece is
  unmapped when the parameter's tensor dies (vLLM repacks linear weights after loading on this
  build, and frees the originals).

A memory never claimed (the engine failed before its load) is given back two minutes after it
was faulted in. ``prefault: false`` in the load format's options turns all of it off.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import threading
import time
from typing import Any

from weightlift import env
from weightlift.checkpoint import open_checkpoint
from weightlift.memory.prefaulted import PAGE, PageMap, Prefaulted

__all__ = [
    "ENV",
    "ENGINE_CORE",
    "WORKER",
    "MIN_PARAMETER",
    "MEMORY_SHARE",
    "arrange",
    "from_environment",
    "begin",
    "place",
    "wanted",
]

#: set by the process that built the configuration for the processes vLLM spawns next:
#: ``ROLE:ITEMSIZE:RESERVE:FOLDER``, the name of the one that builds the model, the model's
#: dtype's size, the memory to leave available (:func:`_reserve`), and the checkpoint's folder
ENV = "WEIGHTLIFT_VLLM_PREFAULT"
#: parameters smaller than this stay where they are (they come from the allocator's heap,
#: touched already, and a piece of their own would cost a mapping each)
MIN_PARAMETER = 256 << 10
#: the memory is faulted in only where the parameters take at most this share of the memory
#: available (they need it anyway; this leaves room for the engine's other allocations)
MEMORY_SHARE = 0.9
#: the names vLLM gives the process that builds the model: an engine core (``EngineCore``, or
#: ``EngineCore_DP<n>`` with data parallelism) running its one worker itself, or the worker
#: process of a multiprocess executor (rank 0, the only one where one process loads it all)
ENGINE_CORE, WORKER = "EngineCore", "VllmWorker-0"
_SLACK = 1.02  # parameters can be a little larger than their tensors (padded vocabularies)
_FLOATS = ("F64", "F32", "F16", "BF16")  # cast to the model's dtype as vLLM loads them

_lock = threading.Lock()
_memory: Prefaulted | None = None
_claims = 0  # place() calls so far: memory a begin() made after one of them is given back at once


def wanted(config: Any, prefault: bool | None) -> bool:
    """Whether the model of ``config`` (a ``VllmConfig``, load format ``weightlift``) gets its
    memory faulted in ahead: on by default (``prefault`` None) where its parameters are in host
    memory and one process loads the whole of it."""
    parallel = config.parallel_config
    return (
        prefault is not False
        and getattr(config.device_config, "device_type", None) == "cpu"
        and parallel.tensor_parallel_size * parallel.pipeline_parallel_size == 1
        and parallel.distributed_executor_backend in ("uni", "mp")
        and _one_memory_node()
    )


def arrange(config: Any, folder: str, prefault: bool | None, usage_context: Any = None) -> None:
    """Have ``folder``'s parameters faulted in ahead in the process that will build the model,
    where :func:`wanted` says so (and clear what an earlier configuration asked of children).
    ``usage_context`` is what vLLM's ``create_engine_config`` was given: only ``LLM(...)``
    (``LLM_CLASS``) runs the engine core in the calling process, and only with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; ``vllm serve``'s engine core has a process of its own."""
    os.environ.pop(ENV, None)
    if not wanted(config, prefault):
        return
    itemsize = _itemsize(getattr(config.model_config, "dtype", None))
    reserve = _reserve(config)
    if config.parallel_config.distributed_executor_backend == "mp":
        role = WORKER  # vLLM's CPU build runs even one worker so, where the engine core is a process
    elif _multiprocessing() or getattr(usage_context, "name", None) != "LLM_CLASS":
        role = ENGINE_CORE
    else:
        begin(folder, itemsize, reserve)
        return
    # the processes vLLM spawns next inherit it; one that is not named so leaves it alone (and
    # an engine core that turns out to run in this process after all gets nothing: no memory held)
    os.environ[ENV] = f"{role}:{itemsize}:{reserve}:{folder}"


def from_environment() -> threading.Thread | None:
    """In the process that :data:`ENV` names (its parent set it), start :func:`begin`."""
    value = os.environ.get(ENV, "")
    role, itemsize, reserve, folder = (value.split(":", 3) + ["", "", ""])[:4]
    name = multiprocessing.current_process().name
    if not folder or not (name == role or name.startswith(role + "_DP")):
        return None  # not the process that builds the model: leave it for that one
    del os.environ[ENV]
    # ASCII digits only: str.isdigit() takes '³', which int() refuses, and this runs in vLLM's
    # plugin hook, where nothing may raise
    if not all(n.isascii() and n.isdigit() for n in (itemsize, reserve)):
        logging.getLogger("vllm.weightlift").warning(
            "weightlift: %s=%r is malformed; no memory faulted in ahead", ENV, value
        )
        return None
    return begin(folder, int(itemsize), int(reserve))


def begin(folder: str, itemsize: int = 0, reserve: int = 0) -> threading.Thread:
    """Fault in memory for ``folder``'s parameters on a background thread: its tensors' size,
    floating-point ones at ``itemsize`` bytes an element (the model's dtype; 0: as stored). Best
    effort: a checkpoint that cannot be opened, or too large for the memory available (or for
    leaving ``reserve`` bytes of it available), gets none, and neither does a load that began
    before the memory was made."""
    with _lock:
        claims = _claims
    args = (folder, itemsize, reserve, claims)
    thread = threading.Thread(target=_begin, args=args, name="wl-vllm-prefault", daemon=True)
    thread.start()
    return thread


def _begin(folder: str, itemsize: int, reserve: int, claims: int) -> None:
    global _memory
    try:
        ck = open_checkpoint(folder)
        size = sum(_size(t, itemsize) for t in ck.tensors)
        size = int(size * _SLACK) + PAGE * (len(ck.tensors) + 64)  # each piece ends on a page
        available = env.available_memory()
        if available is not None and (size > MEMORY_SHARE * available or available - size < reserve):
            return
        if _claims != claims:
            return
        memory = Prefaulted(size, threads=max(1, min(4, env.cpus() - 1)))
    except Exception:  # noqa: BLE001 - the load goes on into the memory vLLM gave it
        return
    old: Prefaulted | None
    with _lock:
        if _claims != claims:
            old = memory  # the load began meanwhile: too late to be of use
        else:
            old, _memory = _memory, memory
    if old is not None:
        old.close()


def _reserve(config: Any) -> int:
    """The memory vLLM's CPU worker wants available as it starts, before any parameter exists:
    ``gpu_memory_utilization`` of the total, where the KV cache's size is not given
    (``VLLM_CPU_KVCACHE_SPACE``); memory faulted in ahead must not take it, or a start that would
    pass that check fails it."""
    cache = getattr(config, "cache_config", None)
    if cache is None or getattr(cache, "kv_cache_memory_bytes", None) is not None:
        return 0
    total = env.available_memory("MemTotal") or 0
    return math.ceil(total * float(getattr(cache, "gpu_memory_utilization", 0.0) or 0.0))


def _size(t: Any, itemsize: int) -> int:
    if itemsize and t.dtype in _FLOATS:
        return math.prod(t.shape) * itemsize
    return int(t.length)


def _itemsize(dtype: Any) -> int:
    return int(getattr(dtype, "itemsize", 0) or 0)


def _multiprocessing() -> bool:
    """vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING`` (on unless set to 0), as vLLM reads it."""
    try:
        from vllm import envs

        return bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING)
    except ImportError:
        try:
            return bool(int(os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")))
        except ValueError:
            return True


def place(model: Any, report: dict[str, Any] | None = None, *, use: bool = True) -> int:
    """Move ``model``'s parameters into the memory faulted in for it, as far as it reaches (the
    rest of it given back; all of it where ``use`` is false); returns the bytes moved (0 where
    none was faulted in). A parameter moves only where it is alone on its storage: a second
    parameter or a view sharing it would be left behind on the old memory. ``report`` gets
    ``prefault_s``, the seconds the faulting took (None: not done by now), and
    ``prefault_lead_s``, how long before this call it was done."""
    global _memory, _claims
    with _lock:
        memory, _memory, _claims = _memory, None, _claims + 1
    if memory is None:
        return 0
    if not use:
        memory.close()
        return 0
    if report is not None:
        done, now = memory.finished, time.monotonic()
        report["prefault_s"] = None if done is None else done - memory.started
        report["prefault_lead_s"] = None if done is None else now - done
    try:
        return _move(model, memory)
    finally:
        memory.close()


def _move(model: Any, memory: Prefaulted) -> int:
    import torch

    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return 0  # no way to tell a storage nobody else shares: nothing moves
    with PageMap() as pages:  # the parameters' memory is mapped already: one map for them all
        return _move_each(model, memory, pages, use_count)


def _move_each(model: Any, memory: Prefaulted, pages: PageMap, use_count: Any) -> int:
    import torch
    from torch.nn.parameter import UninitializedParameter

    placed = 0
    for p in model.parameters():
        if (
            isinstance(p, UninitializedParameter)
            or p.device.type != "cpu"
            or p.nbytes < MIN_PARAMETER
            or not p.is_contiguous()
            or p.storage_offset() != 0
            or p.untyped_storage().nbytes() != p.nbytes
            or use_count(p.untyped_storage()._cdata) != 2  # the parameter and the storage asked for
        ):
            continue
        piece = memory.take(p.nbytes)
        if piece is None:
            break  # the rest was not faulted in by now
        try:
            moved = torch.from_numpy(piece).view(p.dtype).view(p.shape)
            pages.move_into(p.data_ptr(), p.nbytes, piece)
        except (RuntimeError, TypeError, OSError):
            continue  # a dtype no byte view reaches, or memory that could not be read: it stays
        p.data = moved
        placed += p.nbytes
    return placed


def _one_memory_node() -> bool:
    """Whether this machine has one memory node (or says nothing of its nodes)."""
    try:
        with open("/sys/devices/system/node/has_memory") as f:
            nodes = f.read().strip()
    except OSError:
        return True
    return nodes.isdigit()
