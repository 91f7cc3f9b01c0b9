"""Load plans: runs of back-to-back tensors, their arena layout, and chunks."""

from __future__ import annotations

from weightlift.formats import TensorInfo
from weightlift.plan import ALIGN, layout, make_chunks, make_runs


def T(name, off, n, dtype="U8", file="f"):
    return TensorInfo(name, dtype, (n,), file, off, n)


def test_back_to_back_coalesce_and_gaps_break():
    ts = [T("a", 100, 10), T("b", 110, 20), T("c", 130 + 32, 8), T("d", 10_000, 4)]
    runs = make_runs(ts)
    assert [[t.name for t in r.tensors] for r in runs] == [["a", "b", "c"], ["d"]]
    assert (runs[0].offset, runs[0].length) == (100, 70)


def test_kinds_and_files_never_mix():
    ts = [T("a", 0, 4), T("b", 4, 4, file="g"), T("c", 4, 4)]
    runs = make_runs(ts)
    assert [(r.file, [t.name for t in r.tensors]) for r in runs] == [("f", ["a", "c"]), ("g", ["b"])]
    ts = [T("a", 0, 4), T("b", 4, 4), T("c", 8, 4)]
    assert len(make_runs(ts, kind=lambda t: t.name == "b")) == 3
    assert len(make_runs(ts, coalesce=False)) == 3


def test_layout_keeps_file_alignment():
    ts = [T("a", 8, 16, "F64"), T("b", 1000 + 4, 8, "F32"), T("odd", 5001, 8, "F64")]
    runs = make_runs(ts)
    starts, total = layout(runs)
    for r, s in zip(runs, starts, strict=False):
        for t in r.tensors:
            a = s + t.offset - r.offset
            if t.name == "odd":
                assert a % ALIGN == 0  # misaligned in the file, aligned in memory
            else:
                assert a % ALIGN == t.offset % ALIGN
    assert total >= sum(r.length for r in runs)
    assert all(s2 >= s1 + r.length for (s1, r), s2 in zip(zip(starts, runs, strict=False), starts[1:], strict=False))


def test_chunks_cover_runs_exactly():
    runs = make_runs([T("a", 0, 100), T("b", 500, 7)])
    chunks = make_chunks(runs, chunk=30)
    assert [(c.run, c.start, c.length) for c in chunks] == [
        (0, 0, 30),
        (0, 30, 30),
        (0, 60, 30),
        (0, 90, 10),
        (1, 0, 7),
    ]
