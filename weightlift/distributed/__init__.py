"""Weights beyond one process: sharded loads, group loads, broadcast and parallel pushes.

Theory of operation. Four ways to get one checkpoint to many ranks or machines, by what each
rank needs and where the bytes are:

1. **A rank's slices, each rank reading for itself** (``weightlift.load(path, shard=Shard(...))``).
   :class:`Shard` rules map name patterns to a placement (a dimension, or replicated; see
   :mod:`.shard` for the mapping to vLLM's ColumnParallel/RowParallel and DTensor's
   ``Shard(d)``/``Replicate()``). A slice along the first dimension is one byte range: only
   that range is read (``preadv`` straight into the destination, or a copy out of the mapping
   when the file is in the page cache). A slice along another dimension is rows: read row by
   row into the destination rows when rows are at least :data:`ROW_READ_MIN` (1 MiB), else as
   one sequential read of the span with the rows scattered into place (:mod:`.reader` has the
   measurement behind the threshold). ``copy=False`` gives (strided) views of the mapping.
2. **One read, shared over a process group** (``weightlift.load(path, group=pg)``, with or
   without ``shard``): every rank opens the headers and derives the same plan; replicated
   tensors are read in stripes, 1/world of the bytes per rank, and gathered in place
   (``all_gather``); sharded slices that are byte ranges or large rows are read by their own
   rank; strided slices with small rows are read whole by one owner rank and delivered by
   ``all_to_all`` (:mod:`.group`). Together the ranks read each byte once. Before any of that,
   one tiny ``all_gather`` checks that every rank planned, and planned the same load. A
   checkpoint in a store (``s3://``, ``https://``) loads the same way: rank 0 reads its header
   and broadcasts it, and ranged GETs take the place of ``preadv`` (:mod:`.fromstore`).
3. **One source, many receivers of the same weights** (:func:`broadcast_load`): the source
   reads chunk by chunk and broadcasts each chunk while reading the next; receivers need no
   files and land the bytes straight in their arena (host or CUDA) (:mod:`.fanout`).
4. **Different selections to several tensor servers** (:func:`push_many`): one
   ``weightlift.Client`` per server, on its own thread (:mod:`.push`).
5. **Shards as a trainer holds them, into servers that hold slices** (:func:`push_shards`): each
   rank sends its DTensors (or :class:`ShardOf` boxes) to every ``Server(shard=...)``, only the
   intersection of what it holds with what that server needs; nothing is gathered, and the
   linear sketch proves the result (:mod:`.regions`). With a ``set_id`` every server holds the
   complete update until :func:`switch_all` (after the sketches pass on every server) switches
   all of them, or drops it on all: receivers of one update never disagree.

Which to use: with shared storage and a group, (2) reads storage once and moves ``(world-1)/world``
of the bytes over the network per rank. Without shared storage, (3) from the one machine that
has the files: a pipelined broadcast costs about ``size / min(link, storage)`` plus a chunk's
time per hop, where separate pushes (4) cost ``receivers * size / uplink``. With no process
group, (4) is what remains. ``bench/distributed.py`` measures all of them.

Collectives run on flat uint8 buffers weightlift lays out (never pickled objects), through
:class:`~.comm.Comm`, which maps every torch failure (a dead peer, a timeout) to
:class:`~weightlift.errors.TransportError`. gloo groups move host memory, NCCL groups CUDA memory.
"""

from __future__ import annotations

from weightlift.distributed.fanout import BROADCAST_CHUNK, broadcast_load
from weightlift.distributed.group import ROUND, STRIPE, distributed_load
from weightlift.distributed.push import PushError, push_many
from weightlift.distributed.reader import ROW_READ_MIN
from weightlift.distributed.regions import (
    ShardOf,
    ShardPush,
    abort_all,
    check_sketches,
    push_shards,
    server_sketches,
    switch_all,
)
from weightlift.distributed.shard import Piece, Rows, Shard, chunk_bounds
from weightlift.distributed.transfer import Resharded, Resharder, reshard_transfer, verify_resharded

__all__ = [
    "Shard",
    "Piece",
    "Rows",
    "chunk_bounds",
    "distributed_load",
    "broadcast_load",
    "push_many",
    "reshard_transfer",
    "verify_resharded",
    "Resharded",
    "Resharder",
    "PushError",
    "ROW_READ_MIN",
    "STRIPE",
    "ROUND",
    "BROADCAST_CHUNK",
    "ShardOf",
    "ShardPush",
    "push_shards",
    "server_sketches",
    "check_sketches",
    "switch_all",
    "abort_all",
]
