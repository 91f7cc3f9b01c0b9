#!/usr/bin/env python3
"""Time to first token: transformers' own from_pretrained against weightlift.hf.from_pretrained.

    python bench/ttft.py [--model DIR] [--runs 3] [--mode warm|cold|both] [--settle 15] [--arms A,B] [--json FILE]

Each run is a fresh process that imports torch and transformers, builds the model from the
same folder (``transformers``: its ``from_pretrained``; ``weightlift``:
``weightlift.hf.from_pretrained`` as it is by default, parameters viewing a private copy-on-write
mapping of the files as transformers' own are; ``weightlift.prefetch``: the same, with
``weightlift.prefetch(folder)`` called before the imports, so that a cold read runs under them;
``weightlift.copy``: the same as ``weightlift`` with ``copy=True``,
parameters in memory of their own), runs one forward pass over an 8-token prompt and takes the
greedy next token. Its window runs from the spawn to the line the child prints then, read here;
the child also reports its own import, load and first-forward times, and its peak resident
memory (``getrusage``'s ``ru_maxrss``) after the imports, after the load and at the end. All
arms must produce the same token. The last line is the ratio for the README's table:
transformers' median time to first token over weightlift's, warm and cold, and each arm's
growth of peak resident memory from the imports to the first token against the checkpoint's size.

The arms are interleaved (each round in its own order, see ``round_order``), with a pause
before every run (``--settle``, 15 s) so that neither inherits memory the other just freed
while the host still backs it. Warm runs find the model in the page cache (one uncounted
warm-up round reads it in); cold runs first drop the model's files from the page cache
(``posix_fadvise(DONTNEED)`` after writing back) and check with ``mincore`` that nothing
stayed. Only the model's files are evicted: the Python, torch and transformers files the
imports read stay cached, as they would on a serving machine.

Without ``--model``, a Llama of about 0.76 GB in bfloat16 (random weights, hidden 1536, 10
layers, vocabulary 32000) is written once by transformers' ``save_pretrained`` under the
benchmark cache folder (``~/.cache/weightlift/bench``, or ``WEIGHTLIFT_BENCH_DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

from weightlift.benchmark.harness import (
    READY,
    ArmFailed,
    ArmSkipped,
    bench_dir,
    ensure_bytecode,
    evict_files,
    max_resident,
    run_once,
)
from weightlift.benchmark.stats import summarize

ARMS = ("transformers", "weightlift", "weightlift.prefetch", "weightlift.copy")
MODEL_NAME = "ttft-llama-0.8g"

MAKE = r"""
import sys, torch, transformers
cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=10,
                               num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                               tie_word_embeddings=False, dtype="bfloat16")
torch.manual_seed(0)
transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16).save_pretrained(sys.argv[1], max_shard_size="300MB")
"""

CHILD = r"""
import time
t0 = time.perf_counter()
import json, os, resource, sys
arm, path = sys.argv[1], sys.argv[2]
if arm == "weightlift.prefetch":
    import weightlift
    weightlift.prefetch(path)  # the files' read runs under the imports below
import torch, transformers
with open(os.path.join(path, "config.json")) as f:
    cls = getattr(transformers, json.load(f)["architectures"][0])  # transformers imports the model's module here
if arm.startswith("weightlift"):
    import weightlift.hf
hwm = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
t_import, rss_import = time.perf_counter(), hwm()
if arm == "transformers":
    model = cls.from_pretrained(path)
else:
    model = weightlift.hf.from_pretrained(path, model_class=cls, progress=False, copy=True if arm == "weightlift.copy" else None)
t_load, rss_load = time.perf_counter(), hwm()
with torch.inference_mode():
    token = int(model(input_ids=torch.tensor([[1, 8, 15, 22, 29, 36, 43, 50]])).logits[0, -1].argmax())
t_first = time.perf_counter()
info = {"import_s": t_import - t0, "load_s": t_load - t_import, "forward_s": t_first - t_load,
        "inner_s": t_first - t0, "peak_rss": hwm(), "import_rss": rss_import, "load_growth": rss_load - rss_import,
        "growth": hwm() - rss_import, "token": token, "dtype": str(model.dtype)}
