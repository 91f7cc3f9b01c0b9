"""Reading the checkpoint into the page cache from the moment vLLM has the engine's configuration.

vLLM builds its configuration (``EngineArgs.create_engine_config``) in the process the user
started, ``LLM(...)`` or ``vllm serve``, a second or more before any worker asks a load format
for weights: the engine core is set up (by default in a process of its own: spawned, as on
vLLM's CPU build, it imports vLLM again), then the platform, the workers and the model. A load format is only called at the end
of that, so a cold checkpoint's read would start there. :func:`install` (run by the plugin's
``register``) makes vLLM's ``create_engine_config`` start :func:`start` on the configuration it
has just built: where the load format is ``weightlift``, its options read ahead
(:meth:`~weightlift.integrations.vllm.options.LoaderOptions.reads_ahead`: by default, unless the
tensors come from a server or ``page_cache`` is ``"evict"``) and the model is a local folder (or
a hub name already in the local cache) of safetensors that fits in half the memory available,
its cold files are read into the page cache on a background thread, through mappings of that
thread's own (:func:`weightlift.local.prefetch.prefetch` with ``keep=False``): the process keeps
no mapping of them, and the engine's loader, in this process or another, finds the pages there.

Only one host's page cache is filled: with pipeline parallelism or several nodes a rank reads
only part of the checkpoint, and this process's host would read what other hosts load, so
nothing is read ahead there. Everything here is best effort: a checkpoint that cannot be
opened is left to the loader, which says what is wrong with it.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

from weightlift import env
from weightlift.checkpoint import open_checkpoint
from weightlift.errors import WeightliftError
from weightlift.integrations.vllm import prefault
from weightlift.integrations.vllm.options import LoaderOptions
from weightlift.local.prefetch import prefetch

__all__ = ["install", "check", "start", "local_folder", "has_safetensors", "MEMORY_SHARE"]

#: a checkpoint is read ahead only where it takes at most this share of the memory available
#: (the rest is for the engine's own copy of the weights, on a CPU build, and its cache)
MEMORY_SHARE = 0.5
_MARK = "_weightlift_reads_ahead"


def install() -> None:
    """Make vLLM's ``EngineArgs.create_engine_config`` start :func:`start` on each configuration
    it builds (idempotent; the configuration is returned unchanged)."""
    from vllm.engine.arg_utils import EngineArgs

    inner = EngineArgs.create_engine_config
    if getattr(inner, _MARK, False):
        return

    @functools.wraps(inner)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = inner(self, *args, **kwargs)
        check(config)  # a wrong option stops here, before any engine process starts
        try:
            start(config, kwargs.get("usage_context", args[0] if args else None))
        except Exception as e:  # noqa: BLE001 - a read ahead never stops an engine; said, not hidden
            _logger().warning("weightlift: no read ahead, nor memory faulted in ahead (%r)", e)
        return config

    setattr(create_engine_config, _MARK, True)
    EngineArgs.create_engine_config = create_engine_config


def check(config: Any) -> None:
    """Refuse ``config`` (a ``VllmConfig``) where its load format is ``weightlift`` and its
    ``model_loader_extra_config`` is wrong: OptionError naming the option (the loader checks the
    same again, where no plugin ran in the process that built the configuration)."""
    from weightlift.integrations.vllm import LOAD_FORMAT

    if config.load_config.load_format == LOAD_FORMAT:
        LoaderOptions.parse(config.load_config.model_loader_extra_config)


def start(config: Any, usage_context: Any = None) -> threading.Thread | None:
    """Start reading ``config``'s checkpoint (a ``VllmConfig``) into the page cache, where the
    module's rules say so, and have its parameters' memory faulted in ahead where
    :mod:`.prefault`'s do (``usage_context``: what ``create_engine_config`` was given); the
    thread reading, or None."""
    from weightlift.integrations.vllm import LOAD_FORMAT

    load, model, parallel = config.load_config, config.model_config, config.parallel_config
    os.environ.pop(prefault.ENV, None)  # what an earlier configuration asked of its engine
    if load.load_format != LOAD_FORMAT:
        return None
    try:
        options = LoaderOptions.parse(load.model_loader_extra_config)
    except WeightliftError:
        return None  # the loader stops the engine naming the option
    folder = local_folder(model.model, model.revision, load.download_dir) if options.server is None else None
    if folder is None:
        return None
    prefault.arrange(config, folder, options.prefault, usage_context)
    if not options.reads_ahead() or parallel.pipeline_parallel_size > 1 or getattr(parallel, "nnodes", 1) > 1:
        return None
    thread = threading.Thread(target=_read_ahead, args=(folder,), name="wl-vllm-read-ahead", daemon=True)
    thread.start()
    return thread


def local_folder(model: str, revision: str | None, download_dir: str | None) -> str | None:
    """The folder of ``model``'s safetensors on this host: the model itself where it is a folder,
    else a hub name's snapshot in the local cache (nothing is downloaded); None where neither."""
    if os.path.isdir(model):
        folder: str = model
    else:
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(
                model,
                revision=revision,
                cache_dir=download_dir,
                local_files_only=True,
                allow_patterns=["*.safetensors", "*.safetensors.index.json"],
            )
        except Exception:  # noqa: BLE001 - not in the cache, or not a hub name
            return None
    return folder if has_safetensors(folder) else None


def has_safetensors(folder: str) -> bool:
    """Whether ``folder`` holds a safetensors file (else the default loader reads what it has)."""
    return any(n.endswith(".safetensors") for n in os.listdir(folder))


def _read_ahead(folder: str) -> None:
    try:
        ck = open_checkpoint(folder)
        available = env.available_memory()
        if available is not None and ck.nbytes > MEMORY_SHARE * available:
            _logger().info(
                "weightlift: %.1f GB checkpoint, %.1f GB of memory available: not read ahead",
                ck.nbytes / 1e9,
                available / 1e9,
            )
            return
        prefetch(ck, keep=False).wait()
    except Exception as e:  # noqa: BLE001 - the loader reads (and reports) what this could not
        _logger().debug("weightlift: read ahead of %s stopped: %s", folder, e)


def _logger() -> Any:
    from vllm.logger import init_logger

    return init_logger("vllm.weightlift")
