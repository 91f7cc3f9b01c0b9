from __future__ import annotations

import json
import threading

import pytest

from weightlift.errors import OptionError
from weightlift.profile import PHASES, Profiler

MS = 1_000_000  # ns


def _sum_phases(rep: dict) -> float:
    return sum(rep["phases_s"][p] for p in (*PHASES, "gap"))


def test_overlapping_phases_share_time_and_sum_to_span() -> None:
    prof = Profiler(enabled=True)
    prof.record("read", 0, 100 * MS, 10)
    prof.record("device", 50 * MS, 150 * MS, 10)  # overlaps the read by 50 ms
    prof.record("hash", 300 * MS, 400 * MS, 10)
    prof.record("wire", 350 * MS, 360 * MS, 10)  # nested inside the hash
    rep = prof.report()
    assert rep["span_s"] == pytest.approx(0.4)
    ph = rep["phases_s"]
    assert ph["read"] == pytest.approx(0.075)
    assert ph["device"] == pytest.approx(0.075)
    assert ph["hash"] == pytest.approx(0.095)
    assert ph["wire"] == pytest.approx(0.005)
    assert ph["stage"] == 0.0
    assert ph["gap"] == pytest.approx(0.150)
    assert _sum_phases(rep) == pytest.approx(rep["span_s"], abs=1e-12)
    # work counts every duration in full
    assert rep["work_s"]["read"] == pytest.approx(0.1)
    assert rep["work_s"]["wire"] == pytest.approx(0.01)


def test_one_phase_on_many_threads_counts_once() -> None:
    prof = Profiler(enabled=True)
    prof.record("read", 0, 100 * MS)
    prof.record("read", 50 * MS, 150 * MS)
    prof.record("read", 60 * MS, 70 * MS)
    rep = prof.report()
    assert rep["phases_s"]["read"] == pytest.approx(0.15)
    assert rep["phases_s"]["gap"] == 0.0
    assert rep["work_s"]["read"] == pytest.approx(0.21)
    assert _sum_phases(rep) == pytest.approx(rep["span_s"], abs=1e-12)


def test_random_overlaps_always_sum_to_span() -> None:
    import random

    rng = random.Random(7)
    prof = Profiler(enabled=True)
    for _ in range(500):
        t0 = rng.randrange(0, 10**9)
        prof.record(rng.choice(PHASES), t0, t0 + rng.randrange(0, 5 * 10**7))
    rep = prof.report()
    assert _sum_phases(rep) == pytest.approx(rep["span_s"], rel=1e-12)
    assert all(v >= 0 for v in rep["phases_s"].values())


def test_counts_and_bytes_are_exact() -> None:
    prof = Profiler(enabled=True)
    prof.count(tensors=3, calls=5, nbytes=1000)
    prof.count(tensors=1, nbytes=24)
    prof.count(calls=2)
    prof.record("read", 0, 2 * MS, 600)
    prof.record("device", 2 * MS, 4 * MS, 424)
    rep = prof.report()
    assert (rep["tensors"], rep["calls"], rep["bytes"]) == (4, 7, 1024)
    assert rep["phase_bytes"] == {"read": 600, "hash": 0, "stage": 0, "wire": 0, "device": 424}
    assert rep["gbps"] == pytest.approx(1024 / 0.004 / 1e9)


def test_bytes_fall_back_to_the_largest_phase_when_not_counted() -> None:
    prof = Profiler(enabled=True)
    prof.record("read", 0, MS, 4096)
    prof.record("read", MS, 2 * MS, 4096)
    prof.record("device", 2 * MS, 3 * MS, 8192)
    assert prof.report()["bytes"] == 8192


def test_background_records_do_not_stretch_the_span() -> None:
    prof = Profiler(enabled=True)
    prof.record("read", 0, 1000 * MS, 100, background=True)
    prof.record("hash", 10 * MS, 20 * MS, 5, background=True)
    prof.record("device", 400 * MS, 500 * MS, 100)
    rep = prof.report()
    assert rep["span_s"] == pytest.approx(0.1)
    assert rep["phases_s"]["device"] == pytest.approx(0.1)
    assert rep["phases_s"]["read"] == 0.0
    assert rep["background_s"]["read"] == pytest.approx(1.0)
    assert rep["background_s"]["hash"] == pytest.approx(0.01)


def test_reset_starts_a_new_span_per_client() -> None:
    prof = Profiler(enabled=True)
    # client 1
    prof.record("wire", 1000 * MS, 1100 * MS, 10)
    prof.count(tensors=1, nbytes=10)
    first = prof.report()
    prof.reset()
    # client 2 arrives long after
    prof.record("wire", 9000 * MS, 9050 * MS, 20)
    prof.record("stage", 9060 * MS, 9070 * MS, 20)
    prof.count(tensors=2, nbytes=20)
    second = prof.report()
    assert first["span_s"] == pytest.approx(0.1)
    assert second["span_s"] == pytest.approx(0.07)
    assert second["phases_s"]["gap"] == pytest.approx(0.01)  # 9050..9060 only, not the idle time
    assert (second["tensors"], second["bytes"]) == (2, 20)

    # without the reset, the idle time between clients would be a gap
    joined = Profiler(enabled=True)
    joined.record("wire", 1000 * MS, 1100 * MS)
    joined.record("wire", 9000 * MS, 9050 * MS)
    assert joined.report()["phases_s"]["gap"] == pytest.approx(7.9)


