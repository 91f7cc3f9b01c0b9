#!/usr/bin/env python3
"""Host memory of a vLLM worker through weight updates with the ``weightlift`` weight-transfer engine.

    VENV/bin/python bench/vllm_update_memory.py [--model DIR] [--json FILE]

Run with an interpreter that has vLLM (its CPU build) and weightlift. This process is the
trainer: it starts ``vllm.LLM(model, load_format="weightlift", weight_transfer_config=
{"backend": "weightlift"})`` (its worker in a process of its own),
loads the checkpoint's tensors into its own memory and takes them through updates:

1. a whole push (``Client(keep_base=True)``), then start / update / finish;
2. a sparse step (about 1 % of each matrix's elements moved, in place in the trainer's
   tensors) pushed as what changed with ``in_place=True`` (applied into the server's tensors),
   then an update; another step pushed as what changed into new memory (the default), then an
   update;
3. an update with ``release=True``: the server gives its copy back after finish;
4. the same step pushed again by a client without bases (large tensors named by digest, so
   the server's disk cache can fill them), then an update with ``release=True``.

After every phase the worker process's ``VmRSS``, ``RssAnon``, ``RssFile`` and ``VmHWM`` are read
from ``/proc``; the load average is printed with them. Also reported: which of the
checkpoint's tensors are plain copies in the model after loading (a parameter of the same
name, dtype and shape holding the same bytes), the only ones whose memory the server could
share with the model.

Without ``--model``, the Llama of about 0.76 GB that ``bench/vllm_start.py`` writes is used
(written once under the benchmark cache folder).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the KV cache is not what is measured
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the plain-copy probe is a callable

TOKEN = "a benchmark token long enough for the weightlift server 0123"
PROMPTS = [[1, 5, 9, 22], [7, 7, 3]]


def _status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _pid(worker: Any) -> int:
    """In the worker: its process id (the process whose memory is measured)."""
    return os.getpid()


def _plain_copies(worker: Any, files: list[str]) -> dict[str, int]:
    """In the worker: bytes of checkpoint tensors that a same-named parameter holds as they are."""
    import torch
    from safetensors import safe_open

    model = worker.model_runner.get_model()
    params = dict(model.named_parameters(remove_duplicate=False))
    plain = total = 0
    names = []
    for path in files:
        with safe_open(path, "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                total += t.numel() * t.element_size()
                p = params.get(name)
                if (
                    p is not None
                    and p.dtype == t.dtype
                    and tuple(p.shape) == tuple(t.shape)
                    and p.is_contiguous()
                    and torch.equal(p.data, t)
                ):
                    plain += t.numel() * t.element_size()
                    names.append(name)
    kinds = sorted({n.split(".")[-2] if n.count(".") else n for n in names})
    return {"plain_bytes": plain, "checkpoint_bytes": total, "plain_tensors": len(names), "plain_kinds": kinds}


def _step(weights: dict[str, Any], seed: int) -> None:
    """About 1 % of each matrix's elements moved, in place (as an optimizer step changes them)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for w in weights.values():
        if w.ndim == 2:
            flat = w.view(-1)
            hit = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=gen)
            flat[hit] += 0.01


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a checkpoint folder (default: bench/vllm_start.py's Llama)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()

    import vllm
    from safetensors.torch import load_file

    from weightlift import Client
    from weightlift.checkpoint import open_checkpoint

    if args.model:
        path = args.model
    else:
        from vllm_start import ensure_model

        path = ensure_model(sys.executable)
    files = sorted({t.file for t in open_checkpoint(path).tensors})
    port = _free_port()
    llm = vllm.LLM(
        model=path,
        load_format="weightlift",
        weight_transfer_config={"backend": "weightlift"},
        skip_tokenizer_init=True,
        enforce_eager=True,
        gpu_memory_utilization=0.05,
        max_model_len=128,
    )
    llm.init_weight_transfer_engine({"init_info": {"port": port, "token": TOKEN}})
    pid = llm.collective_rpc(_pid)[0]
    params = vllm.SamplingParams(max_tokens=4, temperature=0)
    phases: list[dict[str, Any]] = []

    def mark(phase: str, **extra: Any) -> None:
        gc.collect()
        time.sleep(1.0)  # the server's threads settle (a write behind, finalizers)
        row = {"phase": phase, **_status(pid), "loadavg": open("/proc/loadavg").read().split()[:3], **extra}
        phases.append(row)
        print(json.dumps(row), flush=True)

    def update(**info: Any) -> float:
        t0 = time.perf_counter()
        llm.start_weight_update()
        llm.update_weights({"update_info": info})
        llm.finish_weight_update()
        return time.perf_counter() - t0

    def tokens() -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    first_tokens = tokens()
    mark("started")
    probe = llm.collective_rpc(_plain_copies, args=(files,))[0]
    print(json.dumps({"plain_copies": probe}), flush=True)

    weights: dict[str, Any] = {}
    for f in files:
        weights.update(load_file(f))
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    address = ("127.0.0.1", port)
    with Client(address, token=TOKEN, keep_base=True) as trainer:
        r = trainer.push(weights)
        mark("pushed whole", bytes_sent=r.bytes_sent, push_s=r.seconds)
        mark("updated", update_s=update())
        _step(weights, 1)
        r = trainer.push(weights, in_place=True)
        mark("pushed a step as deltas, in place", bytes_sent=r.bytes_sent, deltas=r.deltas, push_s=r.seconds)
        mark("updated", update_s=update())
        _step(weights, 2)
        r = trainer.push(weights)
        mark("pushed a step as deltas, into new memory", bytes_sent=r.bytes_sent, deltas=r.deltas, push_s=r.seconds)
        mark("updated", update_s=update())
        step_tokens = tokens()
        mark("updated, release", update_s=update(release=True))
    with Client(address, token=TOKEN) as plain:
        r = plain.push(weights)
        mark("pushed again after release", bytes_sent=r.bytes_sent, cached=r.cached, push_s=r.seconds)
        mark("updated, release", update_s=update(release=True))
    assert tokens() == step_tokens, "the weights pushed again after a release serve other tokens"
    llm.llm_engine.engine_core.shutdown()
    result = {
        "model": path,
        "model_bytes": model_bytes,
        "plain_copies": probe,
        "tokens_changed_by_the_step": first_tokens != step_tokens,
        "phases": phases,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
