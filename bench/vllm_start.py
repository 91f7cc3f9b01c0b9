#!/usr/bin/env python3
"""vLLM engine start by load format: vLLM's own "Loading weights took" and the time to first token.

    python bench/vllm_start.py --python VENV/bin/python [--model DIR] [--runs 3] [--mode warm|cold|both]
                               [--settle 5] [--arms auto,weightlift,runai_streamer,fastsafetensors] [--json FILE]
                               [--engine-process]

``--python`` is an interpreter with vLLM installed (vLLM's CPU build pins a transformers of its
own, so it usually lives in a venv apart from weightlift's). Each run is a fresh process of it
that starts ``vllm.LLM(model, load_format=ARM)`` (the engine in that process) and generates one
greedy token from a fixed prompt; the window runs from the spawn to the line the child prints
then (``--engine-process``: the engine core in a process of its own, vLLM's default, timed by
vLLM's own figure only). An arm ``FORMAT:STRATEGY`` is a format with vLLM's
``safetensors_load_strategy`` (``auto:prefetch``: vLLM's own read ahead, which starts in its loader);
``weightlift:noOPTION`` is the ``weightlift`` format with that option false
(``weightlift:noprefetch``). The weight loading is timed the same way for every arm: the wall time of the format's
loader's ``load_weights`` (finding the files, reading them and ``model.load_weights``), which
is the span vLLM's own "Loading weights took N seconds" covers; that line is read from the
output too where the format logs it (the default loader, ``weightlift``; not
``runai_streamer``). All arms must produce the same tokens (eight greedy ones, generated after
the timed first).

The arms are interleaved, each round in its own order (the rotations of the arm list, then
those reversed), with a pause before every run (``--settle``). Warm runs find the model in the
page cache (one uncounted warm-up round reads it in); cold runs drop the model's files from the
page cache first (``posix_fadvise(DONTNEED)`` after writing back) and check with ``mincore``
that nothing stayed. An arm that cannot run here (``runai_streamer`` without
``runai-model-streamer``; ``fastsafetensors``, whose vLLM iterator places tensors on a CUDA
device) is reported as skipped with the reason.

Without ``--model``, a Llama of about 0.76 GB in bfloat16 (random weights, hidden 1536, 10
layers, vocabulary 32000, heads of 128) is written once by ``save_pretrained`` (by ``--python``'s
transformers) under the benchmark cache folder.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from typing import Any

from weightlift.benchmark.harness import bench_dir, evict_files, max_resident

ARMS = ("auto", "weightlift", "runai_streamer", "fastsafetensors")
MODEL_NAME = "vllm-llama-0.8g"
READY = "WL_VLLM_READY"
LOADING = re.compile(rb"Loading weights took ([0-9.]+) seconds")

MAKE = r"""
import sys, torch, transformers
cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=10,
                               num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                               tie_word_embeddings=False)
