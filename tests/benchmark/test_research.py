"""The research bench in bench/ (not installed): the peer arms and weightlift's variants on the
package's harness, imported from bench/ as its scripts import them."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from weightlift.benchmark import arms as bench_arms
from weightlift.benchmark import floors as bench_arms_floors
from weightlift.benchmark import suite as package_suite
from weightlift.benchmark.harness import describe_checkpoint, run_once
from weightlift.benchmark.report import format_table

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import peer_arms  # noqa: E402
import suite as research  # noqa: E402


def test_the_research_table_adds_to_the_package_one() -> None:
    assert set(package_suite.PACKAGE.specs) < set(research.TABLE.specs)
    assert research.TABLE.files[: len(package_suite.PACKAGE.files)] == package_suite.PACKAGE.files
    assert set(research.LOCAL_ARMS) >= set(package_suite.LOCAL_ARMS)
    assert "runai" in research.expand_arm_names("local") and "runai" not in research.expand_arm_names("remote")
    assert "wl.push.legacy" in research.expand_arm_names("remote")
    for name, spec in peer_arms.SPECS.items():
        assert name not in package_suite.PACKAGE.specs, name
        assert name in peer_arms.BODIES or spec.kind == "baseline", name


def test_research_arm_bodies_report_every_byte(tiny) -> None:
    ck = describe_checkpoint(tiny)
    for name in ("wl.push.legacy", "wl.split", "wl.push.cached", "wl.push.second", "wl.push.update", "wl.numpy.verify"):
        arm = research.build_arms(ck, [name])[0]
        assert arm.skip is None, arm.skip
        s = run_once(arm.argv, env=arm.env)
        assert (s.info["tensors"], s.info["bytes"]) == (ck["tensors"], ck["bytes"]), name
        assert s.info["inner_s"] >= s.info["load_s"] >= 0


def test_a_research_run_lists_the_peers_it_did_not_select(tiny) -> None:
    res = research.run_benchmark(tiny, arms="wl.numpy", runs=1, warmup=0, baselines=(), settle=0, profile_round=False)
    assert res["arms"]["wl.numpy"]["status"] == "ok"
    assert "runai" in res["not_selected"] and "wl.push.legacy" in res["not_selected"]


def test_remote_arms_are_set_against_the_fault_in_floor(tiny) -> None:
    res = research.run_benchmark(
        tiny, arms="wl.push,limit.fault,limit.fault.huge", runs=1, warmup=0, baselines=(), settle=0
    )
    assert res["arms"]["limit.fault"]["status"] == "ok" and res["arms"]["wl.push"]["status"] == "ok"
    assert res["arms"]["limit.fault.huge"]["status"] == "ok"
    line = next(x for x in format_table(res).splitlines() if x.startswith("fault-in floor"))
    assert "wl.push" in line and line.endswith("x")


def test_limit_tcp_fresh_arm_lands_the_file_in_fresh_memory(tmp_path) -> None:
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(9 * 2**20 + 3))  # more than one 8 MiB receive
    info = bench_arms_floors.BODIES["limit.tcp.fresh"]({"files": [str(p)]})
    assert info["bytes"] == p.stat().st_size and info["load_s"] > 0


def test_limit_fault_arm_faults_in_the_checkpoints_size(tmp_path) -> None:
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(3 * 2**20 + 7))
    info = peer_arms.BODIES["limit.fault"]({"files": [str(p)]})
    assert info["bytes"] == p.stat().st_size and info["load_s"] > 0 and info["threads"] >= 1


# -- the peer arms: fastsafetensors, tensorizer, InstantTensor --

PEERS = {
    "fastsafetensors": ("fastsafetensors", "torch"),
    "tensorizer": ("tensorizer", "torch"),
    "instanttensor": ("instanttensor", "torch"),
}


def test_peer_arms_are_registered_as_local_arms() -> None:
    for name, modules in PEERS.items():
        spec = research.TABLE.specs[name]
        assert spec.kind == "local" and spec.safetensors_only, name
        assert set(modules) <= set(spec.requires), name
        assert name in {**bench_arms.BODIES, **peer_arms.BODIES}, name
        assert name in research.expand_arm_names("local"), name
    assert research.TABLE.specs["tensorizer"].uses_tensorizer and "make-tensorizer" in peer_arms.BODIES
    assert research.TABLE.specs["instanttensor"].cuda  # it loads into CUDA devices only


def test_peer_arms_without_their_package_are_skips_naming_it(tiny, monkeypatch) -> None:
    b = package_suite
    gone = {"fastsafetensors", "tensorizer", "instanttensor"}
    real = b.missing_module
    monkeypatch.setattr(b, "missing_module", lambda m: f"module {m} is not installed" if m in gone else real(m))
    monkeypatch.setattr(b, "cuda_reason", lambda: "no CUDA device (test)")
    ck = describe_checkpoint(tiny)
    arms = {a.name: a for a in research.build_arms(ck, list(PEERS))}
    for name in PEERS:
        assert arms[name].skip == f"module {name} is not installed", name
    bench = os.environ["WEIGHTLIFT_BENCH_DIR"]  # no tensorizer copy is written for an arm that is skipped
    assert not os.path.isdir(bench) or not [f for f in os.listdir(bench) if f.endswith(".tensors")]


def test_instanttensor_without_a_cuda_device_says_so(tiny, monkeypatch) -> None:
    b = package_suite
    monkeypatch.setattr(b, "missing_module", lambda m: None)
    monkeypatch.setattr(b, "cuda_reason", lambda: "no CUDA device (test)")
    arm = research.build_arms(describe_checkpoint(tiny), ["instanttensor"])[0]
    assert arm.skip == "no CUDA device (test)"


@pytest.mark.parametrize("name", ["fastsafetensors", "tensorizer"])
def test_cpu_peer_arm_bodies_report_every_byte(tiny, name) -> None:
    for module in PEERS[name]:
        if importlib.util.find_spec(module) is None:
            extra = "bench" if name == "fastsafetensors" else "peers"
            pytest.skip(f"the {name} arm needs {module} (pip install -e '.[{extra}]')")
    ck = describe_checkpoint(tiny)
    arm = research.build_arms(ck, [name])[0]
    assert arm.skip is None, arm.skip
    s = run_once(arm.argv, env=arm.env, timeout=300)
    assert (s.info["tensors"], s.info["bytes"]) == (ck["tensors"], ck["bytes"])
    assert s.info["inner_s"] >= s.info["load_s"] >= 0
    if name == "tensorizer":  # read from its own copy, written once beside the others, outside the window
        (tz,) = arm.files
        assert tz.endswith(".tensors") and os.path.dirname(tz) == os.environ["WEIGHTLIFT_BENCH_DIR"]
        assert research.build_arms(ck, [name])[0].files == (tz,)
