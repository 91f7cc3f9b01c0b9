#!/usr/bin/env python3
"""weightlift's push against llama.cpp's RPC server, same run, same model, fresh processes.

The model is a ~2 GB GGUF shaped like a small Llama (20 blocks of 9 tensors plus token_embd,
output_norm and output: 183 tensors, F16 matrices and F32 norms, random data), made once and
cached under ~/.cache/weightlift/bench/ (or --model PATH).

Arms, each run with a fresh server started before it and ready (its ready line read):

  llama.rpc    bench/llamacpp/rpc_server (ggml's RPC server on the CPU backend, no cache, as
               llama.cpp's rpc-server runs it), then bench/llamacpp/rpc_upload: what llama.cpp's
               loader does when the whole model goes to one RPC device (mmap, one buffer,
               ggml_backend_tensor_set per tensor), ending with a round trip that proves the
               server stored everything (--no-fence drops it)
  wl.push      python -m weightlift serve --port P, then python -m weightlift push MODEL --to
  wl.push.api  the same server, then python -c '... weightlift.Client(addr).push(MODEL)'

The time is the client process's, spawn to exit. Each round runs the arms in an order shuffled
with a seeded RNG (every permutation once per 6 rounds, so each arm takes each place equally);
1 warm-up round then --runs counted ones; --settle seconds (default 20) pass before every run
so that memory freed by the previous run does not speed up the next. The page cache stays
warm: the model is read from memory in every run. After each run the server's CPU
time is read from /proc and what arrived is checked (weightlift: Client.list count and bytes;
rpc: the uploader's own count); before the rounds one rpc upload is read back and compared
with the file byte for byte.

Build the two ggml programs first (see bench/llamacpp/README.md):

    bench/llamacpp/build.sh ~/src/ggml ~/.cache/weightlift/llamacpp/bin
    python bench/vs_llamacpp.py [--llama-bin DIR] [--runs 5] [--settle 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("WEIGHTLIFT_CACHE", Path.home() / ".cache" / "weightlift"))
DEFAULT_BIN = CACHE / "llamacpp" / "bin"
ARMS = ("llama.rpc", "wl.push", "wl.push.api")
RPC_VERSION: list[str | None] = [None]  # what rpc_server says it runs ("Starting RPC server v5.1.0")

# A small Llama: d_model 2048, 32 heads of 64, 4 KV heads (GQA), FFN 5632, vocab 32000, 20 blocks.
D, KV, FFN, VOCAB, BLOCKS = 2048, 256, 5632, 32000, 20

API_CLIENT = r"""
import json, sys, time
t0 = time.perf_counter()
import weightlift
t1 = time.perf_counter()
with weightlift.Client(sys.argv[1]) as c:
    t2 = time.perf_counter()
    r = c.push(sys.argv[2])
    t3 = time.perf_counter()
print(json.dumps({"tensors": r.tensors, "bytes": r.bytes, "push_s": r.seconds, "connect_push_s": t3 - t1,
                  "import_s": t1 - t0, "connect_s": t2 - t1}))
"""


# ---- model ---------------------------------------------------------------------------------------


def llama_tensors() -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, dtype) in the order llama.cpp's converter writes a Llama."""
    out = [("token_embd.weight", (VOCAB, D), "f16")]
    for i in range(BLOCKS):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (D,), "f32"),
            (b + "attn_q.weight", (D, D), "f16"),
            (b + "attn_k.weight", (KV, D), "f16"),
            (b + "attn_v.weight", (KV, D), "f16"),
            (b + "attn_output.weight", (D, D), "f16"),
            (b + "ffn_norm.weight", (D,), "f32"),
            (b + "ffn_gate.weight", (FFN, D), "f16"),
            (b + "ffn_up.weight", (FFN, D), "f16"),
            (b + "ffn_down.weight", (D, FFN), "f16"),
        ]
    out += [("output_norm.weight", (D,), "f32"), ("output.weight", (VOCAB, D), "f16")]
    return out