torch.manual_seed(0)
transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1], max_shard_size="300MB")
"""

CHILD = r"""
import json, sys, time
def main():
    arm, path, own_process = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    fmt, _, strategy = arm.partition(":")  # "auto:prefetch": vLLM's loader with that safetensors strategy
    if fmt == "runai_streamer":
        try:
            import runai_model_streamer  # noqa: F401
        except ImportError:
            print("WL_VLLM_SKIP runai-model-streamer is not installed", flush=True)
            return
    if fmt == "fastsafetensors":
        import torch
        if not torch.cuda.is_available():
            print("WL_VLLM_SKIP vLLM's fastsafetensors iterator places tensors on a CUDA device; there is none", flush=True)
            return
    import os
    if not own_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its loader can be timed
    from vllm import LLM, SamplingParams
    from vllm.model_executor import model_loader
    from weightlift.integrations.vllm import register
    register()
    timed = {}
    cls = model_loader.get_model_loader(model_loader.LoadConfig(load_format=fmt)).__class__
    inner = cls.load_weights
    def load_weights(self, model, model_config):
        t = time.perf_counter()
        inner(self, model, model_config)
        timed["load_weights_s"] = time.perf_counter() - t
    cls.load_weights = load_weights
    if fmt == "weightlift" and strategy.startswith("no"):  # "weightlift:noprefetch": an option of the format off
        extra = {"model_loader_extra_config": {strategy[2:]: False}}
    else:
        extra = {"safetensors_load_strategy": strategy} if strategy else {}
    llm = LLM(model=path, load_format=fmt, skip_tokenizer_init=True, enforce_eager=True,
              gpu_memory_utilization=0.05, max_model_len=128, **extra)
    prompt = [{"prompt_token_ids": [1, 8, 15, 22, 29, 36, 43, 50]}]
    first = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    print("WL_VLLM_READY", time.time_ns(), json.dumps({"first": list(first[0].outputs[0].token_ids), **timed}), flush=True)
    more = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    print("WL_VLLM_TOKENS", json.dumps(list(more[0].outputs[0].token_ids)), flush=True)
    llm.llm_engine.engine_core.shutdown()
if __name__ == "__main__":
    main()