def test_reset_clears_commands_and_empty_report_is_zero() -> None:
    prof = Profiler(enabled=True)
    prof.command("SET_TENSOR", 0, 3 * MS)
    prof.command("SET_TENSOR", 5 * MS, 6 * MS)
    prof.command("HELLO", 0, MS)
    rep = prof.report()
    assert rep["commands"]["SET_TENSOR"]["count"] == 2
    assert rep["commands"]["SET_TENSOR"]["seconds"] == pytest.approx(0.004)
    assert rep["commands"]["HELLO"] == {"count": 1, "seconds": pytest.approx(0.001)}
    prof.reset()
    rep = prof.report()
    assert rep["commands"] == {}
    assert rep["span_s"] == 0.0 and rep["gbps"] == 0.0 and rep["bytes"] == 0
    assert set(rep["phases_s"]) == {*PHASES, "gap"}


def test_disabled_profiler_records_nothing() -> None:
    prof = Profiler(enabled=False)
    assert prof.enabled is False
    prof.record("read", 0, MS, 100)
    prof.command("X", 0, MS)
    prof.count(tensors=1, calls=1, nbytes=100)
    rep = prof.report()
    assert rep["tensors"] == rep["calls"] == rep["bytes"] == 0
    assert rep["span_s"] == 0.0 and rep["commands"] == {}
    assert prof._fg == []


def test_env_var_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEIGHTLIFT_LOADPROF", raising=False)
    assert Profiler().enabled is False
    monkeypatch.setenv("WEIGHTLIFT_LOADPROF", "1")
    assert Profiler().enabled is True
    assert Profiler(enabled=False).enabled is False
    monkeypatch.setenv("WEIGHTLIFT_LOADPROF", "0")
    assert Profiler().enabled is False
    assert Profiler(enabled=True).enabled is True


def test_unknown_phase_is_an_option_error() -> None:
    with pytest.raises(OptionError):
        Profiler(enabled=True).record("compute", 0, 1)


def test_concurrent_records_are_all_kept() -> None:
    prof = Profiler(enabled=True)

    def work(k: int) -> None:
        for j in range(1000):
            t = (k * 1000 + j) * 10
            prof.record("read", t, t + 5, 3)
            prof.count(tensors=1, nbytes=3)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rep = prof.report()
    assert rep["tensors"] == 4000
    assert rep["bytes"] == 12000
    assert rep["phase_bytes"]["read"] == 12000
    assert rep["work_s"]["read"] == pytest.approx(4000 * 5 / 1e9)


def test_chrome_trace_has_one_track_per_thread(tmp_path) -> None:
    prof = Profiler(enabled=True, trace=True)
    prof.record("read", 10_000, 12_000, 4096, name="model.embed")
    prof.command("SET_TENSOR", 12_000, 13_000)

    def warmer() -> None:
        prof.record("read", 11_000, 15_000, 8192, name="warm chunk", background=True)
        prof.record("hash", 15_000, 16_000, 8192, name="model.embed", background=True)

    t = threading.Thread(target=warmer, name="wl-warmer-0")
    t.start()
    t.join()
    out = tmp_path / "trace.json"
    prof.write_trace(out)
    obj = json.loads(out.read_text())
    events = obj["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    ms = [e for e in events if e["ph"] == "M" and e["name"] == "thread_name"]
    assert len(xs) == 4
    assert {e["tid"] for e in xs} == {e["tid"] for e in ms}
    assert len({e["tid"] for e in xs}) == 2
    names = {e["args"]["name"] for e in ms}
    assert "wl-warmer-0" in names and threading.current_thread().name in names
    by_name = {e["name"]: e for e in xs}
    read = by_name["read model.embed"]
    assert read["ts"] == 0.0 and read["dur"] == 2.0  # microseconds from the first event
    assert read["args"]["bytes"] == 4096
    assert by_name["read warm chunk"]["cat"] == "read,background"
    assert by_name["read warm chunk"]["tid"] != read["tid"]
    assert by_name["SET_TENSOR"]["dur"] == 1.0
    assert by_name["hash model.embed"]["ts"] == 5.0
    for e in xs:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "args"} <= e.keys()


def test_trace_needs_trace_mode_and_trace_turns_profiler_on(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("WEIGHTLIFT_LOADPROF", raising=False)
    with pytest.raises(OptionError):
        Profiler(enabled=True).write_trace(tmp_path / "x.json")
    assert Profiler(trace=True).enabled is True
    assert Profiler(enabled=False, trace=True).enabled is False


def test_reset_clears_the_trace() -> None:
    prof = Profiler(enabled=True, trace=True)
    prof.record("read", 0, 10)
    prof.reset()
    prof.record("wire", 100, 110, name="send")
    xs = [e for e in prof.trace_events()["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in xs] == ["wire send"]
    assert xs[0]["ts"] == 0.0


def test_format_names_every_phase() -> None:
    prof = Profiler(enabled=True)
    prof.record("read", 0, 2 * MS, 2**20)
    prof.command("SET_TENSOR", 0, MS)
    prof.count(tensors=1, nbytes=2**20)
    text = prof.format()
    for p in (*PHASES, "gap", "SET_TENSOR"):
        assert p in text
    assert "1 tensors" in text and "1.0 MiB" in text
