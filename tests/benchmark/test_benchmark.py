from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

from tests.devices import HAS_TORCH
from weightlift.benchmark import arms as bench_arms
from weightlift.benchmark import floors as bench_floors
from weightlift.benchmark import suite as bench_suite
from weightlift.benchmark.harness import (
    Arm,
    ArmFailed,
    ArmSkipped,
    child_argv,
    describe_checkpoint,
    evict_files,
    max_resident,
    round_order,
    run_arms,
    run_once,
    with_preload,
)
from weightlift.benchmark.report import format_table
from weightlift.benchmark.stats import paired_ratio, summarize
from weightlift.benchmark.suite import SCHEMA, build_arms, cuda_reason, expand_arm_names, run_benchmark
from weightlift.errors import OptionError


def _marker_arm(name: str, payload: dict | None = None, *, sleep: float = 0.0, **kw) -> Arm:
    code = (
        "import json,time\n"
        f"time.sleep({sleep})\n"
        f"print('WL_READY', time.time_ns(), json.dumps({payload or {'inner_s': 0.0}!r}), flush=True)\n"
    )
    return Arm(name, [sys.executable, "-c", code], **kw)


# -- statistics --


def test_summarize_fixed_inputs() -> None:
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s == {"n": 5, "median": 3.0, "min": 1.0, "max": 5.0, "q1": 2.0, "q3": 4.0, "iqr": 2.0}
    s = summarize([4.0, None, 2.0])  # failed runs are left out
    assert (s["n"], s["median"], s["min"], s["max"], s["iqr"]) == (2, 3.0, 2.0, 4.0, 1.0)
    assert summarize([7.0])["iqr"] == 0.0
    assert summarize([])["median"] is None


def test_paired_ratio_pairs_runs_of_the_same_round() -> None:
    # pairwise 0.5, 2, 0.5 -> 0.5; the ratio of the medians would be 3/5
    r = paired_ratio([1.0, 10.0, 3.0], [2.0, 5.0, 6.0])
    assert r["ratios"] == [0.5, 2.0, 0.5]
    assert r["median"] == 0.5
    r = paired_ratio([2.0, 4.0, None, 8.0], [1.0, 2.0, 2.0, None])
    assert r["ratios"] == [2.0, 2.0] and r["median"] == 2.0
    assert paired_ratio([None], [1.0])["median"] is None


def test_expand_arm_names() -> None:
    assert expand_arm_names("wl.numpy, safetensors.numpy") == ["wl.numpy", "safetensors.numpy"]
    assert "wl.push" in expand_arm_names("remote") and "runai" not in expand_arm_names("remote")
    assert expand_arm_names("local,wl.numpy").count("wl.numpy") == 1
    assert expand_arm_names(None, quick=True) == [
        "safetensors.numpy",
        "wl.numpy",
        "wl.numpy.nocopy",
        "wl.push",
        "limit.copy",
        "limit.tcp.fresh",  # the push's floor: TCP into fresh memory, as a fresh server's is
    ]
    with pytest.raises(OptionError):
        expand_arm_names("no.such.arm")
    with pytest.raises(OptionError):
        expand_arm_names("base.copy")  # a baseline is not an arm


def test_the_installed_bench_holds_weightlift_its_extras_peers_and_the_floors_only() -> None:
    kinds = {s.kind for s in bench_suite.PACKAGE.specs.values()}
    assert kinds == {"local", "remote", "limit", "baseline"}
    for name in bench_suite.PACKAGE.specs:
        assert name.split(".")[0] in ("wl", "safetensors", "fastsafetensors", "limit", "base"), name
    # every peer the bench extra installs runs as an arm (tensorizer, which needs a converted
    # copy of the checkpoint, is the research bench's, in the peers extra)
    assert "fastsafetensors" in expand_arm_names("local")
    for peer in ("runai", "tensorizer", "torch.load", "wl.push.legacy"):
        with pytest.raises(OptionError, match="unknown arm"):
            expand_arm_names(peer)


# -- running arms in fresh processes --


def test_run_once_reads_the_marker_and_the_childs_json() -> None:
    s = run_once(_marker_arm("a", {"inner_s": 0.25, "bytes": 10}, sleep=0.05).argv)
    assert s.info == {"inner_s": 0.25, "bytes": 10}
    assert s.window_s >= 0.05  # the child slept that long before it could print


