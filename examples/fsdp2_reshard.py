"""A trainer with FSDP2 syncing its weights, as deltas, into engines that hold a TP-2 layout.

Four processes on one gloo group (CPU, loopback): ranks 0 and 1 train a tiny Llama-like model
(the parameter names of transformers' ``LlamaForCausalLM``) sharded with FSDP2's
``fully_shard``; ranks 2 and 3 are engine workers holding vLLM's tensor-parallel layout of the
same weights (q, k, v and gate, up column-parallel, as vLLM's fused QKV and merged layers hold
them; o and down row-parallel; vocabulary-parallel embeddings and head; norms replicated).
After every training step all four call ``Resharder.update``: each trainer rank sends, from
the shards FSDP2 gives it (no ``full_tensor()``), only what changed since the last step, each
engine rank receives only its slices, and the new version becomes current on both engines once
the sketch proof passes on every rank. After the last step the trainers save the weights to
safetensors with a sketched manifest (``weightlift manifest --sketch``); the last update is
proven against that manifest, and each engine checks, byte for byte, that what it serves equals
``weightlift.load(saved, shard=its Shard)``.

    python examples/fsdp2_reshard.py --steps 3 [--layers 2 --hidden 256] [--train 're:.*mlp.*'] [--json]

``--train``: a pattern of the parameters to train (the others frozen), as a fine-tune does.
Training everything with Adam changes every weight a little each step: the delta is then every
piece's XOR with its last version, compressed (about 70 % of the model in float32). ``--hf``: build transformers' ``LlamaForCausalLM`` itself (slower to import).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

WORLD, TRAINERS = 4, 2

#: vLLM's tensor-parallel layout of a Llama checkpoint, as the Shard rules of a sharded load take it
ENGINE_TP = {
    "model.embed_tokens.weight": 0,  # VocabParallelEmbedding
    "lm_head.weight": 0,  # ParallelLMHead
    "*.self_attn.q_proj.weight": "colwise",  # QKVParallelLinear stacks q, k, v: each column-parallel
    "*.self_attn.k_proj.weight": "colwise",
    "*.self_attn.v_proj.weight": "colwise",
    "*.self_attn.o_proj.weight": "rowwise",  # RowParallelLinear
    "*.mlp.gate_proj.weight": "colwise",  # MergedColumnParallelLinear stacks gate, up
    "*.mlp.up_proj.weight": "colwise",
    "*.mlp.down_proj.weight": "rowwise",
    "*norm.weight": None,  # replicated
}


def _model(args: argparse.Namespace):
    import torch
    from torch import nn

    if args.hf:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        )  # fmt: skip
        return LlamaForCausalLM(cfg)

    class Attention(nn.Module):
        def __init__(self, d: int, heads: int = 4, kv: int = 2):
            super().__init__()
            self.h, self.kv, self.hd = heads, kv, d // heads
            self.q_proj = nn.Linear(d, d, bias=False)
            self.k_proj = nn.Linear(d, kv * self.hd, bias=False)
            self.v_proj = nn.Linear(d, kv * self.hd, bias=False)
            self.o_proj = nn.Linear(d, d, bias=False)

        def forward(self, x):
            b, n, _ = x.shape
            q = self.q_proj(x).view(b, n, self.h, self.hd).transpose(1, 2)
            k = self.k_proj(x).view(b, n, self.kv, self.hd).transpose(1, 2).repeat_interleave(self.h // self.kv, 1)
            v = self.v_proj(x).view(b, n, self.kv, self.hd).transpose(1, 2).repeat_interleave(self.h // self.kv, 1)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(y.transpose(1, 2).reshape(b, n, -1))

    class MLP(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.gate_proj = nn.Linear(d, 2 * d, bias=False)
            self.up_proj = nn.Linear(d, 2 * d, bias=False)
            self.down_proj = nn.Linear(2 * d, d, bias=False)

        def forward(self, x):
            return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.self_attn, self.mlp = Attention(d), MLP(d)
            self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(d), nn.RMSNorm(d)

        def forward(self, x):
            x = x + self.self_attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(args.vocab, args.hidden)
            self.layers = nn.ModuleList(Layer(args.hidden) for _ in range(args.layers))
            self.norm = nn.RMSNorm(args.hidden)

        def forward(self, ids):
            x = self.embed_tokens(ids)
            for layer in self.layers:
                x = layer(x)
            return self.norm(x)

    class TinyLlama(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Body()
            self.lm_head = nn.Linear(args.hidden, args.vocab, bias=False)

        def forward(self, input_ids, labels=None):
            logits = self.lm_head(self.model(input_ids))
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
            )
            return type("Out", (), {"loss": loss, "logits": logits})()

    return TinyLlama()


def _rank(rank: int, port: int, args: argparse.Namespace, out: Path) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import weightlift as wl
    from weightlift.checkpoint import matcher
    from weightlift.distributed import Resharder, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = DeviceMesh("cpu", list(range(TRAINERS)))  # every rank builds it; the trainers are on it
    trainer = rank < TRAINERS
    engine = Shard(ENGINE_TP, rank=rank - TRAINERS, world=WORLD - TRAINERS, uneven="error") if not trainer else None
    saved = out / "model.safetensors"
    rep: dict = {"rank": rank, "steps": []}
    if trainer:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = _model(args)
        train = matcher(args.train) if args.train else None
        for name, p in model.named_parameters():
            p.requires_grad_(train is None or bool(train(name)))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
        gen = torch.Generator().manual_seed(1 + rank)
    # a trainer keeps a copy of its own shards (what it last sent) to send only what changed
    sync = Resharder(dst=engine, keep=trainer, framework="torch", timeout=120)
    for step in range(1, args.steps + 1):
        state, loss = None, 0.0
        if trainer:
            ids = torch.randint(0, args.vocab, (4, 32), generator=gen)
            out_ = model(input_ids=ids, labels=ids)
            out_.loss.backward()
            opt.step()
            opt.zero_grad()
            loss = float(out_.loss.detach())
            state = model.state_dict()  # DTensors: this rank's FSDP2 shards, never gathered here
        last = step == args.steps
        if last:
            if trainer:  # the checkpoint a fresh engine would load (gathered for saving, as trainers do)
                full = {k: v.full_tensor().contiguous() for k, v in state.items()}
                if rank == 0:
                    from safetensors.torch import save_file

                    from weightlift.digest.published import make_manifest

                    save_file(full, str(saved))
                    Path(str(saved) + ".manifest.json").write_text(make_manifest(saved, sketch=True).to_json())
                del full
            dist.barrier()
        t0 = time.perf_counter()
        res = sync.update(state, manifest=str(saved) + ".manifest.json" if last else None)
        took = time.perf_counter() - t0
        rep["steps"].append(
            {"step": step, "loss": loss, "delta": res.delta, "sent": res.sent, "needed": res.needed,
             "seconds": took, "verified": res.verified, "version": sync.version}
        )  # fmt: skip
    if not trainer:
        want = wl.load(str(saved), shard=engine, framework="torch")
        got = sync.tensors
        same = set(got) == set(want) and all(
            got[k].shape == want[k].shape and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))
            for k in want
        )
        rep["equal_to_saved"] = bool(same)
        rep["tensors"] = len(got)
    dist.barrier()
    dist.destroy_process_group()
    return rep


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--train", default=None, help="train only the parameters matching this pattern")
    ap.add_argument("--hf", action="store_true", help="use transformers' LlamaForCausalLM")
    ap.add_argument("--out", default=None, help="where to save the trainer's checkpoint (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print the per-step figures as JSON")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="fsdp2_reshard"))
    out.mkdir(parents=True, exist_ok=True)
    if args.rank is not None:  # one rank's program
        try:
            rep = _rank(args.rank, args.port, args, out)
        except Exception:  # noqa: BLE001 - reported to the launcher
            rep = {"rank": args.rank, "error": traceback.format_exc()}
        (out / f"rank{args.rank}.json").write_text(json.dumps(rep))
        return 0 if "error" not in rep else 1
    port = _free_port()
    argv = [a for a in sys.argv[1:]]
    if args.out is None:
        argv += ["--out", str(out)]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, __file__, *argv, "--rank", str(r), "--port", str(port)], env=env)
        for r in range(WORLD)
    ]
    codes = [p.wait() for p in procs]
    reps = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD) if (out / f"rank{r}.json").exists()]
    if any(c != 0 for c in codes) or len(reps) != WORLD:
        for rep in reps:
            if "error" in rep:
                print(f"rank {rep['rank']}:\n{rep['error']}", file=sys.stderr)
        return 1
    steps = []
    for k in range(args.steps):
        at = [rep["steps"][k] for rep in reps]
        steps.append(
            {"step": k + 1, "loss": at[0]["loss"], "delta": at[0]["delta"],
             "sent": sum(s["sent"] for s in at), "full": sum(s["needed"] for s in at),
             "seconds": max(s["seconds"] for s in at[:TRAINERS]), "verified": min(s["verified"] for s in at),
             "version": at[0]["version"]}
        )  # fmt: skip
    summary = {
        "steps": steps,
        "equal_to_saved": all(rep.get("equal_to_saved") for rep in reps[TRAINERS:]),
        "tensors_per_engine": [rep.get("tensors") for rep in reps[TRAINERS:]],
        "checkpoint": str(out / "model.safetensors"),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print("step  loss    kind   bytes sent   full bytes  share  seconds  verified")
        for s in steps:
            kind = "delta" if s["delta"] else "full"
            share = s["sent"] / s["full"] if s["full"] else 0.0
            print(
                f"{s['step']:>4}  {s['loss']:.3f}  {kind:<5} {s['sent']:>11,} {s['full']:>12,}  {share:5.1%}"
                f"  {s['seconds']:7.3f}  {s['verified']:>8}"
            )
        print(f"engines equal to wl.load(saved, shard=...) byte for byte: {summary['equal_to_saved']}")
    return 0 if summary["equal_to_saved"] else 1


if __name__ == "__main__":
    sys.exit(main())
