"""An FSDP2 trainer syncing into a running vLLM after every step, each rank sending only its shards.

    python examples/fsdp2_to_vllm.py --steps 3 --ranks 2 [--tp 2] [--freeze 1] [--model DIR] [--out DIR]

What it does:

1. Starts a vLLM engine on a tiny Llama checkpoint (``--model``, else one written here), with the
   ``weightlift`` weight-transfer backend and ``sharded=True``: the engine's worker runs a
   :class:`weightlift.Server` that takes sharded pushes (REGIONs) and assembles them; with
   ``--tp 2`` two workers, each server holding its worker's slices (on port and port + 1).
2. Spawns ``--ranks`` trainer processes (torch.distributed on gloo, CPU) that load the same
   checkpoint and wrap it in FSDP2 (``fully_shard`` per decoder layer and at the root): each rank
   holds a dim-0 slice of every parameter, as a DTensor.
3. Per optimizer step every rank calls ``weightlift.distributed.push_shards`` with its state
   dict (the DTensors cast to the checkpoint's bfloat16, never ``full_tensor()``): it sends the
   bytes it owns straight to the engine's server, one set per step, held there. Rank 0 gathers the
   ranks' sketches and calls ``switch_all``: once every worker's server holds the step and its
   sketches match what the ranks sent, all of them switch it in (else none does). Then the engine
   runs start / update / finish.
4. After the last step the trainer saves its weights (the full state dict on rank 0, for the save
   only) and a fresh engine started on that checkpoint must give the same greedy tokens as the
   engine that was updated in place.

Only what changed goes: each rank compares its shards with the copy it kept of what it pushed
last (at first, the checkpoint the engine started on), one all-reduce makes the ranks agree on
the set of tensors that changed anywhere, and only those are pushed; the engine's server keeps
the versions it holds of the others (``--freeze N`` freezes the first N decoder layers, 1 by
default, so that some do not change). A tensor that changed goes whole: sharded pushes send no
changes within a tensor yet.

It prints the tokens of both engines, the bytes each rank sent against the bytes of its own
shards of the tensors pushed, and the time of each push.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import secrets
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

PROMPTS = [[1, 5, 9, 22], [7, 7, 3], [100, 42, 17, 8, 250]]
# vLLM's engine core in this process (its default is a process of its own, a spawn and vLLM's
# imports again per engine start); the weight-transfer engine works the same in either
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: the model is tiny
ENGINE = dict(skip_tokenizer_init=True, enforce_eager=True, gpu_memory_utilization=0.05, max_model_len=128)


@dataclass
class Result:
    """What a run measured: the greedy tokens of the updated engine and of a fresh one on the
    saved checkpoint, and per trainer rank the bytes it sent, the bytes it owns and its pushes'
    seconds; ``model_bytes`` the checkpoint's tensors' bytes."""

    updated: list[list[int]]
    fresh: list[list[int]]
    before: list[list[int]]
    ranks: list[dict[str, Any]] = field(default_factory=list)
    model_bytes: int = 0
    saved: str = ""


def write_tiny_llama(path: str, seed: int = 0) -> str:
    """A tiny Llama checkpoint (bfloat16, tied embeddings) at ``path``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        initializer_range=0.2,
        tie_word_embeddings=True,
    )
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tokens(llm: Any) -> list[list[int]]:
    import vllm

    params = vllm.SamplingParams(max_tokens=8, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _stop(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _checkpoint_names(model: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(os.path.join(model, "model.safetensors"), framework="pt") as f:
        return sorted(f.keys())


def _local(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """This rank's shard of each of ``names``, in the checkpoint's dtype (a copy)."""
    import torch

    return {k: state[k].detach().to(torch.bfloat16).to_local().clone() for k in names}


def _changed(state: dict[str, Any], kept: dict[str, Any]) -> dict[str, Any]:
    """The tensors of ``state`` that changed on any rank since ``kept`` (which is brought up to
    date): every rank compares its own shards, and one all-reduce makes the ranks agree, so that
    they push the same set. An unchanged tensor is not pushed at all; the engine's server keeps
    the version it holds, which ``update`` loads again."""
    import torch
    import torch.distributed as dist

    names = sorted(state)
    flags = torch.tensor([int(not torch.equal(state[k].to_local(), kept[k])) for k in names])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    out = {k: state[k] for k, f in zip(names, flags.tolist(), strict=True) if f}
    for k, v in out.items():
        kept[k] = v.to_local().clone()
    return out


def _trainer(
    rank: int,
    world: int,
    rdv: int,
    model: str,
    addresses: list[tuple[str, int]],
    token: str,
    steps: int,
    out: str,
    freeze: int,
    chan: Any,
) -> None:
    """One FSDP2 rank: train, push its shards after every step, save at the end (rank 0)."""
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import weightlift as wl
    from weightlift.distributed import push_shards, switch_all

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(rdv))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        names = _checkpoint_names(model)  # the engine's tensors: a tied LM head is not one of them
        net = transformers.LlamaForCausalLM.from_pretrained(model, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (world,))
        for layer in net.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        for layer in net.model.layers[:freeze]:  # frozen: their tensors never change
            layer.requires_grad_(False)
        opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
        # what the engine holds, as this rank's shards: the checkpoint both started from
        kept = _local(net.state_dict(), names)
        gen = torch.Generator().manual_seed(1234)  # the same batch on every rank: any data would do
        vocab = net.config.vocab_size
        stats: dict[str, Any] = {"rank": rank, "bytes_sent": [], "owned": [], "tensors": [], "push_s": [], "step_s": []}
        clients = [wl.Client(a, token=token) for a in addresses]  # one server per engine worker
        try:
            for step in range(steps):
                t0 = time.perf_counter()
                batch = torch.randint(0, vocab, (4, 32), generator=gen)
                loss = net(input_ids=batch, labels=batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                # this rank's DTensors in the checkpoint's dtype: a cast of the local shard only
                state = {k: v.detach().to(torch.bfloat16) for k, v in net.state_dict().items() if k in names}
                t1 = time.perf_counter()
                state = _changed(state, kept)
                # each the bytes that worker holds, held there as set step + 1 until rank 0 switches it
                pushed = [push_shards(c, state, set_id=step + 1) for c in clients]
                stats["push_s"].append(time.perf_counter() - t1)
                stats["bytes_sent"].append(sum(p.bytes_sent for p in pushed))
                stats["owned"].append(sum(v.to_local().numel() * v.element_size() for v in state.values()))
                stats["tensors"].append(len(state))
                every: list[Any] = [None] * world if rank == 0 else []
                dist.gather_object(pushed, every if rank == 0 else None, dst=0)
                if rank == 0:
                    # wait for every rank's regions; only if each server holds exactly what was sent
                    # do all of them switch the step in (else none does)
                    if state:
                        sent = [[e[w] for e in every] for w in range(len(clients))]
                        switch_all(clients, step + 1, list(state), sent, timeout=60)
                    chan.put(("pushed", step, loss.item()))
                    if chan.get_reply() != step:
                        raise RuntimeError("the engine did not take the update")
                dist.barrier()
                stats["step_s"].append(time.perf_counter() - t0)
        finally:
            for c in clients:
                c.close()
        full = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            from safetensors.torch import save_file

            os.makedirs(out, exist_ok=True)
            weights = {k: full[k].to(torch.bfloat16).contiguous() for k in names}
            save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
            for extra in ("config.json", "generation_config.json"):
                if os.path.exists(os.path.join(model, extra)):
                    shutil.copy(os.path.join(model, extra), out)
        chan.put(("done", rank, stats))
    except BaseException as e:
        chan.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()


class _Channel:
    """The trainers' line to the engine's driver: requests up, rank 0's replies down."""

    def __init__(self, ctx: Any) -> None:
        self.up = ctx.Queue()
        self.down = ctx.Queue()

    def put(self, msg: Any) -> None:
        self.up.put(msg)

    def get_reply(self) -> Any:
        return self.down.get(timeout=600)


def run(
    model: str,
    out: str,
    *,
    steps: int = 3,
    ranks: int = 2,
    freeze: int = 1,
    tp: int = 1,
    port: int | None = None,
    timeout: float = 600,
) -> Result:
    """Train ``steps`` steps on ``ranks`` FSDP2 processes, syncing into a running engine after
    each; then compare its greedy tokens with a fresh engine's on the saved weights."""
    import multiprocessing as mp

    import vllm

    token = secrets.token_hex(32)
    port = port or _free_port()
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # vLLM's CPU workers bind one NUMA node each; on one node, give each worker its own CPUs
        cpus = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(str(c) for c in cpus[w::tp]) for w in range(tp))
    engine = dict(ENGINE, tensor_parallel_size=tp)
    wt = {"backend": "weightlift"}
    llm = vllm.LLM(model=model, load_format="weightlift", weight_transfer_config=wt, **engine)
    try:
        before = _tokens(llm)  # the first forward pass
        llm.init_weight_transfer_engine({"init_info": {"port": port, "token": token, "sharded": True}})
        ctx = mp.get_context("spawn")
        chan = _Channel(ctx)
        rdv = _free_port()
        addresses = [("127.0.0.1", port + w) for w in range(tp)]  # worker w's server on port + w
        args = (ranks, rdv, model, addresses, token, steps, out, freeze, chan)
        procs = [ctx.Process(target=_trainer, args=(r, *args), daemon=True) for r in range(ranks)]
        for p in procs:
            p.start()
        stats: list[dict[str, Any]] = []
        end = time.monotonic() + timeout
        while len(stats) < ranks:
            try:
                msg = chan.up.get(timeout=1)
            except Exception:  # queue.Empty: see that every trainer still runs
                if time.monotonic() > end or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"trainers failed: exit codes {[p.exitcode for p in procs]}") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"trainer rank {msg[1]}: {msg[2]}")
            if msg[0] == "pushed":
                llm.start_weight_update()
                llm.update_weights({"update_info": {}})
                llm.finish_weight_update()
                print(f"step {msg[1]}: loss {msg[2]:.4f}, engine updated", flush=True)
                chan.down.put(msg[1])
            else:
                stats.append(msg[2])
        for p in procs:
            p.join(timeout=60)
        updated = _tokens(llm)
    finally:
        _stop(llm)
    fresh_llm = vllm.LLM(model=out, **engine)
    try:
        fresh = _tokens(fresh_llm)
    finally:
        _stop(fresh_llm)
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        model_bytes = sum(_nbytes(f, k) for k in f.keys())
    return Result(updated, fresh, before, sorted(stats, key=lambda s: s["rank"]), model_bytes, out)


def _nbytes(f: Any, name: str) -> int:
    t = f.get_tensor(name)
    return int(t.numel() * t.element_size())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a Llama checkpoint folder (default: a tiny one written here)")
    ap.add_argument("--out", help="where the trainer saves its weights (default: a temporary folder)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1, help="the engine's tensor-parallel size")
    ap.add_argument("--freeze", type=int, default=1, help="leading decoder layers frozen (not pushed)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fsdp2-to-vllm-") as tmp:
        model = a.model or write_tiny_llama(os.path.join(tmp, "llama-tiny"))
        out = a.out or os.path.join(tmp, "trained")
        t0 = time.perf_counter()
        r = run(model, out, steps=a.steps, ranks=a.ranks, freeze=a.freeze, tp=a.tp)
        print(f"before training:        {r.before}")
        print(f"updated engine:         {r.updated}")
        print(f"fresh engine on saved:  {r.fresh}")
        for s in r.ranks:
            per_step = ", ".join(f"{x:.3f}" for x in s["push_s"])
            per_step += "; step s (train, push, check, engine update): " + ", ".join(f"{x:.2f}" for x in s["step_s"])
            print(
                f"rank {s['rank']}: sent {s['bytes_sent']} bytes per step, owns {s['owned']} of the "
                f"{s['tensors']} tensors that changed; push s: {per_step}"
            )
        print(f"model bytes: {r.model_bytes}; whole run {time.perf_counter() - t0:.1f} s")
        print(json.dumps({"equal": r.updated == r.fresh, "changed": r.updated != r.before}))
        return 0 if r.updated == r.fresh else 1


if __name__ == "__main__":
    sys.exit(main())