def test_run_once_failures() -> None:
    with pytest.raises(ArmFailed, match="exit status 3"):
        run_once([sys.executable, "-c", "import sys; print('hello'); sys.exit(3)"])
    with pytest.raises(ArmFailed, match="no ready line within"):
        run_once([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
    with pytest.raises(ArmFailed, match="malformed JSON"):
        run_once([sys.executable, "-c", "print('WL_READY 1 {not json')"])
    with pytest.raises(ArmSkipped, match="no GPU here"):
        run_once([sys.executable, "-c", "print('WL_SKIP no GPU here')"])


def test_round_order_gives_each_arm_different_neighbours() -> None:
    arms = [f"a{i}" for i in range(10)]
    orders = [round_order(arms, r) for r in range(6)]
    assert orders[0] == arms and all(sorted(o) == arms for o in orders)
    before = {tuple(o[o.index(a) - 1] for o in orders if o.index(a)) for a in arms}
    assert all(len(set(b)) > 1 for b in before)  # no arm always runs right after the same one


def test_round_order_forward_and_reverse_keep_one_order_every_round() -> None:
    assert [round_order("ABC", r, "forward") for r in range(3)] == [list("ABC")] * 3
    assert [round_order("ABC", r, "reverse") for r in range(3)] == [list("CBA")] * 3
    with pytest.raises(OptionError):
        round_order("ABC", 0, "sideways")


def test_run_arms_in_reverse_order() -> None:
    res = run_arms([_marker_arm(n) for n in "ABC"], runs=2, warmup=1, profile_round=False, order="reverse")
    assert "".join(o["arm"] for o in res["order"]) == "CBA" * 3 and res["order_mode"] == "reverse"


def test_full_runs_pause_the_validated_settle_and_quick_runs_a_short_one(tiny, monkeypatch) -> None:
    import weightlift.benchmark.harness as bm

    monkeypatch.setattr(bm.time, "sleep", lambda s: None)
    full = run_benchmark(tiny, arms="limit.copy", runs=1, warmup=0, baselines=(), profile_round=False)
    quick = run_benchmark(tiny, arms="limit.copy", runs=1, warmup=0, baselines=(), profile_round=False, quick=True)
    assert full["settle_s"] == bm.SETTLE_S and quick["settle_s"] == bm.QUICK_SETTLE_S < bm.SETTLE_S


def test_the_copy_floor_is_the_faster_page_size(tiny) -> None:
    res = run_benchmark(
        tiny, arms="wl.numpy,limit.copy,limit.copy.huge", runs=1, warmup=0, baselines=(), settle=0, profile_round=False
    )
    meds = {n: res["arms"][n]["load"]["median"] for n in ("limit.copy", "limit.copy.huge")}
    assert res["local_limit"] == min(meds, key=meds.__getitem__)
    line = next(x for x in format_table(res).splitlines() if x.startswith("copy floor"))
    assert res["local_limit"] in line and "wl.numpy" in line


def test_arms_are_interleaved_with_an_uncounted_warmup() -> None:
    arms = [_marker_arm(n) for n in "ABC"]
    res = run_arms(arms, runs=2, warmup=1, profile_round=False)
    rounds = ["".join(o["arm"] for o in res["order"] if o["round"] == r) for r in range(3)]
    assert rounds[0] == "ABC" and all(sorted(r) == list("ABC") for r in rounds)
    assert rounds[1:] == ["".join(round_order("ABC", r)) for r in (1, 2)]  # seeded: the same every time
    assert [o["counted"] for o in res["order"]] == [False] * 3 + [True] * 6
    assert [o["round"] for o in res["order"]] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for n in "ABC":
        assert len(res["arms"][n]["times_s"]) == 2
        assert res["arms"][n]["summary"]["n"] == 2


def test_end_to_end_two_trivial_arms_and_json_shape() -> None:
    arms = [
        _marker_arm("fast", {"inner_s": 0.01, "bytes": 5, "tensors": 1}),
        _marker_arm("slow", {"inner_s": 0.02, "load_s": 0.01, "bytes": 5, "tensors": 1}, sleep=0.1),
    ]
    res = run_arms(arms, runs=3, warmup=1, baseline="fast")
    assert res["baseline"] == "fast" and res["mode"] == "warm" and res["cold_check"] is None
    fast, slow = res["arms"]["fast"], res["arms"]["slow"]
    assert fast["status"] == slow["status"] == "ok"
    assert len(slow["times_s"]) == 3 and all(t >= 0.1 for t in slow["times_s"])
    assert slow["inner_s"] == [0.02] * 3 and slow["load_s"] == [0.01] * 3
    assert fast["speedup"]["median"] == 1.0
    assert len(slow["speedup"]["ratios"]) == 3
    # one way everywhere: the baseline's time over the arm's, so the slower arm is below 1
    assert slow["speedup"]["median"] == pytest.approx(
        sorted(b / a for a, b in zip(slow["times_s"], fast["times_s"], strict=False))[1]
    )
    assert slow["speedup"]["median"] < 1
    assert (slow["bytes"], slow["tensors"]) == (5, 1)
    back = json.loads(json.dumps(res))
    assert set(back) >= {"arms", "order", "baseline", "runs", "warmup", "mode", "cold_check"}
    assert set(back["arms"]["slow"]) >= {
        "status",
        "reason",
        "times_s",
        "inner_s",
        "load_s",
        "summary",
        "speedup",
        "load_speedup",
        "bytes",
        "tensors",
        "profile",
    }


def test_failed_and_skipped_arms_do_not_stop_the_others() -> None:
    arms = [
        _marker_arm("good"),
        Arm("crash", [sys.executable, "-c", "import sys; sys.stderr.write('boom\\n'); sys.exit(2)"]),
        Arm("runtime-skip", [sys.executable, "-c", "print('WL_SKIP nothing to do')"]),
        Arm("pre-skip", ["/nonexistent/never-run"], skip="module x is not installed"),
    ]
    res = run_arms(arms, runs=2, warmup=0, profile_round=False)
    a = res["arms"]
    assert a["good"]["status"] == "ok" and a["good"]["summary"]["n"] == 2
    assert a["crash"]["status"] == "failed" and "boom" in a["crash"]["reason"]
    assert a["crash"]["times_s"] == [None, None]
    assert a["runtime-skip"] == {**a["runtime-skip"], "status": "skipped", "reason": "nothing to do"}
    assert a["pre-skip"]["status"] == "skipped" and a["pre-skip"]["reason"] == "module x is not installed"
    # a failed arm is not started again in later rounds; a skipped one never is
    assert [o["arm"] for o in res["order"]] == ["good", "crash", "runtime-skip", "good"]


def test_profile_round_is_extra_and_uncounted() -> None:
    arm = _marker_arm("w", {"inner_s": 0.0})
    arm.profile_argv = _marker_arm("w", {"inner_s": 0.0, "profile": {"span_s": 1.5}}).argv
    res = run_arms([arm], runs=1, warmup=0)
    assert res["arms"]["w"]["profile"] == {"span_s": 1.5}
    assert len(res["arms"]["w"]["times_s"]) == 1


# -- cold mode --


def _evictable(path: str) -> bool:
    evict_files([path])
    return max_resident([path]) == 0.0


def test_cold_eviction_of_a_small_file(tmp_path) -> None:
    p = tmp_path / "blob.bin"
    p.write_bytes(os.urandom(4 * 1024 * 1024))
    p.read_bytes()
    assert bench_arms.resident_fraction(str(p)) > 0.5
    evict_files([str(p)])
    after = max_resident([str(p)])
    if after > 0.0:
        pytest.skip(f"this filesystem keeps {after:.0%} of the file after DONTNEED (tmpfs cannot evict)")
    assert after == 0.0
    p.read_bytes()  # mincore is asked afresh each time, not memoized
    assert bench_arms.resident_fraction(str(p)) > 0.5


def test_cold_mode_records_residency_before_each_run(tmp_path) -> None:
    p = tmp_path / "blob.bin"
    p.write_bytes(os.urandom(1024 * 1024))
    if not _evictable(str(p)):
        pytest.skip("this filesystem cannot evict pages (tmpfs)")
    reader = f"import json,time\nopen({str(p)!r},'rb').read()\nprint('WL_READY', time.time_ns(), '{{}}', flush=True)\n"
    arm = Arm("reader", [sys.executable, "-c", reader], files=(str(p),))
    res = run_arms([arm], runs=2, warmup=1, cold=True, profile_round=False)
    assert res["mode"] == "cold"
    assert res["arms"]["reader"]["resident_before"] == [0.0, 0.0]
    assert res["cold_check"] == {"runs_checked": 2, "max_resident_before": 0.0}


# -- real arm bodies and the whole benchmark on a tiny checkpoint --


def test_synthetic_checkpoint_is_valid_safetensors(tiny) -> None:
    from safetensors.numpy import load_file

    ck = describe_checkpoint(tiny)
    assert ck["format"] == "safetensors" and ck["files"] == [os.path.abspath(tiny)]
    import ml_dtypes  # noqa: F401

    ref = load_file(tiny)
    assert sorted(ref) == sorted(ck["names"])
    assert ck["bytes"] == sum(a.nbytes for a in ref.values())
    assert any(a.dtype == np.float32 for a in ref.values()) and len(ref) == ck["tensors"]


def test_real_arm_bodies_report_every_byte(tiny) -> None:
    ck = describe_checkpoint(tiny)
    for name in ("safetensors.numpy", "wl.numpy", "wl.numpy.nocopy", "wl.push"):
        arm = build_arms(ck, [name])[0]
        assert arm.skip is None, arm.skip
        s = run_once(arm.argv, env=arm.env)
        assert (s.info["tensors"], s.info["bytes"]) == (ck["tensors"], ck["bytes"]), name
        assert s.info["inner_s"] >= s.info["load_s"] >= 0


def test_weightlift_arm_profiled_round_carries_a_report(tiny) -> None:
    ck = describe_checkpoint(tiny)
    arm = build_arms(ck, ["wl.numpy"])[0]
    s = run_once(arm.profile_argv)
    rep = s.info["profile"]
    assert rep["bytes"] == ck["bytes"]
    assert set(rep["phases_s"]) == {"read", "hash", "stage", "wire", "device", "gap"}


def test_push_arm_profiled_round_has_client_and_server_reports(tiny) -> None:
    ck = describe_checkpoint(tiny)
    arm = build_arms(ck, ["wl.push"])[0]
    s = run_once(arm.profile_argv, env=arm.env)
    assert s.info["push"]["bytes"] == ck["bytes"]
    assert s.info["profile"]["bytes"] == ck["bytes"]
    assert s.info["server_profile"]["tensors"] == ck["tensors"]


def test_baseline_children(tiny) -> None:
    size = os.path.getsize(tiny)
    for name in ("base.read", "base.tcp", "base.copy"):
        s = run_once(child_argv(name, {"files": [tiny], "repeats": 1}))
        assert s.info["bytes"] == size and s.info["gbps"] > 0, name
    s = run_once(child_argv("base.read", {"files": [tiny], "repeats": 1}))
    assert set(s.info["by_threads"]) == {"1", "2", "4"}


def test_missing_module_and_device_are_skips_not_errors(tiny, monkeypatch) -> None:
    b = bench_suite
    ck = describe_checkpoint(tiny)
    monkeypatch.setattr(b, "cuda_reason", lambda: "no CUDA device (test)")
    arms = {a.name: a for a in build_arms(ck, ["wl.cuda", "safetensors.cuda", "wl.numpy"])}
    # without torch the missing module is the first reason given
    expected = "no CUDA device (test)" if HAS_TORCH else "module torch is not installed"
    assert arms["wl.cuda"].skip == expected
    assert arms["safetensors.cuda"].skip == expected
    assert arms["wl.numpy"].skip is None
    assert b.missing_module("no_such_module_xyz") == "module no_such_module_xyz is not installed"


def test_every_run_waits_the_settle_pause_first(monkeypatch) -> None:
    import weightlift.benchmark.harness as bm

    slept: list[float] = []
    monkeypatch.setattr(bm.time, "sleep", slept.append)
    res = run_arms([_marker_arm(n) for n in "AB"], runs=2, warmup=1, profile_round=False, settle=2.5)
    # before each of the 3 rounds x 2 arms (the child runner's own short polls aside)
    assert slept.count(2.5) == 6 and res["settle_s"] == 2.5
    slept.clear()
    again = run_arms([_marker_arm("A")], runs=1, warmup=0, profile_round=False)
    assert 2.5 not in slept and again["settle_s"] == 0  # no pause unless asked (run_benchmark asks for SETTLE_S)


def test_run_benchmark_json_table_and_png(tiny, tmp_path) -> None:
    out = tmp_path / "r.json"
    png = tmp_path / "r.png"
    res = run_benchmark(
        tiny,
        arms="safetensors.numpy,wl.numpy",
        runs=1,
        warmup=0,
        baselines=("base.read",),
        settle=0,
        json_path=str(out),
        png_path=str(png),
    )
    obj = json.loads(out.read_text())
    assert obj["schema"] == SCHEMA
    assert obj["baseline"] == "safetensors.numpy"
    assert obj["checkpoint"]["bytes"] == describe_checkpoint(tiny)["bytes"]
    assert obj["arms"]["wl.numpy"]["status"] == "ok"
    assert obj["arms"]["wl.numpy"]["bytes_match"] is True
    assert obj["arms"]["wl.numpy"]["profile"]["bytes"] == obj["checkpoint"]["bytes"]
    assert obj["baselines"]["base.read"]["status"] == "ok"
    assert "safetensors.torch" in obj["not_selected"] and "runai" not in obj["not_selected"]
    assert obj["not_selected"]["wl.torch"] == (None if HAS_TORCH else "module torch is not installed")
    table = format_table(res)
    assert "wl.numpy" in table and "safetensors.numpy" in table and "(baseline)" in table
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:  # the plot is optional (the plot and bench extras)
        assert not png.exists() and not res.get("png")


def test_cli_has_the_bench_command() -> None:
    from weightlift.cli import build_parser

    args = build_parser().parse_args(
        [
            "bench",
            "ck.safetensors",
            "--quick",
            "--cold",
            "--runs",
            "7",
            "--arms",
            "wl.numpy,runai",
            "--json",
            "o.json",
            "--png",
            "o.png",
        ]
    )
    assert (args.path, args.quick, args.cold, args.runs) == ("ck.safetensors", True, True, 7)
    assert (args.arms, args.json, args.png) == ("wl.numpy,runai", "o.json", "o.png")
    assert callable(args.func)


@pytest.mark.gpu
@pytest.mark.skipif(cuda_reason() is not None, reason=f"needs a CUDA device: {cuda_reason()}")
def test_gpu_arms_and_the_h2d_baseline(tiny) -> None:
    ck = describe_checkpoint(tiny)
    for name in ("wl.cuda", "safetensors.cuda"):
        arm = build_arms(ck, [name])[0]
        assert arm.skip is None, arm.skip
        s = run_once(arm.argv, env=arm.env)
        assert (s.info["tensors"], s.info["bytes"]) == (ck["tensors"], ck["bytes"]), name
    s = run_once(child_argv("base.h2d", {"files": [tiny], "repeats": 3}))
    assert s.info["gbps"] > 0 and s.info["bytes"] == os.path.getsize(tiny)


def test_local_share_is_taken_against_the_copy_limit_arm_when_it_ran() -> None:
    from weightlift.benchmark.suite import _derive

    def arm(kind: str, load: float) -> dict:
        return {"status": "ok", "kind": kind, "bytes": 100, "summary": {"median": load + 0.5}, "load": {"median": load}}

    ck = {"bytes": 10**9}
    bl = {"base.copy": {"fresh": {"gbps": 10.0}}, "base.tcp": {"gbps": 4.0}}
    result = {"arms": {"wl.numpy": arm("local", 0.5), "limit.copy": arm("limit", 0.4), "wl.push": arm("remote", 0.5)}}
    _derive(result, ck, bl)
    assert result["local_limit"] == "limit.copy"
    assert result["arms"]["wl.numpy"]["floor_speedup"] == pytest.approx(0.8)  # 2.0 GB/s of the arm's 2.5
    assert result["arms"]["wl.push"]["floor_speedup"] == pytest.approx(0.5)  # in-process raw TCP: no limit.tcp arm ran
    assert result["remote_limit"] == "base.tcp"
    assert result["arms"]["limit.copy"]["floor_speedup"] is None
    result["arms"]["limit.tcp"] = arm("limit", 0.25)
    _derive(result, ck, bl)
    assert result["remote_limit"] == "limit.tcp"
    assert result["arms"]["wl.push"]["floor_speedup"] == pytest.approx(0.5)  # 2.0 GB/s of limit.tcp's 4.0
    result["arms"]["limit.tcp"] = arm("limit", 0.2)
    _derive(result, ck, bl)
    assert result["arms"]["wl.push"]["floor_speedup"] == pytest.approx(0.4)
    # the push lands in fresh memory: TCP into fresh memory is its floor where it ran, though slower
    result["arms"]["limit.tcp.fresh"] = arm("limit", 0.5)
    _derive(result, ck, bl)
    assert result["remote_limit"] == "limit.tcp.fresh"
    assert result["arms"]["wl.push"]["floor_speedup"] == pytest.approx(1.0)
    del result["arms"]["limit.tcp.fresh"]
    result["arms"]["limit.read.1"] = arm("limit", 1.0)
    result["arms"]["limit.read.4"] = arm("limit", 0.8)
    _derive(result, ck, bl)
    assert result["local_limit"] == "limit.read.4"  # a cold run: the fastest reader count is the limit
    assert result["arms"]["wl.numpy"]["floor_speedup"] == pytest.approx(1.6)
    del result["arms"]["limit.read.1"], result["arms"]["limit.read.4"]
    del result["arms"]["limit.copy"], result["arms"]["limit.tcp"]
    _derive(result, ck, bl)
    assert result["local_limit"] == "base.copy"
    assert result["arms"]["wl.numpy"]["floor_speedup"] == pytest.approx(0.2)  # 2.0 of the in-process 10


@pytest.mark.parametrize("k", bench_floors.READ_LIMIT_THREADS)
def test_limit_read_arms_read_the_file(tmp_path, k) -> None:
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(5 * 2**20 + 11))
    info = bench_floors.BODIES[f"limit.read.{k}"]({"files": [str(p)]})
    assert info["bytes"] == p.stat().st_size and info["threads"] == k and info["load_s"] > 0


def test_limit_tcp_arm_sends_the_file(tmp_path) -> None:
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(2 * 2**20 + 3))
    info = bench_floors.limit_tcp({"files": [str(p)]})
    assert info["bytes"] == p.stat().st_size and info["load_s"] > 0


