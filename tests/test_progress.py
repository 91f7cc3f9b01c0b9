"""The progress line: what it says, only on a terminal, and the demo's write reported by its size."""

from __future__ import annotations

import io
import sys

import weightlift.progress as progress
from weightlift.progress import Progress, terminal


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def _tty(monkeypatch) -> FakeTTY:
    # set in the test's body: pytest puts its own capture back in sys.stderr after the fixtures
    out = FakeTTY()
    monkeypatch.setattr(sys, "stderr", out)
    monkeypatch.setattr(progress, "DELAY", 0.0)  # draw from the first call
    return out


def _lines(text: str) -> list[str]:
    return [s.replace("\x1b[K", "") for s in text.replace("\n", "\r").split("\r") if s]


def test_a_line_says_percent_done_of_total_rate_and_eta(monkeypatch):
    tty = _tty(monkeypatch)
    bar = terminal("pushing")
    assert bar is not None
    bar(1 << 30, 4 << 30)
    line = _lines(tty.getvalue())[-1]
    assert line.startswith("pushing:  25.0%  1.00 GiB / 4.00 GiB  ") and " GB/s  ETA " in line
    bar(4 << 30, 4 << 30)
    assert tty.getvalue().endswith("\n")  # the last draw ends the line
    last = _lines(tty.getvalue())[-1]
    assert last.startswith("pushing: 100.0%  4.00 GiB / 4.00 GiB  ") and "  in " in last
    bar(4 << 30, 4 << 30)  # nothing after the end
    assert _lines(tty.getvalue())[-1] == last


def test_sizes_in_the_unit_that_reads(monkeypatch):
    tty = _tty(monkeypatch)
    for done, total, text in [(512, 1000, "512 B / 1000 B"), (3 << 19, 3 << 20, "1.50 MiB / 3.00 MiB")]:
        Progress(label="pulling")(done, total)  # a fresh bar each: one draws ten times a second at most
        assert text in _lines(tty.getvalue())[-1]


def test_a_load_counts_bytes_up_to_its_total(monkeypatch):
    tty = _tty(monkeypatch)
    bar = Progress(3 << 20)
    for _ in range(3):
        bar.update(1 << 20)
    assert "100.0%  3.00 MiB / 3.00 MiB" in _lines(tty.getvalue())[-1]


def test_nothing_on_a_pipe_or_when_not_enabled(monkeypatch):
    _tty(monkeypatch)
    assert terminal("x", enabled=False) is None
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
    assert terminal("x") is None


def test_nothing_before_the_delay(monkeypatch):
    tty = _tty(monkeypatch)
    bar = Progress(100, delay=60.0)
    bar(50, 100)
    bar(100, 100)
    assert tty.getvalue() == ""


def test_the_demo_write_reports_each_piece_up_to_the_total(tmp_path, monkeypatch):
    from weightlift.benchmark import synthetic

    small = [("a", "F32", (1 << 18,)), ("b", "BF16", (3, 1 << 16))]  # the demo's shape, 1.4 MiB
    monkeypatch.setenv("WEIGHTLIFT_CACHE", str(tmp_path))
    monkeypatch.setattr(synthetic, "demo_tensors", lambda layers=8: small)
    calls = []
    path = synthetic.ensure_demo_checkpoint(layers=1, progress=lambda done, total: calls.append((done, total)))
    total = 4 * (1 << 18) + 2 * 3 * (1 << 16)
    assert path.exists() and calls[-1] == (total, total)
    assert all(t == total and 0 < d <= total for d, t in calls)
    assert [d for d, _ in calls] == sorted({d for d, _ in calls})  # rising, each piece once
    calls.clear()
    synthetic.ensure_demo_checkpoint(layers=1, progress=lambda done, total: calls.append((done, total)))
    assert calls == []  # written already: nothing to report