def make_model(path: Path, seed: int = 0) -> dict[str, Any]:
    """Write the GGUF (once) and return its description; a .json beside it says it is complete."""
    meta_path = path.with_suffix(".json")
    spec = llama_tensors()
    want = {"tensors": len(spec), "layout": f"llama d{D} kv{KV} ffn{FFN} vocab{VOCAB} blocks{BLOCKS}", "seed": seed}
    if path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if all(meta.get(k) == v for k, v in want.items()) and meta.get("file_bytes") == path.stat().st_size:
            return meta
    import numpy as np
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    print(f"making {path} ({len(spec)} tensors) ...", file=sys.stderr, flush=True)
    w = GGUFWriter(tmp, arch="llama")
    w.add_block_count(BLOCKS)
    w.add_context_length(4096)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FFN)
    w.add_head_count(D // 64)
    w.add_head_count_kv(KV // 64)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1)  # mostly F16
    dtypes = {"f16": np.float16, "f32": np.float32}
    nbytes = 0
    for name, shape, dt in spec:
        n = int(np.prod(shape)) * np.dtype(dtypes[dt]).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtypes[dt]), n)
        nbytes += n
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, shape, dt in spec:
        if dt == "f16":
            # random bits with the top exponent bit clear: finite halves, |x| < 2
            a = (rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) & np.uint16(0xBFFF)).view(np.float16)
        else:
            a = (1.0 + 0.01 * rng.standard_normal(shape)).astype(np.float32)
        w.write_tensor_data(a)
    w.close()
    os.replace(tmp, path)
    meta = dict(want, bytes=nbytes, file_bytes=path.stat().st_size)
    meta_path.write_text(json.dumps(meta, indent=1))
    return meta


# ---- processes -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float | None:
    """user + sys CPU seconds of a live process, from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


class Server:
    """A server process started fresh; ready when a line matching ``ready`` appears on its stdout."""

    def __init__(self, argv: list[str], ready: str, timeout: float = 60.0):
        self.lines: list[str] = []
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        got = threading.Event()
        pat = re.compile(ready)

        def drain() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                if not got.is_set() and pat.search(line):
                    got.set()
            got.set()

        self.reader = threading.Thread(target=drain, daemon=True)
        self.reader.start()
        if not got.wait(timeout) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"server {argv[0]} did not get ready: " + " | ".join(self.lines[-8:]))
        self.ready_s = time.perf_counter() - t0
        self.cpu_ready_s = cpu_seconds(self.proc.pid)

    def cpu(self) -> float | None:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.reader.join(5)


def run_client(argv: list[str], timeout: float) -> tuple[float, float, str, int]:
    """Spawn ``argv``, wait for its exit: (wall seconds spawn to exit, its CPU seconds, stdout, status)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    try:
        out = p.stdout.read() if p.stdout else ""  # returns at EOF: the child has exited (or closed stdout)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
    finally:
        timer.cancel()
    p.returncode = os.waitstatus_to_exitcode(status)
    return wall, ru.ru_utime + ru.ru_stime, out, p.returncode


# ---- arms ----------------------------------------------------------------------------------------


def run_llama(args: argparse.Namespace, model: Path, meta: dict[str, Any], *, verify: bool = False) -> dict[str, Any]:
    port = free_port()
    srv = Server(
        [str(args.llama_bin / "rpc_server"), "--host", "127.0.0.1", "--port", str(port)], r"^rpc_server: listening on "
    )
    try:
        argv = [str(args.llama_bin / "rpc_upload"), str(model), "--endpoint", f"127.0.0.1:{port}", "--json"]
        if args.no_fence:
            argv.append("--no-fence")
        if verify:
            argv.append("--verify")
        wall, ccpu, out, rc = run_client(argv, args.timeout)
        scpu = srv.cpu()
    finally:
        srv.stop()
    for line in srv.lines:
        m = re.search(r"Starting RPC server v(\S+)", line)
        if m:
            RPC_VERSION[0] = m.group(1)
    if rc != 0:
        raise RuntimeError(f"rpc_upload exited {rc}: {out.strip()[-800:]}")
    info = json.loads(out.strip().splitlines()[-1])
    ok = info["tensors"] == meta["tensors"] and info["bytes"] == meta["bytes"]
    if verify:
        ok = ok and info["mismatched"] == 0
    return {
        "wall_s": wall,
        "inner_s": info["seconds"],
        "client_cpu_s": ccpu,
        "server_cpu_s": scpu,
        "server_cpu_push_s": None if scpu is None else scpu - (srv.cpu_ready_s or 0.0),
        "server_ready_s": srv.ready_s,
        "tensors": info["tensors"],
        "bytes": info["bytes"],
        "ok": ok,
        "detail": info,
    }