def test_limit_copy_arm_copies_the_file(tmp_path) -> None:
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(3 * 2**20 + 7))
    info = bench_floors.BODIES["limit.copy"]({"files": [str(p)]})
    assert info["bytes"] == p.stat().st_size and info["load_s"] > 0


# -- honest first numbers: imports, the run's length, the columns --


def test_no_arm_of_weightlift_bench_times_a_first_import(tiny) -> None:
    # the checkpoint is bf16: weightlift's load imports ml_dtypes lazily, which took about 1 s of
    # a 1.3 s load call while the safetensors arm imported it before its clock
    ck = describe_checkpoint(tiny)
    runnable = [
        n
        for n, spec in bench_suite.PACKAGE.specs.items()
        if spec.kind in ("local", "remote", "limit") and bench_suite.arm_reason(n, ck) is None
    ]
    assert {"safetensors.numpy", "wl.numpy", "wl.numpy.nocopy", "wl.push", "limit.copy", "limit.tcp"} <= set(runnable)
    for arm in build_arms(ck, runnable):
        first = run_once(arm.argv, env=arm.env)  # a warm-up: a fresh process, nothing learned yet
        learned = first.info["timed_imports"]
        assert isinstance(learned, list), arm.name  # None: the body never started the shared clock
        if arm.name in ("safetensors.numpy", "wl.numpy", "wl.numpy.nocopy"):
            assert learned == [], arm.name  # ml_dtypes before the clock in every numpy arm, as a user must
        # a counted run: the pre-clock step imports what the warm-up's clock did
        again = run_once(with_preload(arm.argv, learned), env=arm.env)
        assert again.info["timed_imports"] == [], arm.name


