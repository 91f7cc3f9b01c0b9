"""A worker's slices of the checkpoint under vLLM's tensor parallelism, for sharded pushes.

With ``sharded=True`` in the weight-transfer engine's init info, each worker's server holds only
the slices of the checkpoint's tensors its model shard loads, by their checkpoint names, and
takes them as REGIONs from every trainer rank (:func:`weightlift.distributed.push_shards`). The
rules come from the model's own layers, not from a preset: a column-parallel layer (and each
part of a fused one: q, k and v of ``qkv_proj``, gate and up of ``gate_up_proj``, by the model's
``packed_modules_mapping``) splits dim 0, a row-parallel one dim 1 of its weight, a
vocabulary-parallel embedding or head dim 0; everything else is replicated. K and V whose heads
vLLM replicates across ranks (fewer KV heads than ranks) are replicated when there is one KV head;
with several (each rank a different one, not a split of the world) and a padded vocabulary vLLM's
cut is not a ``Shard`` rule: refused at init, before any push.

vLLM's weight loaders take whole checkpoint tensors and cut their rank's slice themselves, so
above tensor parallel 1 :func:`staged` puts each slice the server holds at its place in a tensor
of the checkpoint's shape (the rest zeros, never read) before ``load_weights``: a full-size
buffer per tensor during ``update``, in the worker's own memory, nothing more on the wire.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from vllm.config import VllmConfig

from weightlift.distributed.shard import Shard, chunk_bounds
from weightlift.errors import OptionError
from weightlift.formats import TensorInfo

__all__ = ["receiver_shard", "staged"]


def receiver_shard(vllm_config: VllmConfig, model: Any) -> Shard:
    """This worker's :class:`Shard` of the checkpoint: rules from ``model``'s layers, its
    tensor-parallel rank and world."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise OptionError("sharded weight transfer: pipeline parallelism is not supported (tensor parallel only)")
    world = parallel.tensor_parallel_size
    if world == 1:
        return Shard((), rank=0, world=1)
    from vllm.distributed import get_tensor_model_parallel_rank

    return Shard(tuple(_rules(model, world)), rank=get_tensor_model_parallel_rank(), world=world, uneven="error")


def _rules(model: Any, world: int) -> Iterator[tuple[str, int | None]]:
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
    for prefix, m in model.named_modules():
        parent, _, leaf = prefix.rpartition(".")
        here = f"{parent}." if parent else ""
        parts = packed.get(leaf, [leaf])
        if isinstance(m, QKVParallelLinear):
            replicas = int(getattr(m, "num_kv_head_replicas", 1))
            if replicas > 1 and int(m.total_num_kv_heads) > 1:
                raise OptionError(
                    f"sharded weight transfer: {prefix} gives each of {world} ranks one of "
                    f"{m.total_num_kv_heads} KV heads, not a split a Shard rule states"
                )
            for k, p in enumerate(parts):
                yield f"{here}{p}.*", 0 if k == 0 or replicas == 1 else None
        elif isinstance(m, ColumnParallelLinear):  # MergedColumnParallelLinear too: each part
            for p in parts:
                yield f"{here}{p}.*", 0
        elif isinstance(m, RowParallelLinear):
            for p in parts:
                yield f"{here}{p}.weight", 1  # its bias is added once, whole on every rank
        elif isinstance(m, VocabParallelEmbedding):
            if m.num_embeddings_padded != m.org_vocab_size or m.org_vocab_size % world:
                raise OptionError(
                    f"sharded weight transfer: {prefix}'s vocabulary ({m.org_vocab_size}) is padded or does not "
                    f"split evenly over {world} ranks; vLLM's cut of it is not a Shard rule"
                )
            yield f"{prefix}.*", 0


def staged(held: dict[str, Any], shard: Shard, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """``held`` with each slice put at its place in a zero tensor of its checkpoint shape (the
    shape in ``shapes``), for vLLM's loaders, which cut their rank's slice from a whole tensor;
    a tensor held whole, or not in ``shapes`` (refused later by name), as it is."""
    if shard.world in (None, 1):
        return held
    out: dict[str, Any] = {}
    for name, t in held.items():
        full = shapes.get(name)
        if full is None or tuple(t.shape) == tuple(full):
            out[name] = t
            continue
        dim = shard.placement(TensorInfo(name, "BF16", tuple(full), "", 0, 0))
        if dim is None:
            out[name] = t  # a replicated tensor of another shape: refused by the shape check
            continue
        lo, hi = chunk_bounds(full[dim], shard.rank or 0, shard.world or 1, uneven=shard.uneven, what=f"{name}: ")
        whole = torch.zeros(full, dtype=t.dtype)
        whole.narrow(dim, lo, hi - lo).copy_(t)
        out[name] = whole
    return out