"""


def ensure_model(python: str) -> str:
    path = os.path.join(bench_dir(), MODEL_NAME)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tmp = f"{path}.tmp{os.getpid()}"
    print(f"writing the benchmark model (once): {path}", file=sys.stderr)
    subprocess.run([python, "-c", MAKE, tmp], check=True)
    os.replace(tmp, path)
    return path


def model_files(path: str) -> list[str]:
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith((".safetensors", ".json")))


def run_child(python: str, arm: str, path: str, timeout: float, own_process: bool = False) -> dict[str, Any]:
    """One fresh engine: its window to the first token, vLLM's loading figure, its tokens. With
    ``own_process`` the engine core runs in a process of its own, as vLLM's default is; its
    loader cannot be timed from here, so the loading figure is vLLM's own line."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    t0 = time.time_ns()
    proc = subprocess.run(
        [python, "-c", CHILD, arm, path, "1" if own_process else "0"],
        capture_output=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    out = proc.stdout + proc.stderr
    skip = re.search(rb"WL_VLLM_SKIP (.*)", out)
    if skip:
        return {"skipped": skip.group(1).decode().strip()}
    ready = re.search(rb"WL_VLLM_READY (\d+) (.*)", out)
    tokens = re.search(rb"WL_VLLM_TOKENS (.*)", out)
    loading = LOADING.findall(out)
    if ready is None or tokens is None:
        tail = out.decode(errors="replace").strip().splitlines()[-8:]
        raise SystemExit(f"vllm_start: the {arm} arm failed (exit {proc.returncode}): " + " | ".join(tail))
    info = json.loads(ready.group(2))
    timed = info.get("load_weights_s", float(loading[-1]) if loading else None)
    if timed is None:
        return {"skipped": "its engine runs in a process of its own and it logs no loading figure"}
    return {
        "window_s": (int(ready.group(1)) - t0) / 1e9,
        "loading_s": timed,
        "vllm_loading_s": float(loading[-1]) if loading else None,
        "tokens": json.loads(tokens.group(1)),
    }


def round_order(arms: tuple[str, ...], rnd: int) -> tuple[str, ...]:
    orders = [arms[i:] + arms[:i] for i in range(len(arms))]
    orders += [o[::-1] for o in orders]
    return orders[rnd % len(orders)]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def run_mode(
    python: str, path: str, arms: tuple[str, ...], *, cold: bool, runs: int, settle: float, own_process: bool = False
) -> dict[str, Any]:
    files = model_files(path)
    res: dict[str, dict[str, Any]] = {
        a: {"window_s": [], "loading_s": [], "vllm_loading_s": [], "tokens": [], "resident_before": []} for a in arms
    }
    skipped: dict[str, str] = {}
    warmup = 0 if cold else 1
    for rnd in range(warmup + runs):
        for arm in round_order(arms, rnd - warmup):
            if arm in skipped:
                continue
            time.sleep(settle)
            resident = None
            if cold:
                evict_files(files)
                resident = max_resident(files)
            s = run_child(python, arm, path, timeout=900, own_process=own_process)
            if "skipped" in s:
                skipped[arm] = s["skipped"]
                print(f"  {arm}: skipped ({s['skipped']})", file=sys.stderr)
                continue
            label = "warm-up" if rnd < warmup else f"run {rnd - warmup + 1}"
            print(
                f"  {'cold' if cold else 'warm'} {label} {arm}: load_weights {s['loading_s']:.2f} s, "
                f"first token {s['window_s']:.2f} s",
                file=sys.stderr,
            )
            if rnd >= warmup:
                r = res[arm]
                r["window_s"].append(s["window_s"])
                r["loading_s"].append(s["loading_s"])
                if s["vllm_loading_s"] is not None:
                    r["vllm_loading_s"].append(s["vllm_loading_s"])
                r["tokens"].append(s["tokens"])
                if resident is not None:
                    r["resident_before"].append(resident)
    ran = {a: r for a, r in res.items() if a not in skipped}
    tokens = {json.dumps(t) for r in ran.values() for t in r["tokens"]}
    for r in ran.values():
        r["median_loading_s"] = _median(r["loading_s"])
        r["median_window_s"] = _median(r["window_s"])
        r["median_vllm_loading_s"] = _median(r["vllm_loading_s"])
    return {"mode": "cold" if cold else "warm", "arms": ran, "skipped": skipped, "same_tokens": len(tokens) == 1}


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"model {result['model']} ({result['bytes'] / 1e9:.2f} GB), median of {result['runs']} runs per arm, "
        f"{result['settle_s']:.0f} s pause before each run"
    ]
    head = f"{'mode':<5} {'load format':<16} {'load_weights':>13} {'vs auto':>8} {'vLLM says':>10} {'first token':>12}"
    lines += [head, "-" * len(head)]
    for m in result["modes"]:
        base = m["arms"].get("auto", {}).get("median_loading_s")
        for arm, r in m["arms"].items():
            ratio = f"{r['median_loading_s'] / base:.2f}x" if base else "-"
            said = r["median_vllm_loading_s"]
            said_s = f"{said:>8.2f} s" if said is not None else f"{'-':>10}"
            lines.append(
                f"{m['mode']:<5} {arm:<16} {r['median_loading_s']:>11.2f} s {ratio:>8} {said_s} {r['median_window_s']:>10.2f} s"
            )
        for arm, why in m["skipped"].items():
            lines.append(f"{m['mode']:<5} {arm:<16} skipped: {why}")
        if not m["same_tokens"]:
            lines.append("WARNING: the arms produced different tokens")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", required=True, help="an interpreter with vLLM installed")
    ap.add_argument("--model", help="a model folder (default: a 0.76 GB Llama written once)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mode", choices=("warm", "cold", "both"), default="both")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds to pause before each run")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--json", help="write the result here")
    ap.add_argument(
        "--engine-process", action="store_true", help="the engine core in a process of its own (vLLM's default)"
    )
    args = ap.parse_args(argv)
    arms = tuple(a for a in args.arms.split(",") if a)
    path = args.model or ensure_model(args.python)
    modes = ["warm", "cold"] if args.mode == "both" else [args.mode]
    result: dict[str, Any] = {
        "model": path,
        "bytes": sum(os.path.getsize(f) for f in model_files(path) if f.endswith(".safetensors")),
        "runs": args.runs,
        "engine_process": args.engine_process,
        "settle_s": args.settle,
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs",
        "loadavg": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "modes": [
            run_mode(
                args.python,
                path,
                arms,
                cold=m == "cold",
                runs=args.runs,
                settle=args.settle,
                own_process=args.engine_process,
            )
            for m in modes
        ],
    }
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