def _lazy_arm_file(tmp_path) -> str:
    # an arm whose load imports a module nothing else here imports, inside its clock
    path = tmp_path / "lazy_arms.py"
    path.write_text(
        "import sys\n"
        "core = sys.modules['wl_bench_arms']\n"
        "def lazy(o):\n"
        "    t0 = core.start_clock()\n"
        "    import colorsys  # noqa: F401\n"
        "    return {'load_s': core.stop_clock(t0), 'tensors': 0, 'bytes': 0}\n"
        "BODIES = {'lazy': lazy}\n"
    )
    return str(path)


def test_an_import_seen_in_the_warmup_is_made_before_the_clock_in_counted_runs(tmp_path) -> None:
    from weightlift.benchmark.harness import ARM_FILES

    files = (ARM_FILES[0], _lazy_arm_file(tmp_path))
    arm = Arm("lazy", child_argv("lazy", {}, files))
    first = run_once(arm.argv)
    assert first.info["timed_imports"] == ["colorsys"]
    res = run_arms([arm], runs=2, warmup=1, profile_round=False)
    assert res["arms"]["lazy"]["timed_imports"] == []  # the warm-up's import was preloaded after it
    cold_start = run_arms([arm], runs=1, warmup=0, profile_round=False)
    assert cold_start["arms"]["lazy"]["timed_imports"] == ["colorsys"]  # no warm-up: nothing learned yet


