"""The parameters' memory faulted in while vLLM starts (vLLM's CPU build).

vLLM builds a model's parameters empty (``torch.empty``: memory never touched) a moment before
the load format's ``load_weights``, and every weight loader's copy then pays the first touch of
the pages it writes, about half of a warm load on these machines (bench/RESULTS.md: 2026-12-02).
Both loaders pay it alike, so no load format that feeds vLLM's loaders gets under it by reading
faster. What does: the touch needs no bytes, only the size, and the engine's start-up leaves a
core idle for seconds before the load (it is mostly one thread importing and building).

So, where the parameters will be in this host's memory and one process loads the whole model
(tensor and pipeline parallel size 1, vLLM's one-process executor), on a machine with one
memory node (elsewhere the pages would be faulted on a node the worker may not be bound to):

- :func:`arrange`, when the engine's configuration is built (:mod:`.early`), has the memory
  faulted in (:class:`weightlift.memory.prefaulted.Prefaulted`, the checkpoint's size and a
  little more, on the cores the start-up leaves, at most 4 threads) in the process that will
  build the model: this one, where the engine core runs in-process with its worker; else the
  process vLLM spawns for it (the engine core, or on the CPU build, whose executor runs even
  one worker in a process of its own, that worker), which :func:`from_environment` (the
  plugin's ``register``, run there as it starts) recognises by its name and by :data:`ENV`,
  which the process that built the configuration set for its children;
- :func:`place`, at the start of ``load_weights``, moves each parameter that owns its storage
  into a piece of that memory (its contents kept: what the model wrote at construction, the
  norms' ones, is copied over; memory never written reads as zeros in both), in order, as far
  as what is faulted in by then reaches; the rest stay where they were, and whatever is left of
  the memory is given back. Each piece is unmapped when the parameter's tensor dies (vLLM
  repacks linear weights after loading on this build, and frees the originals).

A memory never claimed (the engine failed before its load) is given back two minutes after it
was faulted in. ``prefault: false`` in the load format's options turns all of it off.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Any

from weightlift import env
from weightlift.checkpoint import open_checkpoint
from weightlift.memory.prefaulted import PAGE, Prefaulted, move_into, swapped_out

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

#: set by the process that built the configuration for the engine-core process it spawns: the
#: checkpoint's folder
ENV = "WEIGHTLIFT_VLLM_PREFAULT"
#: parameters smaller than this stay where they are (they come from the allocator's heap,
#: touched already, and a piece of their own would cost a mapping each)
MIN_PARAMETER = 256 << 10
#: the memory is faulted in only where the checkpoint takes at most this share of the memory
#: available (the parameters need it anyway; this leaves room for the engine's other allocations)
MEMORY_SHARE = 0.9
#: the names vLLM gives the process that builds the model: an engine core (``EngineCore``, or
#: ``EngineCore_DP<n>`` with data parallelism) running its one worker itself, or the worker
#: process of a multiprocess executor (rank 0, the only one where one process loads it all)
ENGINE_CORE, WORKER = "EngineCore", "VllmWorker-0"
_SLACK = 1.02  # parameters can be a little larger than their tensors (padded vocabularies)

_lock = threading.Lock()
_memory: Prefaulted | None = None


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


def arrange(config: Any, folder: str, prefault: bool | None) -> None:
    """Have ``folder``'s parameters faulted in ahead in the process that will build the model,
    where :func:`wanted` says so (and clear what an earlier configuration asked of children)."""
    os.environ.pop(ENV, None)
    if not wanted(config, prefault):
        return
    if config.parallel_config.distributed_executor_backend == "mp":
        role = WORKER  # vLLM's CPU build runs even one worker so, where the engine core is a process
    elif os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":  # as vllm.envs reads it
        role = ENGINE_CORE
    else:
        begin(folder)
        return
    os.environ[ENV] = f"{role}:{folder}"  # the processes vLLM spawns next inherit it


def from_environment() -> threading.Thread | None:
    """In the process that :data:`ENV` names (its parent set it), start :func:`begin`."""
    role, _, folder = os.environ.get(ENV, "").partition(":")
    name = multiprocessing.current_process().name
    if not folder or not (name == role or name.startswith(role + "_DP")):
        return None  # not the process that builds the model: leave it for that one
    del os.environ[ENV]
    return begin(folder)


def begin(folder: str) -> threading.Thread:
    """Fault in memory for ``folder``'s checkpoint on a background thread (best effort: a
    checkpoint that cannot be opened, or too large for the memory available, gets none)."""
    thread = threading.Thread(target=_begin, args=(folder,), name="wl-vllm-prefault", daemon=True)
    thread.start()
    return thread


def _begin(folder: str) -> None:
    global _memory
    try:
        ck = open_checkpoint(folder)
        available = env.available_memory()
        if available is not None and ck.nbytes > MEMORY_SHARE * available:
            return
        size = int(ck.nbytes * _SLACK) + PAGE * (len(ck.tensors) + 64)  # each piece ends on a page
        memory = Prefaulted(size, threads=max(1, min(4, env.cpus() - 1)))
    except Exception:  # noqa: BLE001 - the load goes on into the memory vLLM gave it
        return
    with _lock:
        old, _memory = _memory, memory
    if old is not None:
        old.close()


def place(model: Any) -> int:
    """Move ``model``'s parameters into the memory faulted in for it, as far as it reaches (the
    rest of it given back); returns the bytes moved (0 where none was faulted in)."""
    global _memory
    with _lock:
        memory, _memory = _memory, None
    if memory is None:
        return 0
    import torch
    from torch.nn.parameter import UninitializedParameter

    placed, seen, whole = 0, set(), swapped_out()
    try:
        for p in model.parameters():
            if (
                isinstance(p, UninitializedParameter)
                or p.device.type != "cpu"
                or p.nbytes < MIN_PARAMETER
                or not p.is_contiguous()
                or p.storage_offset() != 0
                or p.untyped_storage().nbytes() != p.nbytes
                or p.data_ptr() in seen
            ):
                continue
            seen.add(p.data_ptr())
            piece = memory.take(p.nbytes)
            if piece is None:
                break  # the rest was not faulted in by now
            move_into(p.data_ptr(), p.nbytes, piece, whole=whole)
            try:
                p.data = torch.from_numpy(piece).view(p.dtype).view(p.shape)
            except (RuntimeError, TypeError):
                continue  # a dtype no byte view reaches: it stays, the piece goes back
            placed += p.nbytes
    finally:
        memory.close()
    return placed


def _one_memory_node() -> bool:
    """Whether this machine has one memory node (or says nothing of its nodes)."""
    try:
        with open("/sys/devices/system/node/has_memory") as f:
            nodes = f.read().strip()
    except OSError:
        return True
    return nodes.isdigit()
