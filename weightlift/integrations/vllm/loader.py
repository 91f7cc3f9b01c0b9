"""The ``weightlift`` load format: vLLM's model, weightlift's reads.

Theory of operation
-------------------
vLLM builds the model (its own layers: fused QKV and gate-up projections, stacked experts,
quantized linear methods, tied embeddings) and then feeds ``model.load_weights`` an iterator of
``(checkpoint name, tensor)`` pairs; each parameter's ``weight_loader`` copies what it keeps out
of the tensor it is given (for tensor parallelism, its rank's slice). This loader changes only
where those tensors come from, so every architecture vLLM supports loads as it does with the
default loader:

- from the files: each tensor a view of a private copy-on-write mapping of its file, as
  safetensors hands out, with the mapped bytes made ready on parallel threads first (read into
  the page cache where cold, mapped, touched once: :func:`weightlift.hf.mapped.read_and_map`), so
  that the loaders' copies neither wait on storage nor fault page by page. With ``verify`` every
  tensor is hashed as it lands and compared with the manifest given, else the one published
  beside the checkpoint, else only with the files as they are now
  (:func:`weightlift.digest.published.reference`), before any reaches the model; the log says
  which, and a mismatch stops the engine with an error naming the tensors and their files. ``copy`` reads into fresh memory instead (:func:`weightlift.load`).
- from a tensor server (``server``): every tensor it holds, READ over the wire into one block of
  this process's memory (:mod:`weightlift.integrations.vllm.pulled`).

The files are a local folder, or what vLLM's default loader downloads for a hub name (found in
the hub's cache; elsewhere, ModelScope, through :func:`.compat.prepared_folder`); checkpoints
that are not safetensors (``.bin``, ``.pt``) are left to the default loader, which reads them.
With ``prefetch`` (or vLLM's own ``safetensors_load_strategy="prefetch"``) the cold files are
read into the page cache from ``load_model`` on, while vLLM builds the model. This module uses
vLLM's public interfaces only: what needs an internal is in :mod:`.compat`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from weightlift.api import load, prefetch
from weightlift.checkpoint import Checkpoint, open_checkpoint
from weightlift.digest.published import announce
from weightlift.errors import IntegrityError
from weightlift.hf.mapped import read_and_map
from weightlift.integrations.vllm import compat
from weightlift.integrations.vllm.options import LoaderOptions
from weightlift.integrations.vllm.pulled import pull_tensors, tls_context
from weightlift.integrations.vllm.streamed import streamed_tensors
from weightlift.options import LoadOptions

__all__ = ["WeightliftModelLoader"]

logger = init_logger("vllm.weightlift")  # a child of vLLM's logger: its handlers and level


class WeightliftModelLoader(BaseModelLoader):
    """vLLM's ``load_format="weightlift"``; options from ``model_loader_extra_config``
    (:class:`~weightlift.integrations.vllm.options.LoaderOptions`)."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        self.options = LoaderOptions.parse(load_config.model_loader_extra_config)
        self._prefetch: Any = None
        #: what the last load did: tensors, bytes, seconds, source
        self.report: dict[str, Any] = {}

    def _default(self, load_format: str = "safetensors") -> DefaultModelLoader:
        """vLLM's own loader on the same config, for finding and downloading the files (and
        reading those that are not safetensors)."""
        cfg = LoadConfig(
            load_format=load_format,
            download_dir=self.load_config.download_dir,
            ignore_patterns=self.load_config.ignore_patterns,
        )
        return DefaultModelLoader(cfg)

    def download_model(self, model_config: ModelConfig) -> None:
        if self.options.server is None:
            self._default().download_model(model_config)

    def checkpoint(self, model_config: ModelConfig) -> Checkpoint | None:
        """The model's safetensors checkpoint, or None where it has none (``.bin``, ``.pt``) or
        its files cannot be found without a vLLM internal this release was not tested with."""
        path = model_config.model
        if not os.path.isdir(path):
            found = local_folder(path, model_config.revision, self.load_config.download_dir)
            if found is None:
                found = compat.prepared_folder(self._default(), path, model_config.revision)
            if found is None:
                return None
            path = found
        if not has_safetensors(path):
            return None
        return open_checkpoint(path)

    def reads_ahead(self) -> bool:
        """Whether the files are read into the page cache from ``load_model`` on: ``prefetch``
        as given, else as vLLM's ``safetensors_load_strategy`` asks (``"prefetch"``)."""
        return self.options.reads_ahead(getattr(self.load_config, "safetensors_load_strategy", None))

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        # asked for, the read runs while vLLM builds the model, and the load waits for it;
        # otherwise the load reads what is cold itself, in parallel pieces as it goes
        if self.reads_ahead():
            ck = self.checkpoint(model_config)
            if ck is not None:
                self._prefetch = prefetch(ck, keep=False)
        return super().load_model(vllm_config, model_config, prefix)

    def tensors(self, model_config: ModelConfig) -> Iterable[tuple[str, torch.Tensor]] | None:
        """The checkpoint's tensors by name, read as the options say; None: no safetensors here."""
        o = self.options
        if o.server is not None:
            pulled = pull_tensors(o.server, token=o.token(), tls=tls_context(o.tls), verify=o.verify, timeout=o.timeout)
            return pulled.items()
        ck = self.checkpoint(model_config)
        if ck is None:
            return None
        if self._prefetch is not None:
            self._prefetch.wait()
        extra: dict[str, Any] = {"verify": True, "manifest": o.manifest} if o.verify else {}
        kw: dict[str, Any] = dict(page_cache=o.page_cache, threads=o.threads, report=self.report, **extra)
        try:
            if o.copy:
                return load(ck, framework="torch", copy=True, **kw).items()
            if o.verify or o.page_cache is not None:  # every tensor proven before any reaches the model
                return read_and_map(ck, LoadOptions(framework="torch", **kw)).items()
            # with tensor parallelism each rank faults in only the pages its loaders slice out
            return streamed_tensors(ck, threads=o.threads, touch=compat.tp_size() == 1)
        except IntegrityError as e:
            files = sorted({t.file for t in ck.tensors if repr(t.name) in str(e) or t.name in str(e)})
            raise IntegrityError(f"{e} (in {', '.join(files) or ck.path}); the engine does not start") from None

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        t0 = time.perf_counter()
        tensors = self.tensors(model_config)
        if tensors is None:
            logger.info("weightlift: no safetensors checkpoint; vLLM's default loader reads these files")
            self._default("auto").load_weights(model, model_config)
            return
        announce(self.report, logger, "weightlift: ")  # what a verify checked the files against
        if self.options.verify and self.options.server is not None:
            logger.info("weightlift: every tensor equal to what %s holds (its stated BLAKE3)", self.options.server)
        count = [0, 0]

        def counted() -> Iterable[tuple[str, torch.Tensor]]:
            for name, t in tensors:
                count[0] += 1
                count[1] += t.nbytes
                yield name, t

        model.load_weights(counted())
        elapsed = time.perf_counter() - t0
        self.report.update(tensors=count[0], bytes=count[1], seconds=elapsed, source=self.options.server or "files")
        logger.info(
            "Loading weights took %.2f seconds (weightlift: %d tensors, %.2f GB)",
            elapsed,
            count[0],
            count[1] / 1e9,
        )


def local_folder(model: str, revision: str | None, download_dir: str | None) -> str | None:
    """The folder of hub name ``model``'s safetensors in the local cache (where vLLM's
    ``download_model`` put them; nothing is downloaded here), or None."""
    try:
        from huggingface_hub import snapshot_download

        folder: str = snapshot_download(
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