def test_the_table_warns_of_an_import_inside_a_clock(tmp_path) -> None:
    from weightlift.benchmark.harness import ARM_FILES
    from weightlift.benchmark.report import _import_lines

    files = (ARM_FILES[0], _lazy_arm_file(tmp_path))
    res = run_arms([Arm("lazy", child_argv("lazy", {}, files))], runs=1, warmup=0, profile_round=False)
    assert _import_lines(res) == ["warning: lazy imported colorsys inside its clock: its load s includes that import"]


def test_speedups_read_one_way_and_every_column_is_explained(tiny) -> None:
    from weightlift.benchmark.report import COLUMNS

    res = run_benchmark(
        tiny, arms="safetensors.numpy,wl.numpy,wl.numpy.nocopy,limit.copy", runs=1, warmup=0, baselines=(), settle=0
    )
    a = res["arms"]
    for name in ("wl.numpy", "wl.numpy.nocopy", "limit.copy"):
        expect = a["safetensors.numpy"]["times_s"][0] / a[name]["times_s"][0]
        assert a[name]["speedup"]["median"] == pytest.approx(expect)  # above 1: faster than the baseline
    assert a["wl.numpy.nocopy"]["floor_speedup"] is None  # a mapping copies nothing: no copy floor
    # safetensors.torch maps the file on the CPU too (its load call took 0.007 s for 0.23 GiB,
    # "24x" the copy floor); held to no floor either
    assert not bench_suite.PACKAGE.specs["safetensors.torch"].floored
    assert a["wl.numpy"]["floor_speedup"] == pytest.approx(
        a["limit.copy"]["load"]["median"] / a["wl.numpy"]["load"]["median"]
    )
    lines = format_table(res).splitlines()
    header = next(x for x in lines if x.startswith("arm "))
    for name, text in COLUMNS:
        assert name in header and any(x.strip().startswith(f"{name} ") and text[:30] in x for x in lines), name
    assert "ratio" not in header and "of limit" not in header