def wl_check(addr: str) -> tuple[int, int]:
    import weightlift

    with weightlift.Client(addr) as c:
        entries = c.list()
    return len(entries), sum(e.nbytes for e in entries)


PUSHED = re.compile(r"pushed (\d+) tensors, ([\d,]+) bytes to \S+ in ([\d.]+) s")


def run_wl(args: argparse.Namespace, model: Path, meta: dict[str, Any], *, api: bool) -> dict[str, Any]:
    port = free_port()
    srv = Server(
        [sys.executable, "-m", "weightlift", "serve", "--host", "127.0.0.1", "--port", str(port)],
        r"^weightlift: serving on ",
    )
    addr = f"127.0.0.1:{port}"
    try:
        if api:
            argv = [sys.executable, "-c", API_CLIENT, addr, str(model)]
        else:
            argv = [sys.executable, "-m", "weightlift", "push", str(model), "--to", addr]
        wall, ccpu, out, rc = run_client(argv, args.timeout)
        scpu = srv.cpu()
        if rc != 0:
            raise RuntimeError(f"weightlift push exited {rc}: {out.strip()[-800:]}")
        n, nbytes = wl_check(addr)
    finally:
        srv.stop()
    if api:
        info = json.loads(out.strip().splitlines()[-1])
        inner, tensors, sent = info["push_s"], info["tensors"], info["bytes"]
    else:
        m = PUSHED.search(out)
        if not m:
            raise RuntimeError(f"cannot read the push's output: {out.strip()[-400:]}")
        info = {"line": m.group(0)}
        tensors, sent, inner = int(m.group(1)), int(m.group(2).replace(",", "")), float(m.group(3))
    ok = n == meta["tensors"] and nbytes == meta["bytes"] and tensors == n and sent == nbytes
    return {
        "wall_s": wall,
        "inner_s": inner,
        "client_cpu_s": ccpu,
        "server_cpu_s": scpu,
        "server_cpu_push_s": None if scpu is None else scpu - (srv.cpu_ready_s or 0.0),
        "server_ready_s": srv.ready_s,
        "tensors": n,
        "bytes": nbytes,
        "ok": ok,
        "detail": info,
    }


def run_arm(name: str, args: argparse.Namespace, model: Path, meta: dict[str, Any]) -> dict[str, Any]:
    if name == "llama.rpc":
        return run_llama(args, model, meta)
    return run_wl(args, model, meta, api=name == "wl.push.api")


# ---- statistics ----------------------------------------------------------------------------------


def summary(xs: list[float]) -> dict[str, float] | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def fmt(s: dict[str, float] | None, unit: str = "s") -> str:
    if not s:
        return "-"
    return f"{s['median']:.3f} {unit} ({s['min']:.3f}-{s['max']:.3f})"


def round_orders(arms: list[str], rounds: int, seed: int) -> list[list[str]]:
    """The arm order of each round: every permutation of the arms once per block of len(arms)!
    rounds, the blocks shuffled by a seeded RNG. With 3 arms and 6 rounds each arm runs first,
    second and last twice, so none keeps the same neighbour or position."""
    perms = [list(p) for p in itertools.permutations(arms)]
    rng = random.Random(seed)
    out: list[list[str]] = []
    while len(out) < rounds:
        block = [list(p) for p in perms]
        rng.shuffle(block)
        out += block
    return out[:rounds]


def ggml_commit(bin_dir: Path) -> str:
    f = bin_dir / "ggml-commit"
    return f.read_text().strip() if f.exists() else "unknown"


def wl_commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--llama-bin",
        type=Path,
        default=DEFAULT_BIN,
        help=f"folder holding rpc_server and rpc_upload from bench/llamacpp/build.sh (default {DEFAULT_BIN})",
    )
    p.add_argument("--model", type=Path, help="GGUF to push (default: the cached synthetic ~2 GB Llama, made once)")
    p.add_argument("--runs", type=int, default=5, help="counted rounds (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted rounds first (default 1)")
    p.add_argument("--settle", type=float, default=20.0, help="pause in seconds before every run (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-round arm orders (default 0)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    p.add_argument(
        "--no-fence",
        action="store_true",
        help="llama.rpc: end the timing when the last SET_TENSOR is written, not when it is stored",
    )
    p.add_argument("--no-verify", action="store_true", help="skip the byte-for-byte read-back check of one rpc upload")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a client may run (default 600)")
    p.add_argument("--json", metavar="FILE", help="also write every sample and the summary as JSON")
    return p