print(READY, time.time_ns(), json.dumps(info), flush=True)
""".replace("READY,", repr(READY) + ",")


def ensure_model() -> str:
    path = os.path.join(bench_dir(), MODEL_NAME)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tmp = f"{path}.tmp{os.getpid()}"
    print(f"writing the benchmark model (once): {path}", file=sys.stderr)
    subprocess.run([sys.executable, "-c", MAKE, tmp], check=True, env=_env())
    os.replace(tmp, path)
    return path


def _env() -> dict[str, str]:
    # the progress bars of both loaders would go to a pipe nobody reads
    return {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}


def model_files(path: str) -> list[str]:
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith((".safetensors", ".json")))


def round_order(rnd: int) -> tuple[str, ...]:
    """The arms' order in round ``rnd``: the rotations of ARMS, then those of ARMS reversed, so
    that over three rounds each arm runs once in each position, and over six each follows each
    other arm equally often. (The harness's seeded shuffles gave three arms the same order in
    rounds 1 to 3.)"""
    n = len(ARMS)
    orders = [ARMS[i:] + ARMS[:i] for i in range(n)]
    orders += [o[::-1] for o in orders]
    return orders[rnd % len(orders)]


def run_mode(path: str, *, cold: bool, runs: int, settle: float, log: Any) -> dict[str, Any]:
    files = model_files(path)
    res: dict[str, dict[str, Any]] = {a: {"window_s": [], "samples": [], "resident_before": []} for a in ARMS}
    warmup = 0 if cold else 1  # warm: one uncounted round puts the files in the page cache
    for rnd in range(warmup + runs):
        for arm in round_order(rnd - warmup):  # counted rounds from 0: balanced whatever the warm-up
            time.sleep(settle)
            resident = None
            if cold:
                evict_files(files)
                resident = max_resident(files)
            try:
                s = run_once([sys.executable, "-c", CHILD, arm, path], env=_env(), timeout=900)
            except (ArmFailed, ArmSkipped) as e:
                raise SystemExit(f"ttft: the {arm} arm failed: {e}") from None
            label = "warm-up" if rnd < warmup else f"run {rnd - warmup + 1}"
            log(
                f"  {'cold' if cold else 'warm'} {label} {arm}: {s.window_s:.2f} s to first token"
                f" (load {s.info['load_s']:.2f} s, peak RSS {s.info['peak_rss'] / 2**30:.2f} GiB,"
                f" +{s.info['growth'] / 2**30:.2f} GiB from the imports to the first token)"
            )
            if rnd >= warmup:
                r = res[arm]
                r["window_s"].append(s.window_s)
                r["samples"].append(s.info)
                if resident is not None:
                    r["resident_before"].append(resident)
    for r in res.values():
        r["summary"] = {
            k: summarize([x[k] for x in r["samples"]])
            for k in ("import_s", "load_s", "forward_s", "peak_rss", "load_growth", "growth")
        }
        r["summary"]["window_s"] = summarize(r["window_s"])
    tokens = {x["token"] for r in res.values() for x in r["samples"]}
    return {
        "mode": "cold" if cold else "warm",
        "arms": res,
        "same_token": len(tokens) == 1,
        "max_resident_before": max((x for r in res.values() for x in r["resident_before"]), default=None),
    }


def format_table(result: dict[str, Any]) -> str:
    size = result["bytes"]
    lines = [
        f"model {result['model']} ({size / 1e9:.2f} GB in {result['files']} files), "
        f"median of {result['runs']} runs per arm, {result['settle_s']:.0f} s pause before each run, "
        f"load average {result.get('loadavg', '?')}"
    ]
    head = (
        f"{'mode':<5} {'arm':<17} {'to 1st token':>12} {'(min-max)':>15} {'import':>7} {'load':>7} {'forward':>8}"
        f" {'peak RSS':>9} {'RSS growth':>10}"
    )
    lines += [head, "-" * len(head)]
    for m in result["modes"]:
        for arm in ARMS:
            s = m["arms"][arm]["summary"]
            w = s["window_s"]
            lines.append(
                f"{m['mode']:<5} {arm:<17} {w['median']:>10.2f} s {w['min']:>6.2f}-{w['max']:<6.2f} s"
                f" {s['import_s']['median']:>6.2f}s {s['load_s']['median']:>6.2f}s {s['forward_s']['median']:>7.2f}s"
                f" {s['peak_rss']['median'] / 2**30:>5.2f} GiB {s['growth']['median'] / size:>9.2f}x"
            )
        t = m["arms"]["transformers"]["summary"]
        note = "      speed-up over transformers (its median over the arm's): " + ", ".join(
            f"{arm} load {t['load_s']['median'] / m['arms'][arm]['summary']['load_s']['median']:.2f}x, to first token "
            f"{t['window_s']['median'] / m['arms'][arm]['summary']['window_s']['median']:.2f}x"
            for arm in ARMS[1:]
        )
        if not m["same_token"]:
            note += "; WARNING: the arms produced different tokens"
        if m["max_resident_before"] is not None:
            note += f"; at most {m['max_resident_before'] * 100:.1f} % of a file resident before a cold run"
        lines.append(note)
    lines.append(
        "RSS growth: peak resident memory at the first token less that after the imports, over the checkpoint's size"
    )
    lines.append(ratio_line(result))
    return "\n".join(lines)


def ratio_line(result: dict[str, Any]) -> str:
    """One line for the README's table: transformers' time to first token over weightlift's."""
    parts = []
    for m in result["modes"]:
        a = {arm: m["arms"][arm]["summary"] for arm in ARMS}
        ratio = a["transformers"]["window_s"]["median"] / a["weightlift"]["window_s"]["median"]
        # run i of each arm ran in round i: the median of those ratios pairs runs of one round
        paired = statistics.median(
            t / w
            for t, w in zip(m["arms"]["transformers"]["window_s"], m["arms"]["weightlift"]["window_s"], strict=False)
        )
        # the imports are the same for both and most of the window: the part after them, apart
        after = {
            arm: statistics.median(x["load_s"] + x["forward_s"] for x in m["arms"][arm]["samples"]) for arm in ARMS
        }
        text = (
            f"{m['mode']} {ratio:.2f}x ({a['weightlift']['window_s']['median']:.2f} s vs "
            f"{a['transformers']['window_s']['median']:.2f} s; per round {paired:.2f}x; after the imports "
            f"{after['transformers'] / after['weightlift']:.2f}x, {after['weightlift']:.2f} s vs {after['transformers']:.2f} s"
        )
        if "weightlift.prefetch" in a:
            pre = a["transformers"]["window_s"]["median"] / a["weightlift.prefetch"]["window_s"]["median"]
            text += (
                f"; with weightlift.prefetch before the imports {pre:.2f}x, "
                f"{a['weightlift.prefetch']['window_s']['median']:.2f} s"
            )
        parts.append(text + ")")
    growth = ", ".join(
        f"{arm} {max(x['growth'] for m in result['modes'] for x in m['arms'][arm]['samples']) / result['bytes']:.2f}x"
        for arm in ARMS
    )
    return (
        f"RATIO time to first token, transformers' from_pretrained / weightlift.hf.from_pretrained: "
        f"{'; '.join(parts)}; largest RSS growth to the first token / checkpoint size: {growth}"
    )