def test_bar_colours_have_a_legend_entry_for_weightlift() -> None:
    from weightlift.benchmark.report import bar_colors

    colors, keys = bar_colors(["wl.numpy", "safetensors.numpy", "limit.copy", "wl.push"])
    labels = dict(keys)
    assert colors[0] == colors[3] == labels["weightlift: spawn to ready"]
    assert len(keys) == 3 and len(set(colors)) == 3


def test_the_estimate_counts_runs_arms_and_pauses() -> None:
    from weightlift.benchmark.suite import estimate_s

    arms = [_marker_arm("A"), _marker_arm("B"), Arm("C", [], skip="not here")]
    base = {"nbytes": 0, "warmup": 1, "profile_round": False, "baselines": 0}
    assert estimate_s(arms, runs=3, settle=3.0, **base) == pytest.approx(2 * 4 * (3.0 + 0.6))
    assert estimate_s(arms, runs=5, settle=20.0, **base) == pytest.approx(2 * 6 * (20.0 + 0.6))


def test_a_run_says_how_long_it_will_take_before_it_runs(tiny) -> None:
    said: list[str] = []
    run_benchmark(tiny, arms="wl.numpy", runs=1, warmup=0, baselines=(), settle=0, profile_round=False, log=said.append)
    first = next(i for i, x in enumerate(said) if x.startswith("this will take about"))
    assert first < next(i for i, x in enumerate(said) if "run 1" in x)
    assert "--quick" in said[first] and "--settle 20 --runs 5" in said[first]