def _model(a: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The GGUF to push and its tensor count and bytes (the synthetic one made once without --model)."""
    if a.model:
        model = a.model.expanduser()
        from gguf import GGUFReader

        r = GGUFReader(model)
        meta = {
            "tensors": len(r.tensors),
            "bytes": sum(int(t.n_bytes) for t in r.tensors),
            "file_bytes": model.stat().st_size,
        }
        del r
    else:
        model = CACHE / "bench" / f"llama-{BLOCKS}blk-f16.gguf"
        meta = make_model(model)
    return model, meta


def _rounds(
    a: argparse.Namespace, arms: list[str], model: Path, meta: dict[str, Any], say: Any
) -> tuple[dict[str, list[dict[str, Any]]], list[list[str]]]:
    """Every round, each in its own arm order, a pause before every run; the samples and the orders."""
    samples: dict[str, list[dict[str, Any]]] = {x: [] for x in arms}
    order_log: list[list[str]] = []
    orders = round_orders(arms, a.warmup + a.runs, a.seed)
    for rnd in range(a.warmup + a.runs):
        counted = rnd >= a.warmup
        order = orders[rnd]
        order_log.append(order)
        for name in order:
            if a.settle > 0:
                time.sleep(a.settle)
            s = run_arm(name, a, model, meta)
            s["round"] = rnd
            s["counted"] = counted
            samples[name].append(s)
            tag = f"run {rnd - a.warmup + 1}" if counted else "warm-up"
            scpu = "-" if s["server_cpu_push_s"] is None else f"{s['server_cpu_push_s']:.2f}"
            say(
                f"  {tag:<8} {name:<12} {s['wall_s']:.3f} s (in-process {s['inner_s']:.3f} s; client CPU "
                f"{s['client_cpu_s']:.2f} s, server CPU {scpu} s; {s['tensors']} tensors, {s['bytes']:,} bytes "
                f"{'ok' if s['ok'] else 'WRONG'})"
            )
    return samples, order_log


def _summaries(arms: list[str], samples: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per arm the medians of the counted runs; llama.rpc over each other arm, round by round."""
    res: dict[str, Any] = {}
    for name in arms:
        c = [s for s in samples[name] if s["counted"]]
        res[name] = {
            "wall": summary([s["wall_s"] for s in c]),
            "inner": summary([s["inner_s"] for s in c]),
            "client_cpu": summary([s["client_cpu_s"] for s in c]),
            "server_cpu": summary([s["server_cpu_push_s"] for s in c]),
            "server_ready": summary([s["server_ready_s"] for s in c]),
            "all_ok": all(s["ok"] for s in samples[name]),
        }
    ratios: dict[str, Any] = {}
    if "llama.rpc" in arms:
        for name in arms:
            if name == "llama.rpc":
                continue
            by_round = {s["round"]: s["wall_s"] for s in samples[name] if s["counted"]}
            rs = [
                s["wall_s"] / by_round[s["round"]]
                for s in samples["llama.rpc"]
                if s["counted"] and s["round"] in by_round
            ]
            ratios[f"llama.rpc/{name}"] = {"per_round": rs, **(summary(rs) or {})}

    return res, ratios


def _report(
    a: argparse.Namespace,
    arms: list[str],
    env: dict[str, Any],
    meta: dict[str, Any],
    res: dict[str, Any],
    ratios: dict[str, Any],
    verified: bool | None,
) -> list[str]:
    """The table and its notes, as lines."""
    lines = [
        f"weightlift push vs llama.cpp RPC server (ggml {env['ggml_commit'][:12]}, RPC protocol "
        f"v{RPC_VERSION[0] or '?'}), loopback, CPU",
        f"model: {meta['tensors']} tensors, {meta['bytes']:,} bytes ({meta['bytes'] / 1e9:.2f} GB), page cache warm",
        f"{a.warmup} warm-up + {a.runs} counted rounds, arm order shuffled per round (seeded {a.seed}; each "
        f"permutation once per {math.factorial(len(arms))} rounds), "
        f"{a.settle:g} s pause before every run; fresh server per run, started and ready before the client",
        "time: client process spawn to exit"
        + (
            ""
            if "llama.rpc" not in arms
            else (
                ", llama.rpc fenced (ends when the server has stored every byte)"
                if not a.no_fence
                else ", llama.rpc NOT fenced"
            )
        ),
        f"load average before {env['loadavg_before']}, after {env['loadavg_after']} ({env['cpus']} CPUs)",
        "",
        f"{'arm':<12} {'spawn to exit, median (min-max)':<34} {'in-process':<26} {'client CPU':<12} {'server CPU':<12} bytes",
    ]
    for name in arms:
        r = res[name]
        lines.append(
            f"{name:<12} {fmt(r['wall']):<34} {fmt(r['inner']):<26} "
            f"{(r['client_cpu'] or {}).get('median', float('nan')):>7.2f} s   "
            f"{(r['server_cpu'] or {}).get('median', float('nan')):>7.2f} s   "
            f"{'all ok' if r['all_ok'] else 'MISMATCH'}"
        )
    if ratios:
        lines.append("")
        for k, v in ratios.items():
            lines.append(
                f"{k}: median of per-round ratios {v['median']:.2f}x (min {v['min']:.2f}, max {v['max']:.2f}); "
                f"per round " + ", ".join(f"{x:.2f}" for x in v["per_round"])
            )
    if verified is not None:
        lines.append(
            f"rpc read-back check before the rounds: {'every byte matches the file' if verified else 'FAILED'}"
        )
    lines.append(
        "in-process: rpc_upload's own load time (connect to fence); wl.push: the CLI's reported push "
        "time; wl.push.api: Client.push's seconds. server CPU: user+sys from ready to after the client exited"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    if not arms or any(x not in ARMS for x in arms) or a.runs < 1 or a.warmup < 0:
        p.error(f"--arms must name some of {','.join(ARMS)}; --runs >= 1; --warmup >= 0")
    a.llama_bin = a.llama_bin.expanduser()
    if "llama.rpc" in arms and not all((a.llama_bin / x).exists() for x in ("rpc_server", "rpc_upload")):
        p.error(
            f"no rpc_server/rpc_upload in {a.llama_bin}: build them with bench/llamacpp/build.sh SRC_DIR {a.llama_bin}"
        )

    model, meta = _model(a)
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    env = {
        "ggml_commit": ggml_commit(a.llama_bin),
        "weightlift_commit": wl_commit(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "loadavg_before": loadavg(),
    }
    say(f"model {model}: {meta['tensors']} tensors, {meta['bytes']:,} tensor bytes ({meta['bytes'] / 1e9:.2f} GB)")
    say(
        f"ggml {env['ggml_commit']}, weightlift {env['weightlift_commit']}, {env['cpus']} CPUs, "
        f"load average {env['loadavg_before']}"
    )

    # warm the page cache, and check one rpc upload byte for byte (not timed)
    with open(model, "rb") as f:
        while f.read(64 << 20):
            pass
    verified = None
    if "llama.rpc" in arms and not a.no_verify:
        v = run_llama(a, model, meta, verify=True)
        verified = v["ok"]
        say(
            f"rpc read-back check: {v['tensors']} tensors, {v['bytes']:,} bytes, "
            f"{v['detail']['mismatched']} differ from the file -> {'ok' if v['ok'] else 'FAILED'}"
        )

    samples, order_log = _rounds(a, arms, model, meta, say)
    env["loadavg_after"] = loadavg()
    env["rpc_protocol"] = RPC_VERSION[0]

    res, ratios = _summaries(arms, samples)
    lines = _report(a, arms, env, meta, res, ratios, verified)
    print("\n".join(lines), flush=True)

    if a.json:
        out = {
            "env": env,
            "model": {"path": str(model), **meta},
            "args": {k: str(v) for k, v in vars(a).items()},
            "order": order_log,
            "samples": samples,
            "summary": res,
            "ratios": ratios,
            "verified": verified,
        }
        Path(a.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.json}")
    bad = [n for n in arms if not res[n]["all_ok"]] + (["rpc read-back"] if verified is False else [])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