def main(argv: list[str] | None = None) -> int:
    global ARMS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a folder written by save_pretrained (default: a generated 0.76 GB Llama)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mode", choices=["warm", "cold", "both"], default="both")
    ap.add_argument("--settle", type=float, default=15.0, help="pause before each run, seconds (default 15)")
    ap.add_argument("--json", metavar="FILE", help="write the result as JSON here ('-': stdout, instead of the table)")
    ap.add_argument(
        "--arms",
        default=",".join(ARMS),
        help=f"comma-separated, transformers and weightlift among them (default {','.join(ARMS)})",
    )
    a = ap.parse_args(argv)
    chosen = tuple(x.strip() for x in a.arms.split(",") if x.strip())
    if set(chosen) - set(ARMS) or not {"transformers", "weightlift"} <= set(chosen):
        ap.error(f"--arms: choose from {', '.join(ARMS)}, transformers and weightlift included")
    ARMS = chosen
    if a.runs < 1:
        ap.error("--runs must be at least 1")
    path = a.model or ensure_model()
    ensure_bytecode()
    files = model_files(path)
    log = lambda s: print(s, file=sys.stderr, flush=True)
    modes = ["warm", "cold"] if a.mode == "both" else [a.mode]
    result: dict[str, Any] = {
        "schema": "weightlift-ttft/1",
        "model": path,
        "files": len(files),
        "bytes": sum(os.path.getsize(f) for f in files if f.endswith(".safetensors")),
        "runs": a.runs,
        "arms": list(ARMS),
        "settle_s": a.settle,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "modes": [],
        "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    for m in modes:
        result["modes"].append(run_mode(path, cold=m == "cold", runs=a.runs, settle=a.settle, log=log))
    if a.json == "-":
        print(json.dumps(result, indent=1))
        return 0
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