def test_weightlift_bench_defaults_to_a_run_of_minutes(monkeypatch) -> None:
    import argparse

    from weightlift.benchmark import command as bench_command
    from weightlift.cli import build_parser

    seen: dict = {}

    def fake(path, **kw):
        seen.update(kw)
        raise SystemExit(0)

    monkeypatch.setattr(bench_command, "run_benchmark", fake)
    for argv, runs, settle in (
        (["bench", "x.safetensors"], 3, 3.0),
        (["bench", "x.safetensors", "--runs", "5", "--settle", "20"], 5, 20.0),
        (["bench", "--quick"], None, None),  # run_benchmark's quick defaults: 3 runs, 3 s
    ):
        with pytest.raises(SystemExit):
            bench_command.command(build_parser().parse_args(argv))
        assert (seen["runs"], seen["settle"]) == (runs, settle), argv
    # the bench/ scripts keep the published 5 runs and 20 s pause
    p = argparse.ArgumentParser()
    bench_command.add_arguments(p)
    with pytest.raises(SystemExit):
        bench_command.command(p.parse_args(["x.safetensors"]))
    assert (seen["runs"], seen["settle"]) == (5, 20.0)


def test_bench_help_explains_every_column(capsys) -> None:
    from weightlift.benchmark.report import COLUMNS
    from weightlift.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    out = capsys.readouterr().out
    for name, _ in COLUMNS:
        assert f"  {name} " in out, name
    assert "a few minutes" in out and "--quick" in out


