"""The ``weightlift`` weight-transfer engine: a trainer pushes new weights into a running vLLM.

Theory of operation
-------------------
vLLM drives a weight-transfer engine in four phases, each a call on every worker: ``init``
(once), then per update ``start``, ``update`` (one or more chunks) and ``finish``. Here:

- ``init`` starts a :class:`weightlift.Server` inside the worker, on ``host:port + rank``, with
  the token (``token`` or ``token_file``) every client must prove, so that each frame is MAC'd,
  and a digest cache, so that the server remembers what it holds by digest.
- The trainer pushes the new weights to that server with :class:`weightlift.Client`: the
  tensors it holds, ``push({name: tensor})``, sent from their own memory as one update (all
  switched in at once or none, the result proven by the server's set digest), or a checkpoint.
  With ``Client(keep_base=True)`` the next push sends each tensor as what changed against the
  version the server holds (a tensor that did not change costs a header). Nothing of this
  touches the model: the engine keeps serving while the bytes travel.
- With ``sharded=True`` the server takes sharded pushes too: each trainer rank (FSDP2's
  DTensors, say) calls :func:`weightlift.distributed.push_shards` with what it holds and sends
  only the bytes it owns, as REGIONs; the server assembles each tensor from every rank's
  regions and switches the update's set in when the last is covered. At tensor parallel 1 the
  server's slice of every tensor is the whole tensor, so ``update`` is the same as after an
  unsharded push; above 1 each worker's server holds its rank's slices (rules from the model's
  own layers, :mod:`.sharded`), staged at the checkpoint's shapes for the loaders.
- ``start`` prepares vLLM's layerwise reload (the layers' processed kernel tensors are saved,
  so a layer that gets no weights is put back as it was).
- ``update`` checks every tensor the server holds against the checkpoint the engine was started
  on (each name known, each shape the same, each decoder layer whole) before any reaches the
  model, then feeds them all to ``model.load_weights``; the weight loaders copy from the
  server's memory into the parameters. A refused update is undone at once, so the engine serves
  the weights it had; a push refused by the server (a wrong token) never reaches the engine.
- ``finish`` runs the layers' post-processing (repacking for the CPU kernels, quantization) and
  puts the processed tensors in place; the server gives idle memory back (the versions an
  update into new memory replaced), and with ``release`` it drops its tensors too.

Memory. The server keeps the last update's tensors, one host copy of the weights in checkpoint
form beside the model's, as the bases the next update's changes apply to (a push with
``in_place=True`` applies them into that copy; otherwise the new versions land beside the old
until the switch, two copies for the while). It cannot be the model's own memory: the fused
layers hold several checkpoint tensors in one parameter (q, k and v; gate and up; every
expert), and on the CPU build every linear layer repacks its weight for the kernels and drops
the checkpoint-form one (the LM head keeps it beside its packed copy), so only the embeddings,
the LM head and the norms are plain copies a change could be applied to. ``release=True`` gives the copy back after ``finish``,
its bytes kept in the disk cache, so that the next push of a tensor that did not change is
filled from the disk and not resent; but the next update has no bases in memory to apply
changes to, so a tensor that changed goes whole.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from weightlift import libc
from weightlift.distributed.shard import Shard
from weightlift.errors import StateError
from weightlift.integrations.vllm import compat
from weightlift.integrations.vllm.sharded import receiver_shard, staged
from weightlift.integrations.vllm.updates import checked, checkpoint_shapes
from weightlift.remote.server import Server
from weightlift.remote.token import read_token

__all__ = ["WeightliftInitInfo", "WeightliftUpdateInfo", "WeightliftWeightTransferEngine"]

logger = init_logger("vllm.weightlift")  # a child of vLLM's logger: its handlers and level


@dataclass
class WeightliftInitInfo(WeightTransferInitInfo):
    """What ``init_weight_transfer_engine`` takes: where the worker's server listens (rank ``r``
    on ``port + r``; port 0 picks any, for one worker) and the token clients must prove."""

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = field(default=None, repr=False)  # a secret: never in a log line or a traceback
    token_file: str | None = None
    #: bytes the server may hold (None: its default); an update must fit beside the model
    max_memory: int | None = None
    #: take sharded pushes (``weightlift.distributed.push_shards``: each trainer rank sends the
    #: REGIONs it owns, the server assembles them) as well as whole tensors; see :mod:`.sharded`
    sharded: bool = False


@dataclass
class WeightliftUpdateInfo(WeightTransferUpdateInfo):
    """What ``update_weights`` takes: ``names`` (None: every tensor the server holds; a name
    brings the rest of its decoder layer with it), and ``release``: once the update is finished
    the server drops what it holds and gives the memory back (see the theory of operation)."""

    names: list[str] | None = None
    release: bool = False


class WeightliftWeightTransferEngine(WeightTransferEngine[WeightliftInitInfo, WeightliftUpdateInfo]):
    """vLLM's ``weight_transfer_config={"backend": "weightlift"}`` (see the theory of operation)."""

    init_info_cls = WeightliftInitInfo
    update_info_cls = WeightliftUpdateInfo

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device, model: Any):
        super().__init__(config, vllm_config, device, model)
        self.server: Server | None = None
        self._cache: tempfile.TemporaryDirectory[str] | None = None
        self._expected: dict[str, tuple[int, ...]] | None = None
        self._release = False  # the update in progress asked for the server's copy to go at finish
        self.rank = vllm_config.parallel_config.rank
        self._shard: Shard | None = None  # the slices a sharded server holds (init_info.sharded)

    def init_transfer_engine(self, init_info: WeightliftInitInfo) -> None:
        if self.server is not None:
            raise StateError("the weightlift weight-transfer engine is already initialised")
        token: str | bytes | None = init_info.token
        if init_info.token_file is not None:
            token = read_token(init_info.token_file)
        port = init_info.port + self.rank if init_info.port else 0
        self._shard = receiver_shard(self.vllm_config, self.model) if init_info.sharded else None
        self._cache = tempfile.TemporaryDirectory(prefix="weightlift-vllm-")
        self.server = Server(
            init_info.host,
            port,
            framework="torch",
            token=token,
            cache_dir=self._cache.name,
            max_memory=init_info.max_memory,
            shard=self._shard,
        )
        host, bound = self.server.start()
        self._expected = checkpoint_shapes(self.model_config.model)
        logger.info("weightlift weight transfer: rank %d listens on %s:%d", self.rank, host, bound)

    @property
    def address(self) -> tuple[str, int]:
        """Where this worker's server listens."""
        return self._server().address

    def _server(self) -> Server:
        if self.server is None:
            raise StateError("init_weight_transfer_engine has not been called")
        return self.server

    def start_weight_update(self) -> None:
        self._server()
        compat.reload(self.model, start=True)

    def receive_weights(self, update_info: WeightliftUpdateInfo) -> None:
        # the server's tensors held off in-place pushes while they are checked and copied: the
        # model gets one version of each, never bytes another client's switch is changing
        with self._server().reading() as held:
            names = sorted(held) if update_info.names is None else list(update_info.names)
            try:
                if self._shard is not None and self._expected is not None:
                    held = staged(dict(held), self._shard, self._expected)  # at the shapes the loaders cut
                weights = checked(held, names, self._expected)
            except BaseException:
                self._undo()
                raise
            self._release = update_info.release
            with compat.mtp_check_off():
                self.model.load_weights(weights)

    def _undo(self) -> None:
        """Put every layer back as it was before ``start`` (none got weights yet)."""
        compat.reload(self.model, self.model_config, start=False)

    def finish_weight_update(self) -> None:
        compat.reload(self.model, self.model_config, start=False)
        _reprocess_tied(self.model)
        release, self._release = self._release, False
        if release:
            self._release_copy()
        else:
            # an update into new memory left the versions it replaced idle in the server's pool
            # (kept for the next one): beside the model, memory is worth more than the faults
            self._server().trim()
        _malloc_trim()

    def _release_copy(self) -> None:
        """Drop what the server holds and give its memory back, its bytes kept in the disk cache
        first (those that arrived as changes are not there yet), so that a later push of the
        same bytes is filled from the disk, not resent."""
        server = self._server()
        written = server.cache_held()
        if server.cache is not None:
            server.cache.flush()  # the writer holds each tensor until written: then it can go
        freed = server.free()
        returned = server.trim()
        logger.info(
            "weightlift weight transfer: rank %d released %d tensors (%d bytes back to the system, %d written to the cache)",
            self.rank,
            freed,
            returned,
            written,
        )

    def shutdown(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.close()
        if self._cache is not None:
            self._cache.cleanup()
            self._cache = None


def _malloc_trim() -> None:
    """Give the C heap's free memory back to the system where the C library can (glibc). The
    layerwise reload makes and frees a layer's worth of fresh tensors per layer; freed, they
    stay in the heap's arenas, which glibc returns only when asked."""
    libc.malloc_trim(0)  # False where the C library is not glibc: its allocator does it itself


def _reprocess_tied(model: Any) -> None:
    """Process again each layer that shares its weight with another and packed it for its
    kernels (``cpu_linear``: a tied LM head on the CPU). The checkpoint holds a tied weight
    once, so the layerwise reload fills and processes the layer that loads it, and puts the
    other back as it was: the new bytes in its (shared) weight, its kernel's packed copy of the
    old ones."""
    owners: dict[int, int] = {}
    layers = [m for m in model.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)]
    for m in layers:
        if m.weight.numel():
            owners[m.weight.data_ptr()] = owners.get(m.weight.data_ptr(), 0) + 1
    for m in layers:
        method = getattr(m, "quant_method", None)
        if hasattr(m, "cpu_linear") and m.weight.numel() and owners[m.weight.data_ptr()] > 1 and method is not None:
            method.process_weights_after_loading(m)