def test_shuffled_rounds_give_no_arm_the_same_predecessor_twice() -> None:
    from weightlift.benchmark.suite import QUICK_ARMS

    # --quick's six arms, a warm-up and three counted rounds: 30 (predecessor, arm) pairs to pick from
    arms = list(QUICK_ARMS)
    rounds = [round_order(arms, r) for r in range(4)]
    runs = [a for r in rounds for a in r]  # one long sequence: a round's first arm follows the last one's
    pairs = list(zip(runs, runs[1:], strict=False))[
        len(arms) - 1 :
    ]  # those of the counted rounds (and the one into them)
    assert all(a != b for a, b in pairs)
    assert len(set(pairs)) == len(pairs)
    assert rounds == [round_order(arms, r) for r in range(4)]  # the same every time


def test_a_speedup_whose_rounds_span_one_says_the_run_does_not_decide() -> None:
    from weightlift.benchmark.report import _spread_lines

    def arm(speedups: list[float], load: list[float]) -> dict:
        return {"status": "ok", "speedup": {"ratios": speedups}, "load_speedup": {"ratios": load}}

    result = {
        "baseline": "base",
        "arms": {"base": arm([1.0, 1.0], [1.0, 1.0]), "a": arm([0.8, 1.3], [1.5, 1.7]), "b": arm([1.2, 1.4], [1.1, 2])},
    }
    result["arms"]["limit.x"] = {**arm([0.5, 2.0], [0.5, 2.0]), "kind": "limit"}  # a floor is no contender
    assert _spread_lines(result) == [
        "a: per-round speed-ups over base span 1.00x (to ready 0.80x-1.30x): this run does not tell which "
        "is faster; more --runs or a quieter machine will"
    ]


def test_a_busy_machine_is_named_in_the_notes() -> None:
    from weightlift.benchmark.suite import _busy_note

    assert _busy_note({"cpus": 2, "loadavg": {"before": 0.4, "after": 1.2}}) is None
    note = _busy_note({"cpus": 2, "loadavg": {"before": 5.8, "after": 6.4}})
    assert note is not None and note.startswith("busy machine: load average 5.8 before and 6.4 after the run on 2 CPUs")
    assert _busy_note({"cpus": 2}) is None  # no load average on this platform
